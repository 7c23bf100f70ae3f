// The per-call decision path of the CUDA custom op, timed in a C loop (benchmarks/host_overhead.py): what
// ort_ops.cc ComputeCuda runs on the host before a launch, through the same C functions in the same order:
// the feature vector from the input shapes, the tree walk, the vendor check and the call's fit to the chosen
// compiled kernel. No GPU is needed.
#include <chrono>
#include <string>

#include "bundle_impl.h"
#include "core.h"

namespace {

constexpr size_t kMaxInputs = 3;       // A, B, bias: what a node gives dc_bundle_features
constexpr size_t kStackFeatures = 16;  // the benchmark's feature buffer

int Fail(const std::string& message) {
  dietcode::SetError(message);
  return -1;
}

// One decision as ComputeCuda makes it: the kernel id, and its fit code (0 for the vendor kind). -1 on error.
int Decide(const dc_bundle* b, const int64_t* const* dims, const size_t* ranks, size_t n_inputs,
           const dc_launch_args* args, int64_t* features, int32_t* kernel, int* fit) {
  if (dc_bundle_features(b, dims, ranks, n_inputs, features) != 0) return -1;
  const int32_t k = dc_bundle_select(b, features, b->features.size());
  if (k < 0) return -1;
  const int vendor = dc_bundle_kernel_is_vendor(b, k);
  if (vendor < 0) return -1;
  int f = 0;
  if (vendor == 0) {
    f = dc_kernel_fit(b, k, args);
    if (f < 0) return -1;
  }
  *kernel = k;
  *fit = f;
  return 0;
}

}  // namespace

extern "C" {

int dc_bench_select(const dc_bundle* b, const int64_t* const* dims, const size_t* ranks, size_t n_inputs,
                    const dc_launch_args* args, int64_t n_iter, int32_t* kernel_out, int32_t* fit_out,
                    double* ns_per_call) {
  if (b == nullptr || args == nullptr || ns_per_call == nullptr || (n_inputs > 0 && (dims == nullptr || ranks == nullptr))) {
    return Fail("dc_bench_select: null bundle, shapes, launch arguments or result pointer");
  }
  if (n_inputs > kMaxInputs) {
    return Fail("dc_bench_select: " + std::to_string(n_inputs) + " inputs, a node gives at most " +
                std::to_string(kMaxInputs) + " (A, B, bias)");
  }
  for (size_t i = 0; i < n_inputs; ++i) {
    if (dims[i] == nullptr && ranks[i] != 0) return Fail("dc_bench_select: input " + std::to_string(i) + " has no dims");
  }
  if (n_iter <= 0) return Fail("dc_bench_select: n_iter " + std::to_string(n_iter) + " must be positive");
  if (b->features.size() > kStackFeatures) {
    return Fail("dc_bench_select: the bundle has " + std::to_string(b->features.size()) + " features, at most " +
                std::to_string(kStackFeatures) + " are benchmarked");
  }
  int64_t features[kStackFeatures] = {};
  int32_t kernel = -1;
  int fit = 0;
  // One untimed decision first: an invalid call fails here with the core's message.
  if (Decide(b, dims, ranks, n_inputs, args, features, &kernel, &fit) != 0) return -1;
  const auto start = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < n_iter; ++i) {
    if (Decide(b, dims, ranks, n_inputs, args, features, &kernel, &fit) != 0) return -1;
  }
  const auto stop = std::chrono::steady_clock::now();
  *ns_per_call = std::chrono::duration<double, std::nano>(stop - start).count() / static_cast<double>(n_iter);
  if (kernel_out) *kernel_out = kernel;
  if (fit_out) *fit_out = fit;
  return 0;
}

}  // extern "C"
