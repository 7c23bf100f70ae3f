// The vendor path on CUDA (vendor.h): planning a node call as one cuBLAS GEMM plus an epilogue, calling the
// cuBLAS that ONNX Runtime already loaded, and the epilogue's PTX kernel.
#include "vendor.h"

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "bundle_impl.h"
#include "shapes.h"

namespace dietcode {
namespace {

constexpr int32_t kCudaR32F = 0, kCudaR16F = 2, kCudaR16BF = 14;
constexpr int32_t kCompute32F = 68, kCompute32FFastTf32 = 77;
constexpr int kGemmDefault = -1;  // cublasGemmAlgo_t CUBLAS_GEMM_DEFAULT
constexpr int32_t kCudnnFloat = 0, kCudnnHalf = 2, kCudnnBfloat16 = 9;  // cudnnDataType_t
constexpr int32_t kCudnnTensorOpMath = 1, kCudnnFmaMath = 3;  // cudnnMathType_t
constexpr int kCudnnNchw = 0, kCudnnNhwc = 1, kCudnnCrossCorrelation = 1, kCudnnFwdImplicitGemm = 0;

int Refuse(const std::string& message) {
  SetError(message);
  return 0;
}

int Invalid(const std::string& message) {
  SetError(message);
  return -1;
}

int64_t Product(const Shape& s, size_t begin, size_t end) {
  int64_t p = 1;
  for (size_t i = begin; i < end; ++i) p *= s[i];
  return p;
}

// The epilogue's bias indexing for a bias of shape `bias` broadcast onto `out` (viewed as [rows, cols]):
// the bias may vary along the last dim and along a trailing run of the leading dims, nothing else.
int PlanBias(const Shape& bias, const Shape& out, dc_epilogue* p) {
  const size_t L = std::max<size_t>(out.size(), 1);
  if (bias.size() > L) return Invalid("bias " + ShapeText(bias) + " has a higher rank than the output " + ShapeText(out));
  Shape o = out.empty() ? Shape{1} : out, bd(L, 1);
  std::copy(bias.begin(), bias.end(), bd.begin() + (L - bias.size()));
  for (size_t i = 0; i < L; ++i) {
    if (bd[i] != 1 && bd[i] != o[i]) {
      return Invalid("bias " + ShapeText(bias) + " does not broadcast to the output " + ShapeText(out));
    }
  }
  p->bias_cs = bd[L - 1] == o[L - 1] && o[L - 1] > 1 ? 1 : 0;
  size_t j = L - 1;  // leading dims [j, L-1) are the bias's own (bd == o); before them, bd must be 1
  while (j > 0 && bd[j - 1] == o[j - 1]) --j;
  for (size_t i = 0; i < j; ++i) {
    if (bd[i] != 1) {
      return Refuse("bias " + ShapeText(bias) + " varies along non-adjacent output dims of " + ShapeText(out) +
                    "; the vendor epilogue indexes a bias along the last dim and trailing leading dims only");
    }
  }
  p->bias_rows = Product(o, j, L - 1);
  p->bias_rs = bd[L - 1];
  p->has_bias = 1;
  return 1;
}

bool FitsInt32(int64_t v) { return v >= 0 && v <= INT32_MAX; }

}  // namespace
}  // namespace dietcode

extern "C" int dc_gemm_plan_make(int op, const int64_t* a, size_t ra, const int64_t* b, size_t rb, const int64_t* c,
                                 size_t rc, int trans_a, int trans_b, float alpha, float beta, int dtype, int activation,
                                 int tf32, dc_gemm_plan* out) {
  using namespace dietcode;
  if (out == nullptr || (ra && a == nullptr) || (rb && b == nullptr) || (rc && c == nullptr)) {
    return Invalid("null argument");
  }
  if (op != 0 && op != 1) return Invalid("op " + std::to_string(op) + " has no GEMM form (0 MatMul, 1 Gemm)");
  if (dtype < 0 || dtype > 2) return Invalid("dtype " + std::to_string(dtype) + " (0 float32, 1 float16, 2 bfloat16)");
  if (activation < 0 || activation >= kActivationCount) return Invalid("activation " + std::to_string(activation) + " (0..5)");
  const Shape sa(a, a + ra), sb(b, b + rb);
  Shape shape;
  std::string error;
  dc_gemm_plan p{};
  int64_t M = 0, N = 0, K = 0;
  if (op == 0) {
    if (!MatMulShape(sa, sb, &shape, &error)) return Invalid(error);
    M = ra == 1 ? 1 : sa[ra - 2];
    K = sa[ra - 1];
    N = rb == 1 ? 1 : sb[rb - 1];
    const int64_t a_batch = ra > 2 ? Product(sa, 0, ra - 2) : 1, b_batch = rb > 2 ? Product(sb, 0, rb - 2) : 1;
    // output batch entries: the product of the broadcast batch dims (the output drops a 1-D operand's dim)
    const size_t batch_dims = shape.size() - (ra > 1 ? 1 : 0) - (rb > 1 ? 1 : 0);
    const int64_t total = Product(shape, 0, batch_dims);
    p.trans_x = p.trans_y = 0;
    p.ldx = static_cast<int32_t>(std::min<int64_t>(N, INT32_MAX));
    p.ldy = static_cast<int32_t>(std::min<int64_t>(K, INT32_MAX));
    if (b_batch == 1 && a_batch == total && FitsInt32(total * M)) {
      M *= total;  // A's batch folds into its rows: one GEMM against the shared B
      p.batch = 1;
    } else if (b_batch == 1 && a_batch == total) {
      p.batch = static_cast<int32_t>(std::min<int64_t>(total, INT32_MAX));
      p.stride_x = 0, p.stride_y = M * K, p.stride_c = M * N;
    } else if (a_batch == 1 && b_batch == total) {
      p.batch = static_cast<int32_t>(std::min<int64_t>(total, INT32_MAX));
      p.stride_x = K * N, p.stride_y = 0, p.stride_c = M * N;
    } else if (a_batch == total && b_batch == total) {
      p.batch = static_cast<int32_t>(std::min<int64_t>(total, INT32_MAX));
      p.stride_x = K * N, p.stride_y = M * K, p.stride_c = M * N;
    } else {
      return Refuse("MatMul " + ShapeText(sa) + " x " + ShapeText(sb) + " broadcasts both batch shapes; the vendor "
                    "path runs one strided-batched cuBLAS call and cannot express it");
    }
    if (!FitsInt32(total)) return Refuse("batch " + std::to_string(total) + " exceeds cuBLAS's int32 batch count");
  } else {
    GemmAttrs attrs;
    attrs.trans_a = trans_a, attrs.trans_b = trans_b, attrs.alpha = alpha, attrs.beta = beta;
    if (!GemmShape(sa, sb, attrs, &shape, &error)) return Invalid(error);
    M = shape[0], N = shape[1];
    K = trans_a ? sa[0] : sa[1];
    p.trans_x = trans_b ? 1 : 0;  // B stored [N, K] is column-major [K, N]: transpose to x = [N, K]
    p.ldx = static_cast<int32_t>(std::min<int64_t>(trans_b ? K : N, INT32_MAX));
    p.trans_y = trans_a ? 1 : 0;  // A stored [K, M] is column-major [M, K]: transpose to y = [K, M]
    p.ldy = static_cast<int32_t>(std::min<int64_t>(trans_a ? M : K, INT32_MAX));
    p.batch = 1;
  }
  if (!FitsInt32(M) || !FitsInt32(N) || !FitsInt32(K)) {
    return Refuse("M=" + std::to_string(M) + ", N=" + std::to_string(N) + ", K=" + std::to_string(K) +
                  " exceed cuBLAS's int32 sizes");
  }
  // cuBLAS requires leading dimensions >= 1 even for empty operands.
  p.m = static_cast<int32_t>(N), p.n = static_cast<int32_t>(M), p.k = static_cast<int32_t>(K);
  p.ldx = std::max(p.ldx, 1), p.ldy = std::max(p.ldy, 1), p.ldc = static_cast<int32_t>(std::max<int64_t>(N, 1));
  p.data_type = dtype == 0 ? kCudaR32F : dtype == 1 ? kCudaR16F : kCudaR16BF;
  p.compute_type = dtype == 0 && tf32 ? kCompute32FFastTf32 : kCompute32F;
  p.alpha = alpha;  // Gemm's alpha, or a MatMul's fused scale
  dc_epilogue& e = p.epilogue;
  e.dtype = dtype;
  e.activation = activation;
  e.cols = shape.empty() ? 1 : shape.back();
  e.rows = e.cols > 0 ? NumElements(shape) / e.cols : 0;
  e.bias_rows = 1;
  e.bias_scale = op == 1 ? beta : 1.0f;
  if (c != nullptr && !(op == 1 && beta == 0.0f)) {
    const int rc_ok = PlanBias(Shape(c, c + rc), shape, &e);
    if (rc_ok != 1) return rc_ok;
  }
  *out = p;
  return 1;
}

extern "C" int dc_gemm_lt_plan(const dc_gemm_plan* p, dc_gemm_lt* out) {
  using namespace dietcode;
  if (p == nullptr || out == nullptr) return Invalid("null argument");
  const dc_epilogue& e = p->epilogue;
  const bool residual = e.has_residual != 0;
  const int act = e.activation;
  if (!e.has_bias && act == 0 && !residual) return Refuse("no epilogue: the call is one cublasGemmEx");
  if (p->batch > 1) {
    return Refuse("a batch of " + std::to_string(p->batch) + " GEMMs (cublasGemmStridedBatchedEx); the epilogue is "
                  "fused into single GEMMs only");
  }
  if (p->k < 1 || p->m < 1 || p->n < 1) return Refuse("an empty GEMM (m, n or k is 0)");
  if (e.has_bias && !(e.bias_rows == 1 && e.bias_cs == 1)) {
    return Refuse("the bias is not one vector along the output's last dim; cuBLASLt's bias epilogue adds one value "
                  "per output column");
  }
  if (e.has_bias && e.bias_scale != 1.0f) {
    return Refuse("the bias is scaled by Gemm's beta " + std::to_string(e.bias_scale) +
                  "; cuBLASLt's bias epilogue adds it unscaled");
  }
  if (act != 0 && act != 1 && act != 3) {
    const char* name = act == 2 ? "the erf GELU (cuBLASLt's GELU is the tanh approximation)" : act == 4 ? "silu"
                       : act == 5 ? "relu6" : "this activation";
    return Refuse(std::string(name) + " has no cuBLASLt epilogue (relu and the tanh GELU have)");
  }
  if (residual && e.residual_mul) return Refuse("the residual multiplies the activation's result; cuBLASLt adds C");
  if (residual && act != 0 && !e.residual_first) {
    return Refuse("the residual is added after the activation; cuBLASLt adds C before its epilogue's activation");
  }
  const bool bias = e.has_bias != 0;
  out->epilogue = act == 0 ? (bias ? 4 : 1) : act == 1 ? (bias ? 6 : 2) : (bias ? 36 : 32);
  out->has_bias = bias ? 1 : 0;
  out->residual_c = residual ? 1 : 0;
  out->beta = residual ? 1.0f : 0.0f;
  return 1;
}

extern "C" int dc_conv_plan_make(const int64_t* x, size_t rx, const int64_t* w, size_t rw, const int64_t* b,
                                 size_t rb, const int64_t* strides, const int64_t* pads, const int64_t* dilations,
                                 int64_t group, int auto_pad, int dtype, int activation, int tf32, int channels_last,
                                 dc_conv_plan* out) {
  using namespace dietcode;
  if (out == nullptr || x == nullptr || w == nullptr || (rb && b == nullptr) || strides == nullptr ||
      pads == nullptr || dilations == nullptr) {
    return Invalid("null argument");
  }
  if (dtype < 0 || dtype > 2) return Invalid("dtype " + std::to_string(dtype) + " (0 float32, 1 float16, 2 bfloat16)");
  if (activation < 0 || activation >= kActivationCount) return Invalid("activation " + std::to_string(activation) + " (0..5)");
  if (auto_pad < 0 || auto_pad > 3) return Invalid("auto_pad " + std::to_string(auto_pad) + " (0..3)");
  if (channels_last != 0 && channels_last != 1) {
    return Invalid("channels_last " + std::to_string(channels_last) + " (0 or 1)");
  }
  if (channels_last && group != 1) return Invalid("a channels-last Conv must have group 1, got " + std::to_string(group));
  if (rx != 4 || rw != 4) {
    return Refuse("Conv with X of rank " + std::to_string(rx) + ": the vendor path runs 2-D convolutions only");
  }
  // the NCHW view below (sx, sw, shape); channels-last shapes are permuted into it
  const Shape sx = channels_last ? ChannelsFirst(Shape(x, x + rx)) : Shape(x, x + rx);
  const Shape sw = channels_last ? ChannelsFirst(Shape(w, w + rw)) : Shape(w, w + rw);
  ConvAttrs attrs;
  attrs.strides = {strides[0], strides[1]};
  attrs.dilations = {dilations[0], dilations[1]};
  attrs.pads = {pads[0], pads[1], pads[2], pads[3]};
  attrs.group = group;
  attrs.auto_pad = auto_pad == 0 ? "NOTSET" : auto_pad == 1 ? "SAME_UPPER" : auto_pad == 2 ? "SAME_LOWER" : "VALID";
  attrs.channels_last = channels_last == 1;
  Shape shape;
  std::string error;  // (the node's shapes in its messages; the output then in the NCHW view too)
  if (!ConvShape(Shape(x, x + rx), Shape(w, w + rw), attrs, &shape, &error)) return Invalid(error);
  if (channels_last) shape = ChannelsFirst(shape);
  // The pads ONNX applies: explicit, or those auto_pad implies (ONNX: the extra one goes at the end for
  // SAME_UPPER, at the beginning for SAME_LOWER).
  int64_t begin[2], end[2];
  for (int i = 0; i < 2; ++i) {
    const int64_t in = sx[2 + i], k = sw[2 + i], s = strides[i], d = dilations[i];
    if (auto_pad == 0) {
      begin[i] = pads[i], end[i] = pads[2 + i];
    } else if (auto_pad == 3) {
      begin[i] = end[i] = 0;
    } else {
      const int64_t total = std::max<int64_t>(0, (shape[2 + i] - 1) * s + d * (k - 1) + 1 - in);
      begin[i] = auto_pad == 1 ? total / 2 : total - total / 2;
      end[i] = total - begin[i];
    }
  }
  if (begin[0] != end[0] || begin[1] != end[1]) {
    return Refuse("Conv pads (top " + std::to_string(begin[0]) + ", left " + std::to_string(begin[1]) + ", bottom " +
                  std::to_string(end[0]) + ", right " + std::to_string(end[1]) + ") are asymmetric; cuDNN's "
                  "convolution descriptor takes symmetric pads only");
  }
  for (int i = 0; i < 2; ++i) {  // cuDNN's output size must be ONNX's
    const int64_t o = (sx[2 + i] + 2 * begin[i] - dilations[i] * (sw[2 + i] - 1) - 1) / strides[i] + 1;
    if (o != shape[2 + i]) {
      return Refuse("cuDNN's output size " + std::to_string(o) + " differs from ONNX's " + std::to_string(shape[2 + i]) +
                    " on spatial dim " + std::to_string(i));
    }
  }
  for (int64_t v : {sx[0], sx[1], sx[2], sx[3], sw[0], sw[1], sw[2], sw[3], shape[2], shape[3], begin[0], begin[1],
                    int64_t{strides[0]}, int64_t{strides[1]}, int64_t{dilations[0]}, int64_t{dilations[1]}, group}) {
    if (!FitsInt32(v)) return Refuse("Conv sizes past int32 (cuDNN's 4-D descriptors take int)");
  }
  dc_conv_plan p{};
  p.n = static_cast<int32_t>(sx[0]), p.c = static_cast<int32_t>(sx[1]);
  p.h = static_cast<int32_t>(sx[2]), p.w = static_cast<int32_t>(sx[3]);
  p.k = static_cast<int32_t>(sw[0]), p.kc = static_cast<int32_t>(sw[1]);
  p.kh = static_cast<int32_t>(sw[2]), p.kw = static_cast<int32_t>(sw[3]);
  p.group = static_cast<int32_t>(group);
  p.pad_h = static_cast<int32_t>(begin[0]), p.pad_w = static_cast<int32_t>(begin[1]);
  p.stride_h = static_cast<int32_t>(strides[0]), p.stride_w = static_cast<int32_t>(strides[1]);
  p.dil_h = static_cast<int32_t>(dilations[0]), p.dil_w = static_cast<int32_t>(dilations[1]);
  p.out_h = static_cast<int32_t>(shape[2]), p.out_w = static_cast<int32_t>(shape[3]);
  p.data_type = dtype == 0 ? kCudnnFloat : dtype == 1 ? kCudnnHalf : kCudnnBfloat16;
  // Tensor cores for 16-bit data and for float32 with TF32 (ORT's use_tf32 default); use_tf32=0 asks ORT's
  // CUDA EP for FMA math, which rules TF32 out.
  p.math_type = dtype == 0 && !tf32 ? kCudnnFmaMath : kCudnnTensorOpMath;
  p.channels_last = channels_last;
  // NCHW: the output [N, K, OH, OW] as [N*K, OH*OW], B indexed by row % K; NHWC: [N, OH, OW, K] as
  // [N*OH*OW, K], B indexed by column (as a GEMM's bias along N)
  dc_epilogue& e = p.epilogue;
  e.dtype = dtype;
  e.activation = activation;
  e.cols = channels_last ? shape[1] : shape[2] * shape[3];
  e.rows = channels_last ? shape[0] * shape[2] * shape[3] : shape[0] * shape[1];
  e.bias_rows = 1;
  e.bias_scale = 1.0f;
  if (b != nullptr) {
    if (!(rb == 1 && b[0] == sw[0])) {
      return Invalid("Conv's B must be 1-D with one value per output channel (" + std::to_string(sw[0]) + ")");
    }
    if (channels_last) {
      e.has_bias = 1, e.bias_rows = 1, e.bias_rs = 0, e.bias_cs = 1;
    } else {
      e.has_bias = 1, e.bias_rows = sw[0], e.bias_rs = 1, e.bias_cs = 0;
    }
  }
  *out = p;
  return 1;
}

// --- cuBLAS, resolved at run time ---------------------------------------------------------------------------

namespace dietcode {
namespace {

using GemmExFn = int (*)(void*, int, int, int, int, int, const void*, const void*, int, int, const void*, int, int,
                         const void*, void*, int, int, int, int);
using GemmStridedBatchedExFn = int (*)(void*, int, int, int, int, int, const void*, const void*, int, int, long long,
                                       const void*, int, int, long long, const void*, void*, int, int, long long, int,
                                       int, int);
using SetStreamFn = int (*)(void*, void*);
using GetStreamFn = int (*)(void*, void**);

// A vendor library's function table (Cublas, Cudnn), resolved once and kept for the process (never freed).
template <typename T>
struct VendorLibrary {
  using ResolveFn = const T* (*)(void* lib, const std::string& origin, std::string* error);
  VendorLibrary(ResolveFn r, std::vector<const char*> names, const char* none)
      : resolve(r), sonames(std::move(names)), absent(none) {}

  const ResolveFn resolve;
  const std::vector<const char*> sonames;  // the releases ONNX Runtime's CUDA EP may have loaded, newest first
  const char* const absent;  // the error when none of them is in the process
  std::mutex mutex;
  std::atomic<const T*> table{nullptr};
};

// The table of the library at `path`, or with path == nullptr of the copy already in the process: the EP links
// the library, so when it runs one of `sonames` is loaded, and RTLD_NOLOAD never loads a second.
template <typename T>
const T* LoadVendorLibrary(VendorLibrary<T>* v, const char* path, std::string* error) {
  if (path == nullptr) {
    if (const T* loaded = v->table.load()) return loaded;  // the per-call path: no lock
  }
  std::lock_guard<std::mutex> lock(v->mutex);
  if (path == nullptr) {
    if (const T* loaded = v->table.load()) return loaded;
    for (const char* name : v->sonames) {
      void* lib = dlopen(name, RTLD_NOW | RTLD_NOLOAD);
      if (lib == nullptr) continue;
      const T* t = v->resolve(lib, name, error);
      if (t != nullptr) v->table.store(t);
      return t;
    }
    *error = v->absent;
    return nullptr;
  }
  void* lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* why = dlerror();
    *error = std::string("cannot load ") + path + ": " + (why ? why : "unknown reason");
    return nullptr;
  }
  const T* t = v->resolve(lib, path, error);
  if (t != nullptr) v->table.store(t);
  return t;
}

struct Cublas {
  std::string origin;
  GemmExFn gemm_ex = nullptr;
  GemmStridedBatchedExFn gemm_strided_batched_ex = nullptr;
  SetStreamFn set_stream = nullptr;
  GetStreamFn get_stream = nullptr;
};

const Cublas* Resolve(void* lib, const std::string& origin, std::string* error) {
  auto* t = new Cublas;
  t->origin = origin;
  t->gemm_ex = reinterpret_cast<GemmExFn>(dlsym(lib, "cublasGemmEx"));
  t->gemm_strided_batched_ex = reinterpret_cast<GemmStridedBatchedExFn>(dlsym(lib, "cublasGemmStridedBatchedEx"));
  // cublas_v2.h maps cublasSetStream/cublasGetStream to the _v2 symbols; take the plain names where a
  // release exports only those
  t->set_stream = reinterpret_cast<SetStreamFn>(dlsym(lib, "cublasSetStream_v2"));
  if (t->set_stream == nullptr) t->set_stream = reinterpret_cast<SetStreamFn>(dlsym(lib, "cublasSetStream"));
  t->get_stream = reinterpret_cast<GetStreamFn>(dlsym(lib, "cublasGetStream_v2"));
  if (t->get_stream == nullptr) t->get_stream = reinterpret_cast<GetStreamFn>(dlsym(lib, "cublasGetStream"));
  if (t->gemm_ex == nullptr || t->gemm_strided_batched_ex == nullptr || t->set_stream == nullptr ||
      t->get_stream == nullptr) {
    *error = origin + " lacks cublasGemmEx, cublasGemmStridedBatchedEx, cublasSetStream_v2 or cublasGetStream_v2";
    delete t;
    return nullptr;
  }
  return t;
}

VendorLibrary<Cublas> g_cublas{Resolve, {"libcublas.so.13", "libcublas.so.12", "libcublas.so.11"},
                                "no cuBLAS in this process (libcublas.so.13, .12 or .11): the vendor path calls the "
                                "cuBLAS that ONNX Runtime's CUDA execution provider loads, and it has not loaded one"};

const Cublas* LoadCublas(const char* path, std::string* error) { return LoadVendorLibrary(&g_cublas, path, error); }

// The epilogue kernel over the output as [rows, cols], y = act(y + scale * bias[index]) + residual[i] in fp32,
// with p_first 1 y = act(y + scale * bias[index] + residual[i]), with p_first 2 y = act(y + scale * bias[index]) *
// residual[i] (dc_epilogue.residual_mul).
// Activations by code (dc_epilogue.activation): 1 relu, 2 GELU in the erf form ONNX specifies (approximate="none"):
// erf by Abramowitz & Stegun 7.1.26 (absolute error below 1.5e-7) with exp(-z^2) = ex2(-z^2 * log2(e)); 3 GELU's
// tanh approximation and 4 silu through one sigmoid; 5 relu6.
// Its 2-D grid: a thread owns one column c and walks the rows r from its first one in steps of the grid's row
// threads, so a warp reads and writes consecutive elements, and the bias row (r % bias_rows) is carried along with
// one wrap per step: no per-element division (a 64-bit division is a long software sequence on NVIDIA GPUs; the
// former 1-D grid-stride version did a div and a rem per element of a biased output).
std::string EpiloguePtx(int dtype) {
  const bool f32 = dtype == 0, bf16 = dtype == 2;
  const char* shift = f32 ? "2" : "1";
  std::string load = f32 ? "ld.global.f32 %fD, [%ADDR];\n"
                     : bf16 ? "ld.global.b16 %h1, [%ADDR];\n  cvt.u32.u16 %r6, %h1;\n  shl.b32 %r6, %r6, 16;\n"
                              "  mov.b32 %fD, %r6;\n"
                            : "ld.global.b16 %h1, [%ADDR];\n  cvt.f32.f16 %fD, %h1;\n";
  std::string store = f32 ? "st.global.f32 [%rd12], %f2;\n"
                      : bf16 ? "cvt.rn.bf16.f32 %h1, %f2;\n  st.global.b16 [%rd12], %h1;\n"
                             : "cvt.rn.f16.f32 %h1, %f2;\n  st.global.b16 [%rd12], %h1;\n";
  auto sub = [](std::string s, const std::string& d, const std::string& addr) {
    for (size_t at; (at = s.find("%fD")) != std::string::npos;) s.replace(at, 3, d);
    for (size_t at; (at = s.find("%ADDR")) != std::string::npos;) s.replace(at, 5, addr);
    return s;
  };
  std::string ptx;
  ptx += ".version 7.0\n";
  ptx += bf16 ? ".target sm_80\n" : ".target sm_70\n";  // cvt.rn.bf16.f32 needs sm_80
  ptx += ".address_size 64\n\n";
  ptx += ".visible .entry dc_epilogue(\n"
         "  .param .u64 p_y, .param .u64 p_bias, .param .u64 p_rows, .param .u64 p_cols, .param .u64 p_brows,\n"
         "  .param .u64 p_brs, .param .u64 p_bcs, .param .f32 p_scale, .param .u32 p_act, .param .u64 p_res,\n"
         "  .param .u32 p_first)\n{\n";
  ptx += "  .reg .pred %p<8>;\n  .reg .b16 %h<4>;\n  .reg .b32 %r<8>;\n  .reg .f32 %f<24>;\n  .reg .b64 %rd<24>;\n\n";
  ptx += "  ld.param.u64 %rd1, [p_y];\n  ld.param.u64 %rd2, [p_bias];\n  ld.param.u64 %rd3, [p_rows];\n"
         "  ld.param.u64 %rd4, [p_cols];\n  ld.param.u64 %rd5, [p_brows];\n  ld.param.u64 %rd6, [p_brs];\n"
         "  ld.param.u64 %rd7, [p_bcs];\n  ld.param.f32 %f1, [p_scale];\n  ld.param.u32 %r1, [p_act];\n";
  ptx += "  setp.ne.u64 %p2, %rd2, 0;\n  cvta.to.global.u64 %rd1, %rd1;\n  cvta.to.global.u64 %rd2, %rd2;\n";
  ptx += "  ld.param.u64 %rd17, [p_res];\n  setp.ne.u64 %p5, %rd17, 0;\n  cvta.to.global.u64 %rd17, %rd17;\n";
  ptx += "  ld.param.u32 %r7, [p_first];\n  setp.eq.u32 %p6, %r7, 1;\n";  // the residual before the activation
  ptx += "  setp.eq.u32 %p7, %r7, 2;\n";  // the residual multiplies the activation's result
  // the thread's column c = ctaid.x * ntid.x + tid.x (%rd19), none past the last
  ptx += "  mov.u32 %r2, %ctaid.x;\n  mov.u32 %r3, %ntid.x;\n  mov.u32 %r4, %tid.x;\n"
         "  mul.wide.u32 %rd8, %r2, %r3;\n  cvt.u64.u32 %rd9, %r4;\n  add.u64 %rd19, %rd8, %rd9;\n"
         "  setp.ge.u64 %p1, %rd19, %rd4;\n  @%p1 bra $Ldone;\n";
  // its first row r = ctaid.y * ntid.y + tid.y (%rd8), the row step nctaid.y * ntid.y (%rd10); the bias row
  // r % brows (%rd20) advances by step % brows (%rd21) with a wrap, so the loop divides nothing
  ptx += "  mov.u32 %r2, %ctaid.y;\n  mov.u32 %r3, %ntid.y;\n  mov.u32 %r4, %tid.y;\n  mov.u32 %r5, %nctaid.y;\n"
         "  mul.wide.u32 %rd8, %r2, %r3;\n  cvt.u64.u32 %rd9, %r4;\n  add.u64 %rd8, %rd8, %rd9;\n"
         "  mul.wide.u32 %rd10, %r5, %r3;\n  rem.u64 %rd20, %rd8, %rd5;\n  rem.u64 %rd21, %rd10, %rd5;\n"
         "  mul.lo.u64 %rd22, %rd19, %rd7;\n";
  ptx += "$Lloop:\n  setp.ge.u64 %p1, %rd8, %rd3;\n  @%p1 bra $Ldone;\n";
  ptx += std::string("  mad.lo.u64 %rd11, %rd8, %rd4, %rd19;\n  shl.b64 %rd11, %rd11, ") + shift +
         ";\n  add.u64 %rd12, %rd1, %rd11;\n";
  ptx += "  " + sub(load, "%f2", "%rd12");
  ptx += "  @!%p2 bra $Lact;\n";
  ptx += "  mad.lo.u64 %rd15, %rd20, %rd6, %rd22;\n";  // (r % brows) * brs + c * bcs
  ptx += std::string("  shl.b64 %rd15, %rd15, ") + shift + ";\n  add.u64 %rd15, %rd2, %rd15;\n";
  ptx += "  " + sub(load, "%f3", "%rd15");
  ptx += "  fma.rn.f32 %f2, %f3, %f1, %f2;\n";
  // p_first: the residual, laid out as the output (the same byte offset %rd11), before the activation
  ptx += "$Lact:\n  @!%p5 bra $Lapply;\n  @!%p6 bra $Lapply;\n  add.u64 %rd18, %rd17, %rd11;\n";
  ptx += "  " + sub(load, "%f15", "%rd18");
  ptx += "  add.f32 %f2, %f2, %f15;\n";
  // relu and relu6 by ordered compares, x <= 0 -> 0 and, relu6, x > 6 -> 6, so NaN stays NaN as onnxruntime's Relu
  // and Clip give it (max.f32 returns the operand that is not NaN: 0; max.NaN.f32 needs sm_80)
  ptx += "$Lapply:\n  setp.eq.u32 %p3, %r1, 1;\n  setp.eq.u32 %p4, %r1, 5;\n  or.pred %p3, %p3, %p4;\n"
         "  setp.le.and.f32 %p1, %f2, 0f00000000, %p3;\n  @%p1 mov.f32 %f2, 0f00000000;\n"
         "  setp.gt.and.f32 %p1, %f2, 0f40C00000, %p4;\n  @%p1 mov.f32 %f2, 0f40C00000;\n"
         "  setp.eq.u32 %p4, %r1, 2;\n  @%p4 bra $Lgelu;\n"
         "  setp.lt.u32 %p4, %r1, 3;\n  @%p4 bra $Lstore;\n  setp.ge.u32 %p4, %r1, 5;\n  @%p4 bra $Lstore;\n";
  // 3 (gelu tanh) and 4 (silu): x sigmoid(v) = x / (1 + exp(-v)), v = x for silu and for the tanh gelu
  // v = 2 sqrt(2/pi) (x + 0.044715 x^3), as 0.5 x (1 + tanh(u)) = x sigmoid(2u); exp(-v) = ex2(-v log2(e))
  ptx += "  setp.eq.u32 %p4, %r1, 3;\n"
         "  mul.f32 %f18, %f2, 0fBFB8AA3B;\n"               // -x log2(e)
         "  @%p4 mul.f32 %f17, %f2, %f2;\n"
         "  @%p4 mul.f32 %f17, %f17, %f2;\n"                // x^3
         "  @%p4 fma.rn.f32 %f17, %f17, 0f3D372713, %f2;\n" // x + 0.044715 x^3
         "  @%p4 mul.f32 %f18, %f17, 0fC0135761;\n"         // -2 sqrt(2/pi) log2(e) (x + 0.044715 x^3)
         "  ex2.approx.f32 %f18, %f18;\n"                   // exp(-v): +inf for large -v, then x * 0
         "  add.f32 %f18, %f18, 0f3F800000;\n"
         "  rcp.rn.f32 %f18, %f18;\n"
         "  mul.f32 %f2, %f2, %f18;\n"
         "  bra $Lstore;\n";
  ptx += "$Lgelu:\n";
  // gelu(x) = 0.5 x (1 + erf(x / sqrt(2)))
  ptx += "  mul.f32 %f4, %f2, 0f3F3504F3;\n"           // z = x / sqrt(2)
         "  abs.f32 %f5, %f4;\n"
         "  fma.rn.f32 %f6, %f5, 0f3EA7BA05, 0f3F800000;\n"  // 1 + p |z|, p = 0.3275911
         "  rcp.rn.f32 %f7, %f6;\n"                          // t
         "  fma.rn.f32 %f8, %f7, 0f3F87DC22, 0fBFBA00E3;\n"  // a5 t + a4
         "  fma.rn.f32 %f8, %f8, %f7, 0f3FB5F0E3;\n"         // .. t + a3
         "  fma.rn.f32 %f8, %f8, %f7, 0fBE91A98E;\n"         // .. t + a2
         "  fma.rn.f32 %f8, %f8, %f7, 0f3E827906;\n"         // .. t + a1
         "  mul.f32 %f8, %f8, %f7;\n"                        // poly(t)
         "  mul.f32 %f9, %f5, %f5;\n"
         "  mul.f32 %f9, %f9, 0fBFB8AA3B;\n"                 // -z^2 log2(e)
         "  ex2.approx.f32 %f10, %f9;\n"                     // exp(-z^2)
         "  mul.f32 %f11, %f8, %f10;\n"
         "  sub.f32 %f12, 0f3F800000, %f11;\n"               // erf(|z|)
         "  copysign.f32 %f12, %f4, %f12;\n"                 // erf(z)
         "  add.f32 %f13, %f12, 0f3F800000;\n"
         "  mul.f32 %f14, %f2, 0f3F000000;\n"
         "  mul.f32 %f2, %f14, %f13;\n";
  // otherwise the residual after it, added or (p_first 2) multiplied
  ptx += "$Lstore:\n  @!%p5 bra $Lput;\n  @%p6 bra $Lput;\n  add.u64 %rd18, %rd17, %rd11;\n";
  ptx += "  " + sub(load, "%f15", "%rd18");
  ptx += "  @%p7 mul.f32 %f2, %f2, %f15;\n  @!%p7 add.f32 %f2, %f2, %f15;\n";
  ptx += "$Lput:\n  " + store;
  ptx += "  add.u64 %rd8, %rd8, %rd10;\n  add.u64 %rd20, %rd20, %rd21;\n  setp.ge.u64 %p1, %rd20, %rd5;\n"
         "  @%p1 sub.u64 %rd20, %rd20, %rd5;\n  bra $Lloop;\n$Ldone:\n  ret;\n}\n";
  return ptx;
}

const std::string& EpiloguePtxFor(int dtype) {
  static const std::string texts[3] = {EpiloguePtx(0), EpiloguePtx(1), EpiloguePtx(2)};
  return texts[dtype];
}

int Fail(const std::string& message) {
  SetError(message);
  return -1;
}

}  // namespace
}  // namespace dietcode

extern "C" {

int dc_vendor_cublas_load(const char* path) {
  std::string error;
  return dietcode::LoadCublas(path, &error) != nullptr ? 0 : dietcode::Fail(error);
}

int dc_vendor_gemm(const dc_gemm_plan* p, const void* a, const void* b, void* c, void* handle, void* stream) {
  using dietcode::Fail;
  if (p == nullptr) return Fail("null plan");
  if (handle == nullptr) return Fail("no cuBLAS handle (ONNX Runtime gave none for this stream)");
  std::string error;
  const dietcode::Cublas* cb = dietcode::LoadCublas(nullptr, &error);
  if (cb == nullptr) return Fail(error);
  // ORT binds each stream's handle to that stream when it creates it (CudaStream's constructor); bind it only
  // if it is not, since cublasSetStream also resets the handle's workspace to the default pool.
  void* bound = nullptr;
  int st = cb->get_stream(handle, &bound);
  if (st == 0 && bound != stream) st = cb->set_stream(handle, stream);
  if (st != 0) return Fail("binding ORT's cuBLAS handle to its stream failed with cuBLAS status " + std::to_string(st));
  const float alpha = p->alpha, beta = 0.0f;  // alpha/beta are float for every compute type used here
  if (p->batch <= 1) {
    st = cb->gemm_ex(handle, p->trans_x, p->trans_y, p->m, p->n, p->k, &alpha, b, p->data_type, p->ldx, a,
                     p->data_type, p->ldy, &beta, c, p->data_type, p->ldc, p->compute_type, dietcode::kGemmDefault);
  } else {
    st = cb->gemm_strided_batched_ex(handle, p->trans_x, p->trans_y, p->m, p->n, p->k, &alpha, b, p->data_type,
                                     p->ldx, p->stride_x, a, p->data_type, p->ldy, p->stride_y, &beta, c,
                                     p->data_type, p->ldc, p->stride_c, p->batch, p->compute_type,
                                     dietcode::kGemmDefault);
  }
  if (st != 0) {
    return Fail(std::string(p->batch <= 1 ? "cublasGemmEx" : "cublasGemmStridedBatchedEx") + " (" + cb->origin +
                ") failed with cuBLAS status " + std::to_string(st) + " for m=" + std::to_string(p->m) +
                " n=" + std::to_string(p->n) + " k=" + std::to_string(p->k) + " batch=" + std::to_string(p->batch));
  }
  return 0;
}

const char* dc_vendor_epilogue_ptx(int dtype) {
  return dtype >= 0 && dtype <= 2 ? dietcode::EpiloguePtxFor(dtype).c_str() : nullptr;
}

int dc_vendor_epilogue_load(int dtype, void* stream) {
  if (dtype < 0 || dtype > 2) return dietcode::Fail("epilogue dtype " + std::to_string(dtype));
  std::string error;
  if (!dietcode::LoadPtx(dc_vendor_epilogue_ptx(dtype), "dc_epilogue", stream, &error)) {
    return dietcode::Fail("vendor epilogue: " + error);
  }
  return 0;
}

int dc_vendor_epilogue(const dc_epilogue* p, void* c, const void* bias, const void* residual, void* stream) {
  using dietcode::Fail;
  if (p == nullptr) return Fail("null epilogue");
  if (!p->has_bias && p->activation == 0 && !p->has_residual) return 0;
  const int dtype = p->dtype;
  if (dtype < 0 || dtype > 2) return Fail("epilogue dtype " + std::to_string(dtype));
  if (p->rows < 0 || p->cols < 0) {
    return Fail("epilogue extent " + std::to_string(p->rows) + " x " + std::to_string(p->cols) + " is negative");
  }
  uint64_t rows = static_cast<uint64_t>(p->rows), cols = static_cast<uint64_t>(p->cols);
  if (rows == 0 || cols == 0) return 0;
  if (p->has_bias && bias == nullptr) return Fail("the plan adds a bias but none was given");
  if (p->has_residual && residual == nullptr) return Fail("the plan adds a residual but none was given");
  uint64_t res_ptr = p->has_residual ? reinterpret_cast<uint64_t>(residual) : 0;
  uint64_t y = reinterpret_cast<uint64_t>(c), bias_ptr = p->has_bias ? reinterpret_cast<uint64_t>(bias) : 0;
  uint64_t brows = static_cast<uint64_t>(std::max<int64_t>(p->bias_rows, 1));
  uint64_t brs = static_cast<uint64_t>(p->bias_rs), bcs = static_cast<uint64_t>(p->bias_cs);
  float scale = p->bias_scale;
  uint32_t act = static_cast<uint32_t>(p->activation);
  if (p->residual_first && p->residual_mul) return Fail("the plan both adds the residual first and multiplies by it");
  uint32_t first = !p->has_residual ? 0u : p->residual_mul ? 2u : p->residual_first ? 1u : 0u;
  void* params[] = {&y, &bias_ptr, &rows, &cols, &brows, &brs, &bcs, &scale, &act, &res_ptr, &first};
  // 256-thread blocks: a warp's multiple along the columns (all 256 for a wide output), the rest along the rows;
  // along the rows, 4096 blocks in all at most (several waves on any GPU), the kernel's row loop covers the rest
  const unsigned block_x = cols >= 256 ? 256u : cols > 64 ? 128u : cols > 32 ? 64u : 32u, block_y = 256u / block_x;
  const uint64_t grid_x = (cols + block_x - 1) / block_x;
  if (grid_x > 0x7FFFFFFFu) return Fail("epilogue output of " + std::to_string(cols) + " columns is too wide");
  const uint64_t grid_y = std::min<uint64_t>({(rows + block_y - 1) / block_y, 65535u,
                                              std::max<uint64_t>(1, 4096 / grid_x)});
  std::string error;
  if (!dietcode::LaunchPtx(dc_vendor_epilogue_ptx(dtype), "dc_epilogue", static_cast<unsigned>(grid_x),
                           static_cast<unsigned>(grid_y), block_x, block_y, params, stream, &error)) {
    return Fail("vendor epilogue: " + error);
  }
  return 0;
}

}  // extern "C"

// --- cuDNN, resolved at run time ----------------------------------------------------------------------------

namespace dietcode {
namespace {

struct Cudnn {
  std::string origin;
  int (*create_tensor)(void**) = nullptr;
  int (*set_tensor_4d)(void*, int, int, int, int, int, int) = nullptr;
  int (*destroy_tensor)(void*) = nullptr;
  int (*create_filter)(void**) = nullptr;
  int (*set_filter_4d)(void*, int, int, int, int, int, int) = nullptr;
  int (*destroy_filter)(void*) = nullptr;
  int (*create_conv)(void**) = nullptr;
  int (*set_conv_2d)(void*, int, int, int, int, int, int, int, int) = nullptr;
  int (*set_group_count)(void*, int) = nullptr;
  int (*set_math_type)(void*, int) = nullptr;
  int (*destroy_conv)(void*) = nullptr;
  int (*forward)(void*, const void*, void*, const void*, void*, const void*, void*, int, void*, size_t, const void*,
                 void*, void*) = nullptr;
  int (*set_stream)(void*, void*) = nullptr;
  int (*get_stream)(void*, void**) = nullptr;
  const char* (*error_string)(int) = nullptr;
  // the heuristic (optional: without it every call runs IMPLICIT_GEMM without workspace)
  int (*get_algorithm_v7)(void*, void*, void*, void*, void*, int, int*, void*) = nullptr;
  int (*get_workspace_size)(void*, void*, void*, void*, void*, int, size_t*) = nullptr;
};

// cudnnConvolutionFwdAlgoPerf_t (cudnn_cnn.h, cuDNN 8 and 9): the heuristic's result records. cuDNN 9 keeps the
// legacy convolution API in its cudnn_cnn library, marked deprecated, with cuDNN 8's signatures
// (docs.nvidia.com/deeplearning/cudnn/backend/v9.6.0/api/cudnn-cnn-library.html); libcudnn.so.9 exports it.
struct FwdAlgoPerf {
  int algo;  // cudnnConvolutionFwdAlgo_t
  int status;  // cudnnStatus_t
  float time;
  size_t memory;
  int determinism;
  int math_type;  // cudnnMathType_t
  int reserved[3];
};
constexpr int kFwdAlgoCount = 8;  // CUDNN_CONVOLUTION_FWD_ALGO_COUNT

template <typename F>
void Sym(void* lib, const char* name, F* fn, std::string* missing) {
  *fn = reinterpret_cast<F>(dlsym(lib, name));
  if (*fn == nullptr) *missing += std::string(missing->empty() ? "" : ", ") + name;
}

const Cudnn* ResolveCudnn(void* lib, const std::string& origin, std::string* error) {
  auto* t = new Cudnn;
  t->origin = origin;
  std::string missing;
  Sym(lib, "cudnnCreateTensorDescriptor", &t->create_tensor, &missing);
  Sym(lib, "cudnnSetTensor4dDescriptor", &t->set_tensor_4d, &missing);
  Sym(lib, "cudnnDestroyTensorDescriptor", &t->destroy_tensor, &missing);
  Sym(lib, "cudnnCreateFilterDescriptor", &t->create_filter, &missing);
  Sym(lib, "cudnnSetFilter4dDescriptor", &t->set_filter_4d, &missing);
  Sym(lib, "cudnnDestroyFilterDescriptor", &t->destroy_filter, &missing);
  Sym(lib, "cudnnCreateConvolutionDescriptor", &t->create_conv, &missing);
  Sym(lib, "cudnnSetConvolution2dDescriptor", &t->set_conv_2d, &missing);
  Sym(lib, "cudnnSetConvolutionGroupCount", &t->set_group_count, &missing);
  Sym(lib, "cudnnSetConvolutionMathType", &t->set_math_type, &missing);
  Sym(lib, "cudnnDestroyConvolutionDescriptor", &t->destroy_conv, &missing);
  Sym(lib, "cudnnConvolutionForward", &t->forward, &missing);
  Sym(lib, "cudnnSetStream", &t->set_stream, &missing);
  Sym(lib, "cudnnGetStream", &t->get_stream, &missing);
  Sym(lib, "cudnnGetErrorString", &t->error_string, &missing);
  std::string optional;  // a cuDNN without them runs the fallback algorithm (dc_vendor_conv_algo says why)
  Sym(lib, "cudnnGetConvolutionForwardAlgorithm_v7", &t->get_algorithm_v7, &optional);
  Sym(lib, "cudnnGetConvolutionForwardWorkspaceSize", &t->get_workspace_size, &optional);
  if (!missing.empty()) {
    *error = origin + " lacks " + missing;
    delete t;
    return nullptr;
  }
  return t;
}

VendorLibrary<Cudnn> g_cudnn{ResolveCudnn, {"libcudnn.so.9", "libcudnn.so.8"},
                              "no cuDNN in this process (libcudnn.so.9 or .8): the vendor path calls the cuDNN that "
                              "ONNX Runtime's CUDA execution provider loads, and it has not loaded one"};

const Cudnn* LoadCudnn(const char* path, std::string* error) { return LoadVendorLibrary(&g_cudnn, path, error); }

// The three descriptors of one call, destroyed with the scope.
struct ConvDescriptors {
  const Cudnn& dnn;
  void *x = nullptr, *y = nullptr, *w = nullptr, *conv = nullptr;
  explicit ConvDescriptors(const Cudnn& d) : dnn(d) {}
  ~ConvDescriptors() {
    if (x) dnn.destroy_tensor(x);
    if (y) dnn.destroy_tensor(y);
    if (w) dnn.destroy_filter(w);
    if (conv) dnn.destroy_conv(conv);
  }
};

// The descriptors of a plan's call, with `math` as the convolution's math type; false with *error.
bool MakeDescriptors(const Cudnn& dnn, const dc_conv_plan& p, int math, ConvDescriptors* d, std::string* error) {
  // dims stay (n, c, h, w) / (k, kc, kh, kw) either way; NHWC filters are cuDNN's KRSC ([k, kh, kw, kc])
  const int format = p.channels_last ? kCudnnNhwc : kCudnnNchw;
  auto check = [&](int st, const char* what) {
    if (st == 0) return true;
    const char* text = dnn.error_string(st);
    *error = std::string(what) + " (" + dnn.origin + ") failed: " + (text ? text : "") + " (cuDNN status " +
             std::to_string(st) + ")";
    return false;
  };
  return check(dnn.create_tensor(&d->x), "cudnnCreateTensorDescriptor") &&
         check(dnn.set_tensor_4d(d->x, format, p.data_type, p.n, p.c, p.h, p.w), "cudnnSetTensor4dDescriptor (X)") &&
         check(dnn.create_tensor(&d->y), "cudnnCreateTensorDescriptor") &&
         check(dnn.set_tensor_4d(d->y, format, p.data_type, p.n, p.k, p.out_h, p.out_w),
               "cudnnSetTensor4dDescriptor (Y)") &&
         check(dnn.create_filter(&d->w), "cudnnCreateFilterDescriptor") &&
         check(dnn.set_filter_4d(d->w, p.data_type, format, p.k, p.kc, p.kh, p.kw), "cudnnSetFilter4dDescriptor") &&
         check(dnn.create_conv(&d->conv), "cudnnCreateConvolutionDescriptor") &&
         check(dnn.set_conv_2d(d->conv, p.pad_h, p.pad_w, p.stride_h, p.stride_w, p.dil_h, p.dil_w,
                               kCudnnCrossCorrelation, kCudnnFloat),
               "cudnnSetConvolution2dDescriptor") &&
         check(dnn.set_group_count(d->conv, p.group), "cudnnSetConvolutionGroupCount") &&
         check(dnn.set_math_type(d->conv, math), "cudnnSetConvolutionMathType");
}

// Binds the handle to `stream` unless it already is (ORT binds each stream's handle when it creates it).
bool BindStream(const Cudnn& dnn, void* handle, void* stream, std::string* error) {
  void* bound = nullptr;
  int st = dnn.get_stream(handle, &bound);
  const char* what = "cudnnGetStream";
  if (st == 0 && bound != stream) st = dnn.set_stream(handle, stream), what = "cudnnSetStream";
  if (st == 0) return true;
  const char* text = dnn.error_string(st);
  *error = std::string(what) + " (" + dnn.origin + ") failed: " + (text ? text : "") + " (cuDNN status " +
           std::to_string(st) + ")";
  return false;
}

// The key of a plan's algorithm choice: its shapes, conv attributes, data and math type.
using AlgoKey = std::tuple<int32_t, int32_t, int32_t, int32_t, int32_t, int32_t, int32_t, int32_t, int32_t, int32_t,
                           int32_t, int32_t, int32_t, int32_t, int32_t, int32_t, int32_t, int32_t, int32_t, int32_t>;
AlgoKey KeyOf(const dc_conv_plan& p) {  // the layout too: NCHW and NHWC calls of one shape choose apart
  return AlgoKey(p.n, p.c, p.h, p.w, p.k, p.kc, p.kh, p.kw, p.group, p.pad_h, p.pad_w, p.stride_h, p.stride_w,
                 p.dil_h, p.dil_w, p.out_h, p.out_w, p.data_type, p.math_type, p.channels_last);
}

// The heuristic's choice for a plan (uncached); true: chosen, false: the fallback with *why.
bool QueryAlgo(const Cudnn& dnn, const dc_conv_plan& p, void* handle, uint64_t cap, dc_conv_algo* out,
               std::string* why) {
  if (dnn.get_algorithm_v7 == nullptr || dnn.get_workspace_size == nullptr) {
    *why = dnn.origin + " lacks cudnnGetConvolutionForwardAlgorithm_v7 / cudnnGetConvolutionForwardWorkspaceSize";
    return false;
  }
  ConvDescriptors d(dnn);
  if (!MakeDescriptors(dnn, p, p.math_type, &d, why)) return false;
  FwdAlgoPerf perf[kFwdAlgoCount] = {};
  int returned = 0;
  const int st = dnn.get_algorithm_v7(handle, d.x, d.w, d.conv, d.y, kFwdAlgoCount, &returned, perf);
  if (st != 0) {
    const char* text = dnn.error_string(st);
    *why = std::string("cudnnGetConvolutionForwardAlgorithm_v7 (") + dnn.origin + ") failed: " + (text ? text : "") +
           " (cuDNN status " + std::to_string(st) + ")";
    return false;
  }
  returned = std::max(0, std::min(returned, kFwdAlgoCount));
  std::string skipped;
  for (int i = 0; i < returned; ++i) {
    if (perf[i].status != 0) continue;
    size_t bytes = 0;
    if (dnn.get_workspace_size(handle, d.x, d.w, d.conv, d.y, perf[i].algo, &bytes) != 0) continue;
    if (bytes > cap) {
      skipped += (skipped.empty() ? "" : ", ") + std::to_string(perf[i].algo) + " (" + std::to_string(bytes) + " B)";
      continue;
    }
    out->algo = perf[i].algo;
    out->from_heuristic = 1;
    out->math_type = p.math_type == kCudnnFmaMath ? kCudnnFmaMath : perf[i].math_type;  // FMA: no TF32, ever
    out->workspace_bytes = bytes;
    return true;
  }
  *why = "cuDNN's heuristic returned " + std::to_string(returned) + " algorithms and none runs within the " +
         std::to_string(cap) + "-byte workspace cap" + (skipped.empty() ? "" : ": " + skipped);
  return false;
}

}  // namespace
}  // namespace dietcode

struct dc_conv_algo_cache {
  std::mutex mutex;
  std::map<dietcode::AlgoKey, std::pair<dc_conv_algo, std::string>> chosen;  // the choice and a fallback's reason
  int64_t queries = 0;
};

extern "C" {

int dc_vendor_cudnn_load(const char* path) {
  std::string error;
  return dietcode::LoadCudnn(path, &error) != nullptr ? 0 : dietcode::Fail(error);
}

dc_conv_algo_cache* dc_conv_algo_cache_new(void) { return new dc_conv_algo_cache; }

void dc_conv_algo_cache_free(dc_conv_algo_cache* cache) { delete cache; }

int64_t dc_conv_algo_cache_queries(const dc_conv_algo_cache* cache) {
  return cache == nullptr ? 0 : cache->queries;
}

int dc_vendor_conv_algo(dc_conv_algo_cache* cache, const dc_conv_plan* p, void* handle, uint64_t workspace_cap,
                        dc_conv_algo* out) {
  using dietcode::Fail;
  if (p == nullptr || out == nullptr) return Fail("null plan or result");
  if (handle == nullptr) return Fail("no cuDNN handle (ONNX Runtime gave none for this stream)");
  std::string error;
  const dietcode::Cudnn* dnn = dietcode::LoadCudnn(nullptr, &error);
  if (dnn == nullptr) return Fail(error);
  const dietcode::AlgoKey key = dietcode::KeyOf(*p);
  std::unique_lock<std::mutex> lock;
  if (cache != nullptr) {
    lock = std::unique_lock<std::mutex>(cache->mutex);  // held over the query: one query per shape
    auto hit = cache->chosen.find(key);
    if (hit != cache->chosen.end()) {
      *out = hit->second.first;
      if (out->from_heuristic) return 1;
      dietcode::SetError(hit->second.second);
      return 0;
    }
    cache->queries++;
  }
  dc_conv_algo algo{};  // the heuristic enqueues no work: the handle's stream does not matter here
  std::string why;
  if (!dietcode::QueryAlgo(*dnn, *p, handle, workspace_cap, &algo, &why)) {
    algo = dc_conv_algo{};  // IMPLICIT_GEMM, no workspace, the plan's math type
    algo.algo = dietcode::kCudnnFwdImplicitGemm;
    algo.math_type = p->math_type;
    why = "IMPLICIT_GEMM without workspace: " + why;
  }
  if (cache != nullptr) cache->chosen.emplace(key, std::make_pair(algo, why));
  *out = algo;
  if (algo.from_heuristic) return 1;
  dietcode::SetError(why);
  return 0;
}

int dc_vendor_conv(const dc_conv_plan* p, const dc_conv_algo* algo, void* workspace, const void* x, const void* w,
                   void* y, void* handle, void* stream) {
  using dietcode::Fail;
  if (p == nullptr) return Fail("null plan");
  if (handle == nullptr) return Fail("no cuDNN handle (ONNX Runtime gave none for this stream)");
  const uint64_t workspace_bytes = algo == nullptr ? 0 : algo->workspace_bytes;
  if (workspace_bytes != 0 && workspace == nullptr) {
    return Fail("the convolution algorithm needs a " + std::to_string(workspace_bytes) + "-byte workspace, none given");
  }
  std::string error;
  const dietcode::Cudnn* dnn = dietcode::LoadCudnn(nullptr, &error);
  if (dnn == nullptr) return Fail(error);
  if (!dietcode::BindStream(*dnn, handle, stream, &error)) return Fail(error);
  dietcode::ConvDescriptors d(*dnn);
  if (!dietcode::MakeDescriptors(*dnn, *p, algo == nullptr ? p->math_type : algo->math_type, &d, &error)) {
    return Fail(error);
  }
  const float alpha = 1.0f, beta = 0.0f;  // float scaling for float, half and bfloat16 data
  const int st = dnn->forward(handle, &alpha, d.x, x, d.w, w, d.conv,
                              algo == nullptr ? dietcode::kCudnnFwdImplicitGemm : algo->algo,
                              workspace_bytes != 0 ? workspace : nullptr, static_cast<size_t>(workspace_bytes), &beta,
                              d.y, y);
  if (st != 0) {
    const char* text = dnn->error_string(st);
    return Fail(std::string("cudnnConvolutionForward (") + dnn->origin + ") failed: " + (text ? text : "") +
                " (cuDNN status " + std::to_string(st) + ")");
  }
  return 0;
}

}  // extern "C"

// --- cuBLASLt, resolved at run time (dc_gemm_lt_plan says which calls) -------------------------------------

namespace dietcode {
namespace {

// cublasLt.h (cuBLAS 11 to 13; checked against the nvidia-cublas-cu12 12.9 wheel's header and its
// libcublasLt.so.12's exports): the attribute and preference ids used, and the heuristic's result record.
constexpr int kLtDescTransA = 3, kLtDescTransB = 4, kLtDescEpilogue = 7, kLtDescBiasPointer = 8;
constexpr int kLtPrefMaxWorkspace = 1;  // uint64_t
constexpr int kLtPrefAlignA = 5, kLtPrefAlignB = 6, kLtPrefAlignC = 7, kLtPrefAlignD = 8;  // uint32_t, bytes
struct LtHeuristicResult {  // cublasLtMatmulHeuristicResult_t
  uint64_t algo[8];  // cublasLtMatmulAlgo_t
  size_t workspace_size;
  int state;  // cublasStatus_t
  float waves;
  int reserved[4];
};
static_assert(sizeof(LtHeuristicResult) == 96, "cublasLtMatmulHeuristicResult_t is 96 bytes");

struct CublasLt {
  std::string origin;
  int (*create)(void**) = nullptr;
  int (*desc_create)(void**, int compute_type, int scale_type) = nullptr;
  int (*desc_destroy)(void*) = nullptr;
  int (*desc_set)(void*, int attr, const void* buf, size_t size) = nullptr;
  int (*layout_create)(void**, int type, uint64_t rows, uint64_t cols, int64_t ld) = nullptr;
  int (*layout_destroy)(void*) = nullptr;
  int (*pref_create)(void**) = nullptr;
  int (*pref_destroy)(void*) = nullptr;
  int (*pref_set)(void*, int attr, const void* buf, size_t size) = nullptr;
  int (*heuristic)(void* handle, void* op, void* a, void* b, void* c, void* d, void* pref, int requested,
                   LtHeuristicResult* results, int* returned) = nullptr;
  int (*matmul)(void* handle, void* op, const void* alpha, const void* a, void* a_desc, const void* b, void* b_desc,
                const void* beta, const void* c, void* c_desc, void* d, void* d_desc, const void* algo,
                void* workspace, size_t workspace_bytes, void* stream) = nullptr;
  const char* (*status_name)(int) = nullptr;  // optional
};

const CublasLt* ResolveCublasLt(void* lib, const std::string& origin, std::string* error) {
  auto* t = new CublasLt;
  t->origin = origin;
  std::string missing;
  Sym(lib, "cublasLtCreate", &t->create, &missing);
  Sym(lib, "cublasLtMatmulDescCreate", &t->desc_create, &missing);
  Sym(lib, "cublasLtMatmulDescDestroy", &t->desc_destroy, &missing);
  Sym(lib, "cublasLtMatmulDescSetAttribute", &t->desc_set, &missing);
  Sym(lib, "cublasLtMatrixLayoutCreate", &t->layout_create, &missing);
  Sym(lib, "cublasLtMatrixLayoutDestroy", &t->layout_destroy, &missing);
  Sym(lib, "cublasLtMatmulPreferenceCreate", &t->pref_create, &missing);
  Sym(lib, "cublasLtMatmulPreferenceDestroy", &t->pref_destroy, &missing);
  Sym(lib, "cublasLtMatmulPreferenceSetAttribute", &t->pref_set, &missing);
  Sym(lib, "cublasLtMatmulAlgoGetHeuristic", &t->heuristic, &missing);
  Sym(lib, "cublasLtMatmul", &t->matmul, &missing);
  std::string optional;
  Sym(lib, "cublasLtGetStatusName", &t->status_name, &optional);
  if (!missing.empty()) {
    *error = origin + " lacks " + missing;
    delete t;
    return nullptr;
  }
  return t;
}

VendorLibrary<CublasLt> g_cublaslt{ResolveCublasLt, {"libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so.11"},
                                   "no cuBLASLt in this process (libcublasLt.so.13, .12 or .11): the fused path "
                                   "calls the cuBLASLt that ONNX Runtime's CUDA execution provider loads"};

const CublasLt* LoadCublasLt(const char* path, std::string* error) {
  return LoadVendorLibrary(&g_cublaslt, path, error);
}

std::string LtStatus(const CublasLt& lt, const char* what, int st) {
  const char* name = lt.status_name != nullptr ? lt.status_name(st) : nullptr;
  return std::string(what) + " (" + lt.origin + ") failed with cuBLAS status " + std::to_string(st) +
         (name != nullptr ? std::string(" ") + name : std::string());
}

// The descriptors of one distinct call, destroyed with the object.
struct LtDescriptors {
  const CublasLt& lt;
  void *op = nullptr, *a = nullptr, *b = nullptr, *c = nullptr, *d = nullptr;
  explicit LtDescriptors(const CublasLt& l) : lt(l) {}
  LtDescriptors(const LtDescriptors&) = delete;
  LtDescriptors& operator=(const LtDescriptors&) = delete;
  ~LtDescriptors() {
    if (op) lt.desc_destroy(op);
    if (a) lt.layout_destroy(a);
    if (b) lt.layout_destroy(b);
    if (c) lt.layout_destroy(c);
    if (d) lt.layout_destroy(d);
  }
};

// The plan's call as cuBLASLt descriptors: A = x (the node's B), B = y (the node's A), C and D the column-major
// [m, n] output with ldc (C's layout only with the residual as C; else C is D) and the epilogue. The bias pointer
// is set per call (SetLtBias), so the descriptors serve every call of the same plan.
bool MakeLtDescriptors(const CublasLt& lt, const dc_gemm_plan& p, const dc_gemm_lt& f, LtDescriptors* d,
                       std::string* error) {
  auto check = [&](int st, const char* what) { return st == 0 || (*error = LtStatus(lt, what, st), false); };
  const int32_t ta = p.trans_x, tb = p.trans_y;
  const uint32_t epilogue = static_cast<uint32_t>(f.epilogue);
  const uint64_t m = static_cast<uint64_t>(p.m), n = static_cast<uint64_t>(p.n), k = static_cast<uint64_t>(p.k);
  // scale type float: alpha and beta are float for every compute type used here (as for cublasGemmEx)
  return check(lt.desc_create(&d->op, p.compute_type, kCudaR32F), "cublasLtMatmulDescCreate") &&
         check(lt.desc_set(d->op, kLtDescTransA, &ta, sizeof(ta)), "cublasLtMatmulDescSetAttribute (TRANSA)") &&
         check(lt.desc_set(d->op, kLtDescTransB, &tb, sizeof(tb)), "cublasLtMatmulDescSetAttribute (TRANSB)") &&
         check(lt.desc_set(d->op, kLtDescEpilogue, &epilogue, sizeof(epilogue)),
               "cublasLtMatmulDescSetAttribute (EPILOGUE)") &&
         check(lt.layout_create(&d->a, p.data_type, ta ? k : m, ta ? m : k, p.ldx), "cublasLtMatrixLayoutCreate (A)") &&
         check(lt.layout_create(&d->b, p.data_type, tb ? n : k, tb ? k : n, p.ldy), "cublasLtMatrixLayoutCreate (B)") &&
         check(lt.layout_create(&d->d, p.data_type, m, n, p.ldc), "cublasLtMatrixLayoutCreate (D)") &&
         (!f.residual_c || check(lt.layout_create(&d->c, p.data_type, m, n, p.ldc), "cublasLtMatrixLayoutCreate (C)"));
}

// This call's bias pointer on the operation descriptor (the heuristic reads its alignment, the matmul its value).
bool SetLtBias(const CublasLt& lt, LtDescriptors* d, const void* bias, std::string* error) {
  const int st = lt.desc_set(d->op, kLtDescBiasPointer, &bias, sizeof(bias));
  return st == 0 || (*error = LtStatus(lt, "cublasLtMatmulDescSetAttribute (BIAS_POINTER)", st), false);
}

// One thread's descriptors per distinct plan (library, transposes, sizes, leading dims, types, epilogue, bias,
// C's role): a steady shape then sets one attribute per call instead of creating and destroying five or six
// descriptors. Per thread, so no two calls share one (the bias pointer changes per call); bounded like the
// algorithm cache (past kLtDescCap plans the cache frees them and starts over). The entries are not freed at
// thread exit, when cuBLASLt may already be gone: a few hundred bytes per plan a thread has run.
using LtDescKey = std::tuple<const CublasLt*, int32_t, int32_t, int32_t, int32_t, int32_t, int32_t, int32_t, int32_t,
                             int32_t, int32_t, int32_t, int32_t, int32_t>;
constexpr size_t kLtDescCap = 256;
thread_local std::map<LtDescKey, LtDescriptors*>* t_lt_descs = nullptr;

// The thread's descriptors of plan (p, f), made on its first call; null with *error when cuBLASLt refuses one.
LtDescriptors* CachedLtDescriptors(const CublasLt& lt, const dc_gemm_plan& p, const dc_gemm_lt& f,
                                   std::string* error) {
  if (t_lt_descs == nullptr) t_lt_descs = new std::map<LtDescKey, LtDescriptors*>();  // kept: see above
  const LtDescKey key(&lt, p.trans_x, p.trans_y, p.m, p.n, p.k, p.ldx, p.ldy, p.ldc, p.data_type, p.compute_type,
                      f.epilogue, f.has_bias, f.residual_c);
  auto hit = t_lt_descs->find(key);
  if (hit != t_lt_descs->end()) return hit->second;
  auto made = std::make_unique<LtDescriptors>(lt);
  if (!MakeLtDescriptors(lt, p, f, made.get(), error)) return nullptr;  // the partial ones freed with it
  if (t_lt_descs->size() >= kLtDescCap) {
    for (auto& entry : *t_lt_descs) delete entry.second;
    t_lt_descs->clear();
  }
  return t_lt_descs->emplace(key, made.release()).first->second;
}

// A pointer's alignment in bytes, up to the 256 cuBLASLt assumes unless told (its MIN_ALIGNMENT preferences).
uint32_t Alignment(const void* ptr) {
  const uint64_t v = reinterpret_cast<uint64_t>(ptr);
  return v == 0 ? 256u : static_cast<uint32_t>(std::min<uint64_t>(v & (~v + 1), 256));
}

// What the heuristic's answer depends on: the handle (its device), sizes, transposes, leading dims, types, the
// epilogue, C's role, the alignments of A, B, C, D and the bias, and the workspace allowed.
using LtKey = std::tuple<void*, int32_t, int32_t, int32_t, int32_t, int32_t, int32_t, int32_t, int32_t, int32_t,
                         int32_t, int32_t, int32_t, uint64_t, uint64_t>;
struct LtChoice {
  bool ok = false;
  uint64_t algo[8] = {};
  std::string why;  // when !ok
};
constexpr size_t kLtCacheCap = 4096;  // distinct keys kept; past it the cache starts over (dynamic shapes)

std::mutex g_lt_mutex;
std::map<LtKey, LtChoice> g_lt_algos;  // under g_lt_mutex
std::atomic<int64_t> g_lt_calls{0}, g_lt_queries{0};

// The heuristic's first algorithm for the call (uncached); false with *why.
bool QueryLt(const CublasLt& lt, void* handle, const LtDescriptors* d, const uint32_t align[4],
             uint64_t workspace_bytes, LtChoice* out, std::string* why) {
  auto check = [&](int st, const char* what) { return st == 0 || (*why = LtStatus(lt, what, st), false); };
  struct Preference {  // destroyed with the scope
    const CublasLt& lt;
    void* p = nullptr;
    ~Preference() {
      if (p) lt.pref_destroy(p);
    }
  } owned{lt};
  if (!check(lt.pref_create(&owned.p), "cublasLtMatmulPreferenceCreate")) return false;
  void* const pref = owned.p;
  if (!check(lt.pref_set(pref, kLtPrefMaxWorkspace, &workspace_bytes, sizeof(workspace_bytes)),
             "cublasLtMatmulPreferenceSetAttribute (MAX_WORKSPACE_BYTES)")) {
    return false;
  }
  const int ids[4] = {kLtPrefAlignA, kLtPrefAlignB, kLtPrefAlignC, kLtPrefAlignD};
  for (int i = 0; i < 4; ++i) {
    if (!check(lt.pref_set(pref, ids[i], &align[i], sizeof(align[i])),
               "cublasLtMatmulPreferenceSetAttribute (MIN_ALIGNMENT)")) {
      return false;
    }
  }
  LtHeuristicResult result{};
  int returned = 0;
  if (!check(lt.heuristic(handle, d->op, d->a, d->b, d->c ? d->c : d->d, d->d, pref, 1, &result, &returned),
             "cublasLtMatmulAlgoGetHeuristic")) {
    return false;
  }
  if (returned < 1 || result.state != 0) {
    *why = "cublasLtMatmulAlgoGetHeuristic (" + lt.origin + ") found no algorithm within a " +
           std::to_string(workspace_bytes) + "-byte workspace" +
           (returned < 1 ? std::string() : " (result status " + std::to_string(result.state) + ")");
    return false;
  }
  std::copy(result.algo, result.algo + 8, out->algo);
  out->ok = true;
  return true;
}

struct HandleRequest {
  const CublasLt* lt;
  void* handle;
};

// The handle of the current context (InStreamContext made it current), created once per (library, context).
bool ContextHandle(void* context, void* arg, std::string* error) {
  auto* request = static_cast<HandleRequest*>(arg);
  static std::mutex mutex;
  static std::map<std::pair<const CublasLt*, void*>, void*> handles;
  std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_pair(request->lt, context);
  auto it = handles.find(key);
  if (it == handles.end()) {
    void* handle = nullptr;
    const int st = request->lt->create(&handle);
    if (st != 0 || handle == nullptr) return *error = LtStatus(*request->lt, "cublasLtCreate", st), false;
    it = handles.emplace(key, handle).first;
  }
  request->handle = it->second;
  return true;
}

}  // namespace
}  // namespace dietcode

extern "C" {

int dc_vendor_cublaslt_load(const char* path) {
  std::string error;
  return dietcode::LoadCublasLt(path, &error) != nullptr ? 0 : dietcode::Fail(error);
}

int dc_vendor_cublaslt_handle(void* stream, void** handle) {
  using dietcode::Fail;
  if (handle == nullptr) return Fail("null handle");
  std::string error;
  const dietcode::CublasLt* lt = dietcode::LoadCublasLt(nullptr, &error);
  if (lt == nullptr) return Fail(error);
  dietcode::HandleRequest request{lt, nullptr};
  if (!dietcode::InStreamContext(stream, dietcode::ContextHandle, &request, &error)) return Fail(error);
  *handle = request.handle;
  return 0;
}

int dc_vendor_gemm_lt(const dc_gemm_plan* p, const dc_gemm_lt* f, const void* a, const void* b, void* d,
                      const void* bias, const void* residual, void* workspace, uint64_t workspace_bytes,
                      void* handle, void* stream) {
  using dietcode::Fail;
  if (p == nullptr || f == nullptr) return Fail("null plan");
  if (handle == nullptr) return Fail("no cuBLASLt handle");
  if (p->batch > 1) return Fail("the fused cuBLASLt call takes one GEMM, not a batch");
  if (f->has_bias && bias == nullptr) return Fail("the fused call adds a bias but none was given");
  if (f->residual_c && residual == nullptr) return Fail("the fused call adds a residual but none was given");
  if (workspace_bytes != 0 && workspace == nullptr) return Fail("a workspace size without a workspace");
  std::string error;
  const dietcode::CublasLt* lt = dietcode::LoadCublasLt(nullptr, &error);
  if (lt == nullptr) return Fail(error);
  dietcode::LtDescriptors* cached = dietcode::CachedLtDescriptors(*lt, *p, *f, &error);
  if (cached == nullptr || (f->has_bias && !dietcode::SetLtBias(*lt, cached, bias, &error))) return Fail(error);
  const dietcode::LtDescriptors& desc = *cached;
  const void* c = f->residual_c ? residual : d;
  // cuBLASLt's A is the node's B (x), its B the node's A (y)
  const uint32_t align[4] = {dietcode::Alignment(b), dietcode::Alignment(a), dietcode::Alignment(c),
                             dietcode::Alignment(d)};
  const uint32_t bias_align = f->has_bias ? dietcode::Alignment(bias) : 256u;
  const uint64_t aligns = align[0] | uint64_t{align[1]} << 9 | uint64_t{align[2]} << 18 | uint64_t{align[3]} << 27 |
                          uint64_t{bias_align} << 36;
  const dietcode::LtKey key(handle, p->trans_x, p->trans_y, p->m, p->n, p->k, p->ldx, p->ldy, p->ldc, p->data_type,
                            p->compute_type, f->epilogue, f->residual_c, aligns, workspace_bytes);
  dietcode::LtChoice choice;
  {
    std::lock_guard<std::mutex> lock(dietcode::g_lt_mutex);  // held over the query: one query per key
    auto hit = dietcode::g_lt_algos.find(key);
    if (hit != dietcode::g_lt_algos.end()) {
      choice = hit->second;
    } else {
      dietcode::g_lt_queries++;
      std::string why;
      if (!dietcode::QueryLt(*lt, handle, cached, align, workspace_bytes, &choice, &why)) choice.why = why;
      if (dietcode::g_lt_algos.size() >= dietcode::kLtCacheCap) dietcode::g_lt_algos.clear();
      dietcode::g_lt_algos.emplace(key, choice);
    }
  }
  if (!choice.ok) return Fail(choice.why);
  const float alpha = p->alpha, beta = f->beta;
  const int st = lt->matmul(handle, desc.op, &alpha, b, desc.a, a, desc.b, &beta, c, desc.c ? desc.c : desc.d, d,
                            desc.d, choice.algo, workspace, static_cast<size_t>(workspace_bytes), stream);
  if (st != 0) {
    const std::string why = dietcode::LtStatus(*lt, "cublasLtMatmul", st) + " for m=" + std::to_string(p->m) +
                            " n=" + std::to_string(p->n) + " k=" + std::to_string(p->k) + " epilogue " +
                            std::to_string(f->epilogue);
    {  // not again for this key: its calls take the unfused path
      std::lock_guard<std::mutex> lock(dietcode::g_lt_mutex);
      dietcode::LtChoice failed;
      failed.why = why;
      dietcode::g_lt_algos[key] = failed;
    }
    return Fail(why);
  }
  dietcode::g_lt_calls++;
  return 0;
}

int dc_vendor_gemm_call(const dc_gemm_plan* p, const dc_gemm_lt* lt, const void* a, const void* b, void* c,
                        const void* bias, const void* residual, void* cublas_handle, void* lt_handle,
                        void* workspace, uint64_t workspace_bytes, void* stream) {
  std::string why;
  if (lt != nullptr) {
    if (lt_handle != nullptr &&
        dc_vendor_gemm_lt(p, lt, a, b, c, bias, residual, workspace, workspace_bytes, lt_handle, stream) == 0) {
      return 1;
    }
    why = lt_handle == nullptr ? std::string("no cuBLASLt handle") : std::string(dc_last_error());
  }
  if (dc_vendor_gemm(p, a, b, c, cublas_handle, stream) != 0) return -1;
  dietcode::SetError(why);
  return 0;
}

void dc_vendor_lt_stats(int64_t* calls, int64_t* queries) {
  if (calls != nullptr) *calls = dietcode::g_lt_calls.load();
  if (queries != nullptr) *queries = dietcode::g_lt_queries.load();
}

}  // extern "C"
