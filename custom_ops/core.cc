// Kernel bundle parsing, validation and dispatch (docs/bundle.md). Mirrors dietcode_ort/bundle.py: every
// size, offset and index is checked before it is used, and a refusal names the field and the limit.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "bundle_impl.h"

namespace dietcode {
namespace {

constexpr char kMagic[8] = {'D', 'C', 'B', 'U', 'N', 'D', 'L', 'E'};
constexpr uint32_t kVersion = 13;  // 4: toolchain records, 5: alpha, 6: the split-K workspace, 7: persistent, the
                                   // packed QKV layout flag, 8: residual_first, conv kernels taking the residual,
                                   // 9: activations 3 gelu_tanh, 4 silu, 5 relu6, the kernel record's epilogue
                                   // flags byte (residual_mul, mask_rows, nan_to_zero) and head_dim (docs/bundle.md);
                                   // its bit 3 (grouped conv kernels) came later in format 9: a library older
                                   // than C ABI 11 refuses such a bundle at that flag; 10: an attention kernel's
                                   // div16 bit i names param kQ + i (its params all sit from kQ on); 11: the
                                   // epilogue flags' bit 4, channels-last (NHWC) conv kernels; 12: split-K
                                   // kernels take the counters (param 29), kept per stream by the launcher;
                                   // 13: the header's last u32 (reserved before) is the payload's CRC-32
constexpr uint32_t kHeaderSize = 32;
constexpr uint64_t kChecksumAt = 28;  // the header's CRC-32 field, read as 0 when the payload is summed
constexpr uint32_t kSectionEntrySize = 24;
constexpr uint32_t kSectionFeatures = 1, kSectionKernels = 2, kSectionTree = 3;
constexpr uint32_t kFlagResidualFirst = 1;  // the residual added before the activation (format 5: zero_output)
constexpr uint32_t kFlagCausal = 2;  // attention kernels compiled in causal mode
constexpr uint32_t kFlagTf32 = 4;  // float32 kernels compiled with TF32 dots
// bits 3..7: an attention kernel's operand layouts (Q, K, V, out as [batch, seq, heads, d]; bit 7: Q, K, V packed
// in one projection; docs/abi.md)
constexpr uint32_t kFlagLayoutShift = 3, kFlagLayoutMask = 0x1F << kFlagLayoutShift;
constexpr uint32_t kArchSpecific = 1;
constexpr uint8_t kEpilogueResidualMul = 1;  // the kernel record's epilogue flags: the residual multiplies (format 9)
constexpr uint8_t kEpilogueMaskRows = 2;  // attention: the mask varies along the queries (MASK_ROWS)
constexpr uint8_t kEpilogueNanToZero = 4;  // attention: a row with no finite score gives 0 (NAN_TO_ZERO)
constexpr uint8_t kEpilogueGrouped = 8;    // conv: compiled for a grouped conv, its group from the grid's z
constexpr uint8_t kEpilogueChannelsLast = 16;  // conv: compiled for NHWC X, OHWI W, NHWC Y (format 11; ungrouped)
constexpr uint32_t kMaxHeadDim = 256;  // an attention kernel's HEAD_DIM (tuner/attention.py MAX_HEAD_DIM)

// Limits shared with dietcode_ort/bundle.py (LIMITS).
constexpr uint32_t kMaxFeatures = 64, kMaxTerms = 8, kMaxInputs = 8, kMaxDim = 8, kMaxName = 256;
constexpr uint32_t kMaxKernels = 1024, kMaxParams = 32, kMaxImages = 16, kMaxNodes = 1u << 16;
constexpr uint64_t kMaxImageBytes = 64ull << 20, kMaxPtxBytes = 64ull << 20, kMaxTotal = 1ull << 30;
constexpr uint32_t kMaxBlock = 4096, kMaxSplitK = 1024, kMaxShared = 1u << 20;
constexpr uint8_t kMaxActivation = 5;  // 0 none, 1 relu, 2 gelu, 3 gelu_tanh, 4 silu, 5 relu6 (format 9)
constexpr uint32_t kMaxToolchainName = 64, kMaxPtxIsa = 999, kMaxDriver = 999999;
constexpr uint32_t kMaxScratch = 1u << 16, kMaxScratchAlign = 1024;  // global scratch per program
constexpr uint32_t kMaxPersistent = 8;  // programs per SM of a persistent kernel

const char* const kSectionNames[] = {"", "features", "kernels", "tree"};

thread_local std::string g_error;

struct ParseError {
  std::string message;
};

[[noreturn]] void Fail(const std::string& message) { throw ParseError{"invalid kernel bundle: " + message}; }

// A global scratch record (per program): align a power of two in 1..1024, size a multiple of it up to 64 KiB.
void CheckScratch(uint32_t size, uint32_t align, const std::string& where) {
  if (align == 0 || align > kMaxScratchAlign || (align & (align - 1)) != 0 || size > kMaxScratch || size % align != 0) {
    Fail(where + ": global scratch of " + std::to_string(size) + " bytes aligned to " + std::to_string(align) +
         " invalid (align a power of two up to 1024, size a multiple of it up to 65536)");
  }
}

// Python's strict UTF-8 rules: no overlong forms, no surrogates, nothing above U+10FFFF; plus no NUL.
bool ValidUtf8(const std::string& s) {
  size_t i = 0, n = s.size();
  while (i < n) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    if (c == 0) return false;
    if (c < 0x80) { ++i; continue; }
    int len;
    unsigned lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) len = 2;
    else if (c == 0xE0) { len = 3; lo = 0xA0; }
    else if (c == 0xED) { len = 3; hi = 0x9F; }
    else if (c >= 0xE1 && c <= 0xEF) len = 3;
    else if (c == 0xF0) { len = 4; lo = 0x90; }
    else if (c >= 0xF1 && c <= 0xF3) len = 4;
    else if (c == 0xF4) { len = 4; hi = 0x8F; }
    else return false;
    if (n - i < static_cast<size_t>(len)) return false;
    for (int j = 1; j < len; ++j) {
      unsigned char d = static_cast<unsigned char>(s[i + j]);
      unsigned l = j == 1 ? lo : 0x80, h = j == 1 ? hi : 0xBF;
      if (d < l || d > h) return false;
    }
    i += len;
  }
  return true;
}

// Bounds-checked little-endian cursor over [pos, end) of the payload.
class Reader {
 public:
  Reader(const uint8_t* data, uint64_t pos, uint64_t end, std::string what)
      : data_(data), pos_(pos), end_(end), what_(std::move(what)) {}

  const uint8_t* Take(uint64_t n, const char* field) {
    if (n > end_ - pos_) {
      Fail(what_ + ": " + field + " needs " + std::to_string(n) + " bytes, " + std::to_string(end_ - pos_) +
           " left");
    }
    const uint8_t* p = data_ + pos_;
    pos_ += n;
    return p;
  }
  template <typename T>
  T Get(const char* field) {
    T v;
    std::memcpy(&v, Take(sizeof(T), field), sizeof(T));  // the format is little-endian, as is every target
    return v;
  }
  uint32_t Count(const char* field, uint32_t limit, uint32_t lo = 0) {
    uint32_t n = Get<uint32_t>(field);
    if (n < lo || n > limit) {
      Fail(what_ + ": " + field + " " + std::to_string(n) + " outside " + std::to_string(lo) + ".." +
           std::to_string(limit));
    }
    return n;
  }
  std::string String(uint64_t n, const char* field) {
    const uint8_t* p = Take(n, field);
    return std::string(reinterpret_cast<const char*>(p), n);
  }
  void Done() {
    if (pos_ != end_) Fail(what_ + ": " + std::to_string(end_ - pos_) + " trailing bytes");
  }
  uint64_t pos() const { return pos_; }
  uint64_t end() const { return end_; }
  void Seek(uint64_t pos) { pos_ = pos; }

 private:
  const uint8_t* data_;
  uint64_t pos_, end_;
  std::string what_;
};

std::string Utf8(std::string s, const char* what) {
  if (!ValidUtf8(s)) Fail(std::string(what) + " is not UTF-8 or contains a NUL byte");
  return s;
}

void ReadFeatures(Reader r, dc_bundle* b) {
  uint32_t count = r.Count("feature count", kMaxFeatures);
  for (uint32_t j = 0; j < count; ++j) {
    Feature f;
    f.name = Utf8(r.String(r.Count("feature name length", kMaxName), "feature name"), "feature name");
    uint32_t terms = r.Count("feature term count", kMaxTerms, 1);
    for (uint32_t t = 0; t < terms; ++t) {
      uint32_t input = r.Get<uint32_t>("feature term");
      int32_t dim = r.Get<int32_t>("feature term");
      if (input >= kMaxInputs || dim < -static_cast<int32_t>(kMaxDim) || dim >= static_cast<int32_t>(kMaxDim)) {
        Fail("feature " + std::to_string(j) + " (" + f.name + "): term (input " + std::to_string(input) + ", dim " +
             std::to_string(dim) + ") out of range");
      }
      f.terms.emplace_back(input, dim);
    }
    b->features.push_back(std::move(f));
  }
  r.Done();
}

std::string IsaText(uint32_t isa) { return std::to_string(isa / 10) + "." + std::to_string(isa % 10); }

// The PTX ISA of a PTX text as major*10+minor: the first line whose first non-blank text is ".version", whose
// operand must be 1-3 digits, '.', one digit (then only blanks); 0 when there is no such line or operand.
// dietcode_ort/toolchain.py ptx_isa is the same rule.
uint32_t PtxIsa(const std::string& ptx) {
  size_t pos = 0;
  while ((pos = ptx.find(".version", pos)) != std::string::npos) {
    size_t line = ptx.rfind('\n', pos);
    line = line == std::string::npos ? 0 : line + 1;
    if (ptx.find_first_not_of(" \t", line) != pos) {
      pos += 8;
      continue;
    }
    size_t end = ptx.find('\n', pos);
    const std::string operand = ptx.substr(pos + 8, end == std::string::npos ? std::string::npos : end - pos - 8);
    size_t p = operand.find_first_not_of(" \t");
    if (p == 0 || p == std::string::npos) return 0;
    uint32_t major = 0;
    size_t digits = 0;
    while (p < operand.size() && operand[p] >= '0' && operand[p] <= '9' && digits < 4) {
      major = major * 10 + static_cast<uint32_t>(operand[p++] - '0');
      ++digits;
    }
    if (digits == 0 || digits > 3 || p + 1 >= operand.size() || operand[p] != '.') return 0;
    const char minor = operand[p + 1];
    if (minor < '0' || minor > '9') return 0;
    if (operand.find_first_not_of(" \t\r", p + 2) != std::string::npos) return 0;
    return major * 10 + static_cast<uint32_t>(minor - '0');
  }
  return 0;
}

Toolchain ReadToolchain(Reader& r, const char* what) {
  Toolchain t;
  t.ptx_isa = r.Get<uint32_t>(what);
  t.min_driver = r.Get<uint32_t>(what);
  t.triton = Utf8(r.String(r.Count("toolchain Triton version length", kMaxToolchainName), what), what);
  t.ptxas = Utf8(r.String(r.Count("toolchain ptxas version length", kMaxToolchainName), what), what);
  if (t.ptx_isa > kMaxPtxIsa || t.min_driver > kMaxDriver) {
    Fail(std::string(what) + ": PTX ISA " + std::to_string(t.ptx_isa) + " / minimum driver " +
         std::to_string(t.min_driver) + " out of range");
  }
  return t;
}

void ValidateKernel(const Kernel& k, uint32_t index) {
  std::string where = "kernel " + std::to_string(index) + " (" + k.name + ")";
  if (k.kind == kVendor) {
    bool any_conv = false;
    for (uint32_t v : k.conv) any_conv |= v != 0;
    if (!k.images.empty() || !k.ptx.empty() || !k.params.empty() || k.div16 || k.dtype || k.activation ||
        k.trans_b || any_conv || k.alpha != 1.0f || k.causal || k.residual_first || k.residual_mul || k.tf32 || k.layout || k.persistent ||
        k.head_dim || k.mask_rows || k.nan_to_zero || k.grouped || k.channels_last || !k.ptx_toolchain.empty() ||
        k.ptx_scratch_size || k.ptx_scratch_align != 1) {
      Fail(where + ": a vendor kernel carries no cubin, PTX, params, div16 assumptions or build facts");
    }
    return;
  }
  const uint32_t w = k.num_warps;
  if (!(w == 1 || w == 2 || w == 4 || w == 8 || w == 16 || w == 32)) {
    Fail(where + ": num_warps " + std::to_string(w) + ", allowed: 1, 2, 4, 8, 16, 32");
  }
  if (k.block_m < 1 || k.block_m > kMaxBlock) Fail(where + ": block_m " + std::to_string(k.block_m) + " outside 1..4096");
  if (k.block_n < 1 || k.block_n > kMaxBlock) Fail(where + ": block_n " + std::to_string(k.block_n) + " outside 1..4096");
  if (k.split_k < 1 || k.split_k > kMaxSplitK) Fail(where + ": split_k " + std::to_string(k.split_k) + " outside 1..1024");
  if (k.shared > kMaxShared) Fail(where + ": shared " + std::to_string(k.shared) + " bytes too large");
  bool seen[kParamCount] = {};
  for (uint8_t p : k.params) {
    if (seen[p]) Fail(where + ": params repeat a name");
    seen[p] = true;
  }
  // attention kernels (they take seq_q) take q, k, v and out and nothing of the other views; others no
  // attention param
  bool other_params = false, attention_params = false;
  for (uint32_t p = 0; p < kParamCount; ++p) (IsAttentionParam(p) ? attention_params : other_params) |= seen[p];
  if (seen[kSeqQ]) {
    if (!seen[kQ] || !seen[kKt] || !seen[kV] || !seen[kOut]) Fail(where + ": an attention kernel's params lack q, k, v or out");
    if (other_params) Fail(where + ": params name both an attention and another view");
  } else if (attention_params) {
    Fail(where + ": params name attention params without seq_q");
  } else if (!seen[kC]) {
    Fail(where + ": params lack the output pointer 'c'");
  }
  // split-K kernels meet their splits in the workspace and count them in the counters (abi.md): they take
  // both, and no other kernel takes either
  for (const Param p : {kWorkspace, kCounters}) {
    const std::string name = std::string("'") + kParamNames[p] + "'";
    if (k.split_k > 1 && !seen[p]) {
      Fail(where + ": split_k " + std::to_string(k.split_k) + " but the params lack the " + name + " pointer "
           "split-K kernels take (a kernel of an older split-K scheme: optimize the model again)");
    }
    if (k.split_k == 1 && seen[p]) Fail(where + ": takes a " + name + " but has split_k 1");
  }
  if (k.causal && !seen[kSeqQ]) Fail(where + ": causal applies to attention kernels only");
  if (seen[kSeqQ] ? k.head_dim < 1 || k.head_dim > kMaxHeadDim : k.head_dim != 0) {
    Fail(where + ": head_dim " + std::to_string(k.head_dim) +
         (seen[kSeqQ] ? " outside 1..256 (an attention kernel's HEAD_DIM)" : ", but only attention kernels have one"));
  }
  if ((k.nan_to_zero && !seen[kSeqQ]) || (k.mask_rows && !seen[kMask])) {
    Fail(where + ": " + (k.mask_rows && !seen[kMask] ? "mask_rows applies to attention kernels taking a mask"
                                     : "nan_to_zero applies to attention kernels only"));
  }
  // persistent kernels: gemm and bmm without split-K (a persistent bmm loops over the batch: it takes it)
  if (k.persistent && (k.split_k != 1 || seen[kSeqQ] || seen[kImgH])) {
    Fail(where + ": persistent applies to gemm and bmm kernels with split_k 1 (split_k " + std::to_string(k.split_k) +
         (seen[kSeqQ] ? ", an attention kernel" : seen[kImgH] ? ", a conv kernel" : "") + ")");
  }
  if (k.persistent && seen[kStrideABatch] && !seen[kBatch]) {
    Fail(where + ": a persistent bmm kernel takes the 'batch' param (it loops over the batch)");
  }
  if (k.tf32 && k.dtype != 0) Fail(where + ": tf32 applies to float32 kernels only");
  if (k.layout && !seen[kSeqQ]) Fail(where + ": operand layouts apply to attention kernels only");
  if (!LayoutValid(k.layout)) {
    Fail(where + ": operand layout " + std::to_string(k.layout) + " is packed without Q, K and V all [batch, seq, "
         "heads, d]");
  }
  if (seen[kImgH] && seen[kStrideABatch]) Fail(where + ": params name both a conv and a bmm view");
  if (seen[kResidual] && seen[kStrideABatch]) {
    Fail(where + ": params name a residual, which only gemm-view and conv kernels take");
  }
  if (k.residual_first && (!seen[kResidual] || k.activation == 0)) {
    Fail(where + ": residual_first orders a residual before an activation, and the kernel takes " +
         (seen[kResidual] ? "no activation" : "no residual"));
  }
  if (k.residual_mul && (!seen[kResidual] || k.activation == 0 || k.residual_first)) {
    Fail(where + ": residual_mul multiplies an activation's result by a residual, and the kernel takes " +
         (!seen[kResidual] ? "no residual" : k.activation == 0 ? "no activation" : "it before the activation"));
  }
  if (k.grouped && !seen[kImgH]) Fail(where + ": grouped applies to conv kernels only");
  if (k.channels_last && !seen[kImgH]) Fail(where + ": channels_last applies to conv kernels only");
  if (k.channels_last && k.grouped) {
    Fail(where + ": channels_last applies to ungrouped conv kernels only, the kernel is grouped");
  }
  // conv kernels (they take img_h) carry their layer geometry; other kernels carry none
  static const uint32_t kConvMin[9] = {1, 1, 1, 1, 1, 0, 0, 1, 1};
  static const uint32_t kConvMax[9] = {1u << 20, 64, 64, 64, 64, 1024, 1024, 64, 64};
  for (int i = 0; i < 9; ++i) {
    const bool ok = seen[kImgH] ? (k.conv[i] >= kConvMin[i] && k.conv[i] <= kConvMax[i]) : k.conv[i] == 0;
    if (!ok) Fail(where + ": conv geometry field " + std::to_string(i) + " = " + std::to_string(k.conv[i]) + " invalid");
  }
  for (uint32_t p = 0; p < 32; ++p) {  // k.div16 holds absolute param indices (the parser shifted attention's)
    if ((k.div16 >> p & 1u) && (p >= kParamCount || !seen[p])) {
      Fail(where + ": div16 mask names param " + std::to_string(p) + ", which the kernel does not take");
    }
  }
  for (size_t i = 0; i < k.images.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      if (k.images[i].cc == k.images[j].cc && k.images[i].specific == k.images[j].specific) {
        Fail(where + ": two cubins for sm_" + std::to_string(k.images[i].cc));
      }
    }
    if (k.images[i].bytes.empty()) Fail(where + ": empty cubin for sm_" + std::to_string(k.images[i].cc));
  }
  if (k.images.empty() && k.ptx.empty()) Fail(where + ": has neither a cubin nor PTX");
  if (k.ptx.empty() && !k.ptx_toolchain.empty()) Fail(where + ": a toolchain record for PTX it does not carry");
  if (k.ptx.empty() && (k.ptx_scratch_size || k.ptx_scratch_align != 1)) {
    Fail(where + ": a global scratch record for PTX it does not carry");
  }
  const uint32_t isa = PtxIsa(k.ptx);
  if (k.ptx_toolchain.ptx_isa != 0 && k.ptx_toolchain.ptx_isa != isa) {
    Fail(where + ": PTX toolchain says ISA " + IsaText(k.ptx_toolchain.ptx_isa) + ", the PTX's .version says " +
         IsaText(isa));
  }
}

void ReadKernels(Reader r, const uint8_t* data, dc_bundle* b) {
  uint32_t count = r.Count("kernel count", kMaxKernels, 1);
  for (uint32_t index = 0; index < count; ++index) {
    uint64_t start = r.pos();
    uint32_t record = r.Get<uint32_t>("kernel record size");
    if (record < 4 || record > r.end() - start) {
      Fail("kernels: kernel " + std::to_string(index) + " record size " + std::to_string(record) +
           " outside the section");
    }
    Reader sub(data, start + 4, start + record, "kernel " + std::to_string(index));
    Kernel k;
    uint8_t kind = sub.Get<uint8_t>("kind");
    uint8_t flags = sub.Get<uint8_t>("flags");
    uint16_t div16 = sub.Get<uint16_t>("div16 mask");
    if (kind > kVendor || (flags & ~(kFlagResidualFirst | kFlagCausal | kFlagTf32 | kFlagLayoutMask)) != 0) {
      Fail("kernel " + std::to_string(index) + ": kind " + std::to_string(kind) + " / flags " +
           std::to_string(flags) + " invalid");
    }
    k.div16 = div16;
    k.kind = static_cast<KernelKind>(kind);
    k.causal = flags & kFlagCausal;
    k.residual_first = flags & kFlagResidualFirst;
    k.tf32 = flags & kFlagTf32;
    k.layout = static_cast<uint8_t>((flags & kFlagLayoutMask) >> kFlagLayoutShift);
    k.num_warps = sub.Get<uint32_t>("num_warps");
    k.shared = sub.Get<uint32_t>("shared");
    k.block_m = sub.Get<uint32_t>("block_m");
    k.block_n = sub.Get<uint32_t>("block_n");
    k.split_k = sub.Get<uint32_t>("split_k");
    k.dtype = sub.Get<uint8_t>("dtype");
    k.activation = sub.Get<uint8_t>("activation");
    k.trans_b = sub.Get<uint8_t>("trans_b");
    k.persistent = sub.Get<uint8_t>("persistent");
    if (k.dtype > 2 || k.activation > kMaxActivation || k.trans_b > 1) {
      Fail("kernel " + std::to_string(index) + ": dtype " + std::to_string(k.dtype) + " / activation " +
           std::to_string(k.activation) + " / trans_b " + std::to_string(k.trans_b) + " invalid");
    }
    if (k.persistent > kMaxPersistent) {
      Fail("kernel " + std::to_string(index) + ": persistent " + std::to_string(k.persistent) +
           " programs per SM outside 0.." + std::to_string(kMaxPersistent));
    }
    for (uint32_t& v : k.conv) v = sub.Get<uint32_t>("conv geometry");
    const uint32_t alpha_bits = sub.Get<uint32_t>("alpha");
    std::memcpy(&k.alpha, &alpha_bits, sizeof(k.alpha));
    if (!std::isfinite(k.alpha) || k.alpha == 0.0f) {
      Fail("kernel " + std::to_string(index) + ": alpha " + std::to_string(k.alpha) + " is not a finite, non-zero float");
    }
    k.name = Utf8(sub.String(sub.Count("name length", kMaxName, 1), "name"), "kernel name");
    uint32_t n_params = sub.Count("param count", kMaxParams);
    const uint8_t* params = sub.Take(n_params, "params");
    for (uint32_t p = 0; p < n_params; ++p) {
      if (params[p] >= kParamCount) {
        Fail("kernel " + std::to_string(index) + ": param enum out of range 0.." + std::to_string(kParamCount - 1));
      }
      k.params.push_back(params[p]);
    }
    // Format 10: an attention kernel's 16-bit div16 mask counts from kQ (its params are kQ..kStrideMaskK);
    // from here on k.div16 names absolute param indices, whatever the view.
    if (n_params > 0 && IsAttentionParam(params[0])) k.div16 <<= kQ;
    uint32_t n_images = sub.Count("image count", kMaxImages);
    for (uint32_t i = 0; i < n_images; ++i) {
      Image img;
      img.cc = sub.Get<uint32_t>("image arch");
      uint32_t aflags = sub.Get<uint32_t>("image flags");
      img.shared = sub.Get<uint32_t>("image shared");
      if (img.cc < 10 || img.cc > 9999 || (aflags & ~kArchSpecific)) {
        Fail("kernel " + std::to_string(index) + ": image arch " + std::to_string(img.cc) + " / flags " +
             std::to_string(aflags) + " invalid");
      }
      if (img.shared > kMaxShared) {
        Fail("kernel " + std::to_string(index) + ": image shared " + std::to_string(img.shared) + " bytes too large");
      }
      img.scratch_size = sub.Get<uint32_t>("image scratch size");
      img.scratch_align = sub.Get<uint32_t>("image scratch align");
      CheckScratch(img.scratch_size, img.scratch_align, "kernel " + std::to_string(index) + ": image");
      img.toolchain = ReadToolchain(sub, "image toolchain");
      uint64_t size = sub.Get<uint64_t>("image size");
      if (size > kMaxImageBytes) Fail("kernel " + std::to_string(index) + ": image of " + std::to_string(size) + " bytes too large");
      img.specific = aflags & kArchSpecific;
      img.bytes = sub.String(size, "cubin");
      k.images.push_back(std::move(img));
    }
    uint64_t ptx_size = sub.Get<uint64_t>("PTX size");
    if (ptx_size > kMaxPtxBytes) Fail("kernel " + std::to_string(index) + ": PTX of " + std::to_string(ptx_size) + " bytes too large");
    k.ptx = Utf8(sub.String(ptx_size, "PTX"), "PTX");
    k.ptx_toolchain = ReadToolchain(sub, "PTX toolchain");
    k.ptx_scratch_size = sub.Get<uint32_t>("PTX scratch size");
    k.ptx_scratch_align = sub.Get<uint32_t>("PTX scratch align");
    CheckScratch(k.ptx_scratch_size, k.ptx_scratch_align, "kernel " + std::to_string(index) + ": PTX");
    const uint8_t epilogue = sub.Get<uint8_t>("epilogue flags");
    if (epilogue &
        ~(kEpilogueResidualMul | kEpilogueMaskRows | kEpilogueNanToZero | kEpilogueGrouped | kEpilogueChannelsLast)) {
      Fail("kernel " + std::to_string(index) + ": epilogue flags " + std::to_string(epilogue) + " invalid");
    }
    k.residual_mul = epilogue & kEpilogueResidualMul;
    k.mask_rows = epilogue & kEpilogueMaskRows;
    k.nan_to_zero = epilogue & kEpilogueNanToZero;
    k.grouped = epilogue & kEpilogueGrouped;
    k.channels_last = epilogue & kEpilogueChannelsLast;
    k.head_dim = sub.Get<uint32_t>("head_dim");
    sub.Done();
    r.Seek(start + record);
    b->kernels.push_back(std::move(k));
  }
  r.Done();
}

void ReadTree(Reader r, dc_bundle* b) {
  uint32_t n = r.Count("node count", kMaxNodes, 1);
  Tree& t = b->tree;
  auto read_i32 = [&](std::vector<int32_t>* v, const char* field) {
    const uint8_t* p = r.Take(uint64_t{n} * 4, field);
    v->resize(n);
    std::memcpy(v->data(), p, uint64_t{n} * 4);
  };
  read_i32(&t.feature, "feature");
  const uint8_t* p = r.Take(uint64_t{n} * 8, "threshold");
  t.threshold.resize(n);
  std::memcpy(t.threshold.data(), p, uint64_t{n} * 8);
  read_i32(&t.left, "left");
  read_i32(&t.right, "right");
  read_i32(&t.leaf, "leaf");
  r.Done();
}

void ValidateTree(const dc_bundle& b) {
  const Tree& t = b.tree;
  const int32_t n = static_cast<int32_t>(t.leaf.size());
  const int32_t n_features = static_cast<int32_t>(b.features.size());
  const int32_t n_kernels = static_cast<int32_t>(b.kernels.size());
  std::vector<int> parents(n, 0);
  for (int32_t i = 0; i < n; ++i) {
    std::string where = "tree node " + std::to_string(i);
    if (t.leaf[i] >= 0) {
      if (t.leaf[i] >= n_kernels) {
        Fail(where + ": leaf kernel id " + std::to_string(t.leaf[i]) + " out of range 0.." + std::to_string(n_kernels - 1));
      }
      if (t.feature[i] != -1 || t.left[i] != -1 || t.right[i] != -1) {
        Fail(where + ": a leaf must have feature, left and right -1");
      }
      continue;
    }
    if (t.leaf[i] != -1) Fail(where + ": leaf id " + std::to_string(t.leaf[i]) + " (use -1 for inner nodes)");
    if (t.feature[i] < 0 || t.feature[i] >= n_features) {
      Fail(where + ": feature " + std::to_string(t.feature[i]) + " out of range 0.." + std::to_string(n_features - 1));
    }
    for (int32_t child : {t.left[i], t.right[i]}) {
      if (child < 1 || child >= n) Fail(where + ": child " + std::to_string(child) + " out of range 1.." + std::to_string(n - 1));
      if (++parents[child] > 1) {
        Fail("tree node " + std::to_string(child) + " has more than one parent (cycle or shared subtree)");
      }
    }
  }
  // With at most one parent each and none for the root, reaching every node from the root means a tree.
  std::vector<char> seen(n, 0);
  std::vector<int32_t> stack = {0};
  while (!stack.empty()) {
    int32_t i = stack.back();
    stack.pop_back();
    seen[i] = 1;
    if (t.leaf[i] < 0) {
      stack.push_back(t.left[i]);
      stack.push_back(t.right[i]);
    }
  }
  auto it = std::find(seen.begin(), seen.end(), 0);
  if (it != seen.end()) {
    Fail("tree node " + std::to_string(it - seen.begin()) + " is not reachable from the root (cycle?)");
  }
}

// CRC-32 (IEEE 802.3, reflected polynomial 0xEDB88320: zlib's crc32, which the Python writer uses) of
// data[0, size), the 4 bytes at kChecksumAt read as 0. A table of 256 entries, built once.
uint32_t PayloadCrc32(const uint8_t* data, uint64_t size) {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int bit = 0; bit < 8; ++bit) c = (c & 1u) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  uint32_t crc = 0xFFFFFFFFu;
  auto feed = [&](const uint8_t* p, uint64_t n) {
    for (uint64_t i = 0; i < n; ++i) crc = table[(crc ^ p[i]) & 0xFFu] ^ (crc >> 8);
  };
  const uint8_t zeros[4] = {0, 0, 0, 0};
  feed(data, kChecksumAt);  // Parse calls this on payloads of at least the 32-byte header
  feed(zeros, 4);
  feed(data + kChecksumAt + 4, size - kChecksumAt - 4);
  return crc ^ 0xFFFFFFFFu;
}

void Parse(const uint8_t* data, uint64_t size, dc_bundle* b) {
  if (data == nullptr || size < kHeaderSize) {
    Fail(std::to_string(size) + " bytes, shorter than the 32-byte header");
  }
  if (std::memcmp(data, kMagic, 8) != 0) Fail("bad magic, expected DCBUNDLE");
  Reader h(data, 8, kHeaderSize, "header");
  uint32_t version = h.Get<uint32_t>("version");
  uint32_t header_size = h.Get<uint32_t>("header size");
  uint64_t total = h.Get<uint64_t>("total size");
  uint32_t count = h.Get<uint32_t>("section count");
  uint32_t checksum = h.Get<uint32_t>("checksum");
  if (version != kVersion) {
    Fail("version " + std::to_string(version) + ", this reader knows " + std::to_string(kVersion) +
         (version < kVersion ? ": the model was optimized by an older dietcode-ort; optimize it again"
                             : ": the model was optimized by a newer dietcode-ort; update the custom-op library"));
  }
  if (header_size != kHeaderSize) Fail("header size " + std::to_string(header_size) + ", expected 32");
  if (total != size) Fail("header says " + std::to_string(total) + " bytes, payload has " + std::to_string(size));
  if (total > kMaxTotal) Fail("payload of " + std::to_string(total) + " bytes too large");
  const uint32_t summed = PayloadCrc32(data, size);
  if (checksum != summed) {
    char sums[48];
    std::snprintf(sums, sizeof(sums), "%08x, its bytes sum to %08x", checksum, summed);
    Fail(std::string("checksum mismatch: the header says ") + sums + ": the bundle was changed after dietcode-ort "
         "wrote it (a damaged or edited model file); optimize the original model again");
  }
  if (count != 3) Fail(std::to_string(count) + " sections, expected 3 (features, kernels, tree)");
  const uint64_t table_end = kHeaderSize + uint64_t{kSectionEntrySize} * count;
  if (table_end > total) Fail("section table runs past the end");
  uint64_t off[4] = {}, len[4] = {};
  bool have[4] = {};
  Reader table(data, kHeaderSize, table_end, "section table");
  for (uint32_t s = 0; s < count; ++s) {
    uint32_t kind = table.Get<uint32_t>("kind");
    uint32_t res = table.Get<uint32_t>("reserved");
    uint64_t o = table.Get<uint64_t>("offset");
    uint64_t n = table.Get<uint64_t>("size");
    if (kind < kSectionFeatures || kind > kSectionTree || have[kind] || res != 0) {
      Fail("section entry " + std::to_string(s) + ": kind " + std::to_string(kind) + " unknown or repeated");
    }
    if (o < table_end || n > total || o > total - n) {
      Fail(std::string("section ") + kSectionNames[kind] + ": offset " + std::to_string(o) + " size " +
           std::to_string(n) + " outside the payload");
    }
    have[kind] = true;
    off[kind] = o;
    len[kind] = n;
  }
  std::vector<std::pair<uint64_t, uint64_t>> spans = {{off[1], len[1]}, {off[2], len[2]}, {off[3], len[3]}};
  std::sort(spans.begin(), spans.end());
  for (size_t i = 0; i + 1 < spans.size(); ++i) {
    if (spans[i].first + spans[i].second > spans[i + 1].first) Fail("sections overlap");
  }
  ReadFeatures(Reader(data, off[1], off[1] + len[1], "features"), b);
  ReadKernels(Reader(data, off[2], off[2] + len[2], "kernels"), data, b);
  ReadTree(Reader(data, off[3], off[3] + len[3], "tree"), b);
  for (uint32_t k = 0; k < b->kernels.size(); ++k) ValidateKernel(b->kernels[k], k);
  ValidateTree(*b);
}

// ".target sm_XY[a]" of a PTX text; false if there is none.
bool PtxTarget(const std::string& ptx, uint32_t* cc, bool* specific) {
  size_t pos = 0;
  while ((pos = ptx.find(".target", pos)) != std::string::npos) {
    size_t line = ptx.rfind('\n', pos);
    line = line == std::string::npos ? 0 : line + 1;
    bool at_line_start = ptx.find_first_not_of(" \t", line) == pos;
    size_t p = pos + 7;
    pos = p;
    if (!at_line_start) continue;
    p = ptx.find_first_not_of(" \t", p);
    if (p == std::string::npos || p == pos || ptx.compare(p, 3, "sm_") != 0) continue;
    p += 3;
    uint32_t v = 0;
    size_t digits = 0;
    while (p < ptx.size() && ptx[p] >= '0' && ptx[p] <= '9' && digits < 6) {
      v = v * 10 + static_cast<uint32_t>(ptx[p] - '0');
      ++p;
      ++digits;
    }
    if (digits == 0) continue;
    *cc = v;
    *specific = p < ptx.size() && ptx[p] == 'a';
    return true;
  }
  return false;
}

}  // namespace

void SetError(const std::string& message) { g_error = message; }

static std::string DriverText(uint32_t version) {
  return std::to_string(version / 1000) + "." + std::to_string(version % 1000 / 10);
}

bool PickImage(const Kernel& kernel, int major, int minor, int* image_index, std::string* error, int driver_version) {
  const uint32_t cc = static_cast<uint32_t>(major * 10 + minor);
  // Candidates in order of preference: cubins for exactly this cc, binary-compatible cubins (highest cc
  // first), then PTX the driver can JIT for this cc.
  std::vector<int> candidates;
  for (size_t i = 0; i < kernel.images.size(); ++i) {
    if (kernel.images[i].cc == cc) candidates.push_back(static_cast<int>(i));
  }
  std::vector<int> compatible;
  for (size_t i = 0; i < kernel.images.size(); ++i) {
    const Image& img = kernel.images[i];
    if (!img.specific && img.cc != cc && img.cc / 10 == static_cast<uint32_t>(major) &&
        img.cc % 10 <= static_cast<uint32_t>(minor)) {
      compatible.push_back(static_cast<int>(i));
    }
  }
  std::stable_sort(compatible.begin(), compatible.end(),
                   [&](int a, int b) { return kernel.images[a].cc > kernel.images[b].cc; });
  candidates.insert(candidates.end(), compatible.begin(), compatible.end());
  uint32_t tcc = 0;
  bool specific = false;
  if (!kernel.ptx.empty() && PtxTarget(kernel.ptx, &tcc, &specific) && (specific ? tcc == cc : tcc <= cc)) {
    candidates.push_back(-1);
  }
  auto toolchain = [&](int index) -> const Toolchain& {
    return index >= 0 ? kernel.images[index].toolchain : kernel.ptx_toolchain;
  };
  for (int index : candidates) {
    if (driver_version <= 0 || toolchain(index).min_driver <= static_cast<uint32_t>(driver_version)) {
      *image_index = index;
      return true;
    }
  }
  if (!candidates.empty()) {
    const int first = candidates.front();
    const std::string what = first >= 0 ? "cubin sm_" + std::to_string(kernel.images[first].cc) +
                                              (kernel.images[first].specific ? "a" : "")
                                        : "ptx sm_" + std::to_string(tcc) + (specific ? "a" : "");
    *error = "kernel '" + kernel.name + "': " + what + " needs driver >= " + DriverText(toolchain(first).min_driver) +
             ", this driver is " + DriverText(static_cast<uint32_t>(driver_version));
    return false;
  }
  std::string have;
  for (const Image& img : kernel.images) {
    have += (have.empty() ? "" : ", ") + std::string("sm_") + std::to_string(img.cc) + (img.specific ? "a" : "");
  }
  *error = "kernel '" + kernel.name + "' cannot run on sm_" + std::to_string(cc) + ": the bundle has " +
           (have.empty() ? "no cubin" : have) + " and " + (kernel.ptx.empty() ? "no PTX" : "PTX for a different target");
  return false;
}

bool FitsDevice(const Kernel& kernel, int major, int minor, int64_t smem_optin, std::string* why, int driver_version) {
  if (kernel.kind == kVendor) return true;
  int index = -1;
  if (!PickImage(kernel, major, minor, &index, why, driver_version)) return false;
  const uint32_t shared = ImageShared(kernel, index);
  if (shared > smem_optin) {
    *why = "kernel '" + kernel.name + "' needs " + std::to_string(shared) + " bytes of shared memory, sm_" +
           std::to_string(major * 10 + minor) + " allows " + std::to_string(smem_optin) + " per block";
    return false;
  }
  return true;
}

int32_t Evaluate(const dc_bundle& b, const int64_t* features) {
  const Tree& t = b.tree;
  int32_t i = 0;
  for (size_t step = 0; step < t.leaf.size(); ++step) {
    if (t.leaf[i] >= 0) return t.leaf[i];
    i = features[t.feature[i]] <= t.threshold[i] ? t.left[i] : t.right[i];
  }
  return -1;  // unreachable for a validated tree
}

View KernelView(const Kernel& kernel) {
  for (uint8_t p : kernel.params) {
    if (p == kSeqQ) return kViewAttention;
    if (p == kImgH) return kViewConv;
    if (p == kStrideABatch) return kViewBmm;
  }
  return kViewGemm;
}

namespace {

constexpr const char* kFitNames[kFitCount] = {
    "fits", "empty output", "K is 0", "batch above grid z", "tiles above grid x", "int32 offsets",
    "div16 assumption", "negative size", "workspace size", "head dim"};

// The div16 assumptions (bit p: param p 16-byte aligned or a multiple of 16) against this call's arguments.
template <typename Refuse>
Fit Div16Fit(const Kernel& kernel, const dc_launch_args& args, Refuse refuse) {
  for (uint32_t bits = kernel.div16; bits != 0; bits &= bits - 1) {  // the set bits, lowest first
    const uint32_t p = static_cast<uint32_t>(__builtin_ctz(bits));
    if (p >= kParamCount) break;  // the parser accepts no bit past the params
    const bool pointer = IsPointerParam(p);
    const bool ok = pointer ? ArgPointer(args, p) % 16 == 0 : ArgInt(args, p) % 16 == 0;
    if (!ok) {
      return refuse(kFitDiv16, std::string("compiled for ") + kParamNames[p] +
                                   (pointer ? " 16-byte aligned" : " a multiple of 16") + ", and this call's is not");
    }
  }
  return kFits;
}

// An attention launch (grid (cdiv(seq_q, BLOCK_M), 1, batch) with batch = z heads): sizes positive, z within
// grid z and a multiple of heads, query indices and the mask's in-slice offsets within int32 (templates.py).
Fit AttentionFit(const Kernel& kernel, const dc_launch_args& a, std::string* why) {
  const int64_t seq_q = a.seq_q, seq_k = a.seq_k, z = a.batch, heads = a.heads;
  if (seq_q < 0 || seq_k < 0 || z < 0 || heads < 1 || a.stride_mask_b < 0 || a.stride_mask_h < 0 ||
      a.stride_mask_q < 0 || a.stride_mask_k < 0 || z % heads != 0) {
    *why = "seq_q=" + std::to_string(seq_q) + " seq_k=" + std::to_string(seq_k) + " batch=" + std::to_string(z) +
           " heads=" + std::to_string(heads) + " (or a mask stride) invalid: sizes are at least 0, heads at least 1 "
           "and dividing batch";
    return kFitNegative;
  }
  if (seq_q == 0 || z == 0) {
    *why = "seq_q=" + std::to_string(seq_q) + " batch=" + std::to_string(z) + ": nothing to launch";
    return kFitEmpty;
  }
  if (a.head_dim < 0 || static_cast<uint32_t>(a.head_dim) != kernel.head_dim) {  // its rows are HEAD_DIM long
    *why = "compiled for head dim " + std::to_string(kernel.head_dim) + ", the call's is " +
           std::to_string(a.head_dim);
    return kFitHeadDim;
  }
  if (seq_k == 0) {
    *why = "no keys: the output is zeros";
    return kFitZeroK;
  }
  if (z > 65535) {
    *why = "batch x heads " + std::to_string(z) + " above 65535 (grid z)";
    return kFitBatch;
  }
  const int64_t padded = (seq_q + kernel.block_m - 1) / kernel.block_m * kernel.block_m;
  const int64_t keys = (seq_k + kernel.block_n - 1) / kernel.block_n * kernel.block_n;
  const int64_t mask_span = seq_q * a.stride_mask_q + seq_k * a.stride_mask_k;
  if (padded > 0x7fffffff || keys > 0x7fffffff || mask_span > 0x7fffffff) {
    *why = "seq_q=" + std::to_string(seq_q) + " seq_k=" + std::to_string(seq_k) +
           " rounded up to whole tiles, or the mask's offsets inside one head, exceed int32";
    return kFitInt32;
  }
  return kFits;
}

}  // namespace

Fit CallFit(const Kernel& kernel, const dc_launch_args& args, std::string* why) {
  if (kernel.kind == kVendor) return kFits;
  auto refuse = [&](Fit fit, const std::string& detail) {  // the message is built only for a refusal
    *why = "kernel '" + kernel.name + "': " + kFitNames[fit] + ": " + detail;
    return fit;
  };
  if (KernelView(kernel) == kViewAttention) {
    const Fit fit = AttentionFit(kernel, args, why);
    if (fit != kFits) return refuse(fit, *why);
    return Div16Fit(kernel, args, refuse);
  }
  const int64_t M = args.M, N = args.N, K = args.K;
  if (M < 0 || N < 0 || K < 0 || args.batch < 0 || args.stride_a_batch < 0 || args.stride_b_batch < 0 || args.img_n < 0 || args.img_h < 0 ||
      args.img_w < 0 || args.out_h < 0 || args.out_w < 0) {
    return refuse(kFitNegative, "M=" + std::to_string(M) + " N=" + std::to_string(N) + " K=" + std::to_string(K) +
                                    " batch=" + std::to_string(args.batch) + " (or a stride or image dim) below 0");
  }
  const int64_t batch = args.batch > 0 ? args.batch : 1;  // gemm and conv views: 1 (0 read as 1)
  if (M == 0 || N == 0 || (args.batch == 0 && KernelView(kernel) == kViewBmm)) {  // bmm: the output's batch dims
    return refuse(kFitEmpty, "M=" + std::to_string(M) + " N=" + std::to_string(N) + " batch=" +
                                 std::to_string(args.batch) + ": nothing to launch");
  }
  if (K == 0) return refuse(kFitZeroK, "the output is the bias alone, which ORT's kernel writes");
  if (batch > 65535) return refuse(kFitBatch, "batch " + std::to_string(batch) + " above 65535 (grid z)");
  const int64_t tiles_m = (M + kernel.block_m - 1) / kernel.block_m, tiles_n = (N + kernel.block_n - 1) / kernel.block_n;
  const int64_t tiles = tiles_m * tiles_n;
  if (tiles > 0x7fffffff) {
    return refuse(kFitGrid, std::to_string(tiles) + " tiles of " + std::to_string(kernel.block_m) + "x" +
                                std::to_string(kernel.block_n) + " above 2^31-1 (grid x)");
  }
  // Row and column indices within a tile (pid * BLOCK + arange) are int32 in every template: M and N rounded
  // up to whole tiles must stay below 2^31, or the last tile's indices wrap and pass the bounds mask.
  const int64_t padded_m = tiles_m * kernel.block_m, padded_n = tiles_n * kernel.block_n;
  if (padded_m > 0x7fffffff || padded_n > 0x7fffffff) {
    return refuse(kFitInt32, "M=" + std::to_string(M) + " N=" + std::to_string(N) + " rounded up to " +
                                 std::to_string(kernel.block_m) + "x" + std::to_string(kernel.block_n) +
                                 " tiles exceed the int32 row/column indices");
  }
  // Element offsets (tuner/templates.py): gemm and bmm compute them in int64 (row offsets per tile, the batch
  // from program_id(2) widened), so any int32 M, N, K fits. conv computes the image part in int64 and the rest
  // in int32: W's offsets (K*N), and per image X's (channels*img_h*img_w) and Y's (N*out_h*out_w) must stay
  // below 2^31.
  if (KernelView(kernel) == kViewConv) {
    constexpr int64_t kLimit = int64_t{1} << 31;
    const struct {
      const char* what;
      int64_t value;
    } extents[3] = {{"W", K * N},
                    {"X per image", int64_t{kernel.conv[0]} * args.img_h * args.img_w},
                    {"Y per image", N * args.out_h * args.out_w}};
    for (const auto& e : extents) {
      if (e.value >= kLimit) {
        return refuse(kFitInt32, std::string(e.what) + " spans " + std::to_string(e.value) +
                                     " elements, the conv template's int32 offsets reach 2^31-1");
      }
    }
  }
  // A persistent kernel's loop index runs to tiles x batch plus the grid (int32 in the template).
  if (kernel.persistent && tiles * batch > int64_t{0x7fffffff} / 2) {
    return refuse(kFitGrid, std::to_string(tiles) + " tiles x batch " + std::to_string(batch) +
                                " above 2^30 (a persistent kernel's int32 tile loop)");
  }
  if (kernel.split_k > 1 || KernelScratch(kernel).first > 0) {
    int64_t bytes = 0;
    std::string detail;
    if (!WorkspaceBytes(kernel, args, &bytes, &detail)) return refuse(kFitWorkspace, detail);
  }
  return Div16Fit(kernel, args, refuse);
}

std::pair<uint32_t, uint32_t> KernelScratch(const Kernel& kernel) {
  uint32_t size = kernel.ptx_scratch_size, align = kernel.ptx_scratch_align;
  for (const Image& image : kernel.images) {
    size = std::max(size, image.scratch_size);
    align = std::max(align, image.scratch_align);
  }
  return {size, align};
}

bool WorkspaceBytes(const Kernel& kernel, const dc_launch_args& args, int64_t* bytes, std::string* why) {
  if (!SplitKBytes(kernel, args, bytes, why)) return false;
  const auto [size, align] = KernelScratch(kernel);
  if (kernel.kind == kVendor || size == 0 || args.M <= 0 || args.N <= 0 || args.batch < 0) return true;
  // the grid's programs (the launch's grid rule; attention kernels take no scratch: aot.py refuses them)
  const int64_t batch = args.batch > 0 ? args.batch : 1;
  const int64_t tiles = ((int64_t{args.M} + kernel.block_m - 1) / kernel.block_m) *
                        ((int64_t{args.N} + kernel.block_n - 1) / kernel.block_n);
  const int64_t pad = align > kWorkspaceAlign ? align - kWorkspaceAlign : 0;  // the workspace is 16-byte aligned
  int64_t programs = 0, scratch = 0, total = 0;
  const bool overflow = __builtin_mul_overflow(tiles, batch, &programs);
  if (!overflow && kernel.persistent && args.sm_count > 0) {  // a persistent grid: min(tiles x batch, SMs x n)
    programs = std::min(programs, int64_t{args.sm_count} * kernel.persistent);
  }
  if (overflow || __builtin_mul_overflow(programs, int64_t{kernel.split_k}, &programs) ||
      __builtin_mul_overflow(programs, int64_t{size}, &scratch) || __builtin_add_overflow(*bytes, pad, &total) ||
      __builtin_add_overflow(total, scratch, &total) || total > INT64_MAX - kWorkspaceAlign) {
    *why = std::to_string(tiles) + " tiles x batch " + std::to_string(batch) + " x split_k " +
           std::to_string(kernel.split_k) + " programs x " + std::to_string(size) +
           " bytes of global scratch overflows int64";
    return false;
  }
  *bytes = (total + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign;
  return true;
}

void LaunchGrid(const Kernel& kernel, const dc_launch_args& args, uint32_t grid[3]) {
  const int64_t batch = args.batch > 0 ? args.batch : 1;
  if (KernelView(kernel) == kViewAttention) {
    grid[0] = static_cast<uint32_t>((int64_t{args.seq_q} + kernel.block_m - 1) / kernel.block_m);
    grid[1] = 1;
    grid[2] = static_cast<uint32_t>(batch);
    return;
  }
  const int64_t tiles = ((int64_t{args.M} + kernel.block_m - 1) / kernel.block_m) *
                        ((int64_t{args.N} + kernel.block_n - 1) / kernel.block_n);
  if (kernel.persistent) {  // CallFit keeps tiles x batch below 2^30
    const int64_t all = tiles * batch;
    const int64_t slots = args.sm_count > 0 ? int64_t{args.sm_count} * kernel.persistent : all;
    grid[0] = static_cast<uint32_t>(std::min(all, slots));
    grid[1] = grid[2] = 1;
    return;
  }
  grid[0] = static_cast<uint32_t>(tiles);
  grid[1] = kernel.split_k;
  grid[2] = static_cast<uint32_t>(batch);
}

bool ScratchPointer(const Kernel& kernel, int image_index, const dc_launch_args& args, uint64_t* pointer,
                    std::string* why) {
  *pointer = 0;
  const auto [size, align] = ImageScratch(kernel, image_index);
  if (size == 0) return true;
  int64_t split_bytes = 0;
  if (!SplitKBytes(kernel, args, &split_bytes, why)) return false;
  const uint64_t at = args.workspace + static_cast<uint64_t>(split_bytes);
  *pointer = (at + align - 1) / align * align;
  return true;
}

bool SplitKBytes(const Kernel& kernel, const dc_launch_args& args, int64_t* bytes, std::string* why) {
  *bytes = 0;
  if (kernel.kind == kVendor || kernel.split_k <= 1) return true;
  // Sizes below 0 or a 0 output need no workspace (CallFit refuses such calls before this).
  if (args.M <= 0 || args.N <= 0 || args.batch < 0) return true;
  const int64_t batch = args.batch > 0 ? args.batch : 1;
  const int64_t tiles = ((int64_t{args.M} + kernel.block_m - 1) / kernel.block_m) *
                        ((int64_t{args.N} + kernel.block_n - 1) / kernel.block_n);  // < 2^62: int32 factors
  const int64_t per_tile = int64_t{kernel.split_k} * kernel.block_m * kernel.block_n * 4 + 4;  // partials + counter
  int64_t all_tiles = 0, total = 0;
  if (__builtin_mul_overflow(tiles, batch, &all_tiles) || __builtin_mul_overflow(all_tiles, per_tile, &total) ||
      total > INT64_MAX - kWorkspaceAlign) {
    *why = std::to_string(tiles) + " tiles x batch " + std::to_string(batch) + " x " + std::to_string(per_tile) +
           " bytes per tile (split_k " + std::to_string(kernel.split_k) + ") overflows int64";
    return false;
  }
  *bytes = (total + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign;
  return true;
}

}  // namespace dietcode

using dietcode::SetError;

namespace {

// Kernel k of a bundle and the image it loads on a device of compute capability major.minor (`index`:
// into its images, -1 for PTX); nullptr, with the error set, for a bad id, a vendor kernel or no image.
const dietcode::Kernel* KernelImage(const dc_bundle* b, int32_t k, int major, int minor, int* index) {
  const dietcode::Kernel* found = dietcode::KernelAt(b, k);
  if (found == nullptr) return nullptr;
  const dietcode::Kernel& kernel = *found;
  if (kernel.kind == dietcode::kVendor) {
    SetError("kernel '" + kernel.name + "' is the vendor kind and has no image");
    return nullptr;
  }
  std::string error;
  if (!dietcode::PickImage(kernel, major, minor, index, &error)) {
    SetError(error);
    return nullptr;
  }
  return &kernel;
}

}  // namespace

extern "C" {

int dc_abi_version(void) { return DC_ABI_VERSION; }

const char* dc_abi_param_name(int index) {
  return index >= 0 && index < dietcode::kParamCount ? dietcode::kParamNames[index] : nullptr;
}

const char* dc_last_error(void) { return dietcode::g_error.c_str(); }

dc_bundle* dc_bundle_parse(const uint8_t* data, size_t size) {
  try {
    auto b = std::make_unique<dc_bundle>();
    dietcode::Parse(data, size, b.get());
    return b.release();
  } catch (const dietcode::ParseError& e) {
    SetError(e.message);
  } catch (const std::exception& e) {
    SetError(std::string("invalid kernel bundle: ") + e.what());
  }
  return nullptr;
}

void dc_bundle_free(dc_bundle* bundle) { delete bundle; }

}  // extern "C"

namespace dietcode {
namespace {

// Shared bundles: the raw bytes (for the full comparison that decides a hit), the parsed bundle, how many
// handles are out. Few distinct bundles live at once (one per workload), so a linear scan by size suffices.
struct SharedBundle {
  std::string bytes;
  dc_bundle* bundle = nullptr;
  int64_t refs = 0;
};

struct BundleCache {
  std::mutex mutex;
  std::vector<std::unique_ptr<SharedBundle>> entries;
  int64_t parses = 0;
};

BundleCache& Cache() {
  static BundleCache* cache = new BundleCache;  // never destroyed: kernels may outlive static destruction
  return *cache;
}

}  // namespace
}  // namespace dietcode

extern "C" {

dc_bundle* dc_bundle_acquire(const uint8_t* data, size_t size) {
  if (data == nullptr && size > 0) {
    SetError("invalid kernel bundle: null data");
    return nullptr;
  }
  dietcode::BundleCache& cache = dietcode::Cache();
  std::lock_guard<std::mutex> lock(cache.mutex);
  for (auto& e : cache.entries) {
    if (e->bytes.size() == size && (size == 0 || std::memcmp(e->bytes.data(), data, size) == 0)) {
      ++e->refs;
      return e->bundle;
    }
  }
  dc_bundle* parsed = dc_bundle_parse(data, size);
  if (parsed == nullptr) return nullptr;
  try {
    auto entry = std::make_unique<dietcode::SharedBundle>();
    entry->bytes.assign(reinterpret_cast<const char*>(data), size);
    entry->bundle = parsed;
    entry->refs = 1;
    cache.entries.push_back(std::move(entry));
  } catch (const std::exception& e) {
    dc_bundle_free(parsed);
    SetError(std::string("cannot cache the kernel bundle: ") + e.what());
    return nullptr;
  }
  ++cache.parses;
  return parsed;
}

void dc_bundle_release(dc_bundle* bundle) {
  if (bundle == nullptr) return;
  dietcode::BundleCache& cache = dietcode::Cache();
  std::lock_guard<std::mutex> lock(cache.mutex);
  for (auto it = cache.entries.begin(); it != cache.entries.end(); ++it) {
    if ((*it)->bundle != bundle) continue;
    if (--(*it)->refs == 0) {
      dc_bundle_free(bundle);
      cache.entries.erase(it);
    }
    return;
  }
}

void dc_bundle_cache_stats(int64_t* live, int64_t* parses) {
  dietcode::BundleCache& cache = dietcode::Cache();
  std::lock_guard<std::mutex> lock(cache.mutex);
  if (live) *live = static_cast<int64_t>(cache.entries.size());
  if (parses) *parses = cache.parses;
}

int dc_bundle_info(const dc_bundle* b, int32_t* n_features, int32_t* n_kernels, int32_t* n_nodes) {
  if (b == nullptr) {
    SetError("null bundle");
    return -1;
  }
  if (n_features) *n_features = static_cast<int32_t>(b->features.size());
  if (n_kernels) *n_kernels = static_cast<int32_t>(b->kernels.size());
  if (n_nodes) *n_nodes = static_cast<int32_t>(b->tree.leaf.size());
  return 0;
}

int32_t dc_bundle_select(const dc_bundle* b, const int64_t* features, size_t n) {
  if (b == nullptr || (features == nullptr && n > 0)) {
    SetError("null bundle or feature vector");
    return -1;
  }
  if (n != b->features.size()) {
    SetError("expected " + std::to_string(b->features.size()) + " feature values, got " + std::to_string(n));
    return -1;
  }
  return dietcode::Evaluate(*b, features);
}

int dc_bundle_features(const dc_bundle* b, const int64_t* const* dims, const size_t* ranks, size_t n_inputs,
                       int64_t* out) {
  if (b == nullptr || out == nullptr || (n_inputs > 0 && (dims == nullptr || ranks == nullptr))) {
    SetError("null argument");
    return -1;
  }
  for (size_t j = 0; j < b->features.size(); ++j) {
    const dietcode::Feature& f = b->features[j];
    int64_t value = 1;
    for (const auto& term : f.terms) {
      const size_t input = term.first;
      if (input >= n_inputs || dims[input] == nullptr) {
        SetError("feature '" + f.name + "' reads input " + std::to_string(input) + ", the node has " +
                 std::to_string(n_inputs) + " inputs");
        return -1;
      }
      const int64_t rank = static_cast<int64_t>(ranks[input]);
      const int64_t dim = term.second < 0 ? term.second + rank : term.second;
      if (dim < 0 || dim >= rank) {
        SetError("feature '" + f.name + "' reads dim " + std::to_string(term.second) + " of input " +
                 std::to_string(input) + ", whose rank is " + std::to_string(rank));
        return -1;
      }
      const int64_t size = dims[input][dim];
      if (size < 0 || __builtin_mul_overflow(value, size, &value)) {  // a crafted feature of many terms
        SetError("feature '" + f.name + "' (a product of " + std::to_string(f.terms.size()) +
                 " dims) is negative or overflows 64 bits at dim " + std::to_string(size) + " of input " +
                 std::to_string(input));
        return -1;
      }
    }
    out[j] = value;
  }
  return 0;
}

int dc_bundle_kernel_is_vendor(const dc_bundle* b, int32_t k) {
  const dietcode::Kernel* kernel = dietcode::KernelAt(b, k);
  if (kernel == nullptr) return -1;
  return kernel->kind == dietcode::kVendor ? 1 : 0;
}

int dc_kernel_accepts(const dc_bundle* b, int32_t k, const dc_launch_args* args) {
  const dietcode::Kernel* kernel = dietcode::KernelAt(b, k, "null bundle / arguments or ", args != nullptr);
  if (kernel == nullptr) return -1;
  std::string why;
  if (dietcode::MeetsAssumptions(*kernel, *args, &why)) return 1;
  SetError(why);
  return 0;
}

int dc_kernel_fit(const dc_bundle* b, int32_t k, const dc_launch_args* args) {
  const dietcode::Kernel* kernel = dietcode::KernelAt(b, k, "null bundle / arguments or ", args != nullptr);
  if (kernel == nullptr) return -1;
  std::string why;
  const dietcode::Fit fit = dietcode::CallFit(*kernel, *args, &why);
  if (fit != dietcode::kFits) SetError(why);
  return fit;
}

int dc_kernel_grid(const dc_bundle* b, int32_t k, const dc_launch_args* args, uint32_t* grid3) {
  const dietcode::Kernel* found =
      dietcode::KernelAt(b, k, "null bundle / arguments / grid or ", args != nullptr && grid3 != nullptr);
  if (found == nullptr) return -1;
  const dietcode::Kernel& kernel = *found;
  if (kernel.kind == dietcode::kVendor) {
    SetError("kernel '" + kernel.name + "' is the vendor kind and has no grid");
    return -1;
  }
  std::string why;
  if (dietcode::CallFit(kernel, *args, &why) != dietcode::kFits) {
    SetError(why);
    return -1;
  }
  dietcode::LaunchGrid(kernel, *args, grid3);
  return 0;
}

int64_t dc_kernel_workspace_bytes(const dc_bundle* b, int32_t k, const dc_launch_args* args) {
  const dietcode::Kernel* kernel = dietcode::KernelAt(b, k, "null bundle / arguments or ", args != nullptr);
  if (kernel == nullptr) return -1;
  int64_t bytes = 0;
  std::string why;
  if (!dietcode::WorkspaceBytes(*kernel, *args, &bytes, &why)) {
    SetError("kernel '" + kernel->name + "': workspace size: " + why);
    return -1;
  }
  return bytes;
}

int64_t dc_bundle_image_shared(const dc_bundle* b, int32_t k, int major, int minor) {
  int index = -1;
  const dietcode::Kernel* kernel = KernelImage(b, k, major, minor, &index);
  return kernel == nullptr ? -1 : dietcode::ImageShared(*kernel, index);
}

int dc_kernel_fit_device(const dc_bundle* b, int32_t k, int major, int minor, int smem_optin, int driver_version) {
  const dietcode::Kernel* kernel = dietcode::KernelAt(b, k, "null bundle or ");
  if (kernel == nullptr) return -1;
  if (major < 1 || minor < 0 || minor > 9 || smem_optin <= 0) {
    SetError("device sm_" + std::to_string(major) + std::to_string(minor) + " with " + std::to_string(smem_optin) +
             " bytes of opt-in shared memory is not a device");
    return -1;
  }
  std::string why;
  if (dietcode::FitsDevice(*kernel, major, minor, smem_optin, &why, driver_version)) return 1;
  SetError(why);
  return 0;
}

int dc_bundle_fit_device(const dc_bundle* b, int major, int minor, int smem_optin, int driver_version,
                         uint8_t* out_mask, size_t n) {
  if (b == nullptr || (out_mask == nullptr && n > 0) || n < b->kernels.size()) {
    SetError("dc_bundle_fit_device: null bundle, or a mask of " + std::to_string(n) + " for " +
             std::to_string(b ? b->kernels.size() : 0) + " kernels");
    return -1;
  }
  int unfit = 0;
  std::string first;
  for (size_t k = 0; k < b->kernels.size(); ++k) {
    const int r = dc_kernel_fit_device(b, static_cast<int32_t>(k), major, minor, smem_optin, driver_version);
    if (r < 0) return -1;
    out_mask[k] = static_cast<uint8_t>(r);
    if (r == 0 && unfit++ == 0) first = dc_last_error();
  }
  SetError(first);
  return unfit;
}

const char* dc_fit_name(int fit) {
  return fit >= 0 && fit < dietcode::kFitCount ? dietcode::kFitNames[fit] : nullptr;
}

int dc_bundle_kernel_built_for(const dc_bundle* b, int32_t k, int32_t* dtype, int32_t* activation, int32_t* trans_b,
                               int32_t* conv9) {
  const dietcode::Kernel* found = dietcode::KernelAt(b, k);
  if (found == nullptr) return -1;
  const dietcode::Kernel& kernel = *found;
  if (dtype) *dtype = kernel.dtype;
  if (activation) *activation = kernel.activation;
  if (trans_b) *trans_b = kernel.trans_b;
  if (conv9) {
    for (int i = 0; i < 9; ++i) conv9[i] = static_cast<int32_t>(kernel.conv[i]);
  }
  return 0;
}

int dc_bundle_check_node(const dc_bundle* b, int dtype, int base, int activation, int trans_b, const int64_t* conv9,
                         int explicit_pads, int channels_last) {
  if (b == nullptr || (base == 2 && conv9 == nullptr)) {
    SetError("dc_bundle_check_node: null bundle or conv attributes");
    return -1;
  }
  if (base == 2 && conv9[8] < 1) {
    SetError("Conv group " + std::to_string(conv9[8]) + " must be at least 1");
    return -1;
  }
  if (channels_last != 0 && (base != 2 || channels_last != 1)) {
    SetError("dc_bundle_check_node: channels_last " + std::to_string(channels_last) +
             " (0 or 1, and 1 on Conv only)");
    return -1;
  }
  for (size_t k = 0; k < b->kernels.size(); ++k) {
    const dietcode::Kernel& kernel = b->kernels[k];
    if (kernel.kind == dietcode::kVendor) continue;
    const std::string which = "bundle kernel " + std::to_string(k) + " ('" + kernel.name + "')";
    if (kernel.dtype != dtype) {
      SetError(which + " was compiled for another element type than the node's");
      return -1;
    }
    if (kernel.activation != activation) {
      SetError(which + " was compiled for another activation than the op type's");
      return -1;
    }
    if (kernel.trans_b != trans_b) {
      SetError(which + " was compiled with transB=" + std::to_string(kernel.trans_b) + ", the node has " +
               std::to_string(trans_b));
      return -1;
    }
    const bool conv_kernel = kernel.conv[0] != 0;
    const dietcode::View view = dietcode::KernelView(kernel);
    // MatMul (0) takes the gemm or bmm view, Gemm (1) the gemm view, Conv (2) the conv view, Attention (3)
    // the attention view
    if (conv_kernel != (base == 2) || (base == 1 && view != dietcode::kViewGemm) ||
        ((base == 3) != (view == dietcode::kViewAttention))) {
      SetError(which + " is not a kernel for this op type");
      return -1;
    }
    if (!conv_kernel) continue;
    if (kernel.channels_last != (channels_last == 1)) {
      SetError(which + " was compiled for " + (kernel.channels_last ? "NHWC" : "NCHW") + ", the node is " +
               (channels_last ? "NHWC (channels_last=1)" : "NCHW (channels_last=0)") + ": optimize again");
      return -1;
    }
    if (!explicit_pads) {
      SetError(which + " needs explicit pads, the node has auto_pad");
      return -1;
    }
    // conv9: strides h, w, pads top, left, dilations h, w, kernel_shape h, w (0: not given), group
    const int64_t node[9] = {kernel.conv[0], conv9[6] ? conv9[6] : kernel.conv[1], conv9[7] ? conv9[7] : kernel.conv[2],
                             conv9[0], conv9[1], conv9[2], conv9[3], conv9[4], conv9[5]};
    for (int i = 0; i < 9; ++i) {
      if (node[i] != static_cast<int64_t>(kernel.conv[i])) {
        SetError(which + " was compiled for another conv geometry (field " + std::to_string(i) + ": " +
                 std::to_string(kernel.conv[i]) + ", the node has " + std::to_string(node[i]) + ")");
        return -1;
      }
    }
    // a grouped conv launches its groups along the grid's z: only a kernel compiled for one computes its group there
    if (conv9[8] > 1 && !kernel.grouped) {
      SetError(which + " was compiled for an ungrouped conv, the node has group " + std::to_string(conv9[8]) +
               ": optimize the original model again");
      return -1;
    }
  }
  return 0;
}

int dc_bundle_check_scale(const dc_bundle* b, float scale) {
  if (b == nullptr) {
    SetError("dc_bundle_check_scale: null bundle");
    return -1;
  }
  for (size_t k = 0; k < b->kernels.size(); ++k) {
    const dietcode::Kernel& kernel = b->kernels[k];
    if (kernel.kind == dietcode::kVendor || kernel.alpha == scale) continue;
    char values[96];
    std::snprintf(values, sizeof(values), "alpha %.9g, the node's scale is %.9g", kernel.alpha, scale);
    SetError("bundle kernel " + std::to_string(k) + " ('" + kernel.name + "') was compiled with " + values +
             "; optimize the model again");
    return -1;
  }
  return 0;
}

int dc_bundle_check_attention(const dc_bundle* b, int layout, int64_t head_dim, int mask_rows, int nan_to_zero) {
  if (b == nullptr || !dietcode::LayoutValid(layout) || head_dim < 0) {
    SetError("dc_bundle_check_attention: null bundle, layout " + std::to_string(layout) + " not a valid bit set "
             "(0..31, packed only with q, k and v) or negative head_dim " + std::to_string(head_dim));
    return -1;
  }
  for (size_t k = 0; k < b->kernels.size(); ++k) {
    const dietcode::Kernel& kernel = b->kernels[k];
    if (kernel.kind == dietcode::kVendor) continue;
    const std::string which = "bundle kernel " + std::to_string(k) + " ('" + kernel.name + "') was compiled ";
    std::string what;
    if (kernel.layout != layout) {
      what = "for operand layout " + dietcode::LayoutText(kernel.layout) + ", the node has " +
             dietcode::LayoutText(layout);
    } else if (head_dim > 0 && kernel.head_dim != head_dim) {
      what = "for head_dim " + std::to_string(kernel.head_dim) + ", the node's head_dim attribute is " +
             std::to_string(head_dim);
    } else if (std::find(kernel.params.begin(), kernel.params.end(), dietcode::kMask) != kernel.params.end() && kernel.mask_rows != (mask_rows != 0)) {
      what = std::string("with mask_rows=") + (kernel.mask_rows ? "1" : "0") + ", the node has mask_rows=" +
             (mask_rows ? "1" : "0");
    } else if (kernel.nan_to_zero != (nan_to_zero != 0)) {
      what = std::string("with nan_to_zero=") + (kernel.nan_to_zero ? "1" : "0") + ", the node has nan_to_zero=" +
             (nan_to_zero ? "1" : "0");
    } else {
      continue;
    }
    SetError(which + what + "; optimize the model again");
    return -1;
  }
  return 0;
}

int dc_bundle_max_feature_input(const dc_bundle* b) {
  if (b == nullptr) {
    SetError("null bundle");
    return -1;
  }
  int max_input = -1;
  for (const dietcode::Feature& f : b->features) {
    for (const auto& term : f.terms) max_input = std::max(max_input, static_cast<int>(term.first));
  }
  return max_input;
}

int dc_bundle_kernel_takes_param(const dc_bundle* b, int32_t k, const char* name) {
  const dietcode::Kernel* kernel = dietcode::KernelAt(b, k, "null bundle / name or ", name != nullptr);
  if (kernel == nullptr) return -1;
  for (uint8_t p : kernel->params) {
    if (std::strcmp(dietcode::kParamNames[p], name) == 0) return 1;
  }
  return 0;
}

int dc_bundle_kernel_view(const dc_bundle* b, int32_t k) {
  const dietcode::Kernel* kernel = dietcode::KernelAt(b, k);
  return kernel == nullptr ? -1 : dietcode::KernelView(*kernel);
}

int dc_bundle_pick_image(const dc_bundle* b, int32_t k, int major, int minor, char* desc, size_t desc_size) {
  int index = -1;
  const dietcode::Kernel* found = KernelImage(b, k, major, minor, &index);
  if (found == nullptr) return -1;
  const dietcode::Kernel& kernel = *found;
  std::string text;
  if (index >= 0) {
    const dietcode::Image& img = kernel.images[index];
    text = "cubin sm_" + std::to_string(img.cc) + (img.specific ? "a" : "");
  } else {
    uint32_t cc = 0;
    bool specific = false;
    dietcode::PtxTarget(kernel.ptx, &cc, &specific);
    text = "ptx sm_" + std::to_string(cc) + (specific ? "a" : "");
  }
  if (desc != nullptr && desc_size > 0) std::snprintf(desc, desc_size, "%s", text.c_str());
  return index >= 0 ? 0 : 1;
}

int dc_bundle_image_count(const dc_bundle* b, int32_t k) {
  const dietcode::Kernel* kernel = dietcode::KernelAt(b, k);
  return kernel == nullptr ? -1 : static_cast<int>(kernel->images.size());
}

int dc_bundle_image_toolchain(const dc_bundle* b, int32_t k, int32_t image, char* triton, size_t triton_size,
                              char* ptxas, size_t ptxas_size, int32_t* ptx_isa, int32_t* min_driver) {
  const dietcode::Kernel* found = dietcode::KernelAt(b, k);
  if (found == nullptr) return -1;
  const dietcode::Kernel& kernel = *found;
  if (image < -1 || (image >= 0 && static_cast<size_t>(image) >= kernel.images.size()) ||
      (image == -1 && kernel.ptx.empty())) {
    SetError("kernel '" + kernel.name + "' has no image " + std::to_string(image) + " (" +
             std::to_string(kernel.images.size()) + " cubins, " + (kernel.ptx.empty() ? "no PTX" : "PTX as -1") + ")");
    return -1;
  }
  const dietcode::Toolchain& t = image >= 0 ? kernel.images[image].toolchain : kernel.ptx_toolchain;
  if (triton != nullptr && triton_size > 0) std::snprintf(triton, triton_size, "%s", t.triton.c_str());
  if (ptxas != nullptr && ptxas_size > 0) std::snprintf(ptxas, ptxas_size, "%s", t.ptxas.c_str());
  if (ptx_isa) *ptx_isa = static_cast<int32_t>(t.ptx_isa);
  if (min_driver) *min_driver = static_cast<int32_t>(t.min_driver);
  return 0;
}

// Kernel k of `b` if `image` names one of its images (-1: its PTX), else null with the error set.
static const dietcode::Kernel* KernelImage(const dc_bundle* b, int32_t k, int32_t image) {
  const dietcode::Kernel* found = dietcode::KernelAt(b, k, "null bundle or ");
  if (found == nullptr) return nullptr;
  const dietcode::Kernel& kernel = *found;
  if (image < -1 || (image >= 0 && static_cast<size_t>(image) >= kernel.images.size()) ||
      (image == -1 && kernel.ptx.empty())) {
    SetError("kernel '" + kernel.name + "' has no image " + std::to_string(image));
    return nullptr;
  }
  return &kernel;
}

int dc_kernel_scratch_pointer(const dc_bundle* b, int32_t k, int32_t image, const dc_launch_args* args,
                              uint64_t* pointer) {
  if (args == nullptr || pointer == nullptr) {
    SetError("null arguments or pointer");
    return -1;
  }
  const dietcode::Kernel* found = KernelImage(b, k, image);
  if (found == nullptr) return -1;
  const dietcode::Kernel& kernel = *found;
  std::string why;
  if (!dietcode::ScratchPointer(kernel, image, *args, pointer, &why)) {
    SetError("kernel '" + kernel.name + "': " + why);
    return -1;
  }
  return 0;
}

int dc_bundle_image_scratch(const dc_bundle* b, int32_t k, int32_t image, uint32_t* size, uint32_t* align) {
  const dietcode::Kernel* kernel = KernelImage(b, k, image);
  if (kernel == nullptr) return -1;
  const auto [bytes, alignment] = dietcode::ImageScratch(*kernel, image);
  if (size) *size = bytes;
  if (align) *align = alignment;
  return 0;
}

}  // extern "C"
