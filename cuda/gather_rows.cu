// CUDA gather_rows: out[r] = values[src[r]], or factor[r] * values[src[r]] element by
// element (fp8::scaled_element, rounded once to the dtype); a zero row where src[r] is
// outside [0, num_values). The row copy is row_gather's (cuda/row_gather.cuh); this file
// says where each row comes from and how a factor applies to one copy unit.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "common/gather_rows.h"
#include "common/status.h"
#include "cuda/device.h"
#include "cuda/fp8_lanes.cuh"  // detail::Elem
#include "cuda/gather_rows.h"
#include "cuda/row_gather.cuh"

namespace moe_xla {
namespace cuda {
namespace {

// The values row src[r] names, or -1.
__device__ __forceinline__ int64_t named_row(const int32_t* src, int64_t r, int64_t num_values) {
  const int64_t s = __ldg(src + r);
  return s >= 0 && s < num_values ? s : -1;
}

struct Indexed {
  const int32_t* src;
  int64_t num_values;
  __device__ __forceinline__ row_gather::Copy row(int64_t r) const { return {named_row(src, r, num_values)}; }
};

// A row of values row `index` times `factor`, each element rounded once to D.
template <DType D>
struct Scaled {
  int64_t index;
  float factor;
  template <typename V>
  __device__ __forceinline__ V operator()(V v) const {
    using Elem = detail::Elem<D>;
    using Bits = typename Elem::Bits;
    constexpr int kN = sizeof(V) / sizeof(Bits);
    static_assert(kN >= 1 && kN * sizeof(Bits) == sizeof(V), "a copy unit of whole elements");
    Bits e[kN];
    memcpy(e, &v, sizeof v);
#pragma unroll
    for (int j = 0; j < kN; ++j) e[j] = Elem::from_float(fp8::scaled_element(factor, Elem::to_float(e[j])));
    memcpy(&v, e, sizeof v);
    return v;
  }
};

template <DType D>
struct ScaledIndexed {
  const int32_t* src;
  const float* factor;
  int64_t num_values;
  __device__ __forceinline__ Scaled<D> row(int64_t r) const {
    const int64_t s = named_row(src, r, num_values);
    return {s, s < 0 ? 0.0f : __ldg(factor + r)};
  }
};

template <DType D>
cudaError_t launch_scaled(const GatherRowsParams& p, int64_t row_bytes, cudaStream_t stream) {
  return row_gather::launch<sizeof(typename detail::Elem<D>::Bits)>(
      p.values, p.out, p.rows, row_bytes, ScaledIndexed<D>{p.src, p.factor, p.num_values}, stream);
}

}  // namespace

Status gather_rows(const GatherRowsParams& p, cudaStream_t stream) {
  MOE_XLA_RETURN_IF_ERROR(require_device(DeviceSupport::kSimt, "gather_rows"));
  if (p.rows < 0 || p.cols < 0 || p.num_values < 0) return Status::InvalidArgument("gather_rows: negative dimension");
  if (p.dtype != DType::kF32 && p.dtype != DType::kBF16 && p.dtype != DType::kF16) {
    return Status::InvalidArgument("gather_rows: unsupported dtype");
  }
  if (p.rows == 0 || p.cols == 0) return Status();
  const int64_t row_bytes = p.cols * static_cast<int64_t>(dtype_bytes(p.dtype));
  if (p.factor == nullptr) {
    MOE_XLA_RETURN_IF_CUDA_ERROR(
        row_gather::launch<1>(p.values, p.out, p.rows, row_bytes, Indexed{p.src, p.num_values}, stream));
    return Status();
  }
  switch (p.dtype) {
    case DType::kF32: MOE_XLA_RETURN_IF_CUDA_ERROR(launch_scaled<DType::kF32>(p, row_bytes, stream)); break;
    case DType::kBF16: MOE_XLA_RETURN_IF_CUDA_ERROR(launch_scaled<DType::kBF16>(p, row_bytes, stream)); break;
    case DType::kF16: MOE_XLA_RETURN_IF_CUDA_ERROR(launch_scaled<DType::kF16>(p, row_bytes, stream)); break;
  }
  return Status();
}

}  // namespace cuda
}  // namespace moe_xla
