// Small pieces of ORT glue shared by the custom ops (ort_ops.cc, attention.cc). Header-only: each op's file
// keeps its kernels; what they both ask ORT the same way lives here once.
#pragma once

#include <cstdint>
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

}  // namespace dietcode
