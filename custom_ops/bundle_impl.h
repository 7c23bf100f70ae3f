// Internal representation of a parsed kernel bundle, shared by the parser (core.cc) and the launcher
// (launch.cc). Everything here has been validated by the parser before any other code sees it.
#ifndef DIETCODE_BUNDLE_IMPL_H_
#define DIETCODE_BUNDLE_IMPL_H_

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "core.h"

namespace dietcode {

enum Param : uint8_t {
  kA, kB, kBias, kC, kM, kN, kK, kBatch, kStrideABatch, kStrideBBatch,
  kImgN, kImgH, kImgW, kOutH, kOutW, kResidual,
  kQ, kKt, kV, kMask, kOut, kSeqQ, kSeqK, kHeads, kStrideMaskB, kStrideMaskH, kStrideMaskQ, kStrideMaskK,
  kWorkspace, kCounters,
  kParamCount
};

// The ABI parameter names in enum order (docs/abi.md); dietcode_ort/bundle.py PARAM_NAMES must match
// (tests/test_abi_table.py checks it through dc_abi_param_name).
inline constexpr const char* kParamNames[kParamCount] = {
    "a", "b", "bias", "c", "M", "N", "K", "batch", "stride_a_batch", "stride_b_batch",
    "img_n", "img_h", "img_w", "out_h", "out_w", "residual",
    "q", "k", "v", "mask", "out", "seq_q", "seq_k", "heads", "stride_mask_b", "stride_mask_h", "stride_mask_q",
    "stride_mask_k", "workspace", "counters"};

// Whether param p is a device pointer (the rest are int32 scalars). kResidual (15), the attention params
// (16..27), the split-K workspace (28) and counters (29) came after out_w, so the indices older bundles store
// keep their meaning.
inline constexpr bool IsPointerParam(uint32_t p) {
  return p <= kC || p == kResidual || (p >= kQ && p <= kOut) || p == kWorkspace || p == kCounters;
}
inline constexpr bool IsAttentionParam(uint32_t p) { return p >= kQ && p <= kStrideMaskK; }

// The value of pointer param p in a launch's arguments (0 for a scalar param, and for the split-K counters,
// which the launcher gives: launch.cc SplitKCounters).
inline uint64_t ArgPointer(const dc_launch_args& a, uint32_t p) {
  switch (p) {
    case kA: return a.a;
    case kB: return a.b;
    case kBias: return a.bias;
    case kC: return a.c;
    case kResidual: return a.residual;
    case kQ: return a.q;
    case kKt: return a.k;
    case kV: return a.v;
    case kMask: return a.mask;
    case kOut: return a.out;
    case kWorkspace: return a.workspace;
    default: return 0;
  }
}

// The value of int32 param p in a launch's arguments (0 for a pointer param).
inline int32_t ArgInt(const dc_launch_args& a, uint32_t p) {
  switch (p) {
    case kM: return a.M;
    case kN: return a.N;
    case kK: return a.K;
    case kBatch: return a.batch;
    case kStrideABatch: return a.stride_a_batch;
    case kStrideBBatch: return a.stride_b_batch;
    case kImgN: return a.img_n;
    case kImgH: return a.img_h;
    case kImgW: return a.img_w;
    case kOutH: return a.out_h;
    case kOutW: return a.out_w;
    case kSeqQ: return a.seq_q;
    case kSeqK: return a.seq_k;
    case kHeads: return a.heads;
    case kStrideMaskB: return a.stride_mask_b;
    case kStrideMaskH: return a.stride_mask_h;
    case kStrideMaskQ: return a.stride_mask_q;
    case kStrideMaskK: return a.stride_mask_k;
    default: return 0;
  }
}

enum KernelKind : uint8_t { kTriton = 0, kVendor = 1 };

// An attention kernel's operand layouts (tuner.attention.LAYOUT_BITS, docs/abi.md "attention layouts"): a set
// bit reads (writes) that operand as [batch, seq, heads, d]; clear, the contiguous [z, seq, d] ([z, d, seq_k]
// for Kt). kLayoutPacked (with Q, K and V): the three are parts 0, 1, 2 of one packed projection [batch, seq,
// 3 * heads * d] that the node takes as each of its first three inputs. kLayoutMax: the highest valid value.
enum Layout : uint8_t { kLayoutQ = 1, kLayoutK = 2, kLayoutV = 4, kLayoutOut = 8, kLayoutPacked = 16 };
constexpr int kLayoutMax = 31, kLayoutPackedQkv = kLayoutQ | kLayoutK | kLayoutV | kLayoutPacked;
// Whether `layout` is a valid bit set: within 0..31, packed only with Q, K and V.
inline bool LayoutValid(int layout) {
  return layout >= 0 && layout <= kLayoutMax && (!(layout & kLayoutPacked) || (layout & kLayoutPackedQkv) == kLayoutPackedQkv);
}
inline std::string LayoutText(int layout) {
  return std::string("q=") + (layout & kLayoutQ ? "BSHD" : "BHSD") + ",k=" + (layout & kLayoutK ? "BSHD" : "BHDS") +
         ",v=" + (layout & kLayoutV ? "BSHD" : "BHSD") + ",out=" + (layout & kLayoutOut ? "BSHD" : "BHSD") +
         (layout & kLayoutPacked ? ",packed" : "");
}

enum View : int { kViewGemm = 0, kViewBmm = 1, kViewConv = 2, kViewAttention = 3 };

// What made an image (a cubin or the PTX) and the oldest CUDA driver that loads it (docs/bundle.md, format
// 4): Triton and ptxas versions, the PTX ISA as major*10+minor, the driver as cuDriverGetVersion reports it
// (13000 = CUDA 13.0). Empty / 0: not recorded, so not checked.
struct Toolchain {
  std::string triton, ptxas;
  uint32_t ptx_isa = 0, min_driver = 0;
  bool empty() const { return triton.empty() && ptxas.empty() && ptx_isa == 0 && min_driver == 0; }
};

struct Image {
  uint32_t cc = 0;        // compute capability as major*10+minor
  bool specific = false;  // the 'a' suffix: runs on exactly this cc
  uint32_t shared = 0;    // dynamic shared memory bytes a launch of this cubin asks for
  // Global scratch per program (Triton's device-side TMA descriptors): bytes and alignment; 0 / 1 for none.
  uint32_t scratch_size = 0, scratch_align = 1;
  Toolchain toolchain;
  std::string bytes;
};

struct Kernel {
  KernelKind kind = kTriton;
  std::string name;
  uint32_t num_warps = 4, block_m = 1, block_n = 1, split_k = 1;
  uint32_t shared = 0;  // dynamic shared memory bytes of the PTX launch (the arch it was compiled for)
  bool causal = false;  // attention kernels only: compiled in causal mode (flags bit 1)
  bool residual_first = false;  // kernels taking the residual: added before the activation (flags bit 0)
  bool residual_mul = false;  // ... or multiplied after it (the record's epilogue flags bit 0)
  // attention kernels only: HEAD_DIM (1..256; 0 for other kernels), and MASK_ROWS (a mask varying along the
  // queries; only with the mask) and NAN_TO_ZERO (epilogue flags bits 1, 2)
  uint32_t head_dim = 0;
  bool mask_rows = false, nan_to_zero = false;
  bool grouped = false;  // conv kernels: compiled for a grouped conv (the epilogue flags' bit 3)
  bool channels_last = false;  // conv kernels: compiled for NHWC tensors (the epilogue flags' bit 4, format 11)
  bool tf32 = false;  // float32 kernels only: dots in TF32 on the tensor cores (flags bit 2)
  uint8_t layout = 0;   // attention kernels only: operand layouts, kLayout* bits (flags bits 3..6)
  uint8_t persistent = 0;  // gemm / bmm kernels: programs per SM of a persistent kernel, 0 for one per tile
  uint32_t div16 = 0;  // bit p set: param p (absolute index) was compiled as 16-byte aligned (pointers) / a
                       // multiple of 16 (ints); the record's u16 counts from kQ for an attention kernel
  // What a compiled kernel was built for (its constexprs): element type (0 f32, 1 f16, 2 bf16), activation
  // (0 none, 1 relu, 2 gelu, 3 gelu_tanh, 4 silu, 5 relu6), transposed B, and for conv kernels the layer
  // geometry: channels, KH, KW, stride h/w, pad top/left, dilation h/w (all 0 for other kernels and for vendor
  // kernels).
  uint8_t dtype = 0, activation = 0, trans_b = 0;
  uint32_t conv[9] = {};
  float alpha = 1.0f;  // the scale baked in: ALPHA of the epilogue, SCALE of attention (1 for conv and vendor kernels)
  std::vector<uint8_t> params;
  std::vector<Image> images;
  std::string ptx;
  Toolchain ptx_toolchain;
  uint32_t ptx_scratch_size = 0, ptx_scratch_align = 1;  // the PTX's global scratch per program (as Image's)
};

struct Feature {
  std::string name;
  std::vector<std::pair<uint32_t, int32_t>> terms;  // (input index, dim index; negative counts from the end)
};

struct Tree {
  std::vector<int32_t> feature, left, right, leaf;
  std::vector<int64_t> threshold;
};

// Loaded CUDA function of one kernel in one context (opaque driver handles kept as void*).
struct LoadedKernel {
  void* module = nullptr;
  void* function = nullptr;
  uint32_t shared = 0;  // the loaded image's dynamic shared memory bytes
  int image_index = -1;  // which image was loaded (-1: the PTX): its global scratch (ImageScratch)
};

// The operand view of a kernel, from its ABI params (the one place this rule lives; see core.h).
View KernelView(const Kernel& kernel);

// Which image a kernel loads on a device: index into images, or -1 for PTX; returns false with a message.
// With driver_version > 0 (cuDriverGetVersion's value), an image whose recorded minimum driver is newer is
// passed over for the next candidate; when every candidate needs a newer driver the message says so.
bool PickImage(const Kernel& kernel, int major, int minor, int* image_index, std::string* error,
               int driver_version = 0);

// The dynamic shared memory bytes a launch of image `image_index` (-1: the PTX) asks for.
inline uint32_t ImageShared(const Kernel& kernel, int image_index) {
  return image_index >= 0 ? kernel.images[image_index].shared : kernel.shared;
}

// The global scratch of image `image_index` (-1: the PTX): bytes per program and alignment.
inline std::pair<uint32_t, uint32_t> ImageScratch(const Kernel& kernel, int image_index) {
  return image_index >= 0 ? std::make_pair(kernel.images[image_index].scratch_size, kernel.images[image_index].scratch_align)
                          : std::make_pair(kernel.ptx_scratch_size, kernel.ptx_scratch_align);
}

// The most global scratch any of the kernel's images asks for (bytes per program, alignment): the workspace
// holds that much whichever image the device loads.
std::pair<uint32_t, uint32_t> KernelScratch(const Kernel& kernel);

}  // namespace dietcode

struct dc_bundle {
  std::vector<dietcode::Feature> features;
  std::vector<dietcode::Kernel> kernels;
  dietcode::Tree tree;

  // Module cache: (context, kernel id) -> loaded function; the contexts the bundle's cubins were loaded in
  // eagerly (at its first launch there, launch.cc LoadCubins) and the load errors of kernels that failed then,
  // each reported at that kernel's next launch. Guarded by mutex.
  std::mutex mutex;
  std::map<std::pair<void*, int32_t>, dietcode::LoadedKernel> loaded;
  std::set<void*> eager_loaded;
  std::map<std::pair<void*, int32_t>, std::string> load_errors;
  // Split-K counters kept per (context, stream) (launch.cc SplitKCounters): the device address and how many
  // int32 counters it holds, the smaller ones it replaced (launches still queued may use them), all freed
  // with the bundle, and whether an allocation was refused (the stream then keeps to the workspace's counter
  // room). Guarded by mutex.
  struct Counters {
    uint64_t address = 0, count = 0;
    std::vector<uint64_t> retired;
    bool refused = false;
  };
  std::map<std::pair<void*, void*>, Counters> counters;

  ~dc_bundle();
};

namespace dietcode {

// Thread-local error message used by the C ABI.
void SetError(const std::string& message);

// Kernel k of bundle b (the C ABI's kernel ids); nullptr, with the error "<nulls>kernel id k out of range" set,
// when b is null or has no kernel k, or when `given` is false (another argument the caller needs is null):
// `nulls` names the null arguments a caller refuses ("null bundle or ", "null bundle / arguments or ").
inline const Kernel* KernelAt(const dc_bundle* b, int32_t k, const char* nulls = "", bool given = true) {
  if (b == nullptr || !given || k < 0 || static_cast<size_t>(k) >= b->kernels.size()) {
    SetError(nulls + ("kernel id " + std::to_string(k)) + " out of range");
    return nullptr;
  }
  return &b->kernels[k];
}

// Evaluate the tree; the bundle is validated so this cannot index out of range.
int32_t Evaluate(const dc_bundle& bundle, const int64_t* features);

// Whether compiled kernel k can run on a device of compute capability major.minor whose opt-in shared
// memory per block is smem_optin bytes: an image for the device (PickImage) whose shared memory fits.
// The vendor kind fits every device. False with *why naming the kernel and the reason.
// With driver_version > 0, also an image that driver loads (PickImage).
bool FitsDevice(const Kernel& kernel, int major, int minor, int64_t smem_optin, std::string* why,
                int driver_version = 0);

// Why a call does not fit a compiled kernel (dc_kernel_fit's codes; kFitNames in core.cc names them).
enum Fit : int {
  kFits = 0, kFitEmpty, kFitZeroK, kFitBatch, kFitGrid, kFitInt32, kFitDiv16, kFitNegative, kFitWorkspace, kFitHeadDim,
  kFitCount
};

// The workspace bytes of one call (dc_kernel_workspace_bytes): the split-K partials and counters (SplitKBytes),
// then, for a kernel whose images ask for global scratch, room to align it (scratch align - 16) and grid programs
// x scratch bytes (KernelScratch); 0 when neither; false with *why when the size overflows int64.
bool WorkspaceBytes(const Kernel& kernel, const dc_launch_args& args, int64_t* bytes, std::string* why);
// The split-K part alone (0 without split-K); the global scratch starts at the workspace plus this, aligned up.
bool SplitKBytes(const Kernel& kernel, const dc_launch_args& args, int64_t* bytes, std::string* why);
// The global-scratch kernel parameter of a launch of image `image_index` (-1: the PTX) with args: the first
// multiple of the image's scratch alignment at or past args.workspace + the split-K part, 0 for an image with no
// scratch; false with *why when the split-K part overflows.
bool ScratchPointer(const Kernel& kernel, int image_index, const dc_launch_args& args, uint64_t* pointer,
                    std::string* why);
inline constexpr int64_t kWorkspaceAlign = 16;
// The launch grid of one call that fits (CallFit): the ABI's grid rule (dc_kernel_grid), a persistent kernel's
// from args.sm_count (0: one program per tile).
void LaunchGrid(const Kernel& kernel, const dc_launch_args& args, uint32_t grid[3]);

// Whether one call fits compiled kernel k: sizes the launch can express (no empty output, K > 0, batch
// within grid z, tiles within grid x, every operand's element offsets within int32 as the templates compute
// them) and the divisibility assumptions it was compiled with. kFits, or the first reason it does not with
// *why naming it. A kernel run against an unmet one reads or writes wrongly; the vendor kind fits any call.
Fit CallFit(const Kernel& kernel, const dc_launch_args& args, std::string* why);
inline bool MeetsAssumptions(const Kernel& kernel, const dc_launch_args& args, std::string* why) {
  return CallFit(kernel, args, why) == kFits;
}

}  // namespace dietcode

#endif  // DIETCODE_BUNDLE_IMPL_H_
