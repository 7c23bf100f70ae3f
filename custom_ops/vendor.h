// The vendor path on CUDA: a node call that no compiled kernel takes (a "vendor" leaf of the dispatch tree, a
// kernel unfit for the device, a per-call hazard) runs as one cuBLAS GEMM (MatMul, Gemm) or one cuDNN
// convolution (Conv) on ONNX Runtime's own handles and compute stream, then the fused epilogue (bias,
// activation, residual) as a small PTX kernel on the same stream; or, for the GEMMs whose epilogue cuBLASLt can
// express exactly (dc_gemm_lt_plan), one cublasLtMatmul with the epilogue fused, no second pass over the output.
//
// Why not ORT's own kernel (Ort::Op / InvokeOp): InvokeOp runs the kernel in a StandAloneKernelContext whose
// GetComputeStream() returns nullptr (onnxruntime/core/session/standalone_op_invoker.cc), and the CUDA EP's
// kernels take their cuBLAS/cuDNN handles from that stream (CudaKernel::GetCublasHandle(ctx) dereferences
// static_cast<CudaStream*>(ctx->GetComputeStream())->cublas_handle_ in onnxruntime/core/providers/cuda/
// cuda_kernel.h): a null dereference, or in releases that check for null, a null handle and work on the
// legacy default stream, unordered with ORT's stream. The custom op's own context does have the stream, and
// ORT hands its per-stream handles to custom ops through KernelContext_GetResource (CudaResource ids in
// core/providers/cuda/cuda_resource.h: cuda_stream_t = 10000, cudnn_handle_t, cublas_handle_t; since 1.16).
//
// cuBLAS, cuBLASLt and cuDNN are never linked: dc_vendor_cublas_load / dc_vendor_cublaslt_load /
// dc_vendor_cudnn_load find the libraries ORT's CUDA EP already loaded (dlopen RTLD_NOLOAD of libcublas.so.13,
// .12, .11, libcublasLt.so.13, .12, .11 and libcudnn.so.9, .8), or a given file (a host-memory stand-in in the
// tests). The call planning (row-major node -> column-major cuBLAS call, cuDNN descriptors, epilogue indexing,
// what cuBLASLt fuses) is pure functions, dc_gemm_plan_make, dc_gemm_lt_plan and dc_conv_plan_make, so it is
// tested without a GPU. See docs/abi.md ("The vendor path").
#ifndef DIETCODE_VENDOR_H_
#define DIETCODE_VENDOR_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// The epilogue over the row-major output seen as [rows, cols] (element i: r = i / cols, c = i % cols):
//   y = act(y + bias_scale * bias[(r % bias_rows) * bias_rs + c * bias_cs])   (the bias term when has_bias)
//   y = y + residual[i]                                                       (when has_residual)
// or with residual_first, the residual inside the activation:
//   y = act(y + bias_scale * bias[...] + residual[i])
// or with residual_mul, the activation's result times the residual (LLaMA's SwiGLU gate):
//   y = act(y + bias_scale * bias[...]) * residual[i]
// (a MatMul's scale is cuBLAS's alpha, so y already holds scale * product when the epilogue runs).
typedef struct dc_epilogue {
  int32_t dtype;                        // 0 float32, 1 float16, 2 bfloat16
  int32_t has_bias, activation;         // activation: 0 none, 1 relu, 2 gelu (erf), 3 gelu (tanh), 4 silu, 5 relu6
  int32_t has_residual;                 // 1: add a tensor of the output's shape last (set by the caller)
  int32_t residual_first;               // 1: add it before the activation instead (set by the caller)
  int32_t residual_mul;                 // 1: multiply by it after the activation instead (set by the caller)
  float bias_scale;                     // 1 for MatMul's bias and Conv's B, beta for Gemm's C
  int64_t rows, cols, bias_rows, bias_rs, bias_cs;
} dc_epilogue;

// One node call as a cuBLAS call. cuBLAS is column-major: a row-major [r, c] matrix is its column-major
// [c, r] transpose, so the row-major Y = op(A) op(B) is computed as the column-major Y^T = op(B)^T op(A)^T:
// cuBLAS's first operand ("x") is the node's B, its second ("y") the node's A, m = N, n = M, k = K, ldc = N.
typedef struct dc_gemm_plan {
  int32_t trans_x, trans_y;             // cublasOperation_t of x (node B) and y (node A): 0 N, 1 T
  int32_t m, n, k, ldx, ldy, ldc;       // cuBLAS sizes and leading dimensions (elements)
  int64_t stride_x, stride_y, stride_c; // elements between batch entries; 0: that operand is broadcast
  int32_t batch;                        // 1: cublasGemmEx; more: cublasGemmStridedBatchedEx
  int32_t data_type;                    // cudaDataType of all three: 0 CUDA_R_32F, 2 CUDA_R_16F, 14 CUDA_R_16BF
  int32_t compute_type;                 // cublasComputeType_t: 68 CUBLAS_COMPUTE_32F, 77 .._32F_FAST_TF32
  float alpha;                          // host scalar: Gemm's alpha, a MatMul's scale (beta is 0: overwritten)
  dc_epilogue epilogue;
} dc_gemm_plan;

// Plan one call. op 0 = MatMul (c: the fused bias, NULL without; alpha: the node's scale, 1 for none), 1 = Gemm
// (trans_a, trans_b, alpha, beta; c: Gemm's C, NULL without). dtype 0 float32, 1 float16, 2 bfloat16; activation 0..5 (dc_epilogue); tf32 != 0 computes
// float32 with TF32 tensor cores (ONNX Runtime's CUDA EP default, use_tf32=1). 1: planned; 0: the call has
// no cuBLAS form here (mixed batch broadcasting, a bias broadcast the epilogue cannot index, sizes past
// cuBLAS's int32; message in dc_last_error); -1: the shapes are invalid (message).
int dc_gemm_plan_make(int op, const int64_t* a, size_t ra, const int64_t* b, size_t rb, const int64_t* c, size_t rc,
                      int trans_a, int trans_b, float alpha, float beta, int dtype, int activation, int tf32,
                      dc_gemm_plan* out);

// One 2-D Conv call as cuDNN's legacy cudnnConvolutionForward (NCHW, or NHWC for a channels-last node,
// cross-correlation, symmetric pads, groups); the algorithm comes from dc_vendor_conv_algo.
typedef struct dc_conv_plan {
  int32_t n, c, h, w;                   // X
  int32_t k, kc, kh, kw;                // W: [k, kc = c / group, kh, kw]
  int32_t group, pad_h, pad_w, stride_h, stride_w, dil_h, dil_w;
  int32_t out_h, out_w;
  int32_t data_type;                    // cudnnDataType_t: 0 FLOAT, 2 HALF, 9 BFLOAT16; compute type FLOAT
  int32_t math_type;                    // cudnnMathType_t: 1 TENSOR_OP (16-bit, or float32 with TF32), 3 FMA
                                        // (float32 without TF32)
  int32_t channels_last;                // 1: X, Y CUDNN_TENSOR_NHWC and W NHWC (KRSC: [k, kh, kw, kc]); the
                                        // fields above keep their NCHW meaning
  dc_epilogue epilogue;                 // Conv's B: one value per output channel (per row for NCHW, per
                                        // column for NHWC)
} dc_conv_plan;

// Plan one Conv call: x [N, C, H, W], w [K, C/group, KH, KW], b (Conv's B, [K]) or NULL; strides[2],
// pads[4] (top, left, bottom, right), dilations[2], group; auto_pad 0 NOTSET, 1 SAME_UPPER, 2 SAME_LOWER,
// 3 VALID. channels_last 1 (C ABI 13; group 1 only): x [N, H, W, C], w [K, KH, KW, C], the output [N, OH, OW, K]
// (the epilogue's rows N*OH*OW, cols K, B per column). 1: planned; 0: no cuDNN form here (pads that stay
// asymmetric, not 2-D, sizes past int32; message); -1: invalid shapes or arguments (message).
int dc_conv_plan_make(const int64_t* x, size_t rx, const int64_t* w, size_t rw, const int64_t* b, size_t rb,
                      const int64_t* strides, const int64_t* pads, const int64_t* dilations, int64_t group,
                      int auto_pad, int dtype, int activation, int tf32, int channels_last, dc_conv_plan* out);

// Which cuBLAS the vendor path calls: path NULL = the libcublas this process already loaded (ONNX Runtime's
// CUDA EP), path given = that file (loaded now). 0 on success, -1 with a message. Thread-safe.
int dc_vendor_cublas_load(const char* path);

// The GEMM part of a plan: the handle bound to `stream` (cublasSetStream unless it already is), then
// cublasGemmEx or cublasGemmStridedBatchedEx with y = node A, x = node B, c = the node's output (device
// pointers). Loads cuBLAS (path NULL) on first use. 0 on success, -1 with a message naming the cuBLAS status.
int dc_vendor_gemm(const dc_gemm_plan* plan, const void* a, const void* b, void* c, void* cublas_handle,
                   void* stream);

// --- cuBLASLt: the GEMM and its epilogue as one call ------------------------------------------------------
// cublasLtMatmul computes D = epilogue(alpha op(A) op(B) + beta C + bias) (bias: one value per row of the
// column-major D, i.e. per column of the node's row-major output; the epilogue's activation comes after the bias
// and after beta C). With the plan's operands (A = x = the node's B, B = y = the node's A) and D = the output, it
// replaces cublasGemmEx + the PTX epilogue exactly when the epilogue is one of:
//   act(y + bias)              act none, relu or gelu_tanh (cuBLASLt's GELU is the tanh approximation, so the
//                              erf GELU ONNX's Gelu means is never fused); bias optional
//   act(y + bias + residual)   C = the residual (the output's shape and layout), beta 1: the residual inside the
//                              activation, so with an activation only for residual_first; with act none the
//                              residual's place does not matter
// and the plan is one call (batch 1), the bias (if any) is a vector along the output's last dim (bias_rows 1,
// bias_cs 1) with bias_scale 1, and k >= 1. Everything else (a batch, a broadcast or scaled bias, erf GELU,
// silu, relu6, the residual after an activation or multiplying it, no epilogue at all) keeps cublasGemmEx + PTX.
typedef struct dc_gemm_lt {
  int32_t epilogue;                     // cublasLtEpilogue_t: 1 DEFAULT, 2 RELU, 4 BIAS, 6 RELU_BIAS, 32 GELU,
                                        // 36 GELU_BIAS
  int32_t has_bias;                     // 1: CUBLASLT_MATMUL_DESC_BIAS_POINTER = the node's bias
  int32_t residual_c;                   // 1: C = the residual, beta 1; 0: beta 0 (C is D, not read)
  float beta;
} dc_gemm_lt;

// The cuBLASLt form of a planned call whose dc_epilogue has its residual flags set (as ort_ops.cc sets them):
// 1 with *out filled, 0 when the call keeps cublasGemmEx + the PTX epilogue (why in dc_last_error), -1 for a null
// argument. Pure: no library, no GPU.
int dc_gemm_lt_plan(const dc_gemm_plan* plan, dc_gemm_lt* out);

// Which cuBLASLt the fused path calls, as dc_vendor_cublas_load (libcublasLt.so.13, .12, .11: ORT's CUDA EP
// links it, and libcublas needs it, so it is in the process whenever cuBLAS is). 0, or -1 with a message.
int dc_vendor_cublaslt_load(const char* path);

// The process's cuBLASLt handle for the CUDA context `stream` belongs to (cuBLASLt's context is tied to the device
// current at cublasLtCreate): created on first use with that context current, kept for the process (one per
// context; the handle holds no stream or workspace, so the threads of a context share it). 0, or -1 with a message.
int dc_vendor_cublaslt_handle(void* stream, void** handle);

// The workspace ort_ops.cc gives each fused call (ORT's scratch allocator on the node's stream; the cuBLAS handle's
// own workspace is not exposed): the heuristic is asked for algorithms needing at most what the call gives.
#define DC_LT_WORKSPACE_BYTES (4ull << 20)

// One cublasLtMatmul for a plan and its dc_gemm_lt_plan form on `lt_handle` and `stream`: a = the node's A, b = its
// B, d = the output, bias (has_bias), residual (residual_c), workspace of workspace_bytes (NULL and 0: none); all
// device pointers. The algorithm is cublasLtMatmulAlgoGetHeuristic's first result for (handle, sizes, types,
// epilogue, the pointers' alignments, workspace_bytes), queried once and kept for the process (failures too).
// Loads cuBLASLt (path NULL) on first use. 0, or -1 with a message (nothing was written: run the unfused path).
int dc_vendor_gemm_lt(const dc_gemm_plan* plan, const dc_gemm_lt* lt, const void* a, const void* b, void* d,
                      const void* bias, const void* residual, void* workspace, uint64_t workspace_bytes,
                      void* lt_handle, void* stream);

// The GEMM part of a call with its fused form `lt` (NULL: none): the cuBLASLt call on `lt_handle` when lt is given,
// else, or when that fails (it writes nothing then), dc_vendor_gemm on `cublas_handle`. 1: fused, the epilogue is
// done; 0: cuBLAS ran and the epilogue is the caller's (dc_vendor_epilogue), with the reason the fused call was
// not taken in dc_last_error when lt was given (empty otherwise); -1: cuBLAS failed (message).
int dc_vendor_gemm_call(const dc_gemm_plan* plan, const dc_gemm_lt* lt, const void* a, const void* b, void* c,
                        const void* bias, const void* residual, void* cublas_handle, void* lt_handle,
                        void* workspace, uint64_t workspace_bytes, void* stream);

// Process-wide counts: fused calls run, heuristic queries made (one per distinct key), for tests and stats.
void dc_vendor_lt_stats(int64_t* calls, int64_t* queries);

// Which cuDNN the vendor path calls: as dc_vendor_cublas_load, for libcudnn.so.9 / .8.
int dc_vendor_cudnn_load(const char* path);

// The forward algorithm a plan runs with and the workspace it needs (cudnnConvolutionFwdAlgo_t: 0 is
// IMPLICIT_GEMM, which needs none).
typedef struct dc_conv_algo {
  int32_t algo;
  int32_t from_heuristic;               // 1: cuDNN's heuristic chose it; 0: the IMPLICIT_GEMM fallback
  int32_t math_type;                    // the math type to run it with (the heuristic result's; FMA stays FMA)
  int32_t reserved;
  uint64_t workspace_bytes;             // device memory to pass dc_vendor_conv (0: none)
} dc_conv_algo;

// The workspace cap: the first heuristic algorithm needing at most this much is taken. ORT's CUDA EP searches
// with up to all free device memory (cudnn_conv_use_max_workspace=1, its default) or 32 MiB (=0); the
// heuristic picks without timing, so it is held to a fixed budget between the two.
#define DC_CONV_WORKSPACE_CAP (256ull << 20)

// Per node: the algorithm chosen for each convolution shape, so cuDNN's heuristic runs once per shape.
typedef struct dc_conv_algo_cache dc_conv_algo_cache;
dc_conv_algo_cache* dc_conv_algo_cache_new(void);
void dc_conv_algo_cache_free(dc_conv_algo_cache* cache);
// How many heuristic queries the cache has made (one per distinct shape), for tests and stats.
int64_t dc_conv_algo_cache_queries(const dc_conv_algo_cache* cache);

// The algorithm for a plan (the descriptors as dc_vendor_conv makes them, on `cudnn_handle`; the query enqueues
// no work): cudnnGetConvolutionForwardAlgorithm_v7's first result with status SUCCESS whose workspace
// (cudnnGetConvolutionForwardWorkspaceSize) is at most `workspace_cap`. Cached in `cache` (NULL: none) per
// (shapes, dtype, math type), failures too. 1: chosen; 0: IMPLICIT_GEMM without workspace, because the query
// failed, this cuDNN lacks it, or no result fits (the reason in dc_last_error, set each time it is answered);
// -1: no cuDNN, no handle (message).
int dc_vendor_conv_algo(dc_conv_algo_cache* cache, const dc_conv_plan* plan, void* cudnn_handle,
                        uint64_t workspace_cap, dc_conv_algo* out);

// The convolution part of a plan on `cudnn_handle` bound to `stream` (cudnnSetStream unless it already is):
// descriptors, then cudnnConvolutionForward with alpha 1, beta 0, `algo` (NULL: IMPLICIT_GEMM) and its
// workspace (device memory of algo->workspace_bytes, 16-byte aligned; NULL when it needs none). x, w, y:
// device pointers. Loads cuDNN (path NULL) on first use. 0 on success, -1 with a message naming the cuDNN
// status.
int dc_vendor_conv(const dc_conv_plan* plan, const dc_conv_algo* algo, void* workspace, const void* x,
                   const void* w, void* y, void* cudnn_handle, void* stream);

// An epilogue on `stream` (the module loads once per CUDA context); nothing to do when it has no bias, no
// activation and no residual. residual: a tensor of the output's shape (device pointer) when has_residual.
// 0 on success, -1 with a message.
int dc_vendor_epilogue(const dc_epilogue* epilogue, void* c, const void* bias, const void* residual, void* stream);

// The epilogue kernel's PTX for dtype 0/1/2 (entry "dc_epilogue"), NULL for another dtype.
const char* dc_vendor_epilogue_ptx(int dtype);

// Loads (JIT-compiles) the epilogue module for `dtype` in the context of `stream` now, as the first
// dc_vendor_epilogue there would: a node that may take the vendor path does it at its first call, so that the
// first call of a shape routed there later compiles nothing. Nothing when it is loaded. 0, or -1 with a message.
int dc_vendor_epilogue_load(int dtype, void* stream);

#ifdef __cplusplus
}  // extern "C"

#include <string>

namespace dietcode {
// Launch `entry` of the PTX module `ptx` (text that lives for the process) on `stream` with a 2-D grid of 2-D
// blocks, loading the module once per CUDA context (launch.cc, which owns the driver). False with *error on failure.
bool LaunchPtx(const char* ptx, const char* entry, unsigned grid_x, unsigned grid_y, unsigned block_x,
               unsigned block_y, void** params, void* stream, std::string* error);
// Only the load LaunchPtx does on its first call in the stream's context (nothing when it is done).
bool LoadPtx(const char* ptx, const char* entry, void* stream, std::string* error);
// Calls fn(context) with the CUDA context `stream` belongs to current (pushed for the call when another one is);
// false with *error when the driver or the stream's context is not there, else fn's result.
bool InStreamContext(void* stream, bool (*fn)(void* context, void* arg, std::string* error), void* arg,
                     std::string* error);
}  // namespace dietcode
#endif

#endif  // DIETCODE_VENDOR_H_
