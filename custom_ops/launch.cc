// CUDA side of the core: libcuda loaded with dlopen at run time (no toolkit, no link-time dependency),
// module loading once per (context, kernel): a bundle's cubins all at its first launch in a context, PTX
// on first use (LoadCubins), and the launch itself, following the kernel ABI.
//
// Symbols are looked up by the exact versioned names the cuda.h in use maps each API to (for example
// cuCtxPushCurrent -> cuCtxPushCurrent_v2), obtained by stringizing the header's own macros.
#include <dlfcn.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

#include <cuda.h>

#include "bundle_impl.h"
#include "driver.h"
#include "vendor.h"

#define DC_STR2(x) #x
#define DC_STR(x) DC_STR2(x)

namespace dietcode {
namespace {

struct Driver {
  bool ok = false;
  std::string error;
  void* lib = nullptr;  // the dlopen handle (DriverSymbol)
  decltype(&::cuInit) Init = nullptr;
  decltype(&::cuDriverGetVersion) DriverGetVersion = nullptr;
  decltype(&::cuGetErrorString) GetErrorString = nullptr;
  decltype(&::cuDeviceGetCount) DeviceGetCount = nullptr;
  decltype(&::cuDeviceGet) DeviceGet = nullptr;
  decltype(&::cuDeviceGetName) DeviceGetName = nullptr;
  decltype(&::cuDeviceGetAttribute) DeviceGetAttribute = nullptr;
  decltype(&::cuCtxGetCurrent) CtxGetCurrent = nullptr;
  decltype(&::cuCtxPushCurrent) CtxPushCurrent = nullptr;
  decltype(&::cuCtxPopCurrent) CtxPopCurrent = nullptr;
  decltype(&::cuCtxGetDevice) CtxGetDevice = nullptr;
  decltype(&::cuStreamGetCtx) StreamGetCtx = nullptr;
  decltype(&::cuStreamIsCapturing) StreamIsCapturing = nullptr;
  decltype(&::cuModuleLoadData) ModuleLoadData = nullptr;
  decltype(&::cuModuleUnload) ModuleUnload = nullptr;
  decltype(&::cuModuleGetFunction) ModuleGetFunction = nullptr;
  decltype(&::cuFuncSetAttribute) FuncSetAttribute = nullptr;
  decltype(&::cuMemsetD8Async) MemsetD8Async = nullptr;
  decltype(&::cuMemAlloc) MemAlloc = nullptr;
  decltype(&::cuMemFree) MemFree = nullptr;
  decltype(&::cuLaunchKernel) LaunchKernel = nullptr;
};

template <typename F>
bool Load(void* lib, const char* name, F* fn, std::string* missing) {
  *fn = reinterpret_cast<F>(dlsym(lib, name));
  if (*fn == nullptr) *missing += std::string(missing->empty() ? "" : ", ") + name;
  return *fn != nullptr;
}

Driver LoadDriver() {
  Driver d;
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* why = dlerror();
    d.error = std::string("cannot load the CUDA driver libcuda.so.1 (") + (why ? why : "unknown reason") +
              "): install the NVIDIA driver or run on a machine with a GPU";
    return d;
  }
  d.lib = lib;
  std::string missing;
#define DC_LOAD(field, api) Load(lib, DC_STR(api), &d.field, &missing)
  DC_LOAD(Init, cuInit);
  DC_LOAD(DriverGetVersion, cuDriverGetVersion);
  DC_LOAD(GetErrorString, cuGetErrorString);
  DC_LOAD(DeviceGetCount, cuDeviceGetCount);
  DC_LOAD(DeviceGet, cuDeviceGet);
  DC_LOAD(DeviceGetName, cuDeviceGetName);
  DC_LOAD(DeviceGetAttribute, cuDeviceGetAttribute);
  DC_LOAD(CtxGetCurrent, cuCtxGetCurrent);
  DC_LOAD(CtxPushCurrent, cuCtxPushCurrent);
  DC_LOAD(CtxPopCurrent, cuCtxPopCurrent);
  DC_LOAD(CtxGetDevice, cuCtxGetDevice);
  DC_LOAD(StreamGetCtx, cuStreamGetCtx);
  DC_LOAD(StreamIsCapturing, cuStreamIsCapturing);
  DC_LOAD(ModuleLoadData, cuModuleLoadData);
  DC_LOAD(ModuleUnload, cuModuleUnload);
  DC_LOAD(ModuleGetFunction, cuModuleGetFunction);
  DC_LOAD(FuncSetAttribute, cuFuncSetAttribute);
  DC_LOAD(MemsetD8Async, cuMemsetD8Async);
  DC_LOAD(MemAlloc, cuMemAlloc);
  DC_LOAD(MemFree, cuMemFree);
  DC_LOAD(LaunchKernel, cuLaunchKernel);
#undef DC_LOAD
  if (!missing.empty()) {
    d.error = "the CUDA driver lacks " + missing + ": update the NVIDIA driver";
    return d;
  }
  CUresult rc = d.Init(0);
  if (rc != CUDA_SUCCESS) {
    const char* s = nullptr;
    d.GetErrorString(rc, &s);
    d.error = std::string("cuInit failed: ") + (s ? s : "unknown error") + " (code " + std::to_string(rc) +
              "); is a GPU visible (CUDA_VISIBLE_DEVICES, container runtime)?";
    return d;
  }
  d.ok = true;
  return d;
}

const Driver& GetDriver() {
  static const Driver driver = LoadDriver();  // thread-safe one-time initialization (C++11 statics)
  return driver;
}

std::string CuError(const Driver& d, CUresult rc, const char* what) {
  const char* s = nullptr;
  if (d.GetErrorString) d.GetErrorString(rc, &s);
  return std::string(what) + " failed: " + (s ? s : "unknown error") + " (code " + std::to_string(rc) + ")";
}

// Makes `ctx` current for the scope when it is not already.
class ContextScope {
 public:
  ContextScope(const Driver& d, CUcontext ctx) : d_(d) {
    CUcontext current = nullptr;
    d_.CtxGetCurrent(&current);
    if (current != ctx && ctx != nullptr) pushed_ = d_.CtxPushCurrent(ctx) == CUDA_SUCCESS;
  }
  ~ContextScope() {
    if (pushed_) {
      CUcontext ignored = nullptr;
      d_.CtxPopCurrent(&ignored);
    }
  }

 private:
  const Driver& d_;
  bool pushed_ = false;
};

constexpr uint32_t kDefaultSharedLimit = 48 * 1024;

// What the current context's device offers a kernel's image choice and load (PickImage, FitsDevice).
struct DeviceFacts {
  int major = 0, minor = 0;
  int64_t smem_optin = kDefaultSharedLimit;
  int driver = 0;  // cuDriverGetVersion's value; 0: not checked
};

bool CurrentDevice(const Driver& d, DeviceFacts* facts, std::string* error) {
  CUdevice dev = 0;
  const CUresult rc = d.CtxGetDevice(&dev);
  if (rc != CUDA_SUCCESS) return *error = CuError(d, rc, "cuCtxGetDevice"), false;
  int optin = 0;
  d.DeviceGetAttribute(&facts->major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev);
  d.DeviceGetAttribute(&facts->minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev);
  d.DeviceGetAttribute(&optin, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, dev);
  facts->smem_optin = optin > 0 ? optin : kDefaultSharedLimit;
  if (d.DriverGetVersion(&facts->driver) != CUDA_SUCCESS) facts->driver = 0;
  return true;
}

// Loads kernel k's image for the device (PickImage) into the current context: its module, function and, above
// 48 KiB, the dynamic shared memory attribute. False with the reason in `error`.
bool LoadKernel(const Driver& d, const Kernel& k, const DeviceFacts& dev, LoadedKernel* out, std::string* error) {
  const int major = dev.major, minor = dev.minor;
  int index = -1;
  if (!FitsDevice(k, major, minor, dev.smem_optin, error, dev.driver)) return false;
  if (!PickImage(k, major, minor, &index, error, dev.driver)) return false;
  const void* image = index >= 0 ? static_cast<const void*>(k.images[index].bytes.data())
                                 : static_cast<const void*>(k.ptx.c_str());
  CUmodule module = nullptr;
  CUresult rc = d.ModuleLoadData(&module, image);
  if (rc != CUDA_SUCCESS) {
    *error = CuError(d, rc, "cuModuleLoadData") + " for kernel '" + k.name + "' (" +
             (index >= 0 ? "cubin" : "PTX JIT") + " on sm_" + std::to_string(major * 10 + minor) + ")";
    return false;
  }
  CUfunction fn = nullptr;
  const uint32_t shared = ImageShared(k, index);
  out->image_index = index;
  rc = d.ModuleGetFunction(&fn, module, k.name.c_str());
  if (rc == CUDA_SUCCESS && shared > kDefaultSharedLimit) {
    rc = d.FuncSetAttribute(fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, static_cast<int>(shared));
  }
  if (rc != CUDA_SUCCESS) {
    *error = CuError(d, rc, "loading function") + " '" + k.name + "'";
    d.ModuleUnload(module);
    return false;
  }
  out->module = module;
  out->function = fn;
  out->shared = shared;
  return true;
}

// The eager load of bundle b in context `ctx` (current, b->mutex held), once per (bundle, context) at the first
// launch of any of its kernels there: every compiled kernel that fits the device with a cubin for it is
// loaded now, so that a call whose shape picks a kernel not launched before loads nothing. A kernel the
// device runs from PTX only stays lazy (a JIT compiles it, a cubin load does not), as does one that does not
// fit the device (its launch says why). A kernel whose cubin fails to load keeps its error in b->load_errors for
// its own launch; the launch of another kernel does not fail for it.
void LoadCubins(const Driver& d, dc_bundle* b, void* ctx, const DeviceFacts& dev) {
  for (size_t i = 0; i < b->kernels.size(); ++i) {
    const Kernel& k = b->kernels[i];
    const auto key = std::make_pair(ctx, static_cast<int32_t>(i));
    int index = -1;
    std::string why;
    if (k.kind == kVendor || b->loaded.count(key) != 0) continue;
    if (!FitsDevice(k, dev.major, dev.minor, dev.smem_optin, &why, dev.driver)) continue;  // its launch says why
    if (!PickImage(k, dev.major, dev.minor, &index, &why, dev.driver) || index < 0) continue;  // PTX: on first use
    LoadedKernel loaded;
    if (LoadKernel(d, k, dev, &loaded, &why)) {
      b->loaded.emplace(key, loaded);
    } else {
      b->load_errors[key] = why;
    }
  }
}

int Fail(const std::string& message) {
  SetError(message);
  return -1;
}

// The CUDA context a launch on `stream` runs in (the current one for the null stream); false with the
// reason in `error` when there is none.
bool StreamContext(const Driver& d, CUstream s, CUcontext* ctx, std::string* error) {
  *ctx = nullptr;
  const CUresult rc = s != nullptr ? d.StreamGetCtx(s, ctx) : d.CtxGetCurrent(ctx);
  if (rc != CUDA_SUCCESS) return *error = CuError(d, rc, "finding the stream's context"), false;
  if (*ctx == nullptr) return *error = "no CUDA context is current on this thread and no stream was given", false;
  return true;
}

// What a call that enqueues work on the caller's stream does first: resolve the driver, find the stream's
// context (StreamContext) and make it current for the scope (ContextScope). ok() is false, with the reason in
// `error`, when the driver cannot be used or the stream has no context.
struct StreamCall {
  explicit StreamCall(void* stream) : d(GetDriver()), s(static_cast<CUstream>(stream)) {
    if (!d.ok) {
      error = d.error;
    } else if (StreamContext(d, s, &ctx, &error)) {
      scope.emplace(d, ctx);
    }
  }
  bool ok() const { return scope.has_value(); }

  const Driver& d;
  const CUstream s;
  CUcontext ctx = nullptr;
  std::string error;
  std::optional<ContextScope> scope;
};

// The multiprocessor count of `ctx`'s device, queried once per context and cached (persistent grids).
bool ContextSmCount(const Driver& d, CUcontext ctx, int32_t* count, std::string* error) {
  static std::mutex mutex;
  static std::map<CUcontext, int32_t> counts;
  {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = counts.find(ctx);
    if (it != counts.end()) return *count = it->second, true;
  }
  ContextScope scope(d, ctx);
  CUdevice dev = 0;
  CUresult rc = d.CtxGetDevice(&dev);
  if (rc != CUDA_SUCCESS) return *error = CuError(d, rc, "cuCtxGetDevice"), false;
  int sms = 0;
  rc = d.DeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev);
  if (rc != CUDA_SUCCESS) return *error = CuError(d, rc, "cuDeviceGetAttribute (multiprocessor count)"), false;
  if (sms <= 0) return *error = "the device reports " + std::to_string(sms) + " multiprocessors", false;
  std::lock_guard<std::mutex> lock(mutex);
  counts[ctx] = sms;
  return *count = sms, true;
}

}  // namespace

void* DriverSymbol(const char* name, std::string* error) {
  const Driver& d = GetDriver();
  if (!d.ok) return *error = d.error, nullptr;
  void* fn = dlsym(d.lib, name);
  if (fn == nullptr) *error = std::string("the CUDA driver lacks ") + name + ": update the NVIDIA driver";
  return fn;
}

namespace {

// Entry `entry` of the vendor path's PTX module `ptx` in the call's context (current), loaded (JIT) the first time
// and kept for the process, once per (context, module text). False with *error.
bool PtxFunction(const StreamCall& on, const char* ptx, const char* entry, CUfunction* fn, std::string* error) {
  const Driver& d = on.d;
  static std::mutex mutex;
  static std::map<std::pair<void*, const char*>, CUfunction> functions;
  std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_pair(static_cast<void*>(on.ctx), ptx);
  auto it = functions.find(key);
  if (it == functions.end()) {
    CUmodule module = nullptr;
    CUresult rc = d.ModuleLoadData(&module, ptx);
    if (rc != CUDA_SUCCESS) return *error = CuError(d, rc, "cuModuleLoadData (PTX JIT)") + " for " + entry, false;
    rc = d.ModuleGetFunction(fn, module, entry);
    if (rc != CUDA_SUCCESS) {
      d.ModuleUnload(module);
      return *error = CuError(d, rc, "cuModuleGetFunction") + " for " + entry, false;
    }
    it = functions.emplace(key, *fn).first;
  }
  *fn = it->second;
  return true;
}

}  // namespace

// The vendor path's PTX modules (vendor.h), loaded once per (context, module text) and kept for the process.
bool LoadPtx(const char* ptx, const char* entry, void* stream, std::string* error) {
  const StreamCall on(stream);
  if (!on.ok()) return *error = on.error, false;
  CUfunction fn = nullptr;
  return PtxFunction(on, ptx, entry, &fn, error);
}

bool InStreamContext(void* stream, bool (*fn)(void* context, void* arg, std::string* error), void* arg,
                     std::string* error) {
  const StreamCall on(stream);
  if (!on.ok()) return *error = on.error, false;
  return fn(static_cast<void*>(on.ctx), arg, error);
}

bool LaunchPtx(const char* ptx, const char* entry, unsigned grid_x, unsigned grid_y, unsigned block_x,
               unsigned block_y, void** params, void* stream, std::string* error) {
  const StreamCall on(stream);
  if (!on.ok()) return *error = on.error, false;
  CUfunction fn = nullptr;
  if (!PtxFunction(on, ptx, entry, &fn, error)) return false;
  const CUresult rc = on.d.LaunchKernel(fn, grid_x, grid_y, 1, block_x, block_y, 1, 0, on.s, params, nullptr);
  if (rc != CUDA_SUCCESS) return *error = CuError(on.d, rc, "cuLaunchKernel") + " for " + entry, false;
  return true;
}

// The fewest counters a (context, stream) gets, 16 KiB: the tiles of a split-K call, which a search picks for
// calls with few tiles (4096: 512 rows x 4096 columns of 16 x 32 tiles), so that a later, larger shape seldom
// allocates again on its first call.
constexpr uint64_t kMinCounters = 4096;

// The split-K counters of a launch on (`ctx`, `s`) needing `count` of them: memory the bundle
// keeps per (context, stream), zeroed on the stream when allocated. Every split-K launch puts the counters it
// used back to zero (the last split of a tile resets its counter, docs/abi.md), and launches on one stream run
// in order, so the next launch there finds them at zero without a memset per call. A larger call allocates a
// larger block (at least twice the last), and the one it replaces stays allocated until the bundle is freed,
// since launches queued before may still use it. 0 tells the caller to fall back to the workspace's counter room
// and a memset before the launch, as every launch did before C ABI 14:
// - while the stream is being captured into a CUDA graph (or its capture state is unknown): cuMemAlloc there
//   would fail and invalidate the capture, and a graph holding the stream's counters could be replayed on
//   another stream while launches on this one use them; with the fallback the graph records its own memset and
//   the call's workspace, so each replay zeroes counters no launch outside it touches;
// - when the allocation or its memset is refused (out of memory): remembered for the (context, stream), which
//   then keeps to the fallback rather than retry under the bundle's lock at every launch;
// - on CU_STREAM_PER_THREAD, one handle for a stream per thread, whose launches from two threads may run at once.
uint64_t SplitKCounters(const Driver& d, dc_bundle* b, CUcontext ctx, CUstream s, uint64_t count) {
  if (s == CU_STREAM_PER_THREAD) return 0;
  CUstreamCaptureStatus capture = CU_STREAM_CAPTURE_STATUS_NONE;
  if (d.StreamIsCapturing(s, &capture) != CUDA_SUCCESS || capture != CU_STREAM_CAPTURE_STATUS_NONE) return 0;
  std::lock_guard<std::mutex> lock(b->mutex);
  dc_bundle::Counters& kept = b->counters[std::make_pair(static_cast<void*>(ctx), static_cast<void*>(s))];
  if (count <= kept.count) return kept.address;
  if (kept.refused) return 0;
  const uint64_t grown = std::max<uint64_t>({count, 2 * kept.count, kMinCounters});
  CUdeviceptr fresh = 0;
  if (d.MemAlloc(&fresh, grown * 4) != CUDA_SUCCESS) return kept.refused = true, 0;
  if (d.MemsetD8Async(fresh, 0, grown * 4, s) != CUDA_SUCCESS) {
    d.MemFree(fresh);
    return kept.refused = true, 0;
  }
  if (kept.address != 0) kept.retired.push_back(kept.address);
  kept.address = static_cast<uint64_t>(fresh);
  kept.count = grown;
  return kept.address;
}

}  // namespace dietcode

// The counters are freed as the modules are unloaded: when the bundle's last user lets it go (ORT frees a
// session's kernels once its runs are done), after the work that used them; cuMemFree also waits for the device
// in practice.
dc_bundle::~dc_bundle() {
  if (loaded.empty() && counters.empty()) return;
  const dietcode::Driver& d = dietcode::GetDriver();
  if (!d.ok) return;
  for (auto& entry : loaded) {
    dietcode::ContextScope scope(d, static_cast<CUcontext>(entry.first.first));
    d.ModuleUnload(static_cast<CUmodule>(entry.second.module));
  }
  for (auto& entry : counters) {
    dietcode::ContextScope scope(d, static_cast<CUcontext>(entry.first.first));
    for (uint64_t address : entry.second.retired) d.MemFree(static_cast<CUdeviceptr>(address));
    if (entry.second.address != 0) d.MemFree(static_cast<CUdeviceptr>(entry.second.address));
  }
}

extern "C" {

int dc_cuda_probe(int device, char* name, size_t name_size, int* major, int* minor, int* driver_version) {
  const dietcode::Driver& d = dietcode::GetDriver();
  if (!d.ok) return dietcode::Fail(d.error);
  int version = 0, count = 0;
  d.DriverGetVersion(&version);
  if (driver_version) *driver_version = version;
  CUresult rc = d.DeviceGetCount(&count);
  if (rc != CUDA_SUCCESS) return dietcode::Fail(dietcode::CuError(d, rc, "cuDeviceGetCount"));
  if (device < 0 || device >= count) {
    return dietcode::Fail("device " + std::to_string(device) + " out of range: " + std::to_string(count) + " visible");
  }
  CUdevice dev = 0;
  rc = d.DeviceGet(&dev, device);
  if (rc != CUDA_SUCCESS) return dietcode::Fail(dietcode::CuError(d, rc, "cuDeviceGet"));
  char buffer[256] = {};
  d.DeviceGetName(buffer, sizeof(buffer) - 1, dev);
  if (name && name_size) std::snprintf(name, name_size, "%s", buffer);
  int mj = 0, mn = 0;
  d.DeviceGetAttribute(&mj, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev);
  d.DeviceGetAttribute(&mn, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev);
  if (major) *major = mj;
  if (minor) *minor = mn;
  return 0;
}

int dc_cuda_sm_count(void* stream, int* count) {
  const dietcode::Driver& d = dietcode::GetDriver();
  if (!d.ok) return dietcode::Fail(d.error);
  CUcontext ctx = nullptr;
  std::string why;
  if (!dietcode::StreamContext(d, static_cast<CUstream>(stream), &ctx, &why)) return dietcode::Fail(why);
  int32_t sms = 0;
  if (!dietcode::ContextSmCount(d, ctx, &sms, &why)) return dietcode::Fail(why);
  if (count) *count = sms;
  return 0;
}

int dc_cuda_driver_version(int* version) {
  const dietcode::Driver& d = dietcode::GetDriver();
  if (!d.ok) return dietcode::Fail(d.error);
  int v = 0;
  CUresult rc = d.DriverGetVersion(&v);
  if (rc != CUDA_SUCCESS) return dietcode::Fail(dietcode::CuError(d, rc, "cuDriverGetVersion"));
  if (version) *version = v;
  return 0;
}

int dc_cuda_device_limits(int device, int* major, int* minor, int* smem_optin) {
  const dietcode::Driver& d = dietcode::GetDriver();
  if (!d.ok) return dietcode::Fail(d.error);
  CUdevice dev = 0;
  CUresult rc = d.DeviceGet(&dev, device);
  if (rc != CUDA_SUCCESS) return dietcode::Fail(dietcode::CuError(d, rc, "cuDeviceGet") + " for device " + std::to_string(device));
  int mj = 0, mn = 0, optin = 0;
  d.DeviceGetAttribute(&mj, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev);
  d.DeviceGetAttribute(&mn, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev);
  rc = d.DeviceGetAttribute(&optin, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, dev);
  if (rc != CUDA_SUCCESS || optin <= 0) optin = static_cast<int>(dietcode::kDefaultSharedLimit);
  if (major) *major = mj;
  if (minor) *minor = mn;
  if (smem_optin) *smem_optin = optin;
  return 0;
}

int dc_launch(dc_bundle* b, int32_t k, const dc_launch_args* args, void* stream) {
  return dc_launch_fit(b, k, args, stream) == 0 ? 0 : -1;  // a call that does not fit is an error here
}

int dc_launch_fit(dc_bundle* b, int32_t k, const dc_launch_args* args, void* stream) {
  using dietcode::Fail;
  if (b == nullptr || args == nullptr) return Fail("null bundle or launch arguments");
  if (k < 0 || static_cast<size_t>(k) >= b->kernels.size()) return Fail("kernel id " + std::to_string(k) + " out of range");
  const dietcode::Kernel& kernel = b->kernels[k];
  if (kernel.kind == dietcode::kVendor) return Fail("kernel '" + kernel.name + "' is the vendor kind: run ORT's kernel");
  {
    std::string why;  // the call's one fit check (dc_kernel_fit's decision): nothing launches without it
    const dietcode::Fit fit = dietcode::CallFit(kernel, *args, &why);
    if (fit != dietcode::kFits) {
      dietcode::SetError(why);
      return fit;
    }
  }
  // A split-K kernel meets its splits in the caller's workspace, and a kernel with global scratch (TMA
  // descriptors) writes it there too (abi.md): it must be there, large enough and 16-byte aligned (the kernels
  // are compiled assuming so), or the kernel would write past it. A persistent kernel's scratch follows its grid,
  // which follows the device's SM count: without args->sm_count it is checked once the device is known.
  dc_launch_args call = *args;
  auto check_workspace = [&]() -> bool {
    int64_t workspace = 0;
    std::string why;
    if (!dietcode::WorkspaceBytes(kernel, call, &workspace, &why)) return Fail("kernel '" + kernel.name + "': " + why), false;
    if (workspace > 0 && (call.workspace == 0 || call.workspace % dietcode::kWorkspaceAlign != 0 ||
                          call.workspace_bytes < static_cast<uint64_t>(workspace))) {
      char hex[32];
      std::snprintf(hex, sizeof(hex), "%llx", static_cast<unsigned long long>(call.workspace));
      Fail("kernel '" + kernel.name + "' (split_k " + std::to_string(kernel.split_k) + ", global scratch " +
           std::to_string(dietcode::KernelScratch(kernel).first) + " B per program" +
           (kernel.persistent ? ", " + std::to_string(call.sm_count) + " SMs" : std::string()) +
           ") needs a workspace of " + std::to_string(workspace) + " bytes, 16-byte aligned; the call gives " +
           std::to_string(call.workspace_bytes) + " bytes at 0x" + hex);
      return false;
    }
    return true;
  };
  const bool needs_sms = kernel.persistent && call.sm_count <= 0;
  if (!needs_sms && !check_workspace()) return -1;
  const dietcode::StreamCall on(stream);
  if (!on.ok()) return Fail(on.error);
  const dietcode::Driver& d = on.d;
  CUresult rc = CUDA_SUCCESS;
  if (needs_sms) {
    std::string why;
    if (!dietcode::ContextSmCount(d, on.ctx, &call.sm_count, &why)) return Fail(why);
    if (!check_workspace()) return -1;
  }

  CUfunction fn = nullptr;
  uint32_t shared = 0;
  int image_index = -1;
  {
    std::lock_guard<std::mutex> lock(b->mutex);
    const auto key = std::make_pair(static_cast<void*>(on.ctx), k);
    auto it = b->loaded.find(key);
    if (it == b->loaded.end()) {
      dietcode::DeviceFacts dev;
      std::string error;
      if (!dietcode::CurrentDevice(d, &dev, &error)) return Fail(error);
      if (b->eager_loaded.insert(on.ctx).second) {  // the bundle's first launch in this context
        dietcode::LoadCubins(d, b, on.ctx, dev);
        it = b->loaded.find(key);
      }
      if (it == b->loaded.end()) {
        auto failed = b->load_errors.find(key);
        if (failed != b->load_errors.end()) {  // the eager load's error, reported once: a later launch loads again
          error = failed->second;
          b->load_errors.erase(failed);
          return Fail(error);
        }
        dietcode::LoadedKernel loaded;
        if (!dietcode::LoadKernel(d, kernel, dev, &loaded, &error)) return Fail(error);
        it = b->loaded.emplace(key, loaded).first;
      }
    }
    fn = static_cast<CUfunction>(it->second.function);
    shared = it->second.shared;
    image_index = it->second.image_index;
  }

  // Grid rule of the ABI (LaunchGrid): (ceil(M/BLOCK_M) * ceil(N/BLOCK_N), SPLIT_K, batch), for attention
  // kernels (ceil(seq_q/BLOCK_M), 1, batch heads), for persistent kernels (min(tiles x batch, SMs x n), 1, 1);
  // CallFit (above) has checked that it is within the grid limits and that the sizes are positive.
  const int64_t batch = args->batch > 0 ? args->batch : 1;
  uint32_t grid[3] = {1, 1, 1};
  dietcode::LaunchGrid(kernel, call, grid);

  uint64_t ptrs[dietcode::kParamCount] = {};
  int32_t ints[dietcode::kParamCount] = {};
  uint64_t scratch[2] = {0, 0};
  void* params[dietcode::kParamCount + 2];  // params are unique enums, so at most kParamCount + scratch
  size_t n_params = 0;
  for (uint8_t p : kernel.params) {  // only the params this kernel takes
    if (dietcode::IsPointerParam(p)) {
      ptrs[p] = dietcode::ArgPointer(*args, p);
      params[n_params++] = &ptrs[p];
    } else {
      ints[p] = p == dietcode::kBatch ? static_cast<int32_t>(batch) : dietcode::ArgInt(*args, p);
      params[n_params++] = &ints[p];
    }
  }
  {  // global scratch (TMA descriptors): after the split-K part, aligned up (abi.md); null for an image without
    std::string why;
    if (!dietcode::ScratchPointer(kernel, image_index, call, &scratch[0], &why)) {
      return Fail("kernel '" + kernel.name + "': " + why);
    }
  }
  params[n_params++] = &scratch[0];
  params[n_params++] = &scratch[1];

  if (kernel.split_k > 1) {  // one int32 counter per tile and batch: kept per stream, or in the workspace's room
    const uint64_t count = static_cast<uint64_t>(grid[0]) * static_cast<uint64_t>(batch);
    ptrs[dietcode::kCounters] = dietcode::SplitKCounters(d, b, on.ctx, on.s, count);
    if (ptrs[dietcode::kCounters] == 0) {  // the room after the partial tiles, zeroed for this call
      const uint64_t partials = count * kernel.split_k * kernel.block_m * kernel.block_n * 4;
      ptrs[dietcode::kCounters] = args->workspace + partials;
      rc = d.MemsetD8Async(static_cast<CUdeviceptr>(ptrs[dietcode::kCounters]), 0, count * 4, on.s);
      if (rc != CUDA_SUCCESS) return Fail(dietcode::CuError(d, rc, "cuMemsetD8Async (zeroing the split-K counters)"));
    }
  }
  rc = d.LaunchKernel(fn, grid[0], grid[1], grid[2], kernel.num_warps * 32, 1, 1, shared, on.s, params, nullptr);
  if (rc != CUDA_SUCCESS) return Fail(dietcode::CuError(d, rc, "cuLaunchKernel") + " for '" + kernel.name + "'");
  return 0;
}

int dc_zero_async(uint64_t ptr, uint64_t bytes, void* stream) {
  using dietcode::Fail;
  if (bytes == 0) return 0;
  if (ptr == 0) return Fail("dc_zero_async: null pointer");
  const dietcode::StreamCall on(stream);
  if (!on.ok()) return Fail(on.error);
  const dietcode::Driver& d = on.d;
  const CUresult rc = d.MemsetD8Async(static_cast<CUdeviceptr>(ptr), 0, bytes, on.s);
  if (rc != CUDA_SUCCESS) return Fail(dietcode::CuError(d, rc, "cuMemsetD8Async (zeroing the output)"));
  return 0;
}

}  // extern "C"
