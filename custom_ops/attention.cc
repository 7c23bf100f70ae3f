// ai.dietcode::Attention (see attention.h). CPU EP: ONNX Runtime's own MatMul and Softmax (MLAS, float32, through
// Ort::Op, which needs no stream on the CPU) with the scale and mask added here in between, in place on the
// scores (on the CPU the fusion saves nodes, not memory). CUDA EP: the bundle's tuned flash-style kernels
// (dispatch tree -> dc_attention_view -> dc_launch_fit on ORT's compute stream), with no vendor path.
#define ORT_API_MANUAL_INIT
#include "onnxruntime_cxx_api.h"
#undef ORT_API_MANUAL_INIT

#include "attention.h"
#include "bundle_impl.h"
#include "core.h"
#include "ort_glue.h"
#include "shapes.h"

#include <cmath>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace dietcode {

bool AttentionPlanMake(const std::vector<int64_t>& q, const std::vector<int64_t>& kt, const std::vector<int64_t>& v,
                       const std::vector<int64_t>* mask, int64_t head_dim, AttentionPlan* plan, std::string* error) {
  const std::string shapes = "Q " + ShapeText(q) + ", Kt " + ShapeText(kt) + ", V " + ShapeText(v) +
                             (mask ? ", mask " + ShapeText(*mask) : "");
  const size_t r = q.size();
  if (r < 2 || kt.size() != r || v.size() != r) {
    *error = "Q, Kt and V must have one rank of at least 2 (" + shapes + ")";
    return false;
  }
  for (const auto* s : {&q, &kt, &v}) {
    for (int64_t d : *s) {
      if (d < 0) {
        *error = "negative dim (" + shapes + ")";
        return false;
      }
    }
  }
  AttentionPlan p;
  p.lead.assign(q.begin(), q.end() - 2);
  p.seq_q = q[r - 2];
  p.head_dim = q[r - 1];
  p.seq_k = kt[r - 1];
  bool lead_equal = true;
  for (size_t i = 0; i + 2 < r; ++i) lead_equal = lead_equal && kt[i] == q[i] && v[i] == q[i];
  if (!lead_equal || kt[r - 2] != p.head_dim || v[r - 2] != p.seq_k || v[r - 1] != p.head_dim) {
    *error = "expected Q [..., T_q, d], Kt [..., d, T_k], V [..., T_k, d] with equal leading dims (" + shapes + ")";
    return false;
  }
  if (head_dim > 0 && p.head_dim != head_dim) {
    *error = "the head dim " + std::to_string(p.head_dim) + " differs from the node's head_dim attribute " +
             std::to_string(head_dim) + " (" + shapes + ")";
    return false;
  }
  std::vector<int64_t> scores(p.lead);
  scores.push_back(p.seq_q);
  scores.push_back(p.seq_k);
  p.mask_strides.assign(r, 0);
  if (mask != nullptr) {
    p.has_mask = true;
    if (mask->size() > r) {
      *error = "the mask has more dims than the scores " + ShapeText(scores) + " (" + shapes + ")";
      return false;
    }
    int64_t step = 1;
    for (size_t j = 0; j < mask->size(); ++j) {
      const size_t mi = mask->size() - 1 - j, si = r - 1 - j;
      const int64_t m = (*mask)[mi];
      if (m == scores[si] && m != 1) {
        p.mask_strides[si] = step;
      } else if (m != 1) {
        *error = "the mask does not broadcast to the scores " + ShapeText(scores) + " (" + shapes + ")";
        return false;
      }
      step *= m;
    }
  }
  *plan = std::move(p);
  return true;
}

bool AttentionCanonical(int layout, int64_t head_dim, std::vector<int64_t>* q, std::vector<int64_t>* k,
                        std::vector<int64_t>* v, std::string* error) {
  if (layout == 0) return true;
  if (!LayoutValid(layout)) {
    *error = "operand layout " + std::to_string(layout) + " is not a bit set of q 1, k 2, v 4, out 8, packed 16 "
             "(packed only with q, k and v)";
    return false;
  }
  if (layout & kLayoutPacked) {  // one [B, T, 3 * H * d] projection as Q, K and V: each part as [B, T, H, d]
    const std::string shapes = "Q " + ShapeText(*q) + ", K " + ShapeText(*k) + ", V " + ShapeText(*v);
    if (q->size() != 3 || *k != *q || *v != *q) {
      *error = "the packed layout takes one [batch, seq, 3 * heads * head_dim] projection as each of Q, K and V (" +
               shapes + ")";
      return false;
    }
    if (head_dim <= 0) {
      *error = "the packed layout needs the node's head_dim attribute (" + shapes + ")";
      return false;
    }
    // c = 3 * heads * head_dim, tested without forming 3 * head_dim: a hand-edited head_dim near 2^63 overflows it
    const int64_t b = (*q)[0], t = (*q)[1], c = (*q)[2];
    if (b < 0 || t < 0 || c <= 0 || c % 3 != 0 || (c / 3) % head_dim != 0) {
      *error = "the packed projection " + ShapeText(*q) + " has a negative dim or a last dim that is not a positive "
               "multiple of 3 * head_dim (head_dim " + std::to_string(head_dim) + ")";
      return false;
    }
    const std::vector<int64_t> part = {b, t, c / 3 / head_dim, head_dim};
    *q = part;
    *k = part;
    *v = part;
  }
  if (q->size() != 4 || k->size() != 4 || v->size() != 4) {
    *error = "operand layout " + LayoutText(layout) + " needs Q, K and V of rank 4 (Q " + ShapeText(*q) + ", K " +
             ShapeText(*k) + ", V " + ShapeText(*v) + ")";
    return false;
  }
  auto swap12 = [](std::vector<int64_t>* s) { std::swap((*s)[1], (*s)[2]); };  // [B, S, H, d] <-> [B, H, S, d]
  if (layout & kLayoutQ) swap12(q);
  if (layout & kLayoutK) *k = {(*k)[0], (*k)[2], (*k)[3], (*k)[1]};  // K [B, S, H, d] -> Kt [B, H, d, S]
  if (layout & kLayoutV) swap12(v);
  return true;
}

std::vector<int64_t> AttentionOutputShape(const AttentionPlan& plan, int layout) {
  std::vector<int64_t> y(plan.lead);
  y.push_back(plan.seq_q);
  y.push_back(plan.head_dim);
  if ((layout & kLayoutOut) && y.size() == 4) std::swap(y[1], y[2]);
  return y;
}

void UnpackPart(const float* src, int64_t rows, int64_t width, int part, float* dst) {
  for (int64_t i = 0; i < rows; ++i) {
    std::memcpy(dst + i * width, src + (i * 3 + part) * width, static_cast<size_t>(width) * sizeof(float));
  }
}

void Permute4(const float* src, const int64_t dims[4], const int perm[4], float* dst) {
  // nothing to move: an empty tensor may still have a huge dim (a batch of 2^40 rows of nothing)
  if (dims[0] == 0 || dims[1] == 0 || dims[2] == 0 || dims[3] == 0) return;
  int64_t stride[4];
  stride[3] = 1;
  for (int a = 2; a >= 0; --a) stride[a] = stride[a + 1] * dims[a + 1];
  const int64_t n0 = dims[perm[0]], n1 = dims[perm[1]], n2 = dims[perm[2]], n3 = dims[perm[3]];
  const int64_t s0 = stride[perm[0]], s1 = stride[perm[1]], s2 = stride[perm[2]], s3 = stride[perm[3]];
  for (int64_t i0 = 0; i0 < n0; ++i0) {
    for (int64_t i1 = 0; i1 < n1; ++i1) {
      for (int64_t i2 = 0; i2 < n2; ++i2) {
        const float* row = src + i0 * s0 + i1 * s1 + i2 * s2;
        for (int64_t i3 = 0; i3 < n3; ++i3) *dst++ = row[i3 * s3];
      }
    }
  }
}

void AttentionScaleMask(const AttentionPlan& plan, float scale, const float* mask, float* scores) {
  const int64_t tq = plan.seq_q, tk = plan.seq_k;
  int64_t z = 1;
  for (int64_t x : plan.lead) z *= x;
  const size_t r = plan.lead.size() + 2;
  const int64_t mq = plan.mask_strides[r - 2], mk = plan.mask_strides[r - 1];
  std::vector<int64_t> idx(plan.lead.size(), 0);  // the head's index over the leading dims
  for (int64_t h = 0; h < z; ++h) {
    int64_t mask_head = 0;
    for (size_t a = 0; a < idx.size(); ++a) mask_head += idx[a] * plan.mask_strides[a];
    for (int64_t i = 0; i < tq; ++i) {
      float* s = scores + (h * tq + i) * tk;
      if (scale != 1.0f) {
        for (int64_t j = 0; j < tk; ++j) s[j] *= scale;
      }
      if (mask == nullptr) continue;
      const float* mrow = mask + mask_head + i * mq;
      if (mk == 1) {
        for (int64_t j = 0; j < tk; ++j) s[j] += mrow[j];
      } else {
        for (int64_t j = 0; j < tk; ++j) s[j] += mrow[j * mk];
      }
    }
    for (size_t a = idx.size(); a-- > 0;) {  // next head index, last axis fastest
      if (++idx[a] < plan.lead[a]) break;
      idx[a] = 0;
    }
  }
}

namespace {

constexpr const char* kCpuEp = "CPUExecutionProvider";

struct FloatInput {
  std::vector<float> storage;
  const float* data = nullptr;
  std::vector<int64_t> shape;
};

FloatInput ReadFloat(const Ort::ConstValue& value) {
  FloatInput t;
  auto info = value.GetTensorTypeAndShapeInfo();
  t.shape = info.GetShape();
  const size_t n = info.GetElementCount();
  switch (info.GetElementType()) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT:
      t.data = value.GetTensorData<float>();
      return t;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: {
      const auto* src = value.GetTensorData<Ort::Float16_t>();
      t.storage.resize(n);
      for (size_t i = 0; i < n; ++i) t.storage[i] = src[i].ToFloat();
      break;
    }
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16: {
      const auto* src = value.GetTensorData<Ort::BFloat16_t>();
      t.storage.resize(n);
      for (size_t i = 0; i < n; ++i) t.storage[i] = src[i].ToFloat();
      break;
    }
    default:
      throw std::runtime_error("unsupported element type; allowed: float, float16, bfloat16");
  }
  t.data = t.storage.data();
  return t;
}

// The operand in its contiguous equivalent: `t` ([B, S, H, d]) permuted by `perm` into its own storage.
void Canonicalize(FloatInput* t, const int perm[4]) {
  std::vector<float> permuted(t->shape[0] * t->shape[1] * t->shape[2] * t->shape[3]);
  Permute4(t->data, t->shape.data(), perm, permuted.data());
  t->shape = {t->shape[perm[0]], t->shape[perm[1]], t->shape[perm[2]], t->shape[perm[3]]};
  t->storage = std::move(permuted);
  t->data = t->storage.data();
}

// Part `part` of the packed projection `t` ([B, T, 3 * H * d]) as [B, T, H, d] in its own storage.
void Unpack(FloatInput* t, int part, int64_t head_dim) {
  const int64_t b = t->shape[0], s = t->shape[1], width = t->shape[2] / 3;
  std::vector<float> own(static_cast<size_t>(b * s * width));
  UnpackPart(t->data, b * s, width, part, own.data());
  t->shape = {b, s, width / head_dim, head_dim};
  t->storage = std::move(own);
  t->data = t->storage.data();
}

constexpr int kHeadSplit[4] = {0, 2, 1, 3};  // [B, S, H, d] <-> [B, H, S, d]
constexpr int kKeySplit[4] = {0, 2, 3, 1};   // K [B, S, H, d] -> Kt [B, H, d, S]

// Two float buffers of n elements each from the kernel context's CPU allocator (the session's arena), freed
// with it; plain new[] when the context offers none.
struct ScratchBuffers {
  ScratchBuffers(Ort::KernelContext& ctx, const Ort::MemoryInfo& mem, size_t n) {
    try {
      allocator = ctx.GetAllocator(*mem);
    } catch (const Ort::Exception&) {
      allocator = nullptr;
    }
    if (allocator != nullptr) {
      block = allocator->Alloc(allocator, 2 * n * sizeof(float));
      if (block == nullptr) {
        Ort::GetApi().ReleaseAllocator(allocator);
        throw std::bad_alloc();
      }
      scores = static_cast<float*>(block);
    } else {
      owned.reset(new float[2 * n]);
      scores = owned.get();
    }
    probs = scores + n;
  }
  ~ScratchBuffers() {
    if (allocator != nullptr) {
      allocator->Free(allocator, block);
      Ort::GetApi().ReleaseAllocator(allocator);
    }
  }
  ScratchBuffers(const ScratchBuffers&) = delete;
  ScratchBuffers& operator=(const ScratchBuffers&) = delete;

  OrtAllocator* allocator = nullptr;
  void* block = nullptr;
  std::unique_ptr<float[]> owned;
  float* scores = nullptr;
  float* probs = nullptr;
};

constexpr const char* kCudaEp = "CUDAExecutionProvider";
constexpr size_t kMaskInput = 3, kBundleInput = 4, kInputs = 5;  // (Q, Kt, V, mask, bundle)

// Inputs (Q, Kt, V[, mask][, bundle]): the mask slot is empty when the chain adds none. The CPU EP computes
// with ORT's MatMul and Softmax (the bundle, when there is one, is checked, not used); the CUDA EP launches
// the bundle's tuned kernels (templates.attention_kernel) on ORT's compute stream and has no other path: a
// call no kernel takes fails with the node and the reason.
class AttentionKernel {
 public:
  AttentionKernel(const OrtKernelInfo* raw, bool cuda, ONNXTensorElementDataType dtype) : cuda_(cuda), dtype_(dtype) {
    Ort::ConstKernelInfo info(raw);
    where_ = "node '" + info.GetNodeName() + "' (ai.dietcode:Attention)";
    try {
      scale_ = info.GetAttribute<float>("scale");
    } catch (const Ort::Exception&) {
      if (HasAttribute(info, "scale")) ThrowAttrType<float>(where_, "scale");
      Throw("the 'scale' attribute is missing (optimize the model again)");
    }
    if (!std::isfinite(scale_)) Throw("the scale " + std::to_string(scale_) + " is not finite");
    head_dim_ = AttrOr<int64_t>(info, where_, "head_dim", 0);  // 0: not checked
    nan_to_zero_ = AttrOr<int64_t>(info, where_, "nan_to_zero", 0) != 0;
    mask_rows_ = AttrOr<int64_t>(info, where_, "mask_rows", 1) != 0;
    causal_ = AttrOr<int64_t>(info, where_, "causal", 0) != 0;
    layout_ = AttrOr<int64_t>(info, where_, "layout", 0);
    if (layout_ < 0 || layout_ > kLayoutMax || !LayoutValid(static_cast<int>(layout_))) {
      Throw("the layout attribute " + std::to_string(layout_) + " is not a bit set of q 1, k 2, v 4, out 8, packed "
            "16 (packed only with q, k and v)");
    }
    if (head_dim_ < 0) Throw("negative head_dim attribute");
    if ((layout_ & kLayoutPacked) && head_dim_ == 0) {
      Throw("the packed layout needs the head_dim attribute (the packed projection's last dim is 3 * heads * "
            "head_dim)");
    }
    const size_t n = info.GetInputCount();
    if (n < 3 || n > kInputs) Throw("expects inputs (Q, Kt, V[, mask][, bundle]), got " + std::to_string(n));
    for (size_t i = 0; i < 3; ++i) {
      if (info.GetInputName(i).empty()) Throw("input " + std::to_string(i) + " of (Q, Kt, V) is empty");
    }
    has_mask_ = n > kMaskInput && !info.GetInputName(kMaskInput).empty();
    if (n > kBundleInput && !info.GetInputName(kBundleInput).empty()) LoadBundle(info);
    counter_ = dc_node_counter_get(info.GetNodeName().c_str());  // node_stats() counts both EPs' calls
    if (cuda_) {
      if (!bundle_) {
        Throw("the node carries no kernel bundle (inputs (Q, Kt, V, mask, bundle)); the CUDA EP runs Attention "
              "with tuned kernels only: optimize the original model again");
      }
      FitDevice(raw);
      return;
    }
    // ORT's own MatMul (float32, MLAS) for the two products; the CPU EP's Ort::Op needs no stream
    const ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
    const char* type_names[] = {"T"};
    try {
      matmul_ = Ort::Op::Create(raw, "MatMul", "", 13, type_names, &type, 1, nullptr, 0, 2, 1);
      const int64_t axis = -1;
      Ort::OpAttr axis_attr("axis", &axis, 1, OrtOpAttrType::ORT_OP_ATTR_INT);
      softmax_ = Ort::Op::Create(raw, "Softmax", "", 13, type_names, &type, 1, &axis_attr, 1, 1, 1);
    } catch (const Ort::Exception& e) {
      Throw(std::string("cannot create ONNX Runtime's MatMul or Softmax kernel: ") + e.what());
    }
  }

  OrtStatusPtr ComputeV2(OrtKernelContext* raw) {
    return ComputeStatus(where_, [&] { cuda_ ? ComputeCuda(raw) : Compute(raw); });
  }

 private:
  [[noreturn]] void Throw(const std::string& msg) const { throw std::runtime_error(where_ + ": " + msg); }

  // The bundle input (AcquireBundleInput), parsed once per distinct bytes; every kernel must be a compiled
  // attention kernel for this node's dtype that takes a mask exactly when the node has one.
  void LoadBundle(const Ort::ConstKernelInfo& info) {
    bundle_ = AcquireBundleInput(info, kBundleInput, where_, BundleInputWording::kGrouped);
    int32_t n_features = 0;
    dc_bundle_info(bundle_.get(), &n_features, &n_kernels_, nullptr);
    features_.resize(n_features);
    if (dc_bundle_max_feature_input(bundle_.get()) >= static_cast<int>(kBundleInput)) {
      Throw("the bundle's features read input " + std::to_string(dc_bundle_max_feature_input(bundle_.get())) +
            "; Attention has 4 data inputs (Q, Kt, V, mask)");
    }
    for (int32_t k = 0; k < n_kernels_; ++k) {
      if (dc_bundle_kernel_is_vendor(bundle_.get(), k) != 0) {
        Throw("bundle kernel " + std::to_string(k) + " is the vendor kind; Attention has no vendor kernel");
      }
    }
    if (dc_bundle_check_node(bundle_.get(), DtypeCode(dtype_), 3, 0, 0, nullptr, 1, 0) != 0) Throw(dc_last_error());
    // on both EPs: the kernels' baked-in SCALE (their alpha) must be the scale the CPU path applies
    if (dc_bundle_check_scale(bundle_.get(), scale_) != 0) Throw(dc_last_error());
    // the kernels read and write the operands in the layouts and head dim compiled into them, index the mask
    // and treat a fully masked row as compiled: the node's attributes must say the same
    if (dc_bundle_check_attention(bundle_.get(), static_cast<int>(layout_), head_dim_, mask_rows_ ? 1 : 0,
                                  nan_to_zero_ ? 1 : 0) != 0) {
      Throw(dc_last_error());
    }
    // a causal node's mask is the causal mask (tuner/causal_mask.py): its kernels drop those keys themselves
    // (causal mode) and take no mask, while the CPU path adds the mask as the original graph does
    const bool kernel_mask = has_mask_ && !causal_;
    if (causal_ && !has_mask_) Throw("the node is causal but has no mask input (optimize the model again)");
    for (int32_t k = 0; k < n_kernels_; ++k) {
      if ((dc_bundle_kernel_takes_param(bundle_.get(), k, "mask") == 1) != kernel_mask) {
        Throw("bundle kernel " + std::to_string(k) +
              (kernel_mask ? " takes no mask but the node has one"
                           : causal_ ? " takes a mask but the node is causal (its kernels drop the masked keys)"
                                     : " takes a mask but the node has none"));
      }
      if ((dc_bundle_kernel_causal(bundle_.get(), k) == 1) != causal_) {
        Throw("bundle kernel " + std::to_string(k) + (causal_ ? " is not causal but the node is (causal=1)"
                                                              : " is causal but the node is not"));
      }
    }
  }

  // Per session: which kernels this device and driver can run (dc_bundle_fit_device). None: creation fails;
  // some: a call the tree sends to one of those fails with the reason.
  void FitDevice(const OrtKernelInfo* info) {
    device_fits_.assign(n_kernels_, 1);
    device_reason_.assign(n_kernels_, {});
    int major = 0, minor = 0, optin = 0, driver = 0;
    if (dc_cuda_device_limits(NodeDevice(info), &major, &minor, &optin) != 0) {
      Throw(std::string("cannot read the CUDA device's limits: ") + dc_last_error());
    }
    if (dc_cuda_driver_version(&driver) != 0) driver = 0;  // not checked; dc_launch will say why
    const int unfit =
        dc_bundle_fit_device(bundle_.get(), major, minor, optin, driver, device_fits_.data(), device_fits_.size());
    if (unfit < 0) Throw(dc_last_error());
    if (unfit == 0) return;
    const std::string first = dc_last_error();
    if (unfit == n_kernels_) {
      Throw("no bundle kernel can run on this device (sm_" + std::to_string(major * 10 + minor) +
            "), and Attention has no vendor path; first: " + first + " (optimize for this GPU's --target)");
    }
    for (int32_t k = 0; k < n_kernels_; ++k) {
      if (!device_fits_[k] && dc_kernel_fit_device(bundle_.get(), k, major, minor, optin, driver) == 0) {
        device_reason_[k] = dc_last_error();
      }
    }
  }

  void ComputeCuda(OrtKernelContext* raw) {
    Ort::KernelContext ctx(raw);
    Ort::ConstValue in[4] = {ctx.GetInput(0), ctx.GetInput(1), ctx.GetInput(2),
                             has_mask_ ? ctx.GetInput(kMaskInput) : Ort::ConstValue{nullptr}};
    thread_local std::vector<int64_t> shapes[4];
    for (size_t i = 0; i < 4; ++i) {
      if (i < 3 || has_mask_) ReadShape(in[i], &shapes[i]);
    }
    dc_launch_args args{};
    int64_t layout_shape[4] = {0, 0, 0, 0};
    const int view = dc_attention_view_layout(
        shapes[0].data(), shapes[0].size(), shapes[1].data(), shapes[1].size(), shapes[2].data(), shapes[2].size(),
        has_mask_ ? shapes[3].data() : nullptr, has_mask_ ? shapes[3].size() : 0, head_dim_,
        static_cast<int>(layout_), layout_shape, &args);
    if (view < 0) Throw(dc_last_error());
    thread_local std::vector<int64_t> out_shape;  // Q's shape, or [B, T_q, H, d] with the out layout
    if (layout_ != 0) {
      out_shape.assign(layout_shape, layout_shape + 4);
    } else {
      out_shape = shapes[0];
    }
    Ort::UnownedValue out = ctx.GetOutput(0, out_shape.data(), out_shape.size());
    int64_t total = 1;
    for (int64_t d : out_shape) total *= d;
    if (total == 0) return;
    if (view == 0) Throw(std::string("the attention kernels cannot take this call: ") + dc_last_error());
    if (args.seq_k == 0) {  // Softmax over no keys is empty, and the product of empty matrices is 0
      const uint64_t bytes = static_cast<uint64_t>(total) * (dtype_ == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT ? 4 : 2);
      if (dc_zero_async(reinterpret_cast<uint64_t>(out.GetTensorMutableRawData()), bytes,
                        ctx.GetGPUComputeStream()) != 0) {
        Throw(dc_last_error());
      }
      return;
    }
    if (causal_) {  // the mask input is the causal mask, which the kernels apply themselves
      if (args.seq_q != args.seq_k) {
        Throw("a causal node's queries and keys differ in number (" + std::to_string(args.seq_q) + " and " +
              std::to_string(args.seq_k) + "); the chain was fused for equal ones");
      }
      args.stride_mask_b = args.stride_mask_h = args.stride_mask_q = args.stride_mask_k = 0;
    } else if (!mask_rows_ && args.stride_mask_q != 0) {
      Throw("the mask varies along the queries, but the node's kernels were compiled for a mask of one row "
            "(mask_rows=0)");
    }
    const int64_t* dims[4] = {shapes[0].data(), shapes[1].data(), shapes[2].data(),
                              has_mask_ ? shapes[3].data() : nullptr};
    const size_t ranks[4] = {shapes[0].size(), shapes[1].size(), shapes[2].size(), has_mask_ ? shapes[3].size() : 0};
    thread_local std::vector<int64_t> features;
    features.resize(features_.size());
    if (dc_bundle_features(bundle_.get(), dims, ranks, 4, features.data()) != 0) Throw(dc_last_error());
    const int32_t k = dc_bundle_select(bundle_.get(), features.data(), features.size());
    if (k < 0) Throw(dc_last_error());
    if (!device_fits_[k]) {
      Throw("the dispatch tree picks bundle kernel " + std::to_string(k) + ", which cannot run on this device (" +
            device_reason_[k] + "), and Attention has no vendor path");
    }
    args.q = reinterpret_cast<uint64_t>(in[0].GetTensorRawData());
    args.k = reinterpret_cast<uint64_t>(in[1].GetTensorRawData());
    args.v = reinterpret_cast<uint64_t>(in[2].GetTensorRawData());
    args.mask = has_mask_ && !causal_ ? reinterpret_cast<uint64_t>(in[3].GetTensorRawData()) : 0;
    args.out = reinterpret_cast<uint64_t>(out.GetTensorMutableRawData());
    args.c_bytes = static_cast<uint64_t>(total) * (dtype_ == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT ? 4 : 2);
    const int fit = dc_launch_fit(bundle_.get(), k, &args, ctx.GetGPUComputeStream());
    if (fit == 0) {
      dc_node_count_launch(counter_);
      return;
    }
    if (fit < 0) Throw(dc_last_error());
    // The pick refuses this call (its pointers not 16-byte aligned, as the tuned kernels assume, say). Attention
    // has no vendor path, but every kernel of the bundle computes the node: the first other one that takes the
    // call runs (optimize ships one compiled without alignment assumptions for this).
    const std::string why = dc_last_error();
    for (int32_t other = 0; other < n_kernels_; ++other) {
      if (other == k || !device_fits_[other]) continue;
      const int taken = dc_launch_fit(bundle_.get(), other, &args, ctx.GetGPUComputeStream());
      if (taken < 0) Throw(dc_last_error());
      if (taken == 0) {
        dc_node_count_launch(counter_);
        return;
      }
    }
    Throw("bundle kernel " + std::to_string(k) + " cannot take this call (" + why +
          "), no other kernel of the bundle can, and Attention has no vendor path");
  }

  void Compute(OrtKernelContext* raw) {
    dc_node_count_fallback(counter_, "the CPU execution provider runs ONNX Runtime's kernels");
    Ort::KernelContext ctx(raw);
    const size_t n_in = ctx.GetInputCount();
    Ort::ConstValue mask_value = n_in > 3 ? ctx.GetInput(3) : Ort::ConstValue{nullptr};
    const bool has_mask = static_cast<const OrtValue*>(mask_value) != nullptr;
    FloatInput q = ReadFloat(ctx.GetInput(0)), kt = ReadFloat(ctx.GetInput(1)), v = ReadFloat(ctx.GetInput(2));
    FloatInput mask;
    if (has_mask) mask = ReadFloat(mask_value);
    AttentionPlan plan;
    std::string error;
    {  // the shapes' contiguous equivalents, checked before any operand is permuted into them
      std::vector<int64_t> cq(q.shape), ck(kt.shape), cv(v.shape);
      if (!AttentionCanonical(static_cast<int>(layout_), head_dim_, &cq, &ck, &cv, &error) ||
          !AttentionPlanMake(cq, ck, cv, has_mask ? &mask.shape : nullptr, head_dim_, &plan, &error)) {
        Throw(error);
      }
    }
    if (layout_ & kLayoutPacked) {  // each input is the packed projection: Q its part 0, K part 1, V part 2
      Unpack(&q, 0, head_dim_);
      Unpack(&kt, 1, head_dim_);
      Unpack(&v, 2, head_dim_);
    }
    // the operands the node takes as [B, S, H, d], permuted to the products' [B, H, S, d] (K: to Kt)
    if (layout_ & kLayoutQ) Canonicalize(&q, kHeadSplit);
    if (layout_ & kLayoutK) Canonicalize(&kt, kKeySplit);
    if (layout_ & kLayoutV) Canonicalize(&v, kHeadSplit);
    const bool out_bshd = (layout_ & kLayoutOut) != 0;
    std::vector<int64_t> out_shape(plan.lead);  // the products' output, [B, H, T_q, d] at rank 4
    out_shape.push_back(plan.seq_q);
    out_shape.push_back(plan.head_dim);
    const std::vector<int64_t> node_shape = AttentionOutputShape(plan, static_cast<int>(layout_));
    Ort::UnownedValue out = ctx.GetOutput(0, node_shape.data(), node_shape.size());
    auto info = out.GetTensorTypeAndShapeInfo();
    const size_t total = info.GetElementCount();
    if (total == 0) return;
    const auto type = info.GetElementType();
    if (plan.seq_k == 0) {  // Softmax over no keys is empty, and the product of empty matrices is 0
      void* data = out.GetTensorMutableRawData();
      std::memset(data, 0, total * (type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT ? sizeof(float) : sizeof(uint16_t)));
      return;
    }
    auto mem = Ort::MemoryInfo::CreateCpu(OrtArenaAllocator, OrtMemTypeDefault);
    auto wrap = [&](const float* data, const std::vector<int64_t>& shape, size_t count) {
      return Ort::Value::CreateTensor<float>(mem, const_cast<float*>(data), count, shape.data(), shape.size());
    };
    const size_t heads_elems = total / static_cast<size_t>(plan.head_dim) * static_cast<size_t>(plan.seq_k);
    std::vector<int64_t> s_shape(plan.lead);
    s_shape.push_back(plan.seq_q);
    s_shape.push_back(plan.seq_k);
    // the scores and probabilities of every head (z * seq_q * seq_k each) from the session's CPU arena (a fresh
    // allocation per call would page-fault its way through them), left uninitialized: MatMul and Softmax write
    // every element
    ScratchBuffers buffers(ctx, mem, heads_elems);
    float* scores = buffers.scores;
    float* probs = buffers.probs;
    Ort::Value qv = wrap(q.data, q.shape, total), kv = wrap(kt.data, kt.shape, total / plan.seq_q * plan.seq_k);
    Ort::Value vv = wrap(v.data, v.shape, total / plan.seq_q * plan.seq_k), sv = wrap(scores, s_shape, heads_elems);
    const OrtValue* first[] = {qv, kv};
    OrtValue* s_out = sv;
    matmul_.Invoke(raw, first, 2, &s_out, 1);
    AttentionScaleMask(plan, scale_, has_mask ? mask.data : nullptr, scores);
    Ort::Value pv = wrap(probs, s_shape, heads_elems);  // not in place: Softmax does not promise to allow it
    const OrtValue* s_in[] = {sv};
    OrtValue* p_out = pv;
    softmax_.Invoke(raw, s_in, 1, &p_out, 1);
    if (nan_to_zero_) {
      for (size_t i = 0; i < heads_elems; ++i) probs[i] = std::isnan(probs[i]) ? 0.0f : probs[i];
    }
    std::vector<float> y_storage;
    float* y = nullptr;
    if (type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT && !out_bshd) {
      y = out.GetTensorMutableData<float>();
    } else {
      y_storage.resize(total);
      y = y_storage.data();
    }
    Ort::Value yv = wrap(y, out_shape, total);
    const OrtValue* second[] = {pv, vv};
    OrtValue* y_out = yv;
    matmul_.Invoke(raw, second, 2, &y_out, 1);
    if (out_bshd) {  // [B, H, T_q, d] -> the node's [B, T_q, H, d]
      std::vector<float> merged(total);
      Permute4(y, out_shape.data(), kHeadSplit, merged.data());
      if (type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) {
        std::memcpy(out.GetTensorMutableData<float>(), merged.data(), total * sizeof(float));
        return;
      }
      y_storage = std::move(merged);
      y = y_storage.data();
    }
    if (type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16) {
      auto* dst = out.GetTensorMutableData<Ort::Float16_t>();
      for (size_t i = 0; i < total; ++i) dst[i] = Ort::Float16_t(y[i]);
    } else if (type == ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16) {
      auto* dst = out.GetTensorMutableData<Ort::BFloat16_t>();
      for (size_t i = 0; i < total; ++i) dst[i] = Ort::BFloat16_t(y[i]);
    }
  }

  bool cuda_;
  ONNXTensorElementDataType dtype_;
  std::string where_;
  float scale_ = 1.0f;
  int64_t head_dim_ = 0;
  bool nan_to_zero_ = false;
  bool mask_rows_ = true;
  bool causal_ = false;  // the mask is the causal mask: the kernels run in causal mode without it
  int64_t layout_ = 0;  // the operands taken (written) as [B, S, H, d]: bundle_impl.h kLayout* bits
  bool has_mask_ = false;
  Ort::Op matmul_{nullptr}, softmax_{nullptr};  // CPU only
  BundlePtr bundle_;
  int32_t n_kernels_ = 0;
  std::vector<int64_t> features_;
  std::vector<uint8_t> device_fits_;  // per kernel, CUDA only (see FitDevice)
  std::vector<std::string> device_reason_;
  dc_node_counter* counter_ = nullptr;
};

struct AttentionOp : Ort::CustomOpBase<AttentionOp, AttentionKernel, true> {
  AttentionOp(const char* name, ONNXTensorElementDataType dtype, bool cuda) : name_(name), dtype_(dtype), cuda_(cuda) {}

  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const {
    return CreateKernelStatus(api, kernel, [&] { return new AttentionKernel(info, cuda_, dtype_); });
  }

  const char* GetName() const { return name_; }
  const char* GetExecutionProviderType() const { return cuda_ ? kCudaEp : kCpuEp; }
  // (Q, Kt, V, mask, bundle): the mask and the bundle are optional for the schema so that the kernel, not the
  // schema check, reports a CUDA node without a bundle; the bundle is uint8 and stays in host memory.
  size_t GetInputTypeCount() const { return kInputs; }
  ONNXTensorElementDataType GetInputType(size_t index) const {
    return index == kBundleInput ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 : dtype_;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t index) const {
    return index >= kMaskInput ? OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_OPTIONAL
                               : OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_REQUIRED;
  }
  OrtMemType GetInputMemoryType(size_t index) const {
    return index == kBundleInput ? OrtMemTypeCPUInput : OrtMemTypeDefault;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return dtype_; }

 private:
  const char* name_;
  ONNXTensorElementDataType dtype_;
  bool cuda_;
};

}  // namespace

void AddAttentionOps(OrtCustomOpDomain* domain) {
  // Created once, kept for the life of the process, as ORT requires of custom ops: each dtype and EP under the
  // op type's name and under "Attention", the name models written before used (ai.dietcode opset 2), which is
  // also an ONNX op's and com.microsoft's: tools matching nodes by op type alone took the node for those.
  static const std::vector<std::unique_ptr<AttentionOp>> ops = [] {
    std::vector<std::unique_ptr<AttentionOp>> made;
    for (const char* name : {"ScaledDotProductAttention", "Attention"}) {
      for (bool cuda : {false, true}) {
        for (auto t : {ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16,
                       ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16}) {
          made.push_back(std::make_unique<AttentionOp>(name, t, cuda));
        }
      }
    }
    return made;
  }();
  for (const auto& op : ops) Ort::ThrowOnError(Ort::GetApi().CustomOpDomain_Add(domain, op.get()));
}

}  // namespace dietcode

extern "C" {

int dc_attention_view(const int64_t* q, size_t rq, const int64_t* kt, size_t rk, const int64_t* v, size_t rv,
                      const int64_t* mask, size_t rm, int64_t head_dim, dc_launch_args* out) {
  return dc_attention_view_layout(q, rq, kt, rk, v, rv, mask, rm, head_dim, 0, nullptr, out);
}

int dc_attention_view_layout(const int64_t* q, size_t rq, const int64_t* kt, size_t rk, const int64_t* v,
                             size_t rv, const int64_t* mask, size_t rm, int64_t head_dim, int layout,
                             int64_t* out_shape, dc_launch_args* out) {
  if (out == nullptr || (rq && !q) || (rk && !kt) || (rv && !v) || (rm && !mask) || rq > 8 || rk > 8 || rv > 8 ||
      rm > 8 || !dietcode::LayoutValid(layout)) {
    dietcode::SetError("dc_attention_view: null argument, rank above 8 or layout " + std::to_string(layout) +
                       " not a valid bit set (0..31, packed only with q, k and v)");
    return -1;
  }
  std::vector<int64_t> sq(q, q + rq), sk(kt, kt + rk), sv(v, v + rv);
  const std::vector<int64_t> sm(mask, mask + rm);
  std::string error;
  if (!dietcode::AttentionCanonical(layout, head_dim, &sq, &sk, &sv, &error)) {
    dietcode::SetError(error);
    return -1;
  }
  dietcode::AttentionPlan plan;
  if (!dietcode::AttentionPlanMake(sq, sk, sv, mask ? &sm : nullptr, head_dim, &plan, &error)) {
    dietcode::SetError(error);
    return -1;
  }
  const size_t r = sq.size();  // the contiguous equivalent's rank (4 for the packed projection's rank 3)
  if (out_shape != nullptr && r == 4) {  // also when the view below cannot express the call (it returns 0)
    const std::vector<int64_t> y = dietcode::AttentionOutputShape(plan, layout);
    for (size_t i = 0; i < 4; ++i) out_shape[i] = y[i];
  }
  if (r > 4) {
    dietcode::SetError("rank " + std::to_string(r) + " above 4: the attention view has batch and heads only");
    return 0;
  }
  int64_t z = 1;
  for (int64_t d : plan.lead) z *= d;
  const int64_t heads = r == 4 ? plan.lead[1] : 1;
  const std::vector<int64_t>& s = plan.mask_strides;  // per axis of [lead..., seq_q, seq_k]
  const int64_t stride_b = plan.lead.empty() ? 0 : s[0];
  const int64_t stride_h = r == 4 ? s[1] : 0;
  const int64_t values[] = {plan.seq_q, plan.seq_k, heads, z, stride_b, stride_h, s[r - 2], s[r - 1], plan.head_dim};
  for (int64_t x : values) {
    if (x > 0x7fffffff) {
      dietcode::SetError("a size or mask stride past int32 (the attention view's scalars are int32)");
      return 0;
    }
  }
  // the head-split layouts: offsets inside one head are int32 in the template (rows of heads * d elements)
  const std::pair<int, int64_t> operands[] = {{dietcode::kLayoutQ, plan.seq_q}, {dietcode::kLayoutK, plan.seq_k},
                                              {dietcode::kLayoutV, plan.seq_k}, {dietcode::kLayoutOut, plan.seq_q}};
  for (const auto& [bit, rows] : operands) {
    // a packed operand's rows are 3 * heads * d elements (the three projections side by side)
    const int64_t row = (layout & dietcode::kLayoutPacked) && bit != dietcode::kLayoutOut ? 3 * heads : heads;
    if ((layout & bit) && heads > 0 && plan.head_dim > 0 && rows > 0x7fffffff / row / plan.head_dim) {
      dietcode::SetError("a head-split operand of " + std::to_string(rows) + " x " + std::to_string(row) + " x " +
                         std::to_string(plan.head_dim) + " elements needs offsets past int32 (the template's offsets "
                         "inside one head)");
      return 0;
    }
  }
  *out = dc_launch_args{};
  out->seq_q = static_cast<int32_t>(plan.seq_q);
  out->seq_k = static_cast<int32_t>(plan.seq_k);
  out->heads = static_cast<int32_t>(heads);
  out->batch = static_cast<int32_t>(z);
  out->stride_mask_b = static_cast<int32_t>(stride_b);
  out->stride_mask_h = static_cast<int32_t>(stride_h);
  out->stride_mask_q = static_cast<int32_t>(s[r - 2]);
  out->stride_mask_k = static_cast<int32_t>(s[r - 1]);
  out->head_dim = static_cast<int32_t>(plan.head_dim);
  return 1;
}

}  // extern "C"
