// CPU gather_rows: row by row, memcpy for a copy, the contract's scaled element otherwise.
#include "cpu/gather_rows.h"

#include <cstdint>
#include <cstring>

#include "cpu/dtype.h"

namespace moe_xla::cpu {

void gather_rows(const GatherRowsParams& p) {
  const size_t row_bytes = static_cast<size_t>(p.cols) * dtype_bytes(p.dtype);
  const char* values = static_cast<const char*>(p.values);
  char* out = static_cast<char*>(p.out);
  for (int64_t r = 0; r < p.rows; ++r) {
    char* dst = out + static_cast<size_t>(r) * row_bytes;
    const int64_t s = p.src[r];
    if (s < 0 || s >= p.num_values) {
      std::memset(dst, 0, row_bytes);
    } else if (p.factor == nullptr) {
      std::memcpy(dst, values + static_cast<size_t>(s) * row_bytes, row_bytes);
    } else {
      const float f = p.factor[r];
      for (int64_t c = 0; c < p.cols; ++c) {
        const float x = load_as_float(p.values, s * p.cols + c, p.dtype);
        store_from_float(out, r * p.cols + c, p.dtype, fp8::scaled_element(f, x));
      }
    }
  }
}

}  // namespace moe_xla::cpu
