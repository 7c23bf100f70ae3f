// The dietcode runtime core: kernel bundle parsing, dispatch and CUDA launch, behind a C ABI.
//
// No ONNX Runtime types appear here, so the core can be driven from Python (ctypes) and from fuzzers
// without a session. Functions that can fail return NULL / a negative value and leave a message for
// dc_last_error() (per thread). The bundle layout is documented in docs/bundle.md.
#ifndef DIETCODE_CORE_H_
#define DIETCODE_CORE_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define DC_ABI_VERSION 14  // 3: the device fit takes the driver version; 4: the residual pointer; 5: the attention params and view; 6: kernel alpha; 7: the split-K workspace, the kernel causal and tf32 flags and the images' global scratch (dc_bundle_image_scratch); 8: persistent kernels (dc_launch_args.sm_count, dc_kernel_grid, dc_bundle_kernel_persistent, dc_cuda_sm_count), the packed QKV layout (layout bit 16); 9: the residual before the activation (dc_bundle_kernel_residual_first, dc_epilogue.residual_first in vendor.h), conv kernels taking the residual; 10: activations 3 gelu_tanh, 4 silu, 5 relu6 (dc_bundle_check_node, the vendor plans, dc_epilogue), the residual multiplied after the activation (dc_bundle_kernel_residual_mul, dc_epilogue.residual_mul), attention kernels' HEAD_DIM, MASK_ROWS and NAN_TO_ZERO checked against the node (dc_bundle_check_attention, formerly dc_bundle_check_layout; dc_bundle_kernel_attention) and per launch (dc_launch_args.head_dim, last; dc_kernel_fit code 9); 11: grouped conv kernels (dc_bundle_kernel_grouped; dc_abi_view's conv view takes group > 1 as batch = group); 12: the vendor GEMM's cuBLASLt path (dc_gemm_lt_plan, dc_vendor_gemm_lt, dc_vendor_gemm_call in vendor.h); 13: channels-last (NHWC) conv kernels (bundle format 11, dc_bundle_kernel_channels_last, dc_bundle_check_node's channels_last, dc_abi_view's 10th conv int, dc_conv_plan_make's channels_last in vendor.h); 14: split-K kernels take the counters (param 29, bundle format 12), which dc_launch_fit keeps per (context, stream) instead of zeroing them in the workspace per call

typedef struct dc_bundle dc_bundle;

// Arguments of one launch, following the kernel ABI: raw device pointers and int32 scalars. Fields the
// kernel does not take are ignored. c_bytes is the output's size in bytes (the Attention path zeroes an output
// with no keys). residual: a second tensor of the output's shape, added after the activation, or before it by a
// residual_first kernel (dc_bundle_kernel_residual_first), or multiplying the activation's result in a residual_mul kernel (dc_bundle_kernel_residual_mul) (kernels of op types naming a Residual or ending in Mul). workspace: device memory of workspace_bytes bytes, 16-byte aligned, for split-K kernels
// (dc_kernel_workspace_bytes says how much a call needs; dc_launch_fit passes it, and the split-K counters from
// memory it keeps per (context, stream): docs/abi.md, "The split-K counters").
// sm_count: the multiprocessor count of the device the call runs on, which sizes a persistent kernel's grid
// (dc_kernel_grid) and so its global scratch; 0: unknown, dc_launch_fit asks the stream's device
// (dc_cuda_sm_count) and the pure functions (dc_kernel_grid, dc_kernel_workspace_bytes) assume one program per
// tile, the most a persistent grid launches, so a workspace sized with 0 is large enough for any device.
typedef struct dc_launch_args {
  uint64_t a, b, bias, c, residual;
  uint64_t c_bytes;
  int32_t M, N, K, batch, stride_a_batch, stride_b_batch;
  int32_t img_n, img_h, img_w, out_h, out_w;
  // attention (docs/abi.md): Q, Kt, V, the additive mask and the output; z = batch heads of seq_q x seq_k
  uint64_t q, k, v, mask, out;
  int32_t seq_q, seq_k, heads, stride_mask_b, stride_mask_h, stride_mask_q, stride_mask_k;
  uint64_t workspace, workspace_bytes;
  int32_t sm_count;
  // attention: the call's head dim d (the view functions set it), which must be the kernel's HEAD_DIM
  int32_t head_dim;
} dc_launch_args;

int dc_abi_version(void);

// The name of ABI parameter `index` in the bundle's param enum ("a", "b", ..., "out_w"), NULL past the end.
const char* dc_abi_param_name(int index);
const char* dc_last_error(void);

// Parse and validate a bundle; the bytes are copied. NULL on error (see dc_last_error).
dc_bundle* dc_bundle_parse(const uint8_t* data, size_t size);
void dc_bundle_free(dc_bundle* bundle);

// The parsed bundle for these bytes, shared: every caller that passes the same bytes (compared in full, not
// by hash) gets the same handle, parsed once, so the nodes of a workload share one parse and one CUDA
// module cache. Reference counted: release each handle with dc_bundle_release (never dc_bundle_free).
// Thread-safe. NULL on error (see dc_last_error).
dc_bundle* dc_bundle_acquire(const uint8_t* data, size_t size);
void dc_bundle_release(dc_bundle* bundle);

// The shared cache: distinct bundles alive now, and parses done by dc_bundle_acquire since the library
// loaded (a cache hit does not parse). Either pointer may be NULL.
void dc_bundle_cache_stats(int64_t* live, int64_t* parses);

// Counts: features, kernels, tree nodes. 0 on success.
int dc_bundle_info(const dc_bundle* bundle, int32_t* n_features, int32_t* n_kernels, int32_t* n_nodes);

// The kernel id the tree picks for a feature vector of n values (must equal the feature count); -1 on error.
int32_t dc_bundle_select(const dc_bundle* bundle, const int64_t* features, size_t n);

// Compute the feature vector from input shapes (dims[i] has ranks[i] values; NULL/0 for an absent input)
// into features_out (room for the feature count). 0 on success, -1 if a feature reads a missing dim.
int dc_bundle_features(const dc_bundle* bundle, const int64_t* const* dims, const size_t* ranks,
                       size_t n_inputs, int64_t* features_out);

// 1 if kernel k is the "vendor" kind (run ONNX Runtime's kernel), 0 if a compiled kernel, -1 on error.
int dc_bundle_kernel_is_vendor(const dc_bundle* bundle, int32_t k);

// What compiled kernel k was built for: dtype (0 float32, 1 float16, 2 bfloat16), activation (0 none,
// 1 relu, 2 gelu, 3 gelu_tanh, 4 silu, 5 relu6), trans_b, and for conv kernels conv9 = channels, KH, KW, stride h, stride w, pad top,
// pad left, dilation h, dilation w (zeros otherwise). Any pointer may be NULL. 0 on success.
int dc_bundle_kernel_built_for(const dc_bundle* bundle, int32_t k, int32_t* dtype, int32_t* activation,
                               int32_t* trans_b, int32_t* conv9);

// Whether every compiled kernel of the bundle was built for this node: dtype (as above), base op (0 MatMul,
// 1 Gemm, 2 Conv, 3 Attention: the attention view, activation 0, trans_b 0), activation, trans_b, and for Conv conv9 = strides h, w, pads top, left, dilations h, w,
// kernel_shape h, w (0 where the node does not give it), group (C ABI 11: a node with group > 1 takes only
// kernels compiled for a grouped conv), explicit_pads (0 when the node uses auto_pad) and channels_last (the
// node's attribute, 0 or 1, 1 on Conv only; C ABI 13: every compiled conv kernel's flag must equal it).
// 0 if they all fit, -1 with a message naming the first that does not.
int dc_bundle_check_node(const dc_bundle* bundle, int dtype, int base, int activation, int trans_b,
                         const int64_t* conv9, int explicit_pads, int channels_last);

// Whether every compiled kernel's baked-in alpha equals the node's scale (exact float32 equality; vendor
// kernels carry none). 0 if they do, -1 with a message naming the first kernel and both values.
int dc_bundle_check_scale(const dc_bundle* bundle, float scale);

// Kernel k's baked-in alpha (1 for vendor kernels). 0 on success, -1 for an out-of-range kernel id.
int dc_bundle_kernel_alpha(const dc_bundle* bundle, int32_t k, float* alpha);

// Whether kernel k is an attention kernel compiled in causal mode (bundle flags bit 1): 1 or 0; -1 for an
// out-of-range kernel id.
int dc_bundle_kernel_causal(const dc_bundle* bundle, int32_t k);

// Whether kernel k is a float32 kernel compiled with TF32 dots (bundle flags bit 2; clear: exact float32
// products): 1 or 0; -1 for an out-of-range kernel id.
int dc_bundle_kernel_tf32(const dc_bundle* bundle, int32_t k);

// Whether kernel k adds its residual before the activation (bundle flags bit 0, set only on kernels taking the
// residual and an activation: act(alpha * acc + bias + residual), op types like ConvBiasResidualRelu; clear:
// act(...) + residual): 1 or 0; -1 for an out-of-range kernel id.
int dc_bundle_kernel_residual_first(const dc_bundle* bundle, int32_t k);

// Whether kernel k multiplies the activation's result by its residual (the kernel record's epilogue flags bit 0,
// set only on kernels taking the residual and an activation, never with residual_first: act(alpha * acc + bias) *
// residual, op types like MatMulSiluMul, LLaMA's SwiGLU gate): 1 or 0; -1 for an out-of-range kernel id.
int dc_bundle_kernel_residual_mul(const dc_bundle* bundle, int32_t k);

// Whether conv kernel k was compiled for a grouped conv (the kernel record's epilogue flags bit 3): it computes
// group program_id(2) of batch = group (dc_abi_view's conv view), so a node with group > 1 runs only such
// kernels; 1 or 0; -1 for an out-of-range kernel id.
int dc_bundle_kernel_grouped(const dc_bundle* bundle, int32_t k);

// Whether conv kernel k was compiled for channels-last tensors (the kernel record's epilogue flags bit 4, format
// 11; never with grouped): X [N, H, W, C], W [OC, KH, KW, C], Y and the residual [N, OH, OW, OC]. A node runs it
// only with channels_last=1 (dc_bundle_check_node); 1 or 0; -1 for an out-of-range kernel id.
int dc_bundle_kernel_channels_last(const dc_bundle* bundle, int32_t k);

// Kernel k's programs per SM (the kernel record's persistent byte, docs/abi.md): n > 0 for a persistent gemm or
// bmm kernel launched as min(tiles x batch, SMs x n) programs that loop over the tiles, 0 for one program per
// tile; -1 for an out-of-range kernel id.
int dc_bundle_kernel_persistent(const dc_bundle* bundle, int32_t k);

// The launch grid of one call of compiled kernel k with args (the ABI's grid rule, docs/abi.md): (cdiv(M,
// BLOCK_M) x cdiv(N, BLOCK_N), SPLIT_K, batch) for gemm, bmm and conv kernels, (cdiv(seq_q, BLOCK_M), 1, batch)
// for attention, and for a persistent kernel (min(tiles x batch, args->sm_count x n), 1, 1) with n its programs
// per SM (args->sm_count 0: one program per tile). 0 on success; -1 with a message for a bad id, the vendor kind
// or a call that does not fit (dc_kernel_fit).
int dc_kernel_grid(const dc_bundle* bundle, int32_t k, const dc_launch_args* args, uint32_t* grid3);

// Kernel k's operand layouts (bundle flags bits 3..7: bit 0 Q, 1 K, 2 V, 3 out read/written as [batch, seq,
// heads, d], 4 Q, K and V packed in one projection; docs/abi.md "attention layouts"): 0..31; -1 for an
// out-of-range kernel id.
int dc_bundle_kernel_layout(const dc_bundle* bundle, int32_t k);

// Whether every compiled kernel was compiled for an Attention node's attributes: its operand layouts `layout`
// (the `layout` attribute), its `head_dim` (when > 0; 0: not checked), and its `mask_rows` (for kernels taking
// the mask) and `nan_to_zero` (0 or 1). 0 if so, -1 with a message naming the first kernel that differs and
// both values.
int dc_bundle_check_attention(const dc_bundle* bundle, int layout, int64_t head_dim, int mask_rows, int nan_to_zero);

// Kernel k's attention facts (the kernel record's head_dim and epilogue flags bits 1, 2): its HEAD_DIM (1..256,
// the length of the rows it reads and writes; 0 for other kernels), MASK_ROWS (1: the mask varies along the
// queries; only on kernels taking the mask) and NAN_TO_ZERO (0 or 1). 0 on success; -1 with a message for a
// bad id or a null pointer.
int dc_bundle_kernel_attention(const dc_bundle* bundle, int32_t k, int32_t* head_dim, int32_t* mask_rows,
                               int32_t* nan_to_zero);

// The highest input index any feature reads (-1 when there are no features): the node must have more inputs.
int dc_bundle_max_feature_input(const dc_bundle* bundle);

// 1 if kernel k takes the ABI parameter `name` (e.g. "batch": the bmm view), 0 if not, -1 on error.
int dc_bundle_kernel_takes_param(const dc_bundle* bundle, int32_t k, const char* name);

// The view a kernel takes of its node's operands (abi.md): 0 gemm (A flattened to [M, K]), 1 bmm (A [batch,
// M, K] with batch strides, the batch on grid z), 2 conv (NCHW input gathered as [N*OH*OW, C*KH*KW]). It
// follows from the kernel's ABI params: bmm kernels take stride_a_batch, conv kernels take img_h. Vendor
// kernels report 0 (ORT's own kernel takes the node as it is). -1 for an out-of-range kernel id.
int dc_bundle_kernel_view(const dc_bundle* bundle, int32_t k);

// Which image kernel k would load on a device of compute capability major.minor: 0 = cubin, 1 = PTX,
// -1 = none (message in dc_last_error). desc receives e.g. "cubin sm_90a" or "ptx sm_80".
int dc_bundle_pick_image(const dc_bundle* bundle, int32_t k, int major, int minor, char* desc, size_t desc_size);

// The dynamic shared memory bytes a launch of kernel k asks for on a device of compute capability
// major.minor: those of the image dc_bundle_pick_image picks (each cubin and the PTX record their own).
// -1 when there is none (message in dc_last_error).
int64_t dc_bundle_image_shared(const dc_bundle* bundle, int32_t k, int major, int minor);

// Whether one call with `args` fits compiled kernel k (the one place this is decided; dc_launch refuses a
// launch that does not): a non-empty output (M, N > 0; an empty one needs no launch), K > 0, batch <= 65535
// (grid z), at most 2^31-1 tiles (grid x), M and N rounded up to whole tiles below 2^31 (the templates'
// row and column indices are int32), for conv kernels element offsets below 2^31 where the template
// computes them in int32 (W = K*N, X per image = channels*img_h*img_w, Y per image = N*out_h*out_w; gemm and
// bmm offsets are int64), and the divisibility
// assumptions it was compiled with (its div16 mask: pointers 16-byte aligned, int params multiples of 16).
// The vendor kind fits every call. 1 yes, 0 no (reason in dc_last_error), -1 on error. A caller that gets 0
// runs another kernel (ORT's own) for that call.
int dc_kernel_accepts(const dc_bundle* bundle, int32_t k, const dc_launch_args* args);

// The same decision as a code: 0 fits, else the first reason it does not (message in dc_last_error):
// 1 empty output, 2 K is 0, 3 batch above grid z, 4 tiles above grid x, 5 int32 offsets, 6 div16
// assumption, 7 negative size, 8 workspace size (a split-K call whose workspace would not fit int64 bytes),
// 9 head dim (an attention call whose args->head_dim is not the kernel's HEAD_DIM: its rows are that long).
// -1 on error. dc_fit_name names a code (NULL past the end).
int dc_kernel_fit(const dc_bundle* bundle, int32_t k, const dc_launch_args* args);
const char* dc_fit_name(int fit);

// The bytes of workspace one call of kernel k with `args` needs (docs/abi.md, "The split-K workspace"): 0 for a
// kernel without split-K; for one with SPLIT_K > 1, an fp32 partial tile per (batch, tile, split) and an int32
// counter per (batch, tile): tiles*batch*(SPLIT_K*BLOCK_M*BLOCK_N*4 + 4), rounded up to 16. -1 with a message
// for a bad id or when the size overflows int64 (dc_kernel_fit's code 8 for the same call).
int64_t dc_kernel_workspace_bytes(const dc_bundle* bundle, int32_t k, const dc_launch_args* args);

// The ABI view of one node call: the M, N, K, batch, batch strides and conv dims the CUDA path passes a
// compiled kernel for these input shapes (c: Gemm's C or NULL). op 0 = MatMul (batched != 0 selects the
// bmm view), 1 = Gemm (ints: trans_a, trans_b; floats: alpha, beta), 2 = Conv (ints: strides[2], pads[4],
// dilations[2], group). 1: `out` holds the view; 0: the ABI cannot express the call (ORT's kernel runs);
// -1: the shapes are invalid (message in dc_last_error). Pointers in `out` are left 0.
// The attention view (abi.md) of an ai.dietcode::Attention call: seq_q, seq_k, heads, batch (= z, the batch
// times the heads) and the mask's strides for Q [..., T_q, d], Kt [..., d, T_k], V [..., T_k, d] of rank 2 to
// 4 (heads: the dim before T_q at rank 4, else 1) and the mask (NULL, rank 0: none). 1: `out` holds the view;
// 0: the ABI cannot express the call (a rank above 4, a size past int32); -1: the shapes are invalid (message
// in dc_last_error). Pointers in `out` are left 0.
int dc_attention_view(const int64_t* q, size_t rq, const int64_t* kt, size_t rk, const int64_t* v, size_t rv,
                      const int64_t* mask, size_t rm, int64_t head_dim, dc_launch_args* out);
// The same for a node with operand layouts `layout` (0..31, docs/abi.md "attention layouts"): the shapes are
// the node's inputs as given (Q [B, T_q, H, d] with bit 0, K [B, T_k, H, d] with bit 1, V [B, T_k, H, d] with
// bit 2; rank 4 whenever a bit is set; with bit 4, packed (bits 0..2 set too), Q, K and V are each the packed
// projection [B, T, 3 * H * d], one shape, its last dim a multiple of 3 * head_dim, head_dim > 0); the view's
// seq/heads/batch are those of the contiguous equivalent, and the kernel derives each operand's strides from
// them and its layout constexprs. `out_shape` (4 int64, may be NULL) receives the output's shape ([B, T_q, H,
// d] with bit 3) when the output has rank 4 and the shapes are valid (also when the call cannot be expressed:
// 0). dc_attention_view is this with layout 0.
int dc_attention_view_layout(const int64_t* q, size_t rq, const int64_t* kt, size_t rk, const int64_t* v,
                             size_t rv, const int64_t* mask, size_t rm, int64_t head_dim, int layout,
                             int64_t* out_shape, dc_launch_args* out);

int dc_abi_view(int op, const int64_t* a, size_t ra, const int64_t* b, size_t rb, const int64_t* c, size_t rc,
                const int64_t* ints, size_t n_ints, const float* floats, size_t n_floats, int batched,
                dc_launch_args* out);

// Whether compiled kernel k can run on a device of compute capability major.minor whose opt-in shared
// memory per block (CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN) is smem_optin bytes, under a CUDA
// driver of version driver_version (cuDriverGetVersion's value, e.g. 13000; 0 = not checked): it has an image
// for the device (dc_bundle_pick_image: a matching cubin or PTX the driver can JIT) whose recorded minimum
// driver is at most driver_version (else the next such image is taken), and that image's shared memory fits.
// A pure function of the bundle and the device facts (dc_cuda_device_limits, dc_cuda_driver_version on a GPU).
// The vendor kind fits. 1 yes, 0 no (reason in dc_last_error, e.g. "... needs driver >= 13.4, this driver
// is 13.0"), -1 on error (bad id or device facts).
int dc_kernel_fit_device(const dc_bundle* bundle, int32_t k, int major, int minor, int smem_optin, int driver_version);

// The same for every kernel: out_mask[k] = 1 if kernel k fits the device, 0 if not (n >= kernel count).
// Returns how many do not fit (the first one's reason in dc_last_error), -1 on error. A session marks the
// kernels that do not fit as vendor at creation: their calls run ORT's kernel.
int dc_bundle_fit_device(const dc_bundle* bundle, int major, int minor, int smem_optin, int driver_version,
                         uint8_t* out_mask, size_t n);

// The number of cubins kernel k carries (its PTX, if any, is image -1 below); -1 for a bad id.
int dc_bundle_image_count(const dc_bundle* bundle, int32_t k);

// The toolchain record of kernel k's image `image` (0.. cubin count-1 in bundle order, -1 the PTX): Triton
// and ptxas versions (NUL-terminated, truncated to the buffers; "" when not recorded), the PTX ISA as
// major*10+minor (94 = 9.4) and the minimum driver in cuDriverGetVersion's encoding (0: not recorded). Any
// pointer may be NULL. 0 on success, -1 for a bad id or an image the kernel does not have.
int dc_bundle_image_toolchain(const dc_bundle* bundle, int32_t k, int32_t image, char* triton, size_t triton_size,
                              char* ptxas, size_t ptxas_size, int32_t* ptx_isa, int32_t* min_driver);

// The global scratch per program of kernel k's image `image` (as above; -1 the PTX): bytes and alignment (0 and
// 1 for an image that needs none: Triton's device-side TMA descriptors ask for some). 0, or -1 for a bad id.
int dc_bundle_image_scratch(const dc_bundle* bundle, int32_t k, int32_t image, uint32_t* size, uint32_t* align);

// The global-scratch pointer dc_launch_fit passes to a launch of kernel k's image `image` (-1 the PTX) with args:
// the first multiple of the image's scratch alignment at or past args->workspace plus the split-K part of the
// workspace (dc_kernel_workspace_bytes leaves room for it); 0 for an image with no scratch. 0 on success, -1 for
// a bad id or image, or a split-K part past int64.
int dc_kernel_scratch_pointer(const dc_bundle* bundle, int32_t k, int32_t image, const dc_launch_args* args,
                              uint64_t* pointer);

// The multiprocessor count of the device of `stream`'s context (NULL: the current context), which sizes
// persistent kernels' grids: queried once per context (cuDeviceGetAttribute MULTIPROCESSOR_COUNT) and cached.
// 0 on success, -1 with a message (no driver, no context). Never aborts.
int dc_cuda_sm_count(void* stream, int* count);

// The CUDA driver's version (cuDriverGetVersion: 13000 = CUDA 13.0) into *version. 0 on success, -1 with a
// message when libcuda does not load. Never aborts.
int dc_cuda_driver_version(int* version);

// Device `device`'s compute capability and opt-in shared memory per block, for dc_bundle_fit_device.
// 0 on success, -1 with a message (no driver, no such device). Never aborts.
int dc_cuda_device_limits(int device, int* major, int* minor, int* smem_optin);

// Whether libcuda loads and device `device` answers: fills name, compute capability and driver version.
// 0 on success, -1 with a message otherwise (no driver, no device). Never aborts.
int dc_cuda_probe(int device, char* name, size_t name_size, int* major, int* minor, int* driver_version);

// Launch kernel k on `stream` (a CUstream; NULL is the legacy default stream) in the stream's context. The
// bundle's first launch in a context loads every kernel the device runs from a cubin there (docs/abi.md,
// "Launch"); a kernel run from PTX loads (JIT) at its own first launch in the context. For a split-K kernel, args->workspace must hold at least
// dc_kernel_workspace_bytes (16-byte aligned), and it must stay allocated until the launch is done (stream
// order); its counters come from memory the bundle keeps per (context, stream), zeroed on the stream once when
// allocated (the kernels leave them at zero), or when none can be allocated, from the workspace's counter room,
// zeroed on the stream first (cuMemsetD8Async). 0 on success.
int dc_launch(dc_bundle* bundle, int32_t k, const dc_launch_args* args, void* stream);

// dc_launch deciding the call's fit in the same step, so that a caller checks it once per call: 0 launched;
// a positive dc_kernel_fit code when the call does not fit kernel k (nothing launched, the reason in
// dc_last_error: the caller runs another kernel); -1 on error (bad arguments, a split-K call without its
// workspace, the vendor kind, the driver).
int dc_launch_fit(dc_bundle* bundle, int32_t k, const dc_launch_args* args, void* stream);

// Zero `bytes` bytes of device memory at `ptr` on `stream` (cuMemsetD8Async in the stream's context): an
// Attention call with no keys, whose output ONNX defines as zeros. 0 on success, -1 with a message.
int dc_zero_async(uint64_t ptr, uint64_t bytes, void* stream);

// Reading a bundle back (custom_ops/bundle_read.cc): every field of a parsed bundle, so that Python reads
// payloads through this parser instead of one of its own. Strings and bytes point into the bundle and live
// as long as it does. Out-of-range ids give NULL / -1 with a message.
typedef struct dc_kernel_meta {
  uint32_t num_warps, block_m, block_n, split_k;  // as the payload holds them (a vendor kernel's are unchecked)
  uint32_t shared;       // dynamic shared memory bytes of the PTX launch
  uint32_t div16;        // bit p: ABI param p assumed 16-byte aligned (pointers) / a multiple of 16 (ints)
  uint32_t n_params, n_images;
  uint8_t params[32];   // the kernel's ABI params in its order (dc_abi_param_name indices), n_params of them
} dc_kernel_meta;
const char* dc_bundle_feature_name(const dc_bundle* bundle, int32_t j);  // NUL-terminated UTF-8
// Feature j's terms as (inputs[t], dims[t]), at most `capacity` of them; returns the term count.
int dc_bundle_feature_terms(const dc_bundle* bundle, int32_t j, int32_t* inputs, int32_t* dims, size_t capacity);
// The tree's arrays (n must be the node count, dc_bundle_info's n_nodes). 0 on success.
int dc_bundle_tree(const dc_bundle* bundle, int32_t* feature, int64_t* threshold, int32_t* left, int32_t* right,
                   int32_t* leaf, size_t n);
const char* dc_bundle_kernel_name(const dc_bundle* bundle, int32_t k);  // NUL-terminated UTF-8
int dc_bundle_kernel_meta(const dc_bundle* bundle, int32_t k, dc_kernel_meta* out);  // 0 on success
// Cubin i of kernel k (i < n_images): its compute capability, 'a' flag, shared memory bytes and size.
const uint8_t* dc_bundle_kernel_image(const dc_bundle* bundle, int32_t k, int32_t i, uint32_t* cc, int32_t* specific,
                                      uint32_t* shared, size_t* size);
const char* dc_bundle_kernel_ptx(const dc_bundle* bundle, int32_t k, size_t* size);  // "" when none

// Per-node counters (custom_ops/stats.cc), process-wide and thread-safe: the counter of a node name
// (created on first use, never freed; every node and session with that name shares it), counted per call.
typedef struct dc_node_counter dc_node_counter;
dc_node_counter* dc_node_counter_get(const char* node);
void dc_node_count_launch(dc_node_counter* counter);
void dc_node_count_fallback(dc_node_counter* counter, const char* reason);  // ORT's kernel ran; why

// Reading: how many node names have counters, and counter `index` (0 <= index < count): its node name and
// last fallback reason (truncated to the buffers), launches and fallbacks. Returns the name's full length,
// -1 for an index out of range. dc_node_stats_reset zeroes every counter and reason.
int64_t dc_node_stats_count(void);
int dc_node_stats_get(int64_t index, char* node, size_t node_size, int64_t* launches, int64_t* fallbacks,
                      char* reason, size_t reason_size);
void dc_node_stats_reset(void);

// The host cost of one CUDA node call's decision (custom_ops/bench.cc; benchmarks/host_overhead.py): runs
// what ComputeCuda runs before a launch (dc_bundle_features on the shapes as dc_bundle_features takes them,
// at most 3 inputs; dc_bundle_select; dc_bundle_kernel_is_vendor; dc_kernel_fit with `args` for a compiled
// kernel) n_iter times (> 0) in a C loop. Fills the kernel the tree picks, its fit code (0 for the vendor
// kind) and the mean nanoseconds per decision. 0 on success, -1 with a message (bad arguments, or any error
// those functions report).
int dc_bench_select(const dc_bundle* bundle, const int64_t* const* dims, const size_t* ranks, size_t n_inputs,
                    const dc_launch_args* args, int64_t n_iter, int32_t* kernel_out, int32_t* fit_out,
                    double* ns_per_call);

#ifdef __cplusplus
}  // extern "C"
#endif

#endif  // DIETCODE_CORE_H_
