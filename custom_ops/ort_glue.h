// Small pieces of ORT glue shared by the custom ops (ort_ops.cc, attention.cc). Header-only: each op's file
// keeps its kernels; what they both ask ORT the same way lives here once.
#pragma once

#include <cstdint>
#include <exception>
#include <string>
#include <vector>

#include "onnxruntime_cxx_api.h"

namespace dietcode {

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
