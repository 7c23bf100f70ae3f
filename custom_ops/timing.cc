// Kernel timing for the tuner (timing.h): CUDA events around dc_launch, through the driver the core loaded.
#include "timing.h"

#include <string>
#include <vector>

#include <cuda.h>

#include "bundle_impl.h"
#include "driver.h"

#define DC_STR2(x) #x
#define DC_STR(x) DC_STR2(x)

namespace dietcode {
namespace {

struct TimingDriver {
  bool ok = false;
  std::string error;
  decltype(&::cuGetErrorString) GetErrorString = nullptr;
  decltype(&::cuDeviceGet) DeviceGet = nullptr;
  decltype(&::cuDevicePrimaryCtxRetain) PrimaryCtxRetain = nullptr;
  decltype(&::cuCtxSetCurrent) CtxSetCurrent = nullptr;
  decltype(&::cuCtxSynchronize) CtxSynchronize = nullptr;
  decltype(&::cuStreamCreate) StreamCreate = nullptr;
  decltype(&::cuStreamSynchronize) StreamSynchronize = nullptr;
  decltype(&::cuMemAlloc) MemAlloc = nullptr;
  decltype(&::cuMemFree) MemFree = nullptr;
  decltype(&::cuMemcpyHtoD) MemcpyHtoD = nullptr;
  decltype(&::cuMemsetD8Async) MemsetD8Async = nullptr;
  decltype(&::cuEventCreate) EventCreate = nullptr;
  decltype(&::cuEventDestroy) EventDestroy = nullptr;
  decltype(&::cuEventRecord) EventRecord = nullptr;
  decltype(&::cuEventElapsedTime) EventElapsedTime = nullptr;
};

template <typename F>
void Sym(const char* name, F* fn, std::string* error) {
  if (!error->empty()) return;
  *fn = reinterpret_cast<F>(DriverSymbol(name, error));
}

TimingDriver LoadTimingDriver() {
  TimingDriver t;
#define DC_SYM(field, api) Sym(DC_STR(api), &t.field, &t.error)
  DC_SYM(GetErrorString, cuGetErrorString);
  DC_SYM(DeviceGet, cuDeviceGet);
  DC_SYM(PrimaryCtxRetain, cuDevicePrimaryCtxRetain);
  DC_SYM(CtxSetCurrent, cuCtxSetCurrent);
  DC_SYM(CtxSynchronize, cuCtxSynchronize);
  DC_SYM(StreamCreate, cuStreamCreate);
  DC_SYM(StreamSynchronize, cuStreamSynchronize);
  DC_SYM(MemAlloc, cuMemAlloc);
  DC_SYM(MemFree, cuMemFree);
  DC_SYM(MemcpyHtoD, cuMemcpyHtoD);
  DC_SYM(MemsetD8Async, cuMemsetD8Async);
  DC_SYM(EventCreate, cuEventCreate);
  DC_SYM(EventDestroy, cuEventDestroy);
  DC_SYM(EventRecord, cuEventRecord);
#undef DC_SYM
  // cuda.h maps cuEventElapsedTime to cuEventElapsedTime_v2, which came with CUDA 12.8; older drivers (down to
  // 12.0, the oldest the bundles' cubins target) have only the original entry point, of the same signature.
  std::string missing;
  Sym(DC_STR(cuEventElapsedTime), &t.EventElapsedTime, &missing);
  if (!missing.empty()) Sym("cuEventElapsedTime", &t.EventElapsedTime, &t.error);
  t.ok = t.error.empty();
  return t;
}

const TimingDriver& Driver() {
  static const TimingDriver driver = LoadTimingDriver();
  return driver;
}

// Errors after which the context is lost (the driver reports them for every later call).
bool ContextFatal(CUresult rc) {
  switch (rc) {
    case CUDA_ERROR_ECC_UNCORRECTABLE:
    case CUDA_ERROR_ILLEGAL_ADDRESS:
    case CUDA_ERROR_LAUNCH_TIMEOUT:
    case CUDA_ERROR_ASSERT:
    case CUDA_ERROR_HARDWARE_STACK_ERROR:
    case CUDA_ERROR_ILLEGAL_INSTRUCTION:
    case CUDA_ERROR_MISALIGNED_ADDRESS:
    case CUDA_ERROR_INVALID_ADDRESS_SPACE:
    case CUDA_ERROR_INVALID_PC:
    case CUDA_ERROR_LAUNCH_FAILED:
    case CUDA_ERROR_CONTEXT_IS_DESTROYED:
    case CUDA_ERROR_UNKNOWN:
      return true;
    default:
      return false;
  }
}

// -1 or -2 (context-fatal) with the message set.
int Fail(const TimingDriver& t, CUresult rc, const std::string& what) {
  const char* s = nullptr;
  if (t.GetErrorString) t.GetErrorString(rc, &s);
  SetError(what + " failed: " + (s ? s : "unknown error") + " (code " + std::to_string(rc) + ")" +
           (ContextFatal(rc) ? "; the CUDA context is lost" : ""));
  return ContextFatal(rc) ? -2 : -1;
}

// After dc_launch refused or failed: -2 when the context turns out to be lost (an earlier launch's error
// surfacing now), else -1 with dc_launch's message kept.
int LaunchFailed(const TimingDriver& t) {
  const std::string message = dc_last_error();
  CUresult rc = t.CtxSynchronize();
  if (rc != CUDA_SUCCESS && ContextFatal(rc)) return Fail(t, rc, "launch (" + message + "): cuCtxSynchronize");
  SetError(message);
  return -1;
}

class Events {
 public:
  explicit Events(const TimingDriver& t) : t_(t) {}
  ~Events() {
    for (CUevent e : events_) t_.EventDestroy(e);
  }
  CUresult Add(CUevent* out) {
    CUresult rc = t_.EventCreate(out, CU_EVENT_DEFAULT);
    if (rc == CUDA_SUCCESS) events_.push_back(*out);
    return rc;
  }

 private:
  const TimingDriver& t_;
  std::vector<CUevent> events_;
};

}  // namespace
}  // namespace dietcode

extern "C" {

int dc_timing_open(int device, void** stream) {
  using dietcode::Fail;
  const dietcode::TimingDriver& t = dietcode::Driver();
  if (!t.ok) return dietcode::SetError(t.error), -1;
  if (stream == nullptr) return dietcode::SetError("dc_timing_open: null stream pointer"), -1;
  CUdevice dev = 0;
  CUresult rc = t.DeviceGet(&dev, device);
  if (rc != CUDA_SUCCESS) return Fail(t, rc, "cuDeviceGet for device " + std::to_string(device));
  CUcontext ctx = nullptr;
  rc = t.PrimaryCtxRetain(&ctx, dev);
  if (rc != CUDA_SUCCESS) return Fail(t, rc, "cuDevicePrimaryCtxRetain");
  rc = t.CtxSetCurrent(ctx);
  if (rc != CUDA_SUCCESS) return Fail(t, rc, "cuCtxSetCurrent");
  CUstream s = nullptr;
  rc = t.StreamCreate(&s, CU_STREAM_NON_BLOCKING);
  if (rc != CUDA_SUCCESS) return Fail(t, rc, "cuStreamCreate");
  *stream = s;
  return 0;
}

int dc_mem_alloc(uint64_t bytes, uint64_t* ptr) {
  const dietcode::TimingDriver& t = dietcode::Driver();
  if (!t.ok) return dietcode::SetError(t.error), -1;
  if (ptr == nullptr || bytes == 0) return dietcode::SetError("dc_mem_alloc: null pointer or 0 bytes"), -1;
  CUdeviceptr p = 0;
  CUresult rc = t.MemAlloc(&p, bytes);
  if (rc != CUDA_SUCCESS) return dietcode::Fail(t, rc, "cuMemAlloc of " + std::to_string(bytes) + " bytes");
  *ptr = static_cast<uint64_t>(p);
  return 0;
}

int dc_mem_free(uint64_t ptr) {
  const dietcode::TimingDriver& t = dietcode::Driver();
  if (!t.ok) return dietcode::SetError(t.error), -1;
  CUresult rc = t.MemFree(static_cast<CUdeviceptr>(ptr));
  return rc == CUDA_SUCCESS ? 0 : dietcode::Fail(t, rc, "cuMemFree");
}

int dc_mem_upload(uint64_t dst, const void* src, uint64_t bytes) {
  const dietcode::TimingDriver& t = dietcode::Driver();
  if (!t.ok) return dietcode::SetError(t.error), -1;
  if (src == nullptr && bytes) return dietcode::SetError("dc_mem_upload: null source"), -1;
  CUresult rc = t.MemcpyHtoD(static_cast<CUdeviceptr>(dst), src, bytes);
  return rc == CUDA_SUCCESS ? 0 : dietcode::Fail(t, rc, "cuMemcpyHtoD");
}

int dc_time_kernel(dc_bundle* bundle, int32_t k, const dc_launch_args* args, void* stream, int warmup,
                   int repeat, uint64_t flush, uint64_t flush_bytes, float* ms_out) {
  using dietcode::Fail;
  const dietcode::TimingDriver& t = dietcode::Driver();
  if (!t.ok) return dietcode::SetError(t.error), -1;
  if (bundle == nullptr || args == nullptr || stream == nullptr || ms_out == nullptr) {
    return dietcode::SetError("dc_time_kernel: null bundle, arguments, stream or output"), -1;
  }
  if (warmup < 1 || repeat < 1 || (flush_bytes > 0 && flush == 0)) {
    return dietcode::SetError("dc_time_kernel: warmup and repeat must be >= 1 (got " + std::to_string(warmup) +
                              ", " + std::to_string(repeat) + ") and a flush needs a buffer"), -1;
  }
  CUstream s = static_cast<CUstream>(stream);
  for (int i = 0; i < warmup; ++i) {
    if (dc_launch(bundle, k, args, s) != 0) return dietcode::LaunchFailed(t);
  }
  CUresult rc = t.StreamSynchronize(s);
  if (rc != CUDA_SUCCESS) return Fail(t, rc, "warm-up (cuStreamSynchronize)");
  dietcode::Events events(t);
  std::vector<CUevent> start(repeat), end(repeat);
  for (int i = 0; i < repeat; ++i) {
    if ((rc = events.Add(&start[i])) != CUDA_SUCCESS || (rc = events.Add(&end[i])) != CUDA_SUCCESS) {
      return Fail(t, rc, "cuEventCreate");
    }
  }
  for (int i = 0; i < repeat; ++i) {
    if (flush_bytes > 0) {
      rc = t.MemsetD8Async(static_cast<CUdeviceptr>(flush), static_cast<unsigned char>(i), flush_bytes, s);
      if (rc != CUDA_SUCCESS) return Fail(t, rc, "L2 flush (cuMemsetD8Async)");
    }
    if ((rc = t.EventRecord(start[i], s)) != CUDA_SUCCESS) return Fail(t, rc, "cuEventRecord");
    if (dc_launch(bundle, k, args, s) != 0) return dietcode::LaunchFailed(t);
    if ((rc = t.EventRecord(end[i], s)) != CUDA_SUCCESS) return Fail(t, rc, "cuEventRecord");
  }
  rc = t.StreamSynchronize(s);
  if (rc != CUDA_SUCCESS) return Fail(t, rc, "timed launches (cuStreamSynchronize)");
  for (int i = 0; i < repeat; ++i) {
    float ms = 0.0f;
    rc = t.EventElapsedTime(&ms, start[i], end[i]);
    if (rc != CUDA_SUCCESS) return Fail(t, rc, "cuEventElapsedTime");
    ms_out[i] = ms;
  }
  return 0;
}

}  // extern "C"
