// Standalone GPU self-check of moe_xla::cuda::{route, permute, unpermute} against the CPU
// kernels (cpu/route, cpu/permute, cpu/unpermute), which follow common/routing.h.
//
// Every case:
//   1. draws fresh random inputs (route: rows with exact ties, NaN, -inf, +inf, all-equal
//      rows; permute: invalid expert ids, negative and >= E, INT_MIN / INT_MAX; unpermute:
//      row_map with out-of-range entries and repeated slots), on misaligned pointers where
//      asked (narrower vector paths) and with a misaligned workspace,
//   2. poisons every output (0xff bytes: NaN / -1) and runs the CUDA kernel twice on a
//      non-default stream, checking that both runs are bitwise equal (determinism),
//   3. compares with the CPU kernel:
//        route:     expert ids exactly, except documented near-ties (the two experts'
//                   selection scores, or the kept / dropped group scores, within float
//                   rounding: the GPU's expf and reduction order differ from the host's);
//                   weights to float rounding (NaN where the CPU has NaN);
//        permute:   group_sizes, row_map and x_sorted bitwise;
//        unpermute: y within one unit in the last place of its dtype (expected bitwise:
//                   same float operations in the same order), NaN where the CPU has NaN.
// Then one case of each op is captured into a CUDA graph (global capture mode, so any
// synchronising call would fail), the inputs are changed in device memory and the graph
// is replayed: route's results must be bitwise those of a direct call on the new inputs
// (its agreement with the CPU is what the cases above check), permute's and unpermute's
// must match the CPU on the new inputs. A few invalid calls must return an error. Finally
// the kernels are timed at a DeepSeek-like size. Without a GPU it exits 0 saying it
// skipped. One line per case; exit status 1 if anything fails. Usage: routing_selftest
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/routing.h"
#include "common/status.h"
#include "cpu/dtype.h"
#include "cpu/permute.h"
#include "cpu/route.h"
#include "tests/cc/route_case.h"
#include "cpu/unpermute.h"
#include "cuda/routing.h"
#include "tools/cuda_check.h"

namespace {

using moe_xla::DType;
using moe_xla::dtype_bytes;
using moe_xla::describe;
using moe_xla::dtype_name;
using moe_xla::PermuteParams;
using moe_xla::RouteCase;
using moe_xla::RouteParams;
using moe_xla::Score;
using moe_xla::UnpermuteParams;

constexpr float kInf = std::numeric_limits<float>::infinity();
int failures = 0;

// Device allocation of `bytes` bytes whose usable pointer is offset by `misalign` bytes.
struct DeviceBuffer {
  char* base = nullptr;
  size_t bytes = 0, misalign = 0;
  DeviceBuffer(size_t n, size_t off = 0) : bytes(n), misalign(off) {
    CHECK_CUDA(cudaMalloc(&base, n + off + 16));
  }
  ~DeviceBuffer() { cudaFree(base); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* get() const { return base + misalign; }
  template <typename T>
  T* as() const {
    return reinterpret_cast<T*>(get());
  }
  // Both complete before returning (the kernels run on a non-blocking stream, which does not
  // wait for work on the legacy default stream).
  void upload(const void* host) {
    if (bytes == 0) return;
    CHECK_CUDA(cudaMemcpy(get(), host, bytes, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaDeviceSynchronize());
  }
  void poison() {
    if (bytes == 0) return;
    CHECK_CUDA(cudaMemset(get(), 0xff, bytes));
    CHECK_CUDA(cudaDeviceSynchronize());
  }
  template <typename T>
  std::vector<T> download() const {
    std::vector<T> out(bytes / sizeof(T));
    if (bytes) CHECK_CUDA(cudaMemcpy(out.data(), get(), bytes, cudaMemcpyDeviceToHost));
    return out;
  }
};

bool bitwise_equal(const DeviceBuffer& a, const DeviceBuffer& b) {
  const auto x = a.download<unsigned char>(), y = b.download<unsigned char>();
  return x == y;
}

bool close(float a, float b, float rel, float abs) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  if (a == b) return true;  // also equal infinities
  return std::fabs(a - b) <= abs + rel * std::max(std::fabs(a), std::fabs(b));
}

void report(bool ok, const std::string& line) {
  std::printf("%s %s\n", ok ? "ok  " : "FAIL", line.c_str());
  if (!ok) ++failures;
}

// Stops the program when a call that must succeed (the timed ones) fails.
void check_ok(const moe_xla::Status& status) {
  if (status.ok()) return;
  std::fprintf(stderr, "FATAL %s\n", status.message().c_str());
  std::exit(2);
}

// ---------------------------------------------------------------------------------- route

struct RouteInputs {
  std::vector<unsigned char> logits;
  std::vector<float> bias;
};

RouteInputs make_route_inputs(const RouteCase& c, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::uniform_int_distribution<int> kind(0, 15);
  RouteInputs in;
  in.logits.resize(c.T * c.E * dtype_bytes(c.dtype));
  for (int64_t t = 0; t < c.T; ++t) {
    const int k = kind(rng);
    for (int64_t e = 0; e < c.E; ++e) {
      float v = normal(rng);
      if (k == 0) v = std::round(v);              // exact ties
      if (k == 1 && e % 7 == 3) v = NAN;          // NaN entries
      if (k == 2) v = -kInf;                      // all -inf
      if (k == 3 && e % 3 == 0) v = -kInf;        // some -inf
      if (k == 4) v = 0.25f;                      // all equal
      if (k == 5 && e == c.E / 2) v = kInf;       // +inf entry
      if (k == 6) v = 30.0f + std::round(v);      // sigmoid saturates to 1
      moe_xla::cpu::store_from_float(in.logits.data(), t * c.E + e, c.dtype, v);
    }
  }
  in.bias.resize(c.E);
  for (float& b : in.bias) b = 0.1f * std::round(normal(rng) * 4.0f) / 4.0f;  // some equal biases
  return in;
}

// Selection scores of token t as the contract defines them, before the group filter, and the
// group scores (host, float; the same formulas as cpu/route.cc).
void host_scores(const RouteCase& c, const RouteInputs& in, int64_t t, std::vector<float>& select,
                 std::vector<float>& group_score) {
  select.assign(c.E, 0.0f);
  std::vector<float> x(c.E);
  for (int64_t e = 0; e < c.E; ++e) x[e] = moe_xla::cpu::load_as_float(in.logits.data(), t * c.E + e, c.dtype);
  if (c.score == Score::kSoftmax) {
    float m = -kInf;
    for (float v : x) m = std::fmax(m, v);
    float sum = 0;
    for (int64_t e = 0; e < c.E; ++e) sum += (select[e] = std::exp(x[e] - m));
    for (float& v : select) v = v / sum;
  } else {
    for (int64_t e = 0; e < c.E; ++e) {
      const float s = 1.0f / (1.0f + std::exp(-x[e]));
      select[e] = c.bias ? s + in.bias[e] : s;
    }
  }
  for (float& v : select) v = std::isnan(v) ? -kInf : v;
  group_score = moe_xla::reference_group_scores(select, c.groups);
}

bool near(float a, float b) { return close(a, b, 4e-6f, 1e-30f); }

void check_route(const RouteCase& c, std::mt19937& rng, cudaStream_t stream) {
  const RouteInputs in = make_route_inputs(c, rng);
  const int64_t n = c.T * c.k;
  std::vector<float> w_cpu(n);
  std::vector<int32_t> ids_cpu(n);
  RouteParams p{in.logits.data(), c.dtype, c.bias ? in.bias.data() : nullptr, w_cpu.data(), ids_cpu.data(),
                c.T, c.E, c.k, c.score, c.groups, c.keep, c.renormalize, c.scale};
  moe_xla::cpu::route(p);

  DeviceBuffer logits(in.logits.size(), dtype_bytes(c.dtype)), bias(c.E * 4);
  logits.upload(in.logits.data());
  bias.upload(in.bias.data());
  DeviceBuffer w1(n * 4), ids1(n * 4), w2(n * 4), ids2(n * 4);
  std::string err;  // the first error
  for (int run = 0; run < 2 && err.empty(); ++run) {
    DeviceBuffer& w = run ? w2 : w1;
    DeviceBuffer& ids = run ? ids2 : ids1;
    w.poison();
    ids.poison();
    RouteParams q = p;
    q.logits = logits.get();
    q.bias = c.bias ? bias.as<float>() : nullptr;
    q.weights = w.as<float>();
    q.expert_ids = ids.as<int32_t>();
    err = error_message(moe_xla::cuda::route(q, stream));
  }
  CHECK_CUDA(cudaStreamSynchronize(stream));
  if (!err.empty()) {
    report(false, describe(c) + ": " + err);
    return;
  }
  const bool deterministic = bitwise_equal(w1, w2) && bitwise_equal(ids1, ids2);
  const auto w_gpu = w1.download<float>();
  const auto ids_gpu = ids1.download<int32_t>();

  int64_t bad = 0, near_ties = 0;
  float max_rel = 0;
  std::vector<float> select, group_score;
  for (int64_t t = 0; t < c.T; ++t) {
    const int32_t* gi = &ids_gpu[t * c.k];
    const int32_t* ci = &ids_cpu[t * c.k];
    bool same_ids = std::equal(gi, gi + c.k, ci);
    bool ok = true, compare_weights = true;
    if (!same_ids) {
      host_scores(c, in, t, select, group_score);
      // A near tie between the last kept and the first dropped group (by the CPU's order)?
      bool group_tie = false;
      if (c.groups > 1) {
        std::vector<int64_t> order(c.groups);
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(),
                         [&](int64_t a, int64_t b) { return group_score[a] > group_score[b]; });
        group_tie = c.keep < c.groups && near(group_score[order[c.keep - 1]], group_score[order[c.keep]]);
      }
      std::vector<char> seen(c.E, 0);
      for (int64_t j = 0; j < c.k && ok; ++j) {
        if (gi[j] < 0 || gi[j] >= c.E || seen[gi[j]]) {
          ok = false;
          break;
        }
        seen[gi[j]] = 1;
        if (gi[j] != ci[j] && !group_tie && !near(select[gi[j]], select[ci[j]])) ok = false;
      }
      if (ok) ++near_ties;
      compare_weights = !group_tie;
    }
    for (int64_t j = 0; j < c.k && ok && compare_weights; ++j) {
      const float a = w_gpu[t * c.k + j], b = w_cpu[t * c.k + j];
      // Two float32 sums over up to E terms (softmax, renormalisation), rounded differently
      // on the GPU and the host.
      if (!close(a, b, 1e-4f, 1e-7f)) ok = false;
      if (!std::isnan(a) && !std::isnan(b) && a != b) {
        max_rel = std::max(max_rel, std::fabs(a - b) / std::max(std::fabs(b), 1e-30f));
      }
    }
    if (!ok && bad++ < 3) {
      std::printf("  token %lld:", (long long)t);
      for (int64_t j = 0; j < std::min<int64_t>(c.k, 8); ++j) {
        std::printf(" (%d %.7g | %d %.7g)", gi[j], w_gpu[t * c.k + j], ci[j], w_cpu[t * c.k + j]);
      }
      std::printf("\n");
    }
  }
  char buf[160];
  std::snprintf(buf, sizeof buf, ": bad tokens %lld, near-ties %lld, max weight rel diff %.2e%s", (long long)bad,
                (long long)near_ties, max_rel, deterministic ? "" : ", NOT DETERMINISTIC");
  report(bad == 0 && deterministic, describe(c) + buf);
}

// -------------------------------------------------------------------------------- permute

struct PermuteCase {
  int64_t T, H, k, E;
  DType dtype;
  double invalid;
  size_t misalign;  // bytes added to the x and x_sorted pointers
};

std::string describe(const PermuteCase& c) {
  char buf[200];
  std::snprintf(buf, sizeof buf, "permute T=%lld H=%lld k=%lld E=%lld %s invalid=%.2f misalign=%zu", (long long)c.T,
                (long long)c.H, (long long)c.k, (long long)c.E, dtype_name(c.dtype), c.invalid, c.misalign);
  return buf;
}

std::vector<int32_t> make_ids(const PermuteCase& c, std::mt19937& rng) {
  std::uniform_int_distribution<int32_t> expert(0, static_cast<int32_t>(std::max<int64_t>(c.E, 1) - 1));
  std::uniform_real_distribution<double> u(0, 1);
  std::vector<int32_t> ids(c.T * c.k);
  for (auto& e : ids) {
    e = expert(rng);
    if (u(rng) < 0.3) e = static_cast<int32_t>(std::min<int64_t>(c.E - 1, 3));  // one big group
    if (u(rng) < c.invalid) e = u(rng) < 0.5 ? -1 - expert(rng) : static_cast<int32_t>(c.E) + expert(rng);
    if (u(rng) < c.invalid * 0.1) e = u(rng) < 0.5 ? INT_MIN : INT_MAX;
    if (c.E == 0) e = expert(rng) - 1;
  }
  return ids;
}

struct PermuteRun {
  DeviceBuffer x, ids, xs, sizes, row_map, row_pairs, workspace;
  size_t ws_bytes;
  PermuteParams q;
  PermuteRun(const PermuteCase& c, size_t ws_bytes_)
      : x(c.T * c.H * dtype_bytes(c.dtype), c.misalign),
        ids(c.T * c.k * 4),
        xs(c.T * c.k * c.H * dtype_bytes(c.dtype), c.misalign),
        sizes(c.E * 4),
        row_map(c.T * c.k * 4),
        row_pairs(c.T * c.k * 4),
        workspace(ws_bytes_, 4),  // misaligned workspace
        ws_bytes(ws_bytes_) {
    q = PermuteParams{x.get(), c.dtype, ids.as<int32_t>(), xs.get(), sizes.as<int32_t>(), row_map.as<int32_t>(),
                      row_pairs.as<int32_t>(), c.T, c.H, c.k, c.E};
  }
  void poison() {
    xs.poison();
    sizes.poison();
    row_map.poison();
    row_pairs.poison();
  }
};

// Compares a GPU permute result with the CPU kernel's on the same inputs.
bool same_as_cpu(const PermuteCase& c, const std::vector<unsigned char>& x, const std::vector<int32_t>& ids,
                 const PermuteRun& run, std::string& why) {
  std::vector<unsigned char> xs(c.T * c.k * c.H * dtype_bytes(c.dtype));
  std::vector<int32_t> sizes(c.E), row_map(c.T * c.k), row_pairs(c.T * c.k);
  PermuteParams p{x.data(), c.dtype, ids.data(), xs.data(), sizes.data(), row_map.data(), row_pairs.data(),
                  c.T, c.H, c.k, c.E};
  moe_xla::cpu::permute(p);
  if (run.sizes.download<int32_t>() != sizes) why += " group_sizes differ;";
  if (run.row_map.download<int32_t>() != row_map) why += " row_map differs;";
  if (run.row_pairs.download<int32_t>() != row_pairs) why += " row_pairs differs;";
  if (run.xs.download<unsigned char>() != xs) why += " x_sorted differs;";
  return why.empty();
}

void check_permute(const PermuteCase& c, std::mt19937& rng, cudaStream_t stream) {
  std::vector<unsigned char> x(c.T * c.H * dtype_bytes(c.dtype));
  for (auto& b : x) b = static_cast<unsigned char>(rng());
  const std::vector<int32_t> ids = make_ids(c, rng);
  PermuteParams shape{nullptr, c.dtype, nullptr, nullptr, nullptr, nullptr, nullptr, c.T, c.H, c.k, c.E};
  const size_t ws = moe_xla::cuda::permute_workspace_bytes(shape);
  PermuteRun a(c, ws), b(c, ws);
  std::string err;  // the first error
  for (PermuteRun* r : {&a, &b}) {
    r->x.upload(x.data());
    r->ids.upload(ids.data());
    r->poison();
    if (err.empty()) err = error_message(moe_xla::cuda::permute(r->q, r->workspace.get(), r->ws_bytes, stream));
  }
  CHECK_CUDA(cudaStreamSynchronize(stream));
  if (!err.empty()) {
    report(false, describe(c) + ": " + err);
    return;
  }
  std::string why;
  same_as_cpu(c, x, ids, a, why);
  if (!(bitwise_equal(a.xs, b.xs) && bitwise_equal(a.sizes, b.sizes) && bitwise_equal(a.row_map, b.row_map))) {
    why += " NOT DETERMINISTIC;";
  }
  report(why.empty(), describe(c) + ": workspace " + std::to_string(ws) + " bytes" + why);
}

// ------------------------------------------------------------------------------ unpermute

struct UnpermuteCase {
  int64_t T, H, k;
  DType dtype;
  size_t misalign;  // bytes added to the y_sorted and y pointers
  int64_t rows = -1;  // R, rows of y_sorted; -1: T*k, as after permute
  bool unit = false;  // no weights (a null pointer): every weight 1
};

int64_t sorted_rows(const UnpermuteCase& c) { return c.rows < 0 ? c.T * c.k : c.rows; }

std::string describe(const UnpermuteCase& c) {
  char buf[160];
  std::snprintf(buf, sizeof buf, "unpermute T=%lld H=%lld k=%lld R=%lld %s misalign=%zu%s", (long long)c.T,
                (long long)c.H, (long long)c.k, (long long)sorted_rows(c), dtype_name(c.dtype), c.misalign,
                c.unit ? " unit weights" : "");
  return buf;
}

struct UnpermuteInputs {
  std::vector<unsigned char> ys;
  std::vector<int32_t> row_map;
  std::vector<float> w;
};

UnpermuteInputs make_unpermute_inputs(const UnpermuteCase& c, std::mt19937& rng) {
  const int64_t n = c.T * c.k, rows = sorted_rows(c);
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<double> u(0, 1);
  UnpermuteInputs in;
  in.ys.resize(rows * c.H * dtype_bytes(c.dtype));
  for (int64_t i = 0; i < rows * c.H; ++i) moe_xla::cpu::store_from_float(in.ys.data(), i, c.dtype, normal(rng));
  // A permutation of [0, T*k): with R < T*k its entries past R name no row.
  in.row_map.resize(n);
  std::iota(in.row_map.begin(), in.row_map.end(), 0);
  std::shuffle(in.row_map.begin(), in.row_map.end(), rng);
  std::uniform_int_distribution<int32_t> any_slot(0, static_cast<int32_t>(std::max<int64_t>(rows, 1) - 1));
  for (auto& r : in.row_map) {
    const double d = u(rng);
    if (d < 0.03) r = -1 - any_slot(rng);
    else if (d < 0.06) r = static_cast<int32_t>(rows) + any_slot(rng);
    else if (d < 0.07) r = d < 0.065 ? INT_MIN : INT_MAX;
    else if (d < 0.10) r = any_slot(rng);  // repeated slot
  }
  in.w.resize(n);
  for (float& v : in.w) v = u(rng) < 0.05 ? 0.0f : normal(rng);
  return in;
}

// ys values are finite, so y is NaN only if the CPU's is.
bool unpermute_matches(const UnpermuteCase& c, const UnpermuteInputs& in, const DeviceBuffer& y, std::string& why) {
  std::vector<unsigned char> want(c.T * c.H * dtype_bytes(c.dtype));
  UnpermuteParams p{in.ys.data(), c.dtype, in.row_map.data(), c.unit ? nullptr : in.w.data(), want.data(),
                    c.T, c.H, c.k, sorted_rows(c)};
  moe_xla::cpu::unpermute(p);
  const auto got = y.download<unsigned char>();
  const float ulp = c.dtype == DType::kF32 ? 1.2e-7f : c.dtype == DType::kBF16 ? 7.9e-3f : 9.8e-4f;
  int64_t not_bitwise = 0, bad = 0;
  for (int64_t i = 0; i < c.T * c.H; ++i) {
    const float a = moe_xla::cpu::load_as_float(got.data(), i, c.dtype);
    const float b = moe_xla::cpu::load_as_float(want.data(), i, c.dtype);
    not_bitwise += std::memcmp(got.data() + i * dtype_bytes(c.dtype), want.data() + i * dtype_bytes(c.dtype),
                               dtype_bytes(c.dtype)) != 0;
    if (!close(a, b, ulp, 1e-30f)) {
      if (bad++ < 3) std::printf("  y[%lld] = %.7g, cpu %.7g\n", (long long)i, a, b);
    }
  }
  if (bad) why += " " + std::to_string(bad) + " values differ;";
  if (not_bitwise) why += " (" + std::to_string(not_bitwise) + " within 1 ulp but not bitwise)";
  return bad == 0;
}

void check_unpermute(const UnpermuteCase& c, std::mt19937& rng, cudaStream_t stream) {
  const UnpermuteInputs in = make_unpermute_inputs(c, rng);
  const int64_t n = c.T * c.k;
  DeviceBuffer ys(in.ys.size(), c.misalign), row_map(n * 4), w(n * 4);
  DeviceBuffer y1(c.T * c.H * dtype_bytes(c.dtype), c.misalign), y2(c.T * c.H * dtype_bytes(c.dtype), c.misalign);
  ys.upload(in.ys.data());
  row_map.upload(in.row_map.data());
  w.upload(in.w.data());
  std::string err;  // the first error
  for (DeviceBuffer* y : {&y1, &y2}) {
    y->poison();
    UnpermuteParams q{ys.get(), c.dtype, row_map.as<int32_t>(), c.unit ? nullptr : w.as<float>(), y->get(), c.T, c.H,
                      c.k, sorted_rows(c)};
    if (err.empty()) err = error_message(moe_xla::cuda::unpermute(q, stream));
  }
  CHECK_CUDA(cudaStreamSynchronize(stream));
  if (!err.empty()) {
    report(false, describe(c) + ": " + err);
    return;
  }
  std::string why;
  bool ok = unpermute_matches(c, in, y1, why);
  if (!bitwise_equal(y1, y2)) {
    ok = false;
    why += " NOT DETERMINISTIC;";
  }
  report(ok, describe(c) + ":" + why);
}

// ------------------------------------------------------------------------- graph capture

// Captures `enqueue` into a graph in global capture mode (any synchronising or otherwise
// capture-unsafe call fails), returns the executable graph.
template <typename F>
cudaGraphExec_t capture(cudaStream_t stream, F enqueue, std::string& why) {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  const moe_xla::Status err = enqueue();
  const cudaError_t end = cudaStreamEndCapture(stream, &graph);
  if (!err.ok()) why += " launch under capture failed: " + err.message() + ";";
  if (end != cudaSuccess) why += std::string(" capture failed: ") + cudaGetErrorString(end) + ";";
  if (why.empty()) CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  if (graph) cudaGraphDestroy(graph);
  cudaGetLastError();
  return exec;
}

void graph_checks(std::mt19937& rng, cudaStream_t stream) {
  {  // route
    const RouteCase c{777, 256, 8, DType::kBF16, Score::kSigmoid, true, 8, 4, true, 2.5f};
    RouteInputs in = make_route_inputs(c, rng);
    DeviceBuffer logits(in.logits.size()), bias(c.E * 4), w(c.T * c.k * 4), ids(c.T * c.k * 4);
    logits.upload(in.logits.data());
    bias.upload(in.bias.data());
    w.poison();
    ids.poison();
    RouteParams q{logits.get(), c.dtype, bias.as<float>(), w.as<float>(), ids.as<int32_t>(), c.T, c.E, c.k,
                  c.score, c.groups, c.keep, c.renormalize, c.scale};
    std::string why;
    cudaGraphExec_t exec = capture(stream, [&] { return moe_xla::cuda::route(q, stream); }, why);
    if (exec) {
      in = make_route_inputs(c, rng);  // new logits and bias after capture
      logits.upload(in.logits.data());
      bias.upload(in.bias.data());
      CHECK_CUDA(cudaGraphLaunch(exec, stream));
      CHECK_CUDA(cudaStreamSynchronize(stream));
      // The same call made directly on the new inputs: the replay must give the same bits.
      DeviceBuffer w_direct(c.T * c.k * 4), ids_direct(c.T * c.k * 4);
      w_direct.poison();
      ids_direct.poison();
      RouteParams direct = q;
      direct.weights = w_direct.as<float>();
      direct.expert_ids = ids_direct.as<int32_t>();
      const moe_xla::Status direct_status = moe_xla::cuda::route(direct, stream);
      CHECK_CUDA(cudaStreamSynchronize(stream));
      if (!direct_status.ok()) {
        why += " direct call failed: " + direct_status.message() + ";";
      } else if (!bitwise_equal(w, w_direct) || !bitwise_equal(ids, ids_direct)) {
        why += " replay differs from a direct call on the same inputs;";
      }
      cudaGraphExecDestroy(exec);
    }
    report(why.empty(), "graph capture + replay with new inputs: route" + why);
  }
  {  // permute
    const PermuteCase c{1000, 96, 8, 64, DType::kBF16, 0.05, 0};
    std::vector<unsigned char> x(c.T * c.H * 2);
    for (auto& b : x) b = static_cast<unsigned char>(rng());
    PermuteParams shape{nullptr, c.dtype, nullptr, nullptr, nullptr, nullptr, nullptr, c.T, c.H, c.k, c.E};
    PermuteRun r(c, moe_xla::cuda::permute_workspace_bytes(shape));
    r.x.upload(x.data());
    std::vector<int32_t> ids = make_ids(c, rng);
    r.ids.upload(ids.data());
    r.poison();
    std::string why;
    cudaGraphExec_t exec =
        capture(stream, [&] { return moe_xla::cuda::permute(r.q, r.workspace.get(), r.ws_bytes, stream); }, why);
    if (exec) {
      ids = make_ids(c, rng);  // new routing after capture
      r.ids.upload(ids.data());
      CHECK_CUDA(cudaGraphLaunch(exec, stream));
      CHECK_CUDA(cudaStreamSynchronize(stream));
      same_as_cpu(c, x, ids, r, why);
      cudaGraphExecDestroy(exec);
    }
    report(why.empty(), "graph capture + replay with new inputs: permute" + why);
  }
  {  // unpermute
    const UnpermuteCase c{500, 200, 4, DType::kF16, 0};
    UnpermuteInputs in = make_unpermute_inputs(c, rng);
    const int64_t n = c.T * c.k;
    DeviceBuffer ys(in.ys.size()), row_map(n * 4), w(n * 4), y(c.T * c.H * 2);
    ys.upload(in.ys.data());
    row_map.upload(in.row_map.data());
    w.upload(in.w.data());
    y.poison();
    UnpermuteParams q{ys.get(), c.dtype, row_map.as<int32_t>(), w.as<float>(), y.get(), c.T, c.H, c.k, c.T * c.k};
    std::string why;
    cudaGraphExec_t exec = capture(stream, [&] { return moe_xla::cuda::unpermute(q, stream); }, why);
    bool ok = exec != nullptr;
    if (exec) {
      in = make_unpermute_inputs(c, rng);
      ys.upload(in.ys.data());
      row_map.upload(in.row_map.data());
      w.upload(in.w.data());
      CHECK_CUDA(cudaGraphLaunch(exec, stream));
      CHECK_CUDA(cudaStreamSynchronize(stream));
      ok = unpermute_matches(c, in, y, why);
      cudaGraphExecDestroy(exec);
    }
    report(ok, "graph capture + replay with new inputs: unpermute" + why);
  }
}

// ---------------------------------------------------------------------------- bad params

void error_checks(cudaStream_t stream) {
  RouteParams r{nullptr, DType::kF32, nullptr, nullptr, nullptr, 4, 5000, 2, Score::kSoftmax, 1, 1, true, 1.0f};
  const moe_xla::Status e1 = moe_xla::cuda::route(r, stream);
  r.experts = 8;
  r.top_k = 9;
  const moe_xla::Status e2 = moe_xla::cuda::route(r, stream);
  r.top_k = 2;
  r.n_groups = 3;
  const moe_xla::Status e3 = moe_xla::cuda::route(r, stream);
  PermuteParams p{nullptr, DType::kF32, nullptr, nullptr, nullptr, nullptr, nullptr, 16, 8, 2, 4};
  const size_t need = moe_xla::cuda::permute_workspace_bytes(p);
  DeviceBuffer ws(need);
  const moe_xla::Status e4 = moe_xla::cuda::permute(p, ws.get(), need - 1, stream);
  auto invalid = [](const moe_xla::Status& s) { return s.code() == moe_xla::StatusCode::kInvalidArgument; };
  const bool ok = invalid(e1) && invalid(e2) && invalid(e3) && invalid(e4);
  report(ok, "invalid params return InvalidArgument errors: " + e1.message() + " | " + e2.message() + " | " +
                 e3.message() + " | " + e4.message());
}

// -------------------------------------------------------------------------------- timing

void timing(std::mt19937& rng, cudaStream_t stream) {
  const int64_t T = 16384, E = 256, k = 8, H = 7168;
  const RouteCase rc{T, E, k, DType::kF32, Score::kSigmoid, true, 8, 4, true, 2.5f};
  std::normal_distribution<float> normal;
  std::vector<float> logits(T * E), bias(E);
  for (float& v : logits) v = normal(rng);
  for (float& v : bias) v = 0.1f * normal(rng);
  DeviceBuffer d_logits(T * E * 4), d_bias(E * 4), w(T * k * 4), ids(T * k * 4);
  d_logits.upload(logits.data());
  d_bias.upload(bias.data());
  RouteParams r{d_logits.get(), DType::kF32, d_bias.as<float>(), w.as<float>(), ids.as<int32_t>(), T, E, k,
                rc.score, rc.groups, rc.keep, true, 2.5f};
  std::vector<int32_t> h_ids(T * k);
  std::uniform_int_distribution<int32_t> expert(0, E - 1);
  for (auto& e : h_ids) e = expert(rng);
  ids.upload(h_ids.data());
  DeviceBuffer x(T * H * 2), xs(T * k * H * 2), sizes(E * 4), row_map(T * k * 4), row_pairs(T * k * 4),
      y(T * H * 2);
  PermuteParams p{x.get(), DType::kBF16, ids.as<int32_t>(), xs.get(), sizes.as<int32_t>(), row_map.as<int32_t>(),
                  row_pairs.as<int32_t>(), T, H, k, E};
  const size_t ws_bytes = moe_xla::cuda::permute_workspace_bytes(p);
  DeviceBuffer ws(ws_bytes);
  CHECK_CUDA(cudaMemsetAsync(x.get(), 0, x.bytes, stream));
  CHECK_CUDA(cudaMemsetAsync(xs.get(), 0, xs.bytes, stream));
  UnpermuteParams u{xs.get(), DType::kBF16, row_map.as<int32_t>(), w.as<float>(), y.get(), T, H, k, T * k};
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  auto time = [&](const char* name, double bytes, auto fn) {
    for (int i = 0; i < 3; ++i) check_ok(fn());
    CHECK_CUDA(cudaEventRecord(start, stream));
    const int reps = 20;
    for (int i = 0; i < reps; ++i) check_ok(fn());
    CHECK_CUDA(cudaEventRecord(stop, stream));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    const double us = 1000.0 * ms / reps;
    std::printf("time %-10s T=%lld E=%lld k=%lld H=%lld: %8.1f us  (%.0f GB/s of compulsory traffic)\n", name,
                (long long)T, (long long)E, (long long)k, (long long)H, us, bytes / us * 1e-3);
  };
  time("route", double(T) * E * 4 + double(T) * k * 8, [&] { return moe_xla::cuda::route(r, stream); });
  time("permute", double(T) * H * 2 + double(T) * k * H * 2 + double(T) * k * 12,
       [&] { return moe_xla::cuda::permute(p, ws.get(), ws_bytes, stream); });
  time("unpermute", double(T) * k * H * 2 + double(T) * H * 2 + double(T) * k * 8,
       [&] { return moe_xla::cuda::unpermute(u, stream); });
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
}

}  // namespace

int main() {
  exit_if_no_cuda_device("routing_selftest");
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s (sm_%d%d)\n", prop.name, prop.major, prop.minor);
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::mt19937 rng(20240613);

  const DType dtypes[] = {DType::kF32, DType::kBF16, DType::kF16};
  for (DType d : dtypes) {
    const RouteCase cases[] = {
        {0, 8, 2, d, Score::kSoftmax, false, 1, 1, true, 1.0f},
        {1, 1, 1, d, Score::kSoftmax, false, 1, 1, true, 1.0f},
        {100, 1, 1, d, Score::kSigmoid, true, 1, 1, false, 1.0f},
        {1000, 8, 2, d, Score::kSoftmax, false, 1, 1, true, 1.0f},
        {1000, 8, 8, d, Score::kSoftmax, false, 1, 1, false, 2.5f},
        {999, 64, 6, d, Score::kSoftmax, false, 1, 1, true, 1.0f},
        {999, 60, 4, d, Score::kSigmoid, false, 1, 1, true, 1.0f},
        {2049, 128, 8, d, Score::kSoftmax, false, 1, 1, true, 1.0f},
        {2049, 256, 8, d, Score::kSigmoid, true, 8, 4, true, 2.5f},
        {1000, 256, 8, d, Score::kSoftmax, false, 8, 3, false, 1.0f},
        {1000, 64, 8, d, Score::kSigmoid, true, 64, 8, true, 1.0f},   // groups of one
        {500, 96, 7, d, Score::kSigmoid, true, 48, 5, true, 1.0f},    // groups of two
        {300, 64, 64, d, Score::kSigmoid, true, 4, 4, true, 1.0f},    // k = E
        {200, 512, 512, d, Score::kSoftmax, false, 1, 1, true, 1.0f}, // k = E = 512
        {500, 512, 16, d, Score::kSigmoid, true, 16, 2, true, 1.0f},
        {300, 384, 33, d, Score::kSoftmax, false, 1, 1, true, 1.0f},
        {64, 4096, 8, d, Score::kSigmoid, true, 4096, 8, true, 1.0f},  // the largest E, groups of one
        {64, 2048, 2048, d, Score::kSoftmax, false, 1, 1, true, 1.0f},
    };
    for (const RouteCase& c : cases) check_route(c, rng, stream);
  }
  for (DType d : dtypes) {
    const size_t w = dtype_bytes(d);
    const PermuteCase cases[] = {
        {0, 16, 2, 8, d, 0.0, 0},
        {1, 1, 1, 1, d, 0.0, 0},
        {7, 8, 2, 0, d, 0.0, 0},       // no experts: everything invalid
        {1000, 7, 2, 8, d, 0.0, 0},
        {1000, 64, 8, 256, d, 0.0, 0},
        {1000, 64, 8, 256, d, 0.0, w},  // misaligned x / x_sorted
        {777, 33, 8, 64, d, 0.05, 0},
        {300, 5, 8, 8, d, 0.3, 0},      // k = E
        {500, 3, 4, 1, d, 0.5, 0},      // E = 1
        {4097, 128, 6, 300, d, 0.01, 0},
        {3000, 1000, 2, 1000, d, 0.02, 0},
        {2000, 2048, 1, 17, d, 0.0, 0},
        {40, 0, 3, 5, d, 0.2, 0},       // H = 0
        {20, 4, 2, 3, d, 1.0, 0},       // everything invalid
        {16384, 16, 8, 256, d, 0.001, 0},
        {100, 24, 4, 100000, d, 0.0, 0},  // many experts, mostly empty
    };
    for (const PermuteCase& c : cases) check_permute(c, rng, stream);
  }
  for (DType d : dtypes) {
    const size_t w = dtype_bytes(d);
    const UnpermuteCase cases[] = {
        {0, 8, 2, d, 0},       {1, 1, 1, d, 0},       {1000, 7, 2, d, 0},     {1000, 64, 8, d, 0},
        {1000, 64, 8, d, w},   {500, 129, 3, d, 0},   {300, 1000, 6, d, 0},   {200, 7168, 8, d, 0},
        {200, 7168, 8, d, w},  {64, 4096, 1, d, 0},   {30, 0, 2, d, 0},       {50, 16, 0, d, 0},
        {100, 2, 64, d, 0},
        {1000, 64, 8, d, 0, 3000},   // fewer rows than T*k (an EP layer's buffer): the rest name none
        {300, 136, 4, d, w, 5000},   // a padded buffer: more rows than T*k
        {20, 8, 2, d, 0, 0},         // no rows at all
        {1000, 64, 8, d, 0, -1, true},      // no weights: every weight 1 (a null pointer)
        {300, 136, 4, d, w, 5000, true},
        {200, 7168, 8, d, w, -1, true},
    };
    for (const UnpermuteCase& c : cases) check_unpermute(c, rng, stream);
  }
  graph_checks(rng, stream);
  error_checks(stream);
  timing(rng, stream);

  CHECK_CUDA(cudaStreamDestroy(stream));
  std::printf("%s: %d failure(s)\n", failures ? "FAILED" : "PASSED", failures);
  return failures ? 1 : 0;
}
