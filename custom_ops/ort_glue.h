// Small pieces of ORT glue shared by the custom ops (ort_ops.cc, attention.cc). Header-only: each op's file
// keeps its kernels; what they both ask ORT the same way lives here once.
#pragma once

#include <cstdint>
#include <exception>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "core.h"
#include "onnxruntime_cxx_api.h"

namespace dietcode {

// Whether `get` (one of ORT's typed attribute getters) reads the attribute.
template <typename Get>
bool Reads(Get&& get) {
  try {
    get();
    return true;
  } catch (const Ort::Exception&) {
    return false;
  }
}

// Whether the node sets attribute `name` as an INT, FLOAT, STRING or TENSOR: ORT's typed getters fail alike
// for a missing attribute and for one of another type.
inline bool HasScalarAttribute(const Ort::ConstKernelInfo& info, const char* name) {
  Ort::AllocatorWithDefaultOptions alloc;
  return Reads([&] { info.GetAttribute<int64_t>(name); }) || Reads([&] { info.GetAttribute<float>(name); }) ||
         Reads([&] { info.GetAttribute<std::string>(name); }) || Reads([&] { info.GetTensorAttribute(name, alloc); });
}

// Whether the node sets attribute `name`, of whichever type the kernel API reads (those and INTS, FLOATS).
inline bool HasAttribute(const Ort::ConstKernelInfo& info, const char* name) {
  return HasScalarAttribute(info, name) || Reads([&] { info.GetAttributes<int64_t>(name); }) ||
         Reads([&] { info.GetAttributes<float>(name); });
}

template <typename T>
const char* AttrTypeName() {
  if constexpr (std::is_same_v<T, int64_t>) return "an INT";
  if constexpr (std::is_same_v<T, float>) return "a FLOAT";
  if constexpr (std::is_same_v<T, std::vector<int64_t>>) return "INTS";
  return "a STRING";
}

// An attribute the node (`where`) sets with another type than the op reads: an error naming it and the type
// (read as absent, a hand-edited FLOAT transB would run untransposed, an INTS causal as not causal).
template <typename T>
[[noreturn]] void ThrowAttrType(const std::string& where, const char* name) {
  throw std::runtime_error(where + ": the '" + name + "' attribute is not " + AttrTypeName<T>() +
                           " (optimize the model again)");
}

// The node's attribute `name`, or `def` when the node does not set it; an error naming the node (`where`)
// when it sets it with another type.
template <typename T>
T AttrOr(const Ort::ConstKernelInfo& info, const std::string& where, const char* name, T def) {
  try {
    return info.GetAttribute<T>(name);
  } catch (const Ort::Exception&) {
    if (HasAttribute(info, name)) ThrowAttrType<T>(where, name);
    return def;
  }
}

// The node's INTS attribute `name`, or {} when the node does not set it; an error for another type. (ORT
// reads an attribute of another type as an empty list: an empty one is checked to be no scalar.)
inline std::vector<int64_t> IntsOr(const Ort::ConstKernelInfo& info, const std::string& where, const char* name) {
  std::vector<int64_t> value;
  try {
    value = info.GetAttributes<int64_t>(name);
  } catch (const Ort::Exception&) {
    if (HasAttribute(info, name)) ThrowAttrType<std::vector<int64_t>>(where, name);
    return {};
  }
  if (value.empty() && HasScalarAttribute(info, name)) ThrowAttrType<std::vector<int64_t>>(where, name);
  return value;
}

// The core's element type code (dc_bundle_check_node, the vendor plans): 0 float, 1 float16, 2 bfloat16.
inline int DtypeCode(ONNXTensorElementDataType t) {
  return t == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT ? 0 : t == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 ? 1 : 2;
}

// Kernels hold the shared parse of their bundle input (dc_bundle_acquire): one per distinct bundle.
struct BundleDeleter {
  void operator()(dc_bundle* b) const { dc_bundle_release(b); }
};
using BundlePtr = std::unique_ptr<dc_bundle, BundleDeleter>;

// How AcquireBundleInput words a bundle input of the wrong kind: each problem by itself (the MatMul, Gemm and
// Conv ops), or a value that is no constant tensor, and a tensor of the wrong type, rank or size, as one each
// (Attention).
enum class BundleInputWording { kEach, kGrouped };

// The node's bundle input `index`, parsed once per distinct bytes (dc_bundle_acquire): a constant initializer
// (not a graph input, not computed by a node), a 1-D non-empty uint8 tensor in CPU memory (the op declares the
// input OrtMemTypeCPUInput, so ORT keeps it on the host also for a CUDA node). Throws std::runtime_error
// "<where>: <the problem, naming the input>" otherwise.
inline BundlePtr AcquireBundleInput(const Ort::ConstKernelInfo& info, size_t index, const std::string& where,
                                    BundleInputWording wording) {
  const std::string name = info.GetInputName(index);
  const std::string input = "the bundle input '" + name + "'";
  const bool grouped = wording == BundleInputWording::kGrouped;
  auto fail = [&](const std::string& problem) { throw std::runtime_error(where + ": " + problem); };
  int is_constant = 0;
  Ort::ConstValue tensor{nullptr};
  try {
    tensor = info.GetTensorConstantInput(index, &is_constant);
  } catch (const Ort::Exception& e) {
    fail("cannot read the bundle input '" + name + "': " + e.what());
  }
  if (!is_constant || static_cast<const OrtValue*>(tensor) == nullptr || (grouped && !tensor.IsTensor())) {
    fail(input + " is not a constant initializer" + (grouped ? "" : " (a graph input, or computed by a node)") +
         "; it must be a uint8 initializer that is not also a graph input");
  }
  if (!tensor.IsTensor()) fail(input + " is not a tensor");
  auto shape_info = tensor.GetTensorTypeAndShapeInfo();
  const bool is_uint8 = shape_info.GetElementType() == ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8;
  const size_t rank = shape_info.GetDimensionsCount(), size = shape_info.GetElementCount();
  if (grouped && (!is_uint8 || rank != 1 || size == 0)) fail(input + " must be a non-empty 1-D uint8 tensor");
  if (!is_uint8) fail(input + " must be a uint8 tensor");
  if (rank != 1) fail(input + " must be 1-D, it has rank " + std::to_string(rank));
  if (size == 0) fail(input + " is empty");
  if (tensor.GetTensorMemoryInfo().GetDeviceType() != OrtMemoryInfoDeviceType_CPU) {
    fail(input + " is not in CPU memory");
  }
  BundlePtr bundle(dc_bundle_acquire(tensor.GetTensorData<uint8_t>(), size));
  if (!bundle) fail("bundle input '" + name + "': " + dc_last_error());
  return bundle;
}

// A kernel's ComputeV2: runs `compute`; an exception becomes the status returned, its message prefixed with the
// node (``where``) once, whether or not the thrower already named it.
template <typename Compute>
OrtStatusPtr ComputeStatus(const std::string& where, Compute&& compute) {
  try {
    compute();
    return nullptr;
  } catch (const std::exception& e) {
    const std::string what = e.what();
    const std::string text = what.rfind(where, 0) == 0 ? what : where + ": " + what;
    return Ort::GetApi().CreateStatus(ORT_RUNTIME_EXCEPTION, text.c_str());
  }
}

// A custom op's CreateKernelV2: the kernel `make` returns into *kernel; an exception (the node refused at session
// creation) becomes an INVALID_ARGUMENT status with its message.
template <typename Make>
OrtStatusPtr CreateKernelStatus(const OrtApi& api, void** kernel, Make&& make) {
  try {
    *kernel = make();
    return nullptr;
  } catch (const std::exception& e) {
    return api.CreateStatus(ORT_INVALID_ARGUMENT, e.what());
  }
}

// The input's shape into `out`, reusing its capacity (the hot paths keep per-thread shape buffers).
inline void ReadShape(const Ort::ConstValue& v, std::vector<int64_t>* out) {
  auto info = v.GetTensorTypeAndShapeInfo();
  out->resize(info.GetDimensionsCount());
  if (!out->empty()) info.GetDimensions(out->data(), out->size());
}

// The node's CUDA device (its default allocator's device id; 0 when ORT does not say).
inline int NodeDevice(const OrtKernelInfo* info) {
  const OrtApi& api = Ort::GetApi();
  OrtAllocator* alloc = nullptr;
  int device = 0;
  if (OrtStatus* st = api.KernelInfoGetAllocator(info, OrtMemTypeDefault, &alloc)) {
    api.ReleaseStatus(st);
    return 0;
  }
  const OrtMemoryInfo* mem = nullptr;
  if (OrtStatus* st = api.AllocatorGetInfo(alloc, &mem)) {
    api.ReleaseStatus(st);
  } else if (OrtStatus* st2 = api.MemoryInfoGetId(mem, &device)) {
    api.ReleaseStatus(st2);
    device = 0;
  }
  api.ReleaseAllocator(alloc);
  return device;
}

// The node's device memory (the memory info of its default allocator, kept alive with it): what a CUDA node
// asks ORT's per-call scratch allocator for. Empty (info() null) when ORT gives no allocator.
class NodeMemory {
 public:
  explicit NodeMemory(const OrtKernelInfo* info) {
    const OrtApi& api = Ort::GetApi();
    if (OrtStatus* st = api.KernelInfoGetAllocator(info, OrtMemTypeDefault, &allocator_)) {
      api.ReleaseStatus(st);
      allocator_ = nullptr;
      return;
    }
    if (OrtStatus* st = api.AllocatorGetInfo(allocator_, &info_)) {
      api.ReleaseStatus(st);
      info_ = nullptr;
    }
  }
  ~NodeMemory() {
    if (allocator_ != nullptr) Ort::GetApi().ReleaseAllocator(allocator_);
  }
  NodeMemory(const NodeMemory&) = delete;
  NodeMemory& operator=(const NodeMemory&) = delete;
  const OrtMemoryInfo* info() const { return info_; }

 private:
  OrtAllocator* allocator_ = nullptr;
  const OrtMemoryInfo* info_ = nullptr;
};

// Device memory for one call (the split-K workspace), from ORT's scratch allocator on the call's compute stream,
// given back when the object goes out of scope: right after the launch is enqueued, before the GPU has run it.
// That is safe because ORT's allocator orders reuse by the stream. onnxruntime/core/session/custom_ops.cc:
// KernelContext_GetScratchBuffer allocates from OpKernelContext::GetAllocator(mem_info->device) with
// AllocateBufferWithOptions(..., stream = the kernel's compute stream, stream->GetWaitNotificationFn()): the
// arena records the stream with the chunk, so a later allocation on the same stream reuses it in stream order
// (after our launch), and a stream-aware arena hands it to another stream only after waiting on a notification
// of this one. KernelContext_GetAllocator wraps the same OpKernelContext::GetAllocator(device) allocator, whose
// Free hands the chunk back to that arena. ORT's own CUDA kernels rely on the same contract: the memory of
// their GetScratchBuffer (an IAllocatorUniquePtr) is freed when ComputeInternal returns, launches still queued.
class ScratchBuffer {
 public:
  ScratchBuffer() = default;
  ~ScratchBuffer() { Release(); }
  ScratchBuffer(const ScratchBuffer&) = delete;
  ScratchBuffer& operator=(const ScratchBuffer&) = delete;

  // `bytes` (> 0) of memory `mem` for this call, 16-byte aligned; false with *error when ORT gives none.
  bool Allocate(OrtKernelContext* context, const OrtMemoryInfo* mem, size_t bytes, std::string* error) {
    Release();
    if (mem == nullptr) return *error = "ONNX Runtime gives no allocator for this node's device", false;
    const OrtApi& api = Ort::GetApi();
    try {  // the allocator can throw across the C API (an arena out of memory)
      if (OrtStatus* st = api.KernelContext_GetAllocator(context, mem, &allocator_)) {
        *error = api.GetErrorMessage(st);
        api.ReleaseStatus(st);
        allocator_ = nullptr;
        return false;
      }
      if (OrtStatus* st = api.KernelContext_GetScratchBuffer(context, mem, bytes, &data_)) {
        *error = api.GetErrorMessage(st);
        api.ReleaseStatus(st);
        data_ = nullptr;
      }
    } catch (const std::exception& e) {
      *error = e.what();
      data_ = nullptr;
    } catch (...) {
      *error = "unknown exception";
      data_ = nullptr;
    }
    if (data_ == nullptr) {
      *error = "ONNX Runtime's scratch allocator gives no " + std::to_string(bytes) + " bytes" +
               (error->empty() ? std::string() : ": " + *error);
      Release();
      return false;
    }
    if (reinterpret_cast<uintptr_t>(data_) % 16 != 0) {
      *error = "ONNX Runtime's scratch buffer is not 16-byte aligned";
      Release();
      return false;
    }
    return true;
  }
  uint64_t address() const { return reinterpret_cast<uint64_t>(data_); }

 private:
  void Release() {
    if (data_ != nullptr && allocator_ != nullptr) allocator_->Free(allocator_, data_);
    if (allocator_ != nullptr) Ort::GetApi().ReleaseAllocator(allocator_);
    data_ = nullptr;
    allocator_ = nullptr;
  }

  OrtAllocator* allocator_ = nullptr;
  void* data_ = nullptr;
};

}  // namespace dietcode
