/* A host-memory stand-in for the CUDA driver (libcuda.so.1), for tests without a GPU (tests/test_fake_cuda.py).
 *
 * Built at test time with the system C compiler against the same cuda.h the custom-op library is built with, so
 * every entry point below is exported under the versioned name that header maps it to (cuCtxPushCurrent ->
 * cuCtxPushCurrent_v2, ...), exactly the names custom_ops/launch.cc looks up with dlsym, with the header's own
 * prototypes. Installed as libcuda.so.1 in a folder on a child process's LD_LIBRARY_PATH, it is the library
 * launch.cc's dlopen("libcuda.so.1") finds.
 *
 * Semantics: device pointers are host pointers (cuMemsetD8Async is memset), contexts are two fixed handles
 * with a per-thread current-context stack as the driver keeps one, streams are handles made by
 * fake_cuda_stream(context), a module is an image parsed for its kernels' parameter lists (a cubin's
 * .nv.info.<kernel> EIATTR_KPARAM_INFO records, or a PTX .entry's .param list). Kernels never run: a launch
 * copies each kernelParams entry's bytes (as many as the loaded image says the parameter has) into a log.
 * What the driver refuses is refused here with its error code: a call before cuInit or without a current
 * context, a module or stream of another context, a cubin for another architecture, an unknown kernel name,
 * dynamic shared memory above 48 KiB without cuFuncSetAttribute, a block above 1024 threads, a grid above
 * the limits, a missing kernelParams array, the `extra` form, PTX for a newer SM (or another one with 'a').
 *
 * The tuner's timer (custom_ops/timing.cc) finds its entry points too: the primary context, a stream, host
 * allocations for device memory, and events on a made-up clock: each launch advances it by a deterministic
 * model of its size, fake_cuda_launch_ns + fake_cuda_thread_ns x (grid x block threads) + fake_cuda_param_ns x
 * (its parameters' bytes) nanoseconds; an event recorded on a stream holds the clock, and the elapsed time
 * between two is their difference in milliseconds. These are no GPU's timings: they exist to exercise code
 * paths, and the device's name ("Fake CUDA device (host memory)") keeps any row keyed by it (the tuning
 * database's device key) apart from a real device's.
 *
 * Environment (read by cuInit, for processes a test cannot reach through ctypes, such as the tuner's timing
 * child): FAKE_CUDA_CC_MAJOR, FAKE_CUDA_CC_MINOR, FAKE_CUDA_SM_COUNT, FAKE_CUDA_SMEM_OPTIN, FAKE_CUDA_LAUNCH_NS, FAKE_CUDA_THREAD_NS, FAKE_CUDA_PARAM_NS
 * (the settings below); FAKE_CUDA_MAX_THREADS=n: a launch of blocks of more than n threads is refused with
 * CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES (as the driver refuses a block whose registers exceed the SM's);
 * FAKE_CUDA_FAULT_THREADS=n: a launch of blocks of exactly n threads is accepted and the context then fails
 * as after an illegal address: every later synchronize, event record or query and launch returns
 * CUDA_ERROR_ILLEGAL_ADDRESS. Set through ctypes: fake_cuda_alloc_fails, cuMemAlloc answers out of memory;
 * fake_cuda_capturing, every stream is being captured (cuStreamIsCapturing).
 *
 * The log (fake_cuda_log) is one JSON object per line: "load" (module, image kind, size, FNV-1a 64 hash of
 * the image's bytes), "function", "set_attribute", "alloc", "free", "memset" and "launch" (kernel name, grid,
 * block, shared bytes, stream, each parameter's size and bytes in hex), and "error" for a refused call.
 */
#include <cuda.h>

/* FAKE_CUDA_DRIVER: the driver release this stand-in plays (cuDriverGetVersion's encoding). A driver before
 * CUDA 12.8 has no cuEventElapsedTime_v2, which cuda.h maps cuEventElapsedTime to: it exports the original. */
#ifndef FAKE_CUDA_DRIVER
#define FAKE_CUDA_DRIVER 13010
#endif
#if FAKE_CUDA_DRIVER < 12080
#undef cuEventElapsedTime
#endif

#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define FAKE_MAX_MODULES 64
#define FAKE_MAX_KERNELS 8
#define FAKE_MAX_PARAMS 64
#define FAKE_NAME 256
#define FAKE_STACK 16

/* Settings a test may change (through ctypes) before the calls that read them. */
int fake_cuda_sm_count = 132;
int fake_cuda_alloc_fails = 0; /* nonzero: cuMemAlloc answers CUDA_ERROR_OUT_OF_MEMORY */
int fake_cuda_capturing = 0;    /* nonzero: cuStreamIsCapturing says every stream is being captured */
int fake_cuda_cc_major = 9;
int fake_cuda_cc_minor = 0;
int fake_cuda_smem_optin = 232448;
int fake_cuda_driver_version = FAKE_CUDA_DRIVER;
double fake_cuda_launch_ns = 1000.0;
double fake_cuda_thread_ns = 1.0;
double fake_cuda_param_ns = 0.0;

struct CUctx_st {
  int id;
};
struct CUstream_st {
  uint32_t magic;
  CUcontext ctx;
};
struct CUfunc_st {
  char name[FAKE_NAME];
  int n_params;
  int sizes[FAKE_MAX_PARAMS];
  int max_dynamic_shared;
  CUmodule module;
};
struct CUevent_st {
  uint32_t magic;
  double clock_ns;  /* the made-up clock when recorded; < 0: never recorded */
};
struct CUmod_st {
  int id;
  int loaded;
  CUcontext ctx;
  int n_kernels;
  struct CUfunc_st kernels[FAKE_MAX_KERNELS];
};

static struct CUctx_st contexts[2] = {{1}, {2}};
static struct CUmod_st modules[FAKE_MAX_MODULES];
static int n_modules = 0;
static long n_launches = 0;
static double clock_ns = 0.0;  /* the made-up device clock (see the top) */
static int initialized = 0;
static int max_threads = 1024;
static int fault_threads = 0;
static int faulted = 0;  /* a FAKE_CUDA_FAULT launch ran: the context is lost */
static __thread CUcontext stack[FAKE_STACK];
static __thread int depth = 0;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static char* log_text = NULL;
static size_t log_size = 0, log_cap = 0;
#define STREAM_MAGIC 0x5157u

static void record(const char* fmt, ...) {
  va_list ap, again;
  va_start(ap, fmt);
  va_copy(again, ap);
  int n = vsnprintf(NULL, 0, fmt, ap);
  va_end(ap);
  pthread_mutex_lock(&lock);
  if (log_size + (size_t)n + 2 > log_cap) {
    log_cap = (log_size + (size_t)n + 2) * 2;
    log_text = (char*)realloc(log_text, log_cap);
  }
  vsnprintf(log_text + log_size, (size_t)n + 1, fmt, again);
  log_size += (size_t)n;
  log_text[log_size++] = '\n';
  log_text[log_size] = 0;
  pthread_mutex_unlock(&lock);
  va_end(again);
}

static CUresult refuse(CUresult rc, const char* call, const char* why) {
  record("{\"event\": \"error\", \"call\": \"%s\", \"code\": %d, \"why\": \"%s\"}", call, (int)rc, why);
  return rc;
}

/* The log since the last clear, one JSON object per line. */
const char* fake_cuda_log(void) { return log_text ? log_text : ""; }
void fake_cuda_log_clear(void) {
  pthread_mutex_lock(&lock);
  log_size = 0;
  if (log_text) log_text[0] = 0;
  pthread_mutex_unlock(&lock);
}
/* Context handle i (0 or 1) and a new stream of it. */
CUcontext fake_cuda_context(int i) { return &contexts[i & 1]; }
CUstream fake_cuda_stream(CUcontext ctx) {
  struct CUstream_st* s = (struct CUstream_st*)calloc(1, sizeof(*s));
  s->magic = STREAM_MAGIC;
  s->ctx = ctx;
  return s;
}
/* Makes ctx this thread's only current context (NULL: none), as cuCtxSetCurrent does. */
void fake_cuda_set_current(CUcontext ctx) {
  depth = ctx ? 1 : 0;
  stack[0] = ctx;
}
int fake_cuda_context_depth(void) { return depth; }

static CUcontext current(void) { return depth > 0 ? stack[depth - 1] : NULL; }

static uint64_t fnv1a(const unsigned char* p, size_t n) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

static int param_size_of_type(const char* t, size_t n) {
  if (n < 2) return 0;
  const int bits = atoi(t + 1);
  return bits > 0 ? bits / 8 : 0;
}

/* The kernels of a PTX module: each .entry's name and .param sizes (".param .u64 .ptr ... name",
 * ".param .u32 name", ".param .align A .b8 name[N]"). */
static int parse_ptx(const char* ptx, struct CUmod_st* m) {
  const char* p = ptx;
  while ((p = strstr(p, ".entry ")) != NULL && m->n_kernels < FAKE_MAX_KERNELS) {
    struct CUfunc_st* f = &m->kernels[m->n_kernels];
    memset(f, 0, sizeof(*f));
    p += 7;
    while (*p == ' ') ++p;
    size_t n = strcspn(p, "( \t\n");
    if (n == 0 || n >= FAKE_NAME) return 0;
    memcpy(f->name, p, n);
    p += n;
    const char* open = strchr(p, '(');
    const char* close = open ? strchr(open, ')') : NULL;
    if (!open || !close) return 0;
    for (const char* q = open; (q = strstr(q, ".param")) != NULL && q < close; q += 6) {
      const char* t = q + 6;
      int size = 0;
      while (t < close && *t != ',' && *t != ')') {
        while (*t == ' ' || *t == '\t') ++t;
        size_t w = strcspn(t, " \t,)\n");
        if (w == 6 && strncmp(t, ".align", 6) == 0) {
          t += w;
          continue;
        }
        if (w > 1 && t[0] == '.' && (t[1] == 'u' || t[1] == 's' || t[1] == 'b' || t[1] == 'f') && size == 0) {
          size = param_size_of_type(t + 1, w - 1);
        } else if (w > 0 && t[w - 1] == ']') {  /* name[N]: an array of N elements of the type */
          const char* bracket = memchr(t, '[', w);
          if (bracket) size *= atoi(bracket + 1);
        }
        t += w;
        if (*t == '\n') ++t;
      }
      if (size <= 0 || f->n_params >= FAKE_MAX_PARAMS) return 0;
      f->sizes[f->n_params++] = size;
    }
    f->module = m;
    m->n_kernels++;
    p = close;
  }
  return m->n_kernels > 0;
}

/* The kernels of a cubin (ELF64): the .nv.info.<kernel> sections' EIATTR_KPARAM_INFO records (ordinal,
 * size in bits 18..31 of the last word); *size: the file's extent (headers and sections). 0 for a malformed
 * image or one for another architecture (*arch_ok = 0). */
static int parse_cubin(const unsigned char* b, struct CUmod_st* m, size_t* size, int* arch_ok) {
  uint64_t shoff, phoff;
  uint16_t phentsize, phnum, shentsize, shnum, shstrndx;
  uint32_t flags;
  memcpy(&phoff, b + 0x20, 8);
  memcpy(&shoff, b + 0x28, 8);
  memcpy(&flags, b + 0x30, 4);
  memcpy(&phentsize, b + 0x36, 2);
  memcpy(&phnum, b + 0x38, 2);
  memcpy(&shentsize, b + 0x3A, 2);
  memcpy(&shnum, b + 0x3C, 2);
  memcpy(&shstrndx, b + 0x3E, 2);
  if (b[4] != 2 || shentsize != 64 || shstrndx >= shnum) return 0;
  /* The SM the cubin is for, in e_flags: bits 8..15 in the ELF ABI of CUDA 13's ptxas (OS ABI 0x41; 0x5a:
   * sm_90), bits 0..7 in CUDA 12's (OS ABI 0x33; 0x50: sm_80). It runs on that major revision at that minor
   * or above. */
  const int sm = (int)(b[7] == 0x41 ? (flags >> 8) & 0xff : flags & 0xff);
  *arch_ok = sm / 10 == fake_cuda_cc_major && sm % 10 <= fake_cuda_cc_minor;
  size_t end = shoff + (size_t)shnum * shentsize;
  if (phoff + (size_t)phnum * phentsize > end) end = phoff + (size_t)phnum * phentsize;
  const unsigned char* strtab_hdr = b + shoff + (size_t)shstrndx * 64;
  uint64_t str_off;
  memcpy(&str_off, strtab_hdr + 0x18, 8);
  for (int i = 0; i < shnum; ++i) {
    const unsigned char* h = b + shoff + (size_t)i * 64;
    uint32_t name, type;
    uint64_t off, sz;
    memcpy(&name, h, 4);
    memcpy(&type, h + 4, 4);
    memcpy(&off, h + 0x18, 8);
    memcpy(&sz, h + 0x20, 8);
    if (type != 8 /* SHT_NOBITS */ && off + sz > end) end = off + sz;
    const char* sname = (const char*)b + str_off + name;
    if (strncmp(sname, ".nv.info.", 9) != 0 || m->n_kernels >= FAKE_MAX_KERNELS) continue;
    struct CUfunc_st* f = &m->kernels[m->n_kernels];
    memset(f, 0, sizeof(*f));
    snprintf(f->name, sizeof(f->name), "%s", sname + 9);
    f->module = m;
    int sizes[FAKE_MAX_PARAMS] = {0};
    size_t pos = 0;
    while (pos + 4 <= sz) {
      const unsigned char* a = b + off + pos;
      if (a[0] != 4) {  /* EIFMT_NVAL / BVAL / HVAL: four bytes */
        pos += 4;
        continue;
      }
      uint16_t len;
      memcpy(&len, a + 2, 2);
      if (a[1] == 0x17 && len >= 12) {  /* EIATTR_KPARAM_INFO: index u32, ordinal u16, offset u16, flags u32 */
        uint16_t ordinal;
        uint32_t pflags;
        memcpy(&ordinal, a + 8, 2);
        memcpy(&pflags, a + 12, 4);
        if (ordinal >= FAKE_MAX_PARAMS) return 0;
        sizes[ordinal] = (int)(pflags >> 18);
        if (ordinal + 1 > f->n_params) f->n_params = ordinal + 1;
      }
      pos += 4 + len;
    }
    for (int k = 0; k < f->n_params; ++k) {
      if (sizes[k] <= 0) return 0;
      f->sizes[k] = sizes[k];
    }
    m->n_kernels++;
  }
  *size = end;
  return m->n_kernels > 0;
}

static void env_int(const char* name, int* value) {
  const char* v = getenv(name);
  if (v && *v) *value = atoi(v);
}

static void env_double(const char* name, double* value) {
  const char* v = getenv(name);
  if (v && *v) *value = atof(v);
}

CUresult CUDAAPI cuInit(unsigned int flags) {
  if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized) {
    env_int("FAKE_CUDA_CC_MAJOR", &fake_cuda_cc_major);
    env_int("FAKE_CUDA_CC_MINOR", &fake_cuda_cc_minor);
    env_int("FAKE_CUDA_SM_COUNT", &fake_cuda_sm_count);
    env_int("FAKE_CUDA_SMEM_OPTIN", &fake_cuda_smem_optin);
    env_double("FAKE_CUDA_LAUNCH_NS", &fake_cuda_launch_ns);
    env_double("FAKE_CUDA_THREAD_NS", &fake_cuda_thread_ns);
    env_double("FAKE_CUDA_PARAM_NS", &fake_cuda_param_ns);
    env_int("FAKE_CUDA_MAX_THREADS", &max_threads);
    env_int("FAKE_CUDA_FAULT_THREADS", &fault_threads);
  }
  initialized = 1;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDriverGetVersion(int* version) {
  if (!version) return CUDA_ERROR_INVALID_VALUE;
  *version = fake_cuda_driver_version;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuGetErrorString(CUresult rc, const char** s) {
  if (!s) return CUDA_ERROR_INVALID_VALUE;
  switch (rc) {
    case CUDA_SUCCESS: *s = "no error"; break;
    case CUDA_ERROR_INVALID_VALUE: *s = "invalid argument"; break;
    case CUDA_ERROR_NOT_INITIALIZED: *s = "initialization error"; break;
    case CUDA_ERROR_INVALID_CONTEXT: *s = "invalid device context"; break;
    case CUDA_ERROR_INVALID_HANDLE: *s = "invalid resource handle"; break;
    case CUDA_ERROR_NOT_FOUND: *s = "named symbol not found"; break;
    case CUDA_ERROR_INVALID_IMAGE: *s = "device kernel image is invalid"; break;
    case CUDA_ERROR_NO_BINARY_FOR_GPU: *s = "no kernel image is available for execution on the device"; break;
    case CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES: *s = "too many resources requested for launch"; break;
    case CUDA_ERROR_ILLEGAL_ADDRESS: *s = "an illegal memory access was encountered"; break;
    default: *s = "fake driver error"; break;
  }
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceGetCount(int* count) {
  if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
  *count = 1;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceGet(CUdevice* dev, int ordinal) {
  if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (ordinal != 0) return CUDA_ERROR_INVALID_DEVICE;
  *dev = 0;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceGetName(char* name, int len, CUdevice dev) {
  if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (dev != 0 || !name || len <= 0) return CUDA_ERROR_INVALID_VALUE;
  snprintf(name, (size_t)len, "Fake CUDA device (host memory)");
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceGetAttribute(int* value, CUdevice_attribute attr, CUdevice dev) {
  if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (dev != 0 || !value) return CUDA_ERROR_INVALID_VALUE;
  switch (attr) {
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *value = fake_cuda_cc_major; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *value = fake_cuda_cc_minor; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: *value = fake_cuda_smem_optin; break;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *value = fake_cuda_sm_count; break;
    default: return CUDA_ERROR_INVALID_VALUE;
  }
  record("{\"event\": \"device_attribute\", \"attribute\": %d, \"value\": %d}", (int)attr, *value);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxGetCurrent(CUcontext* ctx) {
  if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
  *ctx = current();
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxPushCurrent(CUcontext ctx) {
  if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (ctx != &contexts[0] && ctx != &contexts[1]) return CUDA_ERROR_INVALID_CONTEXT;
  if (depth == FAKE_STACK) return CUDA_ERROR_OUT_OF_MEMORY;
  stack[depth++] = ctx;
  record("{\"event\": \"push\", \"context\": %d}", ctx->id);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxPopCurrent(CUcontext* ctx) {
  if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (depth == 0) return CUDA_ERROR_INVALID_CONTEXT;
  CUcontext top = stack[--depth];
  if (ctx) *ctx = top;
  record("{\"event\": \"pop\", \"context\": %d}", top->id);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxGetDevice(CUdevice* dev) {
  if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (!current()) return CUDA_ERROR_INVALID_CONTEXT;
  *dev = 0;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuStreamGetCtx(CUstream s, CUcontext* ctx) {
  if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (s == NULL || s == CU_STREAM_LEGACY || s == CU_STREAM_PER_THREAD) {
    if (!current()) return CUDA_ERROR_INVALID_CONTEXT;
    *ctx = current();
    return CUDA_SUCCESS;
  }
  if (s->magic != STREAM_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
  *ctx = s->ctx;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuModuleLoadData(CUmodule* module, const void* image) {
  if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (!module || !image) return CUDA_ERROR_INVALID_VALUE;
  if (!current()) return refuse(CUDA_ERROR_INVALID_CONTEXT, "cuModuleLoadData", "no current context");
  if (n_modules == FAKE_MAX_MODULES) return CUDA_ERROR_OUT_OF_MEMORY;
  struct CUmod_st* m = &modules[n_modules];
  memset(m, 0, sizeof(*m));
  const unsigned char* b = (const unsigned char*)image;
  size_t size = 0;
  const char* kind = "cubin";
  if (memcmp(b, "\x7f" "ELF", 4) == 0) {
    int arch_ok = 0;
    if (!parse_cubin(b, m, &size, &arch_ok)) return refuse(CUDA_ERROR_INVALID_IMAGE, "cuModuleLoadData", "cubin");
    if (!arch_ok) return refuse(CUDA_ERROR_NO_BINARY_FOR_GPU, "cuModuleLoadData", "cubin for another SM");
  } else {
    kind = "ptx";
    size = strlen((const char*)b) + 1;
    /* the driver JIT-compiles PTX for its SM or an older one; an sm_XYa target only for that very SM */
    const char* target = strstr((const char*)b, ".target sm_");
    const int device_sm = fake_cuda_cc_major * 10 + fake_cuda_cc_minor;
    if (!target) return refuse(CUDA_ERROR_INVALID_PTX, "cuModuleLoadData", "PTX without a target");
    char* rest = NULL;
    const long sm = strtol(target + 11, &rest, 10);
    if (sm > device_sm || (*rest == 'a' && sm != device_sm)) {
      return refuse(CUDA_ERROR_NO_BINARY_FOR_GPU, "cuModuleLoadData", "PTX for a newer SM");
    }
    if (!parse_ptx((const char*)b, m)) return refuse(CUDA_ERROR_INVALID_PTX, "cuModuleLoadData", "PTX");
  }
  m->id = ++n_modules;
  m->loaded = 1;
  m->ctx = current();
  *module = m;
  record("{\"event\": \"load\", \"module\": %d, \"context\": %d, \"kind\": \"%s\", \"size\": %zu, "
         "\"fnv1a\": \"%016llx\"}", m->id, m->ctx->id, kind, size, (unsigned long long)fnv1a(b, size));
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuModuleUnload(CUmodule m) {
  if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (!m || !m->loaded) return CUDA_ERROR_INVALID_HANDLE;
  if (current() != m->ctx) return refuse(CUDA_ERROR_INVALID_CONTEXT, "cuModuleUnload", "module of another context");
  m->loaded = 0;
  record("{\"event\": \"unload\", \"module\": %d}", m->id);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuModuleGetFunction(CUfunction* fn, CUmodule m, const char* name) {
  if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (!fn || !m || !m->loaded || !name) return CUDA_ERROR_INVALID_HANDLE;
  for (int i = 0; i < m->n_kernels; ++i) {
    if (strcmp(m->kernels[i].name, name) == 0) {
      *fn = &m->kernels[i];
      record("{\"event\": \"function\", \"module\": %d, \"name\": \"%s\", \"n_params\": %d}", m->id, name,
             m->kernels[i].n_params);
      return CUDA_SUCCESS;
    }
  }
  return refuse(CUDA_ERROR_NOT_FOUND, "cuModuleGetFunction", name);
}

CUresult CUDAAPI cuFuncSetAttribute(CUfunction fn, CUfunction_attribute attr, int value) {
  if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (!fn) return CUDA_ERROR_INVALID_HANDLE;
  record("{\"event\": \"set_attribute\", \"name\": \"%s\", \"attribute\": %d, \"value\": %d}", fn->name, (int)attr,
         value);
  if (attr != CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES) return CUDA_ERROR_INVALID_VALUE;
  if (value < 0 || value > fake_cuda_smem_optin) {
    return refuse(CUDA_ERROR_INVALID_VALUE, "cuFuncSetAttribute", "above the opt-in limit");
  }
  fn->max_dynamic_shared = value;
  return CUDA_SUCCESS;
}

static CUresult check_stream(CUstream s, const char* call) {
  if (!current()) return refuse(CUDA_ERROR_INVALID_CONTEXT, call, "no current context");
  if (s != NULL && s != CU_STREAM_LEGACY && s != CU_STREAM_PER_THREAD) {
    if (s->magic != STREAM_MAGIC) return refuse(CUDA_ERROR_INVALID_HANDLE, call, "not a stream");
    if (s->ctx != current()) return refuse(CUDA_ERROR_INVALID_HANDLE, call, "stream of another context");
  }
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemsetD8Async(CUdeviceptr ptr, unsigned char value, size_t n, CUstream s) {
  if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
  CUresult rc = check_stream(s, "cuMemsetD8Async");
  if (rc != CUDA_SUCCESS) return rc;
  record("{\"event\": \"memset\", \"ptr\": %llu, \"value\": %u, \"bytes\": %zu, \"stream\": %llu}",
         (unsigned long long)ptr, (unsigned)value, n, (unsigned long long)(uintptr_t)s);
  if (n > 0 && ptr == 0) return refuse(CUDA_ERROR_INVALID_VALUE, "cuMemsetD8Async", "null pointer");
  memset((void*)(uintptr_t)ptr, value, n);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                unsigned bz, unsigned shared, CUstream s, void** params, void** extra) {
  if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (!f || !f->module->loaded) return CUDA_ERROR_INVALID_HANDLE;
  if (faulted) return refuse(CUDA_ERROR_ILLEGAL_ADDRESS, "cuLaunchKernel", "the context is lost");
  CUresult rc = check_stream(s, "cuLaunchKernel");
  if (rc != CUDA_SUCCESS) return rc;
  if (f->module->ctx != current()) return refuse(CUDA_ERROR_INVALID_HANDLE, "cuLaunchKernel", "function of another context");
  if (extra != NULL) return refuse(CUDA_ERROR_INVALID_VALUE, "cuLaunchKernel", "extra is not supported here");
  if (f->n_params > 0 && params == NULL) return refuse(CUDA_ERROR_INVALID_VALUE, "cuLaunchKernel", "no kernelParams");
  if (gx == 0 || gy == 0 || gz == 0 || gx > 0x7fffffffu || gy > 65535 || gz > 65535) {
    return refuse(CUDA_ERROR_INVALID_VALUE, "cuLaunchKernel", "grid");
  }
  if (bx == 0 || by == 0 || bz == 0 || (uint64_t)bx * by * bz > 1024) {
    return refuse(CUDA_ERROR_INVALID_VALUE, "cuLaunchKernel", "block");
  }
  if (shared > 48 * 1024 && (int)shared > f->max_dynamic_shared) {
    return refuse(CUDA_ERROR_INVALID_VALUE, "cuLaunchKernel", "dynamic shared memory above 48 KiB without the attribute");
  }
  if ((uint64_t)bx * by * bz > (uint64_t)max_threads) {
    return refuse(CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES, "cuLaunchKernel", "FAKE_CUDA_MAX_THREADS");
  }
  size_t cap = 64;
  for (int i = 0; i < f->n_params; ++i) cap += 32 + 2 * (size_t)f->sizes[i];
  char* text = (char*)malloc(cap);
  size_t at = 0;
  for (int i = 0; i < f->n_params; ++i) {
    const unsigned char* p = (const unsigned char*)params[i];
    at += (size_t)snprintf(text + at, cap - at, "%s{\"size\": %d, \"hex\": \"", i ? ", " : "", f->sizes[i]);
    for (int j = 0; j < f->sizes[i]; ++j) at += (size_t)snprintf(text + at, cap - at, "%02x", p[j]);
    at += (size_t)snprintf(text + at, cap - at, "\"}");
  }
  n_launches++;
  long param_bytes = 0;
  for (int i = 0; i < f->n_params; ++i) param_bytes += f->sizes[i];
  const double threads = (double)gx * gy * gz * bx * by * bz;
  const double cost_ns = fake_cuda_launch_ns + fake_cuda_thread_ns * threads + fake_cuda_param_ns * (double)param_bytes;
  pthread_mutex_lock(&lock);
  clock_ns += cost_ns;
  pthread_mutex_unlock(&lock);
  if (fault_threads > 0 && (uint64_t)bx * by * bz == (uint64_t)fault_threads) faulted = 1;
  record("{\"event\": \"launch\", \"name\": \"%s\", \"module\": %d, \"grid\": [%u, %u, %u], \"block\": [%u, %u, %u], "
         "\"shared\": %u, \"stream\": %llu, \"params\": [%s]}", f->name, f->module->id, gx, gy, gz, bx, by, bz, shared,
         (unsigned long long)(uintptr_t)s, text);
  free(text);
  return CUDA_SUCCESS;
}

/* ---- the timer's entry points (custom_ops/timing.cc) ---- */

CUresult CUDAAPI cuDevicePrimaryCtxRetain(CUcontext* ctx, CUdevice dev) {
  if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (dev != 0 || !ctx) return CUDA_ERROR_INVALID_VALUE;
  *ctx = &contexts[0];
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxSetCurrent(CUcontext ctx) {
  if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (ctx != NULL && ctx != &contexts[0] && ctx != &contexts[1]) return CUDA_ERROR_INVALID_CONTEXT;
  fake_cuda_set_current(ctx);
  record("{\"event\": \"set_current\", \"context\": %d}", ctx ? ctx->id : 0);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxSynchronize(void) {
  if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (!current()) return CUDA_ERROR_INVALID_CONTEXT;
  return faulted ? refuse(CUDA_ERROR_ILLEGAL_ADDRESS, "cuCtxSynchronize", "the context is lost") : CUDA_SUCCESS;
}

CUresult CUDAAPI cuStreamCreate(CUstream* s, unsigned int flags) {
  if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (!current()) return CUDA_ERROR_INVALID_CONTEXT;
  if (!s || (flags & ~1u)) return CUDA_ERROR_INVALID_VALUE;
  *s = fake_cuda_stream(current());
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuStreamIsCapturing(CUstream s, CUstreamCaptureStatus* status) {
  if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
  CUresult rc = check_stream(s, "cuStreamIsCapturing");
  if (rc != CUDA_SUCCESS) return rc;
  if (!status) return CUDA_ERROR_INVALID_VALUE;
  *status = fake_cuda_capturing ? CU_STREAM_CAPTURE_STATUS_ACTIVE : CU_STREAM_CAPTURE_STATUS_NONE;
  record("{\"event\": \"is_capturing\", \"stream\": %llu, \"capturing\": %d}", (unsigned long long)(uintptr_t)s,
         fake_cuda_capturing);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuStreamSynchronize(CUstream s) {
  if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
  CUresult rc = check_stream(s, "cuStreamSynchronize");
  if (rc != CUDA_SUCCESS) return rc;
  return faulted ? refuse(CUDA_ERROR_ILLEGAL_ADDRESS, "cuStreamSynchronize", "the context is lost") : CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemAlloc(CUdeviceptr* p, size_t bytes) {
  if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (!current()) return CUDA_ERROR_INVALID_CONTEXT;
  void* mem = NULL;
  if (!p || bytes == 0) return CUDA_ERROR_INVALID_VALUE;
  if (fake_cuda_alloc_fails) return refuse(CUDA_ERROR_OUT_OF_MEMORY, "cuMemAlloc", "fake_cuda_alloc_fails");
  if (posix_memalign(&mem, 256, bytes) != 0) return CUDA_ERROR_OUT_OF_MEMORY;  /* the driver aligns to 256 */
  *p = (CUdeviceptr)(uintptr_t)mem;
  record("{\"event\": \"alloc\", \"ptr\": %llu, \"bytes\": %zu}", (unsigned long long)*p, bytes);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemFree(CUdeviceptr p) {
  if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
  record("{\"event\": \"free\", \"ptr\": %llu}", (unsigned long long)p);
  free((void*)(uintptr_t)p);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemcpyHtoD(CUdeviceptr dst, const void* src, size_t bytes) {
  if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (!current()) return CUDA_ERROR_INVALID_CONTEXT;
  memcpy((void*)(uintptr_t)dst, src, bytes);
  return CUDA_SUCCESS;
}

#define EVENT_MAGIC 0xE7E7u

CUresult CUDAAPI cuEventCreate(CUevent* e, unsigned int flags) {
  if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (!current()) return CUDA_ERROR_INVALID_CONTEXT;
  if (!e || flags != CU_EVENT_DEFAULT) return CUDA_ERROR_INVALID_VALUE;  /* timing needs the default flags */
  struct CUevent_st* ev = (struct CUevent_st*)calloc(1, sizeof(*ev));
  ev->magic = EVENT_MAGIC;
  ev->clock_ns = -1.0;
  *e = ev;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuEventDestroy(CUevent e) {
  if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (!e || e->magic != EVENT_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
  e->magic = 0;
  free(e);
  record("{\"event\": \"event_destroy\"}");
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuEventRecord(CUevent e, CUstream s) {
  if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (!e || e->magic != EVENT_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
  CUresult rc = check_stream(s, "cuEventRecord");
  if (rc != CUDA_SUCCESS) return rc;
  if (faulted) return refuse(CUDA_ERROR_ILLEGAL_ADDRESS, "cuEventRecord", "the context is lost");
  e->clock_ns = clock_ns;
  record("{\"event\": \"event_record\", \"launches\": %ld, \"clock_ns\": %.1f, \"stream\": %llu}", n_launches,
         clock_ns, (unsigned long long)(uintptr_t)s);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuEventElapsedTime(float* ms, CUevent start, CUevent end) {
  if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (!ms || !start || !end || start->magic != EVENT_MAGIC || end->magic != EVENT_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
  if (start->clock_ns < 0 || end->clock_ns < 0) return CUDA_ERROR_INVALID_HANDLE;  /* never recorded */
  if (faulted) return refuse(CUDA_ERROR_ILLEGAL_ADDRESS, "cuEventElapsedTime", "the context is lost");
  *ms = (float)((end->clock_ns - start->clock_ns) / 1e6);
  return CUDA_SUCCESS;
}
