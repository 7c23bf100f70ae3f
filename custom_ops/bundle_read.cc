// Reading a parsed bundle back field by field (core.h, "Reading a bundle back"): the one bundle reader is
// core.cc's parser; dietcode_ort/runtime.py decodes a bundle for `dietcode-ort inspect` and the tests through
// these accessors, so Python never parses a payload itself. Everything read here was validated by the parser.
#include <cstring>
#include <string>

#include "bundle_impl.h"

namespace {

using dietcode::KernelAt;

const dietcode::Feature* FeatureAt(const dc_bundle* b, int32_t j) {
  if (b == nullptr || j < 0 || static_cast<size_t>(j) >= b->features.size()) {
    dietcode::SetError("feature id " + std::to_string(j) + " out of range");
    return nullptr;
  }
  return &b->features[j];
}

}  // namespace

extern "C" {

const char* dc_bundle_feature_name(const dc_bundle* b, int32_t j) {
  const dietcode::Feature* f = FeatureAt(b, j);
  return f ? f->name.c_str() : nullptr;
}

int dc_bundle_feature_terms(const dc_bundle* b, int32_t j, int32_t* inputs, int32_t* dims, size_t capacity) {
  const dietcode::Feature* f = FeatureAt(b, j);
  if (f == nullptr) return -1;
  for (size_t t = 0; t < f->terms.size() && t < capacity; ++t) {
    if (inputs) inputs[t] = static_cast<int32_t>(f->terms[t].first);
    if (dims) dims[t] = f->terms[t].second;
  }
  return static_cast<int>(f->terms.size());
}

int dc_bundle_tree(const dc_bundle* b, int32_t* feature, int64_t* threshold, int32_t* left, int32_t* right,
                   int32_t* leaf, size_t n) {
  if (b == nullptr || n != b->tree.leaf.size() || !feature || !threshold || !left || !right || !leaf) {
    dietcode::SetError("dc_bundle_tree: null argument or node count other than the tree's");
    return -1;
  }
  const dietcode::Tree& t = b->tree;
  std::memcpy(feature, t.feature.data(), n * sizeof(int32_t));
  std::memcpy(threshold, t.threshold.data(), n * sizeof(int64_t));
  std::memcpy(left, t.left.data(), n * sizeof(int32_t));
  std::memcpy(right, t.right.data(), n * sizeof(int32_t));
  std::memcpy(leaf, t.leaf.data(), n * sizeof(int32_t));
  return 0;
}

const char* dc_bundle_kernel_name(const dc_bundle* b, int32_t k) {
  const dietcode::Kernel* kernel = KernelAt(b, k);
  return kernel ? kernel->name.c_str() : nullptr;
}

int dc_bundle_kernel_meta(const dc_bundle* b, int32_t k, dc_kernel_meta* out) {
  const dietcode::Kernel* kernel = KernelAt(b, k);
  if (kernel == nullptr || out == nullptr) return -1;
  *out = dc_kernel_meta{};
  out->num_warps = kernel->num_warps;
  out->block_m = kernel->block_m;
  out->block_n = kernel->block_n;
  out->split_k = kernel->split_k;
  out->shared = kernel->shared;
  out->div16 = kernel->div16;
  out->n_params = static_cast<uint32_t>(kernel->params.size());
  out->n_images = static_cast<uint32_t>(kernel->images.size());
  for (size_t p = 0; p < kernel->params.size() && p < sizeof(out->params); ++p) out->params[p] = kernel->params[p];
  return 0;
}

int dc_bundle_kernel_alpha(const dc_bundle* b, int32_t k, float* alpha) {
  const dietcode::Kernel* kernel = KernelAt(b, k);
  if (kernel == nullptr || alpha == nullptr) return -1;
  *alpha = kernel->alpha;
  return 0;
}

int dc_bundle_kernel_causal(const dc_bundle* b, int32_t k) {
  const dietcode::Kernel* kernel = KernelAt(b, k);
  return kernel == nullptr ? -1 : kernel->causal ? 1 : 0;
}

int dc_bundle_kernel_attention(const dc_bundle* b, int32_t k, int32_t* head_dim, int32_t* mask_rows,
                               int32_t* nan_to_zero) {
  const dietcode::Kernel* kernel =
      KernelAt(b, k, "null bundle / arguments or ", head_dim != nullptr && mask_rows != nullptr && nan_to_zero != nullptr);
  if (kernel == nullptr) return -1;
  *head_dim = static_cast<int32_t>(kernel->head_dim);
  *mask_rows = kernel->mask_rows ? 1 : 0;
  *nan_to_zero = kernel->nan_to_zero ? 1 : 0;
  return 0;
}

int dc_bundle_kernel_residual_first(const dc_bundle* b, int32_t k) {
  const dietcode::Kernel* kernel = KernelAt(b, k);
  return kernel == nullptr ? -1 : kernel->residual_first ? 1 : 0;
}

int dc_bundle_kernel_residual_mul(const dc_bundle* b, int32_t k) {
  const dietcode::Kernel* kernel = KernelAt(b, k);
  return kernel == nullptr ? -1 : kernel->residual_mul ? 1 : 0;
}

int dc_bundle_kernel_grouped(const dc_bundle* b, int32_t k) {
  const dietcode::Kernel* kernel = KernelAt(b, k);
  return kernel == nullptr ? -1 : kernel->grouped ? 1 : 0;
}

int dc_bundle_kernel_channels_last(const dc_bundle* b, int32_t k) {
  const dietcode::Kernel* kernel = KernelAt(b, k);
  return kernel == nullptr ? -1 : kernel->channels_last ? 1 : 0;
}

int dc_bundle_kernel_tf32(const dc_bundle* b, int32_t k) {
  const dietcode::Kernel* kernel = KernelAt(b, k);
  return kernel == nullptr ? -1 : kernel->tf32 ? 1 : 0;
}

int dc_bundle_kernel_layout(const dc_bundle* b, int32_t k) {
  const dietcode::Kernel* kernel = KernelAt(b, k);
  return kernel == nullptr ? -1 : kernel->layout;
}

int dc_bundle_kernel_persistent(const dc_bundle* b, int32_t k) {
  const dietcode::Kernel* kernel = KernelAt(b, k);
  return kernel == nullptr ? -1 : kernel->persistent;
}

const uint8_t* dc_bundle_kernel_image(const dc_bundle* b, int32_t k, int32_t i, uint32_t* cc, int32_t* specific,
                                      uint32_t* shared, size_t* size) {
  const dietcode::Kernel* kernel = KernelAt(b, k);
  if (kernel == nullptr) return nullptr;
  if (i < 0 || static_cast<size_t>(i) >= kernel->images.size()) {
    dietcode::SetError("kernel '" + kernel->name + "': image " + std::to_string(i) + " out of range");
    return nullptr;
  }
  const dietcode::Image& img = kernel->images[i];
  if (cc) *cc = img.cc;
  if (specific) *specific = img.specific ? 1 : 0;
  if (shared) *shared = img.shared;
  if (size) *size = img.bytes.size();
  return reinterpret_cast<const uint8_t*>(img.bytes.data());
}

const char* dc_bundle_kernel_ptx(const dc_bundle* b, int32_t k, size_t* size) {
  const dietcode::Kernel* kernel = KernelAt(b, k);
  if (kernel == nullptr) return nullptr;
  if (size) *size = kernel->ptx.size();
  return kernel->ptx.c_str();
}

}  // extern "C"
