// ONNX Runtime glue: the ai.dietcode custom ops for the CUDA and CPU execution providers.
//
// One kernel class serves all 132 op types (MatMul|Gemm|Conv x epilogue x Residual after or before the activation
// or Mul after it), configured from the op type name; a MatMul's `scale` attribute (default
// 1) is the fused alpha: y = act(scale * A B + bias) + residual, or y = act(scale * A B + bias + residual) for an op
// type naming the residual before the activation (ConvBiasResidualRelu), or y = act(scale * A B + bias) * residual
// for one ending in Mul (MatMulSiluMul, LLaMA's SwiGLU gate). Compiled kernels have their scale baked in; the CPU
// and vendor paths read the attribute.
// CUDA: evaluate the bundle's dispatch tree on the input shapes and launch the chosen cubin on ORT's
// compute stream (no allocation, no synchronization), or, for "vendor" leaves and calls no compiled kernel
// takes, the vendor path of vendor.h: cuBLAS or cuDNN on ORT's own handles and stream plus a PTX epilogue, or
// one cuBLASLt call with the epilogue fused where dc_gemm_lt_plan takes the call (never ORT's kernel through
// Ort::Op: its standalone context has no stream, see vendor.h). CPU: ORT's own
// MatMul/Gemm/Conv (fp32, through Ort::Op, which needs no stream there) plus the epilogue in C++.
#define ORT_API_MANUAL_INIT
#include "onnxruntime_cxx_api.h"
#undef ORT_API_MANUAL_INIT

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "attention.h"
#include "core.h"
#include "ort_glue.h"
#include "shapes.h"
#include "vendor.h"

namespace dietcode {
namespace {

constexpr const char* kDomain = "ai.dietcode";
constexpr const char* kCpuEp = "CPUExecutionProvider";
constexpr const char* kCudaEp = "CUDAExecutionProvider";
// Reasons a node runs the vendor path beyond dc_kernel_fit's codes (1..7), for one warning per node and reason.
constexpr int kReasonDevice = 16;
constexpr int kReasonWorkspace = 17;  // ORT's scratch allocator gives no workspace (split-K, TMA scratch)
// Notes of the vendor conv (logged once per node each): its algorithm falls back to IMPLICIT_GEMM without
// workspace because cuDNN's heuristic gave none, or because ORT gave no memory for the chosen one's workspace.
constexpr int kNoteConvAlgo = 18;
constexpr int kNoteConvWorkspace = 19;
// Note of the vendor GEMM (logged once per node): a call dc_gemm_lt_plan fuses into one cuBLASLt call runs cuBLAS
// and the PTX epilogue instead, because cuBLASLt is not loaded or the fused call failed.
constexpr int kNoteLt = 20;
constexpr int kFitWorkspaceSize = 8;  // dc_kernel_fit's "workspace size" (core.h): the size overflows int64
// ORT's CUDA resources for custom ops (core/providers/cuda/cuda_resource.h): version 1 has these ids, and
// CudaStream::GetResource accepts any version up to its own.
constexpr int kCudaResourceVersion = 1;
constexpr int kCudaResourceCudnnHandle = 10001;  // CudaResource::cudnn_handle_t
constexpr int kCudaResourceCublasHandle = 10002;  // CudaResource::cublas_handle_t
// ORT's CUDA EP computes float32 GEMMs with TF32 unless its use_tf32 option is 0 (the tuner's vendor baseline
// assumes the same, tuner/measure.py ORT_CUDA_USES_TF32); the vendor path follows the default. A custom op
// cannot read the option (docs/abi.md, "Float32 precision"): neither OrtKernelInfo nor the session's config
// entries carry a provider option, so this stays an assumption.
constexpr int kOrtCudaUsesTf32 = 1;

struct ConvAlgoCacheDeleter {
  void operator()(dc_conv_algo_cache* c) const { dc_conv_algo_cache_free(c); }
};

// Inputs: A, B, [bias], [residual], bundle: the bundle is the last (index 2 to 4).
size_t ResidualInput(const OpSpec& spec) { return spec.bias ? 3 : 2; }
size_t BundleInput(const OpSpec& spec) { return ResidualInput(spec) + (spec.residual ? 1 : 0); }

// The residual holds the output's elements in their order: the output's shape, or one of another rank with the same
// last dim and element count (the output reshaped over its leading dims: GPT-2's Gemm -> Reshape -> Add, whose
// residual is [batch, seq, n] for a [batch * seq, n] product). The rewrite fuses no broadcast residual, and a
// residual of the output's rank but another shape ([2, 8, n] for [4, 4, n]) is one the original Add refuses.
std::string ResidualMismatch(const Shape& residual, const Shape& out) {
  if (residual == out) return "";
  if (!residual.empty() && !out.empty() && residual.size() != out.size() && residual.back() == out.back() &&
      NumElements(residual) == NumElements(out)) {
    return "";
  }
  return "the residual input has shape " + ShapeText(residual) + ", not the output's " + ShapeText(out) +
         " (the fused Add takes a residual of the output's elements only: its shape, or, of another rank, that "
         "shape's last dim and element count)";
}

float Gelu(float x) { return 0.5f * x * (1.0f + std::erf(x * 0.70710678118654752440f)); }

// 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3): the tanh approximation (ONNX Gelu approximate="tanh")
float GeluTanh(float x) { return 0.5f * x * (1.0f + std::tanh(0.79788456080286535588f * (x + 0.044715f * x * x * x))); }

float Silu(float x) { return x / (1.0f + std::exp(-x)); }

void ApplyActivation(float* y, int64_t n, Activation act) {
  if (act == Activation::kRelu) {
    for (int64_t i = 0; i < n; ++i) y[i] = y[i] < 0.0f ? 0.0f : y[i];  // NaN stays NaN, as ORT's CPU Relu
  } else if (act == Activation::kGelu) {
    for (int64_t i = 0; i < n; ++i) y[i] = Gelu(y[i]);
  } else if (act == Activation::kGeluTanh) {
    for (int64_t i = 0; i < n; ++i) y[i] = GeluTanh(y[i]);
  } else if (act == Activation::kSilu) {
    for (int64_t i = 0; i < n; ++i) y[i] = Silu(y[i]);
  } else if (act == Activation::kRelu6) {
    for (int64_t i = 0; i < n; ++i) y[i] = std::min(std::max(y[i], 0.0f), 6.0f);
  }
}

// dst[b][c][r] = src[b][r][c]: a channels-last [N, spatial..., C] tensor as [N, C, spatial...] (rows the
// spatial positions, cols the channels), or the way back with rows and cols swapped.
void SwapLastTwo(const float* src, float* dst, int64_t batch, int64_t rows, int64_t cols) {
  for (int64_t b = 0; b < batch; ++b) {
    const float* s = src + b * rows * cols;
    float* d = dst + b * rows * cols;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) d[c * rows + r] = s[r * cols + c];
    }
  }
}

template <typename T>
void ToFloat(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i].ToFloat();
}

template <typename T>
void FromFloat(const float* src, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = T(src[i]);
}

// Input converted to fp32 (borrowed when it already is fp32); `shape` is the caller's, read once per call.
struct FloatTensor {
  std::vector<float> storage;
  const float* data = nullptr;
  const Shape* shape = nullptr;
};

// `type` is the op's declared element type, which ORT has checked the input against.
FloatTensor AsFloat(const Ort::ConstValue& v, const Shape& shape, ONNXTensorElementDataType type) {
  FloatTensor t;
  t.shape = &shape;
  const int64_t n = NumElements(shape);
  switch (type) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT:
      t.data = v.GetTensorData<float>();
      break;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16:
      t.storage.resize(n);
      ToFloat(v.GetTensorData<Ort::Float16_t>(), t.storage.data(), n);
      t.data = t.storage.data();
      break;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16:
      t.storage.resize(n);
      ToFloat(v.GetTensorData<Ort::BFloat16_t>(), t.storage.data(), n);
      t.data = t.storage.data();
      break;
    default:
      throw std::runtime_error("unsupported element type; allowed: float, float16, bfloat16");
  }
  return t;
}

class DietcodeKernel {
 public:
  DietcodeKernel(const OrtKernelInfo* raw_info, const OpSpec& spec, bool cuda, ONNXTensorElementDataType dtype)
      : spec_(spec), cuda_(cuda), dtype_(dtype) {
    Ort::ConstKernelInfo info(raw_info);
    where_ = "node '" + info.GetNodeName() + "' (" + kDomain + ":" + spec.name + ")";
    logger_ = info.GetLogger();
    counter_ = dc_node_counter_get(info.GetNodeName().c_str());
    CheckInputs(info);
    has_bias_input_ = spec.bias;
    scale_ = AttrOr<float>(info, where_, "scale", 1.0f);
    if (scale_ != 1.0f && spec.base != BaseOp::kMatMul) Throw("the scale attribute applies to MatMul op types only");
    if (!std::isfinite(scale_)) Throw("the scale attribute is not finite");
    LoadBundle(info);
    CheckBundleFitsNode(BundleInput(spec));
    // on both EPs: the compiled kernels' baked-in alpha must be the scale the vendor and CPU paths apply
    if (dc_bundle_check_scale(bundle_.get(), scale_) != 0) Throw(dc_last_error());
    if (spec.base == BaseOp::kGemm) {
      gemm_.trans_a = AttrOr<int64_t>(info, where_, "transA", 0);
      gemm_.trans_b = AttrOr<int64_t>(info, where_, "transB", 0);
      gemm_.alpha = AttrOr<float>(info, where_, "alpha", 1.0f);
      gemm_.beta = AttrOr<float>(info, where_, "beta", 1.0f);
    } else if (spec.base == BaseOp::kConv) {
      conv_.strides = IntsOr(info, where_, "strides");
      conv_.pads = IntsOr(info, where_, "pads");
      conv_.dilations = IntsOr(info, where_, "dilations");
      conv_.kernel_shape = IntsOr(info, where_, "kernel_shape");
      conv_.group = AttrOr<int64_t>(info, where_, "group", 1);
      conv_.auto_pad = AttrOr<std::string>(info, where_, "auto_pad", "NOTSET");
      const int64_t channels_last = AttrOr<int64_t>(info, where_, "channels_last", 0);
      if (channels_last != 0 && channels_last != 1) {
        Throw("the channels_last attribute is " + std::to_string(channels_last) + "; allowed: 0 (NCHW) or 1 (NHWC)");
      }
      if (channels_last == 1 && conv_.group != 1) {
        Throw("channels_last=1 takes group 1 only, the node has group " + std::to_string(conv_.group));
      }
      conv_.channels_last = channels_last == 1;
      CheckLayout();
    }
    if (spec.base != BaseOp::kConv && HasAttribute(info, "channels_last")) {
      Throw("the channels_last attribute applies to Conv op types only");
    }
    if (cuda_) {
      device_memory_ = std::make_unique<NodeMemory>(raw_info);
      if (spec.base == BaseOp::kConv) conv_algos_.reset(dc_conv_algo_cache_new());
      CheckKernelsBuiltForNode();
      FitDevice(raw_info);
      CheckVendorPathCuda();
      WarnTf32Override();
    } else {
      CreateVendorOps(raw_info);
      cpu_memory_ = Ort::MemoryInfo::CreateCpu(OrtArenaAllocator, OrtMemTypeDefault);
    }
  }

  OrtStatusPtr ComputeV2(OrtKernelContext* context) {
    return ComputeStatus(where_, [&] { cuda_ ? ComputeCuda(context) : ComputeCpu(context); });
  }

 private:
  [[noreturn]] void Throw(const std::string& msg) const { throw std::runtime_error(where_ + ": " + msg); }

  // Inputs: (A, B, bundle) or, with a Bias suffix, (A, B, bias, bundle); none may be left empty.
  void CheckInputs(const Ort::ConstKernelInfo& info) const {
    const size_t want = BundleInput(spec_) + 1, have = info.GetInputCount();
    const std::string signature = std::string("(A, B, ") + (spec_.bias ? "bias, " : "") +
                                  (spec_.residual ? "residual, " : "") + "bundle)";
    if (HasAttribute(info, "bundle")) {  // the contract before ai.dietcode opset 2, whatever the inputs say
      Throw("the node carries its kernel bundle as an attribute, the node contract before ai.dietcode opset 2; "
            "this library reads the bundle from the node's last input " + signature +
            " only: optimize the original model again with this dietcode-ort");
    }
    if (have != want) {
      Throw("the node has " + std::to_string(have) + " inputs; " + spec_.name + " takes " +
            std::to_string(want) + " " + signature + (spec_.bias ? "" : " (an op type without Bias takes no bias)") +
            (spec_.residual ? "" : " (an op type without Residual takes no residual)"));
    }
    for (size_t i = 0; i < want; ++i) {
      if (info.GetInputName(i).empty()) {
        Throw("input " + std::to_string(i) + " of " + signature + " is empty");
      }
    }
  }

  // The bundle input (AcquireBundleInput), read once here; nodes with the same bytes share one parse.
  void LoadBundle(const Ort::ConstKernelInfo& info) {
    bundle_ = AcquireBundleInput(info, BundleInput(spec_), where_, BundleInputWording::kEach);
    int32_t n_features = 0;
    dc_bundle_info(bundle_.get(), &n_features, &n_kernels_, nullptr);
    features_.resize(n_features);
    for (int32_t k = 0; k < n_kernels_; ++k) has_vendor_kernel_ |= dc_bundle_kernel_is_vendor(bundle_.get(), k) == 1;
  }

  // The bundle must fit the node: features read existing inputs, compiled kernels take a bias exactly when
  // the op type has one (and, CheckLayout, conv kernels are compiled for the node's layout).
  void CheckBundleFitsNode(size_t n_inputs) {
    const int max_input = dc_bundle_max_feature_input(bundle_.get());
    if (max_input >= static_cast<int>(n_inputs)) {
      Throw("the bundle's features read input " + std::to_string(max_input) + ", the node has " +
            std::to_string(n_inputs) + " data inputs (A, B[, bias][, residual]; the bundle input is not one)");
    }
    for (int32_t k = 0; k < n_kernels_; ++k) {
      if (dc_bundle_kernel_is_vendor(bundle_.get(), k) == 0 &&
          (dc_bundle_kernel_takes_param(bundle_.get(), k, "bias") == 1) != spec_.bias) {
        Throw("bundle kernel " + std::to_string(k) + (spec_.bias ? " takes no bias but the op type has one"
                                                                  : " takes a bias but the op type has none"));
      }
      if (dc_bundle_kernel_is_vendor(bundle_.get(), k) == 0 &&
          (dc_bundle_kernel_takes_param(bundle_.get(), k, "residual") == 1) != spec_.residual) {
        Throw("bundle kernel " + std::to_string(k) + (spec_.residual ? " takes no residual but the op type has one"
                                                                      : " takes a residual but the op type has none"));
      }
      if (dc_bundle_kernel_is_vendor(bundle_.get(), k) == 0 &&
          (dc_bundle_kernel_residual_first(bundle_.get(), k) == 1) != spec_.residual_first) {
        Throw("bundle kernel " + std::to_string(k) +
              (spec_.residual_first ? " adds its residual after the activation but the op type " + spec_.name +
                                          " adds it before"
                                    : " adds its residual before the activation but the op type " + spec_.name +
                                          " does not") +
              ": optimize the original model again");
      }
      if (dc_bundle_kernel_is_vendor(bundle_.get(), k) == 0 &&
          (dc_bundle_kernel_residual_mul(bundle_.get(), k) == 1) != spec_.residual_mul) {
        Throw("bundle kernel " + std::to_string(k) +
              (spec_.residual_mul ? " adds its residual but the op type " + spec_.name + " multiplies by it"
                                  : " multiplies by its residual but the op type " + spec_.name + " adds it") +
              ": optimize the original model again");
      }
    }
  }

  // On both EPs: a conv node's compiled kernels were compiled for its layout (channels_last), or the bundle was
  // made for another model (CUDA checks it again with the rest of the build facts, dc_bundle_check_node).
  void CheckLayout() const {
    for (int32_t k = 0; k < n_kernels_; ++k) {
      if (dc_bundle_kernel_is_vendor(bundle_.get(), k) == 0 &&
          (dc_bundle_kernel_channels_last(bundle_.get(), k) == 1) != conv_.channels_last) {
        Throw("bundle kernel " + std::to_string(k) + " was compiled for " +
              (conv_.channels_last ? "NCHW, the node is NHWC (channels_last=1)" : "NHWC, the node is NCHW (channels_last=0)") +
              ": optimize again");
      }
    }
  }

  // Compiled kernels run on CUDA with their constexprs baked in: the element type, activation, transposed B
  // and a conv layer's geometry must be this node's, or a kernel would compute something else or read past
  // its inputs. (The CPU EP never launches them.) Per call, ComputeCuda also checks a conv's channels and
  // kernel size against the weight it is given.
  void CheckKernelsBuiltForNode() {
    const int dtype = DtypeCode(dtype_);
    const int trans_b = spec_.base == BaseOp::kGemm ? static_cast<int>(gemm_.trans_b) : 0;
    auto at = [](const std::vector<int64_t>& v, size_t i, int64_t dflt) { return i < v.size() ? v[i] : dflt; };
    const int64_t conv9[9] = {at(conv_.strides, 0, 1), at(conv_.strides, 1, 1), at(conv_.pads, 0, 0),
                              at(conv_.pads, 1, 0), at(conv_.dilations, 0, 1), at(conv_.dilations, 1, 1),
                              at(conv_.kernel_shape, 0, 0), at(conv_.kernel_shape, 1, 0), conv_.group};
    if (dc_bundle_check_node(bundle_.get(), dtype, static_cast<int>(spec_.base), static_cast<int>(spec_.activation),
                             trans_b, conv9, conv_.auto_pad == "NOTSET", conv_.channels_last ? 1 : 0) != 0) {
      Throw(dc_last_error());
    }
    conv_geometry_.assign(n_kernels_, {});
    for (int32_t k = 0; k < n_kernels_; ++k) {
      dc_bundle_kernel_built_for(bundle_.get(), k, nullptr, nullptr, nullptr, conv_geometry_[k].data());
    }
  }

  // Per session: a compiled kernel with no image for this device's arch or this driver (an image's recorded
  // minimum driver above cuDriverGetVersion's), or needing more shared memory than the device allows, is run
  // as the vendor kind (the vendor path) for every call, with one warning here.
  void FitDevice(const OrtKernelInfo* info) {
    device_fits_.assign(n_kernels_, 1);
    int major = 0, minor = 0, optin = 0, driver = 0;
    if (dc_cuda_device_limits(NodeDevice(info), &major, &minor, &optin) != 0) return;  // dc_launch will say why
    if (dc_cuda_driver_version(&driver) != 0) driver = 0;  // not checked; dc_launch will say why
    const int unfit =
        dc_bundle_fit_device(bundle_.get(), major, minor, optin, driver, device_fits_.data(), device_fits_.size());
    if (unfit < 0) Throw(dc_last_error());
    if (unfit == 0) return;
    has_vendor_kernel_ = true;  // the vendor path must exist for those calls (CheckVendorPathCuda)
    const std::string first = dc_last_error();
    std::string which;
    device_reason_.assign(n_kernels_, {});
    for (int32_t k = 0; k < n_kernels_; ++k) {
      if (device_fits_[k]) continue;
      which += (which.empty() ? "" : ", ") + std::to_string(k);
      if (dc_kernel_fit_device(bundle_.get(), k, major, minor, optin, driver) == 0) device_reason_[k] = dc_last_error();
    }
    WarnOnce(kReasonDevice, (std::to_string(unfit) + " bundle kernel(s) (" + which + ") cannot run on sm_" +
                             std::to_string(major * 10 + minor) + " and run as the vendor kind; first: " + first).c_str());
  }

  // CUDA: a bundle that needs the vendor path for whole sessions (a vendor leaf, a kernel this device cannot
  // run) checks here that ORT's cuBLAS (MatMul, Gemm) or cuDNN (Conv) is loaded, and for Conv that the node's
  // explicit pads are symmetric (cuDNN's descriptor takes no other).
  void CheckVendorPathCuda() {
    if (!has_vendor_kernel_) return;
    if (spec_.base != BaseOp::kConv) {
      if (dc_vendor_cublas_load(nullptr) != 0) Throw(std::string("the vendor path needs cuBLAS: ") + dc_last_error());
      // optional: without cuBLASLt every call runs cuBLAS and the PTX epilogue (said at the first call it fuses)
      if (dc_vendor_cublaslt_load(nullptr) != 0) lt_absent_ = dc_last_error();
      return;
    }
    if (dc_vendor_cudnn_load(nullptr) != 0) Throw(std::string("the vendor path needs cuDNN: ") + dc_last_error());
    const std::vector<int64_t>& p = conv_.pads;
    if ((conv_.auto_pad == "NOTSET" || conv_.auto_pad.empty()) && p.size() == 4 && (p[0] != p[2] || p[1] != p[3])) {
      Throw("the bundle routes conv calls to the vendor kind, whose cuDNN convolution takes symmetric pads only, "
            "and this node's pads are asymmetric");
    }
  }

  // ORT's own kernels for the CPU EP, fp32 (inputs are converted).
  void CreateVendorOps(const OrtKernelInfo* info) {
    const ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
    const char* type_names[] = {"T"};
    const bool fused_c = spec_.bias && spec_.base != BaseOp::kMatMul;  // Gemm's C and Conv's B go in the op
    std::vector<Ort::OpAttr> attrs;
    const char* op = "MatMul";
    int version = 13;
    if (spec_.base == BaseOp::kGemm) {
      op = "Gemm";
      attrs.emplace_back("transA", &gemm_.trans_a, 1, OrtOpAttrType::ORT_OP_ATTR_INT);
      attrs.emplace_back("transB", &gemm_.trans_b, 1, OrtOpAttrType::ORT_OP_ATTR_INT);
      attrs.emplace_back("alpha", &gemm_.alpha, 1, OrtOpAttrType::ORT_OP_ATTR_FLOAT);
      attrs.emplace_back("beta", &gemm_.beta, 1, OrtOpAttrType::ORT_OP_ATTR_FLOAT);
    } else if (spec_.base == BaseOp::kConv) {
      op = "Conv";
      version = 11;
      auto ints = [&](const char* name, const std::vector<int64_t>& v) {
        if (!v.empty()) attrs.emplace_back(name, v.data(), static_cast<int>(v.size()), OrtOpAttrType::ORT_OP_ATTR_INTS);
      };
      ints("strides", conv_.strides);
      ints("pads", conv_.pads);
      ints("dilations", conv_.dilations);
      ints("kernel_shape", conv_.kernel_shape);
      attrs.emplace_back("group", &conv_.group, 1, OrtOpAttrType::ORT_OP_ATTR_INT);
      attrs.emplace_back("auto_pad", conv_.auto_pad.c_str(), static_cast<int>(conv_.auto_pad.size()),
                         OrtOpAttrType::ORT_OP_ATTR_STRING);
    }
    try {
      base_op_ = Ort::Op::Create(info, op, "", version, type_names, &type, 1, attrs.data(), attrs.size(),
                                 fused_c ? 3 : 2, 1);
    } catch (const Ort::Exception& e) {
      Throw(std::string("cannot create ONNX Runtime's ") + op + " kernel: " + e.what());
    }
  }

  void OutputShape(const Shape& a, const Shape& b, Shape* out) const {
    std::string error;
    bool ok = spec_.base == BaseOp::kMatMul ? MatMulShape(a, b, out, &error)
              : spec_.base == BaseOp::kGemm ? GemmShape(a, b, gemm_, out, &error)
                                            : ConvShape(a, b, conv_, out, &error);
    if (!ok) Throw(error);
  }

  // MatMul's bias is added here: [N] (broadcast along the last dim) or the full output shape.
  void AddBias(float* y, const Shape& out, const FloatTensor& bias) const {
    const int64_t n = out.empty() ? 1 : out.back(), total = NumElements(out), nb = NumElements(*bias.shape);
    if (nb == n && (bias.shape->empty() || bias.shape->back() == n)) {
      for (int64_t i = 0; i < total; ++i) y[i] += bias.data[i % n];
    } else if (nb == total) {
      for (int64_t i = 0; i < total; ++i) y[i] += bias.data[i];
    } else {
      Throw("bias has " + std::to_string(nb) + " elements; expected N=" + std::to_string(n) + " or the output size");
    }
  }

  void ComputeCpu(OrtKernelContext* raw) {
    Ort::KernelContext ctx(raw);
    const size_t n_in = has_bias_input_ ? 3 : 2;
    const Ort::ConstValue in[3] = {ctx.GetInput(0), ctx.GetInput(1), n_in > 2 ? ctx.GetInput(2) : Ort::ConstValue{nullptr}};
    thread_local Shape shapes[3], out_shape;  // per thread: a kernel may run on several threads at once
    for (size_t i = 0; i < n_in; ++i) ReadShape(in[i], &shapes[i]);
    OutputShape(shapes[0], shapes[1], &out_shape);
    Ort::ConstValue residual{nullptr};
    thread_local Shape residual_shape;
    if (spec_.residual) {  // its shape checked before anything is computed or read
      residual = ctx.GetInput(ResidualInput(spec_));
      ReadShape(residual, &residual_shape);
      const std::string mismatch = ResidualMismatch(residual_shape, out_shape);
      if (!mismatch.empty()) Throw(mismatch);
    }
    Ort::UnownedValue out = ctx.GetOutput(0, out_shape.data(), out_shape.size());
    const int64_t total = NumElements(out_shape);
    if (total == 0) return;
    dc_node_count_fallback(counter_, "the CPU execution provider runs ONNX Runtime's kernel");
    const bool fused_c = spec_.bias && spec_.base != BaseOp::kMatMul;
    const size_t n_op_inputs = fused_c ? 3 : 2;
    const bool is_float = dtype_ == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;

    FloatTensor f[3];
    for (size_t i = 0; i < n_in; ++i) f[i] = AsFloat(in[i], shapes[i], dtype_);
    std::vector<float> y_storage;
    float* y = nullptr;
    if (spec_.base == BaseOp::kConv && conv_.channels_last) {
      y = is_float ? out.GetTensorMutableData<float>() : (y_storage.resize(total), y_storage.data());
      ConvChannelsLastCpu(raw, f, n_op_inputs, out_shape, y);
    } else {
      InvokeCpu(raw, in, f, n_op_inputs, is_float, out, out_shape, total, &y_storage, &y);
    }
    Epilogue(y, out_shape, total, f, residual, residual_shape, out);
  }

  // ORT's Conv (NCHW) for a channels-last node: X [N, spatial..., C] -> [N, C, spatial...] and W
  // [OC, spatial..., C] -> [OC, C, spatial...] into fp32 buffers, the op on those, its output back to
  // [N, out spatial..., OC] in y (the epilogue follows in NHWC: the residual has Y's layout).
  void ConvChannelsLastCpu(OrtKernelContext* raw, const FloatTensor* f, size_t n_op_inputs, const Shape& out_shape,
                           float* y) {
    const OrtMemoryInfo* mem = cpu_memory_;  // made once per kernel
    const Shape& xs = *f[0].shape;
    const Shape& ws = *f[1].shape;
    const Shape x_nchw = ChannelsFirst(xs), w_nchw = ChannelsFirst(ws), y_nchw = ChannelsFirst(out_shape);
    const int64_t n_x = NumElements(xs), n_w = NumElements(ws), n_y = NumElements(out_shape);
    // the spatial positions: the dims between the first and the channels
    auto spatial = [](const Shape& s) { return NumElements(Shape(s.begin() + 1, s.end() - 1)); };
    std::vector<float> x_t(n_x), w_t(n_w), y_t(n_y);
    SwapLastTwo(f[0].data, x_t.data(), xs[0], spatial(xs), xs.back());
    SwapLastTwo(f[1].data, w_t.data(), ws[0], spatial(ws), ws.back());
    Ort::Value values[4] = {
        Ort::Value::CreateTensor<float>(mem, x_t.data(), x_t.size(), x_nchw.data(), x_nchw.size()),
        Ort::Value::CreateTensor<float>(mem, w_t.data(), w_t.size(), w_nchw.data(), w_nchw.size()),
        n_op_inputs > 2 ? Ort::Value::CreateTensor<float>(mem, const_cast<float*>(f[2].data),
                                                          static_cast<size_t>(NumElements(*f[2].shape)),
                                                          f[2].shape->data(), f[2].shape->size())
                        : Ort::Value{nullptr},
        Ort::Value::CreateTensor<float>(mem, y_t.data(), y_t.size(), y_nchw.data(), y_nchw.size())};
    const OrtValue* op_inputs[3] = {values[0], values[1], values[2]};
    OrtValue* op_output = values[3];
    base_op_.Invoke(raw, op_inputs, n_op_inputs, &op_output, 1);
    SwapLastTwo(y_t.data(), y, out_shape[0], out_shape.back(), spatial(out_shape));
  }

  // ORT's op on the node's own layout: the inputs as given (fp32) or converted, the output in place (fp32) or
  // in *y_storage.
  void InvokeCpu(OrtKernelContext* raw, const Ort::ConstValue* in, const FloatTensor* f, size_t n_op_inputs,
                 bool is_float, Ort::UnownedValue& out, const Shape& out_shape, int64_t total,
                 std::vector<float>* y_storage_out, float** y_out) {
    std::vector<float>& y_storage = *y_storage_out;
    float*& y = *y_out;
    const OrtMemoryInfo* mem = cpu_memory_;  // made once per kernel
    Ort::Value owned[3] = {Ort::Value{nullptr}, Ort::Value{nullptr}, Ort::Value{nullptr}};
    const OrtValue* op_inputs[3] = {};
    for (size_t i = 0; i < n_op_inputs; ++i) {
      if (is_float) {
        op_inputs[i] = in[i];
      } else {
        owned[i] = Ort::Value::CreateTensor<float>(mem, const_cast<float*>(f[i].data),
                                                   static_cast<size_t>(NumElements(*f[i].shape)),
                                                   f[i].shape->data(), f[i].shape->size());
        op_inputs[i] = owned[i];
      }
    }
    Ort::Value y_value{nullptr};
    OrtValue* op_output = out;
    if (is_float) {
      y = out.GetTensorMutableData<float>();
    } else {
      y_storage.resize(total);
      y = y_storage.data();
      y_value = Ort::Value::CreateTensor<float>(mem, y, static_cast<size_t>(total), out_shape.data(), out_shape.size());
      op_output = y_value;
    }
    base_op_.Invoke(raw, op_inputs, n_op_inputs, &op_output, 1);
  }

  // scale, MatMul's bias, the residual and activation in fp32 on y (the output's layout), then the output's
  // element type.
  void Epilogue(float* y, const Shape& out_shape, int64_t total, const FloatTensor* f, const Ort::ConstValue& residual,
                const Shape& residual_shape, Ort::UnownedValue& out) const {
    if (scale_ != 1.0f) {
      for (int64_t i = 0; i < total; ++i) y[i] *= scale_;
    }
    if (spec_.bias && spec_.base == BaseOp::kMatMul) AddBias(y, out_shape, f[2]);
    // the output's shape (checked above); its data may live in its own storage: made in place, never copied
    const FloatTensor r = spec_.residual ? AsFloat(residual, residual_shape, dtype_) : FloatTensor{};
    if (spec_.residual_first) {
      for (int64_t i = 0; i < total; ++i) y[i] += r.data[i];
    }
    ApplyActivation(y, total, spec_.activation);
    if (spec_.residual_mul) {
      for (int64_t i = 0; i < total; ++i) y[i] *= r.data[i];
    } else if (spec_.residual && !spec_.residual_first) {
      for (int64_t i = 0; i < total; ++i) y[i] += r.data[i];
    }
    if (dtype_ == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16) {
      FromFloat(y, out.GetTensorMutableData<Ort::Float16_t>(), total);
    } else if (dtype_ == ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16) {
      FromFloat(y, out.GetTensorMutableData<Ort::BFloat16_t>(), total);
    }
  }

  void ComputeCuda(OrtKernelContext* raw) {
    Ort::KernelContext ctx(raw);
    if (has_vendor_kernel_) LoadEpilogueOnce(ctx.GetGPUComputeStream());
    const size_t n_in = has_bias_input_ ? 3 : 2;
    Ort::ConstValue in[3] = {ctx.GetInput(0), ctx.GetInput(1), n_in > 2 ? ctx.GetInput(2) : Ort::ConstValue{nullptr}};
    thread_local Shape shapes[3], out_shape;  // per thread: a kernel may run on several threads at once
    for (size_t i = 0; i < n_in; ++i) ReadShape(in[i], &shapes[i]);
    OutputShape(shapes[0], shapes[1], &out_shape);
    Ort::UnownedValue out = ctx.GetOutput(0, out_shape.data(), out_shape.size());
    const int64_t total = NumElements(out_shape);
    if (total == 0) return;
    Ort::ConstValue residual{nullptr};
    if (spec_.residual) {  // no kernel and no vendor epilogue adds another shape: an error, never a wrong result
      residual = ctx.GetInput(ResidualInput(spec_));
      thread_local Shape residual_shape;
      ReadShape(residual, &residual_shape);
      const std::string mismatch = ResidualMismatch(residual_shape, out_shape);
      if (!mismatch.empty()) Throw(mismatch);
    }

    const int64_t* dims[3] = {shapes[0].data(), shapes[1].data(), n_in > 2 ? shapes[2].data() : nullptr};
    const size_t ranks[3] = {shapes[0].size(), shapes[1].size(), n_in > 2 ? shapes[2].size() : 0};
    thread_local std::vector<int64_t> features;
    features.resize(features_.size());
    if (dc_bundle_features(bundle_.get(), dims, ranks, n_in, features.data()) != 0) Throw(dc_last_error());
    const int32_t k = dc_bundle_select(bundle_.get(), features.data(), features.size());
    if (k < 0) Throw(dc_last_error());

    dc_launch_args args{};
    if (dc_bundle_kernel_is_vendor(bundle_.get(), k) == 1) {
      dc_node_count_fallback(counter_, "the dispatch tree picks the vendor kernel");
      VendorCuda(raw, in, shapes, n_in, residual, out, "the dispatch tree picks the vendor kernel");
      return;
    }
    if (!device_fits_[k]) {
      dc_node_count_fallback(counter_, device_reason_[k].c_str());
      VendorCuda(raw, in, shapes, n_in, residual, out, device_reason_[k].c_str());
      return;
    }
    bool abi_ok = false;
    if (spec_.base == BaseOp::kMatMul) {
      abi_ok = MatMulView(shapes[0], shapes[1], out_shape, KernelIsBatched(k), &args);
    } else if (spec_.base == BaseOp::kGemm) {
      abi_ok = GemmView(shapes[0], shapes[1], n_in > 2 ? &shapes[2] : nullptr, gemm_, &args);
    } else {
      const std::array<int32_t, 9>& g = conv_geometry_[k];
      // C, KH, KW: X [N, C, H, W], W [OC, C/group, KH, KW], or channels-last X [N, H, W, C], W [OC, KH, KW, C]
      const bool cl = conv_.channels_last;
      const size_t c = cl ? 3 : 1, kh = cl ? 1 : 2, kw = cl ? 2 : 3;
      if (shapes[0].size() != 4 || shapes[1].size() != 4 || shapes[0][c] != g[0] || shapes[1][c] * conv_.group != g[0] ||
          shapes[1][kh] != g[1] || shapes[1][kw] != g[2]) {
        Throw("input or weight shape does not match the conv geometry bundle kernel " + std::to_string(k) +
              " was compiled for");
      }
      abi_ok = ConvView(shapes[0], shapes[1], out_shape, conv_, &args);
    }
    // The kernel adds a bias of N elements; any other broadcastable bias shape goes to ORT's Add.
    if (abi_ok && spec_.bias && spec_.base == BaseOp::kMatMul && NumElements(shapes[2]) != args.N) abi_ok = false;
    if (!abi_ok) {
      dc_node_count_fallback(counter_, "the kernel ABI cannot express this call (its shapes or attributes)");
      VendorCuda(raw, in, shapes, n_in, residual, out, "the kernel ABI cannot express this call (its shapes or attributes)");
      return;
    }
    const size_t elem = dtype_ == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT ? 4 : 2;
    args.a = reinterpret_cast<uint64_t>(in[0].GetTensorRawData());
    args.b = reinterpret_cast<uint64_t>(in[1].GetTensorRawData());
    args.bias = n_in > 2 ? reinterpret_cast<uint64_t>(in[2].GetTensorRawData()) : 0;
    args.c = reinterpret_cast<uint64_t>(out.GetTensorMutableRawData());
    args.residual = spec_.residual ? reinterpret_cast<uint64_t>(residual.GetTensorRawData()) : 0;
    args.c_bytes = static_cast<uint64_t>(total) * elem;
    // The workspace of a split-K kernel or of one with global scratch (TMA descriptors), from ORT's scratch
    // allocator on this stream; given back when `workspace`
    // goes out of scope, after the launch is enqueued (ScratchBuffer says why that is safe).
    // a call the compiled kernel cannot take: warned once per reason, counted, run by the vendor path
    auto fall_back = [&](int reason, const char* why) {
      WarnOnce(reason, why);
      dc_node_count_fallback(counter_, why);
      VendorCuda(raw, in, shapes, n_in, residual, out, why);
    };
    ScratchBuffer workspace;
    // A persistent kernel's grid, hence its global scratch, follows the device's SM count (cached per context):
    // the workspace is sized for the grid dc_launch_fit launches. Without it (no driver answer) the workspace is
    // sized for one program per tile, the most any grid takes.
    if (dc_bundle_kernel_persistent(bundle_.get(), k) > 0) {
      int sms = 0;
      if (dc_cuda_sm_count(ctx.GetGPUComputeStream(), &sms) == 0) args.sm_count = sms;
    }
    const int64_t workspace_bytes = dc_kernel_workspace_bytes(bundle_.get(), k, &args);
    if (workspace_bytes != 0) {
      std::string error;
      if (workspace_bytes < 0 ||
          !workspace.Allocate(raw, device_memory_->info(), static_cast<size_t>(workspace_bytes), &error)) {
        const int reason = workspace_bytes < 0 ? kFitWorkspaceSize : kReasonWorkspace;
        const std::string why = workspace_bytes < 0 ? std::string(dc_last_error())
                                                    : "no kernel workspace (" + std::to_string(workspace_bytes) +
                                                          " bytes): " + error;
        fall_back(reason, why.c_str());
        return;
      }
      args.workspace = workspace.address();
      args.workspace_bytes = static_cast<uint64_t>(workspace_bytes);
    }
    // One fit check per call, in the launch (e.g. int32 offsets, a view at an unaligned offset): a call that
    // does not fit launches nothing and runs the vendor path.
    const int fit = dc_launch_fit(bundle_.get(), k, &args, ctx.GetGPUComputeStream());
    if (fit == 0) {
      dc_node_count_launch(counter_);
      return;
    }
    if (fit < 0) Throw(dc_last_error());
    char why[512];  // copied: the vendor path may set the core's message
    std::snprintf(why, sizeof(why), "%s", dc_last_error());
    fall_back(fit, why);
  }

  // A node whose bundle sends shapes to the vendor path (a vendor leaf, a kernel this device cannot run) and whose
  // op type has an epilogue (bias, activation, residual) loads the epilogue's module (a PTX JIT, once per context
  // and dtype) at its first call, so that the first call of a shape the tree sends there compiles nothing. A
  // failure is left for that call to report.
  void LoadEpilogueOnce(void* stream) {
    std::call_once(epilogue_once_, [&] {
      if (spec_.bias || spec_.activation != Activation::kNone || spec_.residual) {
        dc_vendor_epilogue_load(DtypeCode(dtype_), stream);
      }
    });
  }

  // NVIDIA_TF32_OVERRIDE=0 makes cuBLAS and cuDNN, hence ORT's own float32 kernels and the vendor path,
  // compute without TF32; it does not reach a compiled kernel's mma.sync / wgmma TF32 instructions. A node
  // whose bundle holds TF32 kernels then computes with less precision than ORT would: said once, at session
  // creation (ORT's use_tf32 provider option, which a custom op cannot read, is not checked).
  void WarnTf32Override() {
    const char* env = std::getenv("NVIDIA_TF32_OVERRIDE");
    if (env == nullptr || std::string(env) != "0") return;
    for (int32_t k = 0; k < n_kernels_; ++k) {
      if (dc_bundle_kernel_tf32(bundle_.get(), k) != 1) continue;
      Warn(where_ + ": NVIDIA_TF32_OVERRIDE=0 turns TF32 off in cuBLAS/cuDNN, but this node's compiled float32 "
           "kernels compute in TF32 (optimize with --fp32-precision ieee for exact float32 products)");
      return;
    }
  }

  // One warning per node for a note of the vendor path itself (kNote*), not per call.
  void NoteOnce(int note, const std::string& message) {
    if (FirstTime(note)) Warn(where_ + ": " + message + " (said once per node)");
  }

  // One warning per node and reason (a dc_kernel_fit code, or a code of this file above those), not per call.
  void WarnOnce(int reason, const char* message) {
    if (!FirstTime(reason)) return;
    Warn(where_ + ": runs the vendor path (cuBLAS/cuDNN) instead of the compiled kernel: " + message +
         " (warned once per node and reason)");
  }

  // Whether `code` (a bit of warned_: a reason or a note) comes up for the first time on this node.
  bool FirstTime(int code) {
    const uint32_t bit = 1u << (code & 31);
    return !(warned_.fetch_or(bit) & bit);
  }

  // A warning in ORT's log; a logger that fails does not fail the call.
  void Warn(const std::string& text) {
    try {
      ORT_CXX_LOG(logger_, OrtLoggingLevel::ORT_LOGGING_LEVEL_WARNING, text.c_str());
    } catch (const Ort::Exception&) {
    }
  }

  bool KernelIsBatched(int32_t k) {
    std::call_once(batched_once_, [&] {
      // The bmm view is the kernel's, from its ABI params (dc_bundle_kernel_view): the batch is grid z.
      batched_.assign(n_kernels_, false);
      for (int32_t i = 0; i < n_kernels_; ++i) batched_[i] = dc_bundle_kernel_view(bundle_.get(), i) == 1;
    });
    return batched_[k];
  }

  // ORT's handle of resource `id` (CudaResource) for this call's stream.
  void* CudaResource(OrtKernelContext* raw, int id, const char* what) const {
    void* resource = nullptr;
    if (OrtStatus* st = Ort::GetApi().KernelContext_GetResource(raw, kCudaResourceVersion, id, &resource)) {
      const std::string message = Ort::GetApi().GetErrorMessage(st);
      Ort::GetApi().ReleaseStatus(st);
      Throw(std::string("ONNX Runtime gives no ") + what + " handle for this node's stream: " + message);
    }
    if (resource == nullptr) Throw(std::string("ONNX Runtime gives no ") + what + " handle for this node's stream");
    return resource;
  }

  // A call no compiled kernel takes: cuBLAS (MatMul, Gemm) or cuDNN (Conv) on ORT's handle for this stream,
  // then the epilogue, all on ORT's compute stream (vendor.h).
  void VendorCuda(OrtKernelContext* raw, const Ort::ConstValue* in, const Shape* shapes, size_t n_in,
                  const Ort::ConstValue& residual, Ort::UnownedValue& out, const char* why) {
    void* stream = Ort::KernelContext(raw).GetGPUComputeStream();
    void* y = out.GetTensorMutableRawData();
    const void* bias = n_in > 2 ? in[2].GetTensorRawData() : nullptr;
    const void* res = spec_.residual ? residual.GetTensorRawData() : nullptr;
    dc_epilogue epilogue{};
    if (spec_.base == BaseOp::kConv) {
      epilogue = VendorConv(raw, in, shapes, n_in, y, stream, why);
      WithResidual(&epilogue);
    } else if (VendorGemm(raw, in, shapes, n_in, bias, res, y, stream, why, &epilogue)) {
      return;  // one cuBLASLt call did the GEMM and its epilogue
    }
    if (dc_vendor_epilogue(&epilogue, y, bias, res, stream) != 0) Throw(dc_last_error());
  }

  // The residual, of the output's shape (checked by the caller), is the epilogue's on every path.
  void WithResidual(dc_epilogue* epilogue) const {
    epilogue->has_residual = spec_.residual ? 1 : 0;
    epilogue->residual_first = spec_.residual_first ? 1 : 0;
    epilogue->residual_mul = spec_.residual_mul ? 1 : 0;
  }

  // The cuDNN part of VendorCuda (Conv): the convolution into y on `stream`; returns the epilogue it plans.
  dc_epilogue VendorConv(OrtKernelContext* raw, const Ort::ConstValue* in, const Shape* shapes, size_t n_in, void* y,
                         void* stream, const char* why) {
    const int dtype = DtypeCode(dtype_);
    auto at = [](const std::vector<int64_t>& v, size_t i, int64_t dflt) { return i < v.size() ? v[i] : dflt; };
    const int64_t strides[2] = {at(conv_.strides, 0, 1), at(conv_.strides, 1, 1)};
    const int64_t dilations[2] = {at(conv_.dilations, 0, 1), at(conv_.dilations, 1, 1)};
    const int64_t pads[4] = {at(conv_.pads, 0, 0), at(conv_.pads, 1, 0), at(conv_.pads, 2, 0), at(conv_.pads, 3, 0)};
    const int auto_pad = conv_.auto_pad == "SAME_UPPER" ? 1 : conv_.auto_pad == "SAME_LOWER" ? 2
                         : conv_.auto_pad == "VALID"    ? 3 : 0;
    dc_conv_plan plan{};
    if (dc_conv_plan_make(shapes[0].data(), shapes[0].size(), shapes[1].data(), shapes[1].size(),
                          n_in > 2 ? shapes[2].data() : nullptr, n_in > 2 ? shapes[2].size() : 0, strides, pads,
                          dilations, conv_.group, auto_pad, dtype, static_cast<int>(spec_.activation),
                          kOrtCudaUsesTf32, conv_.channels_last ? 1 : 0, &plan) != 1) {
      Throw(std::string("the vendor path (") + why + ") cannot run this call: " + dc_last_error());
    }
    void* cudnn = CudaResource(raw, kCudaResourceCudnnHandle, "cuDNN");
    // cuDNN's heuristic, once per shape (the node's cache), then the workspace from ORT's scratch allocator
    // on this stream (given back after the launch is enqueued: ScratchBuffer says why that is safe)
    dc_conv_algo algo{};
    const int chosen = dc_vendor_conv_algo(conv_algos_.get(), &plan, cudnn, DC_CONV_WORKSPACE_CAP, &algo);
    if (chosen < 0) Throw(dc_last_error());
    if (chosen == 0) NoteOnce(kNoteConvAlgo, std::string("Conv runs cuDNN's ") + dc_last_error());
    ScratchBuffer workspace;
    if (algo.workspace_bytes != 0) {
      std::string error;
      if (!workspace.Allocate(raw, device_memory_->info(), static_cast<size_t>(algo.workspace_bytes), &error)) {
        NoteOnce(kNoteConvWorkspace, "Conv runs cuDNN's IMPLICIT_GEMM without workspace instead of algorithm " +
                                         std::to_string(algo.algo) + ": " + error);
        algo = dc_conv_algo{};
        algo.math_type = plan.math_type;
      }
    }
    if (dc_vendor_conv(&plan, &algo, reinterpret_cast<void*>(workspace.address()), in[0].GetTensorRawData(),
                       in[1].GetTensorRawData(), y, cudnn, stream) != 0) {
      Throw(dc_last_error());
    }
    return plan.epilogue;
  }

  // The GEMM part of VendorCuda (MatMul, Gemm) into y on `stream`: one cuBLASLt call with the epilogue fused where
  // dc_gemm_lt_plan takes the call (true: done), else cuBLAS, leaving *epilogue to the caller (false).
  bool VendorGemm(OrtKernelContext* raw, const Ort::ConstValue* in, const Shape* shapes, size_t n_in,
                  const void* bias, const void* residual, void* y, void* stream, const char* why,
                  dc_epilogue* epilogue) {
    const int dtype = DtypeCode(dtype_);
    const bool gemm = spec_.base == BaseOp::kGemm;
    dc_gemm_plan plan{};
    const int planned = dc_gemm_plan_make(gemm ? 1 : 0, shapes[0].data(), shapes[0].size(), shapes[1].data(),
                                          shapes[1].size(), n_in > 2 ? shapes[2].data() : nullptr,
                                          n_in > 2 ? shapes[2].size() : 0, static_cast<int>(gemm_.trans_a),
                                          static_cast<int>(gemm_.trans_b), gemm ? gemm_.alpha : scale_, gemm_.beta, dtype,
                                          static_cast<int>(spec_.activation), kOrtCudaUsesTf32, &plan);
    if (planned != 1) Throw(std::string("the vendor path (") + why + ") cannot run this call: " + dc_last_error());
    WithResidual(&plan.epilogue);
    *epilogue = plan.epilogue;
    void* cublas = CudaResource(raw, kCudaResourceCublasHandle, "cuBLAS");
    // The fused form: one cublasLtMatmul on this context's cuBLASLt handle, with a workspace from ORT's scratch
    // allocator on this stream (none when it gives none: the heuristic then picks among algorithms needing none).
    dc_gemm_lt lt{};
    const bool fuse = dc_gemm_lt_plan(&plan, &lt) == 1;
    void* lt_handle = nullptr;
    ScratchBuffer workspace;
    uint64_t workspace_bytes = 0;
    auto unfused = [this](const std::string& reason) {
      NoteOnce(kNoteLt, "MatMul/Gemm runs cuBLAS and the PTX epilogue, not one fused cuBLASLt call: " + reason);
    };
    if (fuse && !lt_absent_.empty()) {
      unfused(lt_absent_);
    } else if (fuse && dc_vendor_cublaslt_handle(stream, &lt_handle) != 0) {
      unfused(dc_last_error());
      lt_handle = nullptr;
    } else if (fuse) {
      std::string error;
      if (workspace.Allocate(raw, device_memory_->info(), DC_LT_WORKSPACE_BYTES, &error)) {
        workspace_bytes = DC_LT_WORKSPACE_BYTES;
      }
    }
    const int fused = dc_vendor_gemm_call(&plan, lt_handle != nullptr ? &lt : nullptr, in[0].GetTensorRawData(),
                                          in[1].GetTensorRawData(), y, bias, residual, cublas, lt_handle,
                                          reinterpret_cast<void*>(workspace.address()), workspace_bytes, stream);
    if (fused < 0) Throw(dc_last_error());
    if (fused == 0 && lt_handle != nullptr) unfused(dc_last_error());
    return fused == 1;
  }

  OpSpec spec_;
  bool cuda_;
  ONNXTensorElementDataType dtype_;
  std::string where_;
  BundlePtr bundle_;
  std::vector<std::array<int32_t, 9>> conv_geometry_;  // per kernel, CUDA only (see CheckKernelsBuiltForNode)
  int32_t n_kernels_ = 0;
  bool has_vendor_kernel_ = false;
  std::string lt_absent_;  // CUDA MatMul/Gemm: why cuBLASLt is not there (CheckVendorPathCuda), empty when it is
  bool has_bias_input_ = false;
  float scale_ = 1.0f;  // MatMul: the fused scalar Mul/Div (compiled kernels have it baked in)
  std::vector<int64_t> features_;
  std::unique_ptr<NodeMemory> device_memory_;  // CUDA only: the memory split-K and cuDNN workspaces come from
  // CUDA Conv only: the vendor path's cuDNN algorithm per convolution shape
  std::unique_ptr<dc_conv_algo_cache, ConvAlgoCacheDeleter> conv_algos_;
  GemmAttrs gemm_;
  ConvAttrs conv_;
  Ort::Op base_op_{nullptr};  // CPU only
  Ort::MemoryInfo cpu_memory_{nullptr};  // CPU only: for the fp32 copies of fp16/bf16 operands
  std::once_flag batched_once_;
  std::once_flag epilogue_once_;  // CUDA: LoadEpilogueOnce
  std::vector<bool> batched_;
  std::vector<uint8_t> device_fits_;  // per kernel, CUDA only (see FitDevice)
  std::vector<std::string> device_reason_;  // why a kernel does not fit (empty when it does)
  dc_node_counter* counter_ = nullptr;  // this node name's launches and fallbacks (dc_node_stats_get)
  Ort::Logger logger_{nullptr};
  std::atomic<uint32_t> warned_{0};
};

struct DietcodeOp : Ort::CustomOpBase<DietcodeOp, DietcodeKernel, true> {
  DietcodeOp(const std::string& op_type, bool cuda, ONNXTensorElementDataType dtype) : cuda_(cuda), dtype_(dtype) {
    ParseOpType(op_type, &spec_);
  }

  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const {
    return CreateKernelStatus(api, kernel, [&] { return new DietcodeKernel(info, spec_, cuda_, dtype_); });
  }

  const char* GetName() const { return spec_.name.c_str(); }
  const char* GetExecutionProviderType() const { return cuda_ ? kCudaEp : kCpuEp; }
  // (A, B[, bias][, residual], bundle): the bundle is uint8 and stays in host memory on every EP. Inputs after B are
  // declared optional so that the kernel, not the schema check, reports a node with a missing bundle.
  size_t GetInputTypeCount() const { return BundleInput(spec_) + 1; }
  ONNXTensorElementDataType GetInputType(size_t index) const {
    return index == BundleInput(spec_) ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 : dtype_;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t index) const {
    return index >= 2 ? OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_OPTIONAL
                      : OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_REQUIRED;
  }
  OrtMemType GetInputMemoryType(size_t index) const {
    return index == BundleInput(spec_) ? OrtMemTypeCPUInput : OrtMemTypeDefault;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return dtype_; }

 private:
  OpSpec spec_;
  bool cuda_;
  ONNXTensorElementDataType dtype_;
};

// Every (op type, EP, dtype) overload, and the one domain holding them that every registration adds to its
// SessionOptions (ORT keeps a pointer, never a copy), created once and kept for the life of the process, as ORT
// requires. (A domain per registration grew the process by ~9 KB per SessionOptions.)
struct Registry {
  std::vector<std::unique_ptr<DietcodeOp>> ops;
  std::mutex mutex;
  std::unique_ptr<Ort::CustomOpDomain> domain;

  Registry() {
    const ONNXTensorElementDataType types[] = {ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16,
                                               ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16};
    for (const std::string& name : AllOpTypes()) {
      for (bool cuda : {true, false}) {
        for (auto t : types) ops.push_back(std::make_unique<DietcodeOp>(name, cuda, t));
      }
    }
  }
};

Registry& GetRegistry() {
  static Registry registry;
  return registry;
}

}  // namespace
}  // namespace dietcode

extern "C" {

// Entry point named by SessionOptions.register_custom_ops_library.
// Fails with a status naming the C API version the library was built against and the runtime's version
// when the runtime is older than that (version 1 of the API, which every runtime offers, reports it).
OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  if (api_base == nullptr || api_base->GetApi == nullptr) return nullptr;  // not ORT calling: nothing to report to
  const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
  if (api == nullptr) {
    const char* found = api_base->GetVersionString != nullptr ? api_base->GetVersionString() : nullptr;
    const std::string message = "dietcode custom ops: this library needs ONNX Runtime C API version " +
                                std::to_string(ORT_API_VERSION) + " (onnxruntime 1." + std::to_string(ORT_API_VERSION) +
                                " or newer), and this onnxruntime (" + (found ? found : "version unknown") +
                                ") does not offer it: upgrade onnxruntime or build the library against its headers";
    const OrtApi* base = api_base->GetApi(1);
    if (base == nullptr || base->CreateStatus == nullptr) return nullptr;
    return base->CreateStatus(ORT_FAIL, message.c_str());
  }
  Ort::InitApi(api);
  try {
    dietcode::Registry& reg = dietcode::GetRegistry();
    std::lock_guard<std::mutex> lock(reg.mutex);
    if (!reg.domain) {
      auto domain = std::make_unique<Ort::CustomOpDomain>(dietcode::kDomain);
      for (auto& op : reg.ops) domain->Add(op.get());
      dietcode::AddAttentionOps(*domain);
      reg.domain = std::move(domain);
    }
    Ort::UnownedSessionOptions(options).Add(*reg.domain);
    return nullptr;
  } catch (const std::exception& e) {
    return api->CreateStatus(ORT_FAIL, (std::string("dietcode custom ops: ") + e.what()).c_str());
  }
}

}  // extern "C"
