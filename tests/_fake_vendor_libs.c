/* A host-memory stand-in for the cuBLAS, cuBLASLt and cuDNN entry points the vendor path calls
 * (custom_ops/vendor.cc), with their real signatures and semantics (cuBLAS and cuBLASLt: column-major, cuBLASLt's
 * bias and activation epilogues and beta C; cuDNN: NCHW cross-correlation with groups),
 * so the tests drive dc_vendor_gemm, dc_vendor_conv_algo (cuDNN's forward heuristic and workspace sizes, with a
 * fixed ranking) and dc_vendor_conv with host pointers. It checks the arguments the real
 * libraries check and records the last call for the tests. Data types: cuBLAS CUDA_R_32F (0), CUDA_R_16F (2),
 * CUDA_R_16BF (14); cuDNN FLOAT (0), HALF (2), BFLOAT16 (9); accumulation in double. */
#include <dlfcn.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { kOk = 0, kNotInitialized = 1, kInvalidValue = 7, kNotSupported = 15 };

int fake_calls = 0;
int fake_last_compute = -1;
int fake_last_batch = -1;
void* fake_last_stream = 0;
void* fake_bound_stream = 0;

static float half_to_float(uint16_t h) {
  const int sign = h >> 15, exp = (h >> 10) & 31, mant = h & 1023;
  float v = exp == 0 ? ldexpf((float)mant, -24) : exp == 31 ? (mant ? NAN : INFINITY) : ldexpf((float)(mant | 1024), exp - 25);
  return sign ? -v : v;
}

static uint16_t float_to_half(float f) {
  /* round to nearest even through the exact binary representation */
  uint32_t x;
  memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  float a = fabsf(f);
  if (isnan(f)) return (uint16_t)(sign | 0x7e00u);
  if (a >= 65520.0f) return (uint16_t)(sign | 0x7c00u);
  if (a < ldexpf(1.0f, -14)) { /* subnormal: units of 2^-24 */
    float q = nearbyintf(ldexpf(a, 24));
    return (uint16_t)(sign | (uint32_t)q);
  }
  int e;
  float m = frexpf(a, &e); /* a = m * 2^e, m in [0.5, 1) */
  float q = nearbyintf(ldexpf(m, 11)); /* 11 significant bits */
  if (q >= 2048.0f) { q /= 2.0f; e += 1; }
  return (uint16_t)(sign | (uint32_t)((e + 14) << 10) | ((uint32_t)q & 1023u));
}

static float bf16_to_float(uint16_t h) {
  uint32_t x = (uint32_t)h << 16;
  float f;
  memcpy(&f, &x, 4);
  return f;
}

static uint16_t float_to_bf16(float f) {
  uint32_t x;
  memcpy(&x, &f, 4);
  if (isnan(f)) return (uint16_t)((x >> 16) | 0x40);
  x += 0x7fffu + ((x >> 16) & 1u);
  return (uint16_t)(x >> 16);
}

static double load(const void* p, int type, int64_t i) {
  if (type == 0) return ((const float*)p)[i];
  if (type == 2) return half_to_float(((const uint16_t*)p)[i]);
  return bf16_to_float(((const uint16_t*)p)[i]);
}

static void store(void* p, int type, int64_t i, double v) {
  if (type == 0) ((float*)p)[i] = (float)v;
  else if (type == 2) ((uint16_t*)p)[i] = float_to_half((float)v);
  else ((uint16_t*)p)[i] = float_to_bf16((float)v);
}

static int gemm(void* handle, int transa, int transb, int m, int n, int k, const void* alpha, const void* A, int atype,
                int lda, long long sa, const void* B, int btype, int ldb, long long sb, const void* beta, void* C,
                int ctype, int ldc, long long sc, int batch, int compute, int algo) {
  (void)algo;
  if (handle == 0) return kNotInitialized;
  if (m < 0 || n < 0 || k < 0 || batch < 0 || transa < 0 || transa > 1 || transb < 0 || transb > 1) return kInvalidValue;
  if (lda < (transa == 0 ? (m > 1 ? m : 1) : (k > 1 ? k : 1))) return kInvalidValue;
  if (ldb < (transb == 0 ? (k > 1 ? k : 1) : (n > 1 ? n : 1))) return kInvalidValue;
  if (ldc < (m > 1 ? m : 1)) return kInvalidValue;
  if (atype != btype || atype != ctype || (atype != 0 && atype != 2 && atype != 14)) return kNotSupported;
  if (compute != 68 && compute != 77) return kNotSupported;
  if (compute == 77 && atype != 0) return kNotSupported;
  fake_calls++;
  fake_last_compute = compute;
  fake_last_batch = batch;
  fake_last_stream = fake_bound_stream;
  const float al = *(const float*)alpha, be = *(const float*)beta;
  for (int bi = 0; bi < batch; ++bi) {
    for (int j = 0; j < n; ++j) {
      for (int i = 0; i < m; ++i) {
        double acc = 0.0;
        for (int l = 0; l < k; ++l) {
          const int64_t ia = bi * sa + (transa == 0 ? i + (int64_t)l * lda : l + (int64_t)i * lda);
          const int64_t ib = bi * sb + (transb == 0 ? l + (int64_t)j * ldb : j + (int64_t)l * ldb);
          acc += load(A, atype, ia) * load(B, btype, ib);
        }
        const int64_t ic = bi * sc + i + (int64_t)j * ldc;
        const double old = be == 0.0f ? 0.0 : load(C, ctype, ic); /* beta == 0: C is not read */
        store(C, ctype, ic, al * acc + be * old);
      }
    }
  }
  return kOk;
}

int fake_set_stream_calls = 0;

int cublasSetStream_v2(void* handle, void* stream) {
  if (handle == 0) return kNotInitialized;
  fake_bound_stream = stream;
  fake_set_stream_calls++;
  return kOk;
}

int cublasGetStream_v2(void* handle, void** stream) {
  if (handle == 0) return kNotInitialized;
  *stream = fake_bound_stream;
  return kOk;
}

int cublasGemmEx(void* handle, int transa, int transb, int m, int n, int k, const void* alpha, const void* A, int atype,
                 int lda, const void* B, int btype, int ldb, const void* beta, void* C, int ctype, int ldc, int compute,
                 int algo) {
  return gemm(handle, transa, transb, m, n, k, alpha, A, atype, lda, 0, B, btype, ldb, 0, beta, C, ctype, ldc, 0, 1,
              compute, algo);
}

int cublasGemmStridedBatchedEx(void* handle, int transa, int transb, int m, int n, int k, const void* alpha,
                               const void* A, int atype, int lda, long long sa, const void* B, int btype, int ldb,
                               long long sb, const void* beta, void* C, int ctype, int ldc, long long sc, int batch,
                               int compute, int algo) {
  return gemm(handle, transa, transb, m, n, k, alpha, A, atype, lda, sa, B, btype, ldb, sb, beta, C, ctype, ldc, sc,
              batch, compute, algo);
}

/* ---- cuBLASLt ------------------------------------------------------------------------------------------ */
/* D = epilogue(alpha op(A) op(B) + beta C + bias), column-major, with the cublasLt.h signatures and ids the
 * fused path uses (descriptor attributes TRANSA 3, TRANSB 4, EPILOGUE 7, BIAS_POINTER 8; preferences
 * MAX_WORKSPACE_BYTES 1, MIN_ALIGNMENT_A..D_BYTES 5..8; epilogues DEFAULT 1, RELU 2, BIAS 4, RELU_BIAS 6, GELU 32,
 * GELU_BIAS 36, GELU being the tanh approximation). The heuristic answers one algorithm needing
 * fake_lt_workspace bytes, or none when that exceeds the preference's maximum. */

typedef struct { int compute, scale, transa, transb; unsigned epilogue; const void* bias; } LtDesc;
typedef struct { int type; uint64_t rows, cols; int64_t ld; } LtLayout;
typedef struct { uint64_t max_ws; uint32_t align[4]; } LtPref;
typedef struct { uint64_t algo[8]; size_t ws; int state; float waves; int reserved[4]; } LtResult;

enum { kLtAlgoMagic = 0x4C74 };

int fake_lt_creates = 0;
int fake_lt_heuristic_calls = 0;
int fake_lt_heuristic_status = 0; /* != 0: the query fails with it */
int fake_lt_matmul_status = 0;    /* != 0: cublasLtMatmul fails with it, writing nothing */
int fake_lt_matmuls = 0;
int fake_lt_live_descriptors = 0;
size_t fake_lt_workspace = 0; /* the algorithm's workspace */
uint64_t fake_lt_last_max_ws = 0;
uint32_t fake_lt_last_align[4] = {0, 0, 0, 0};
void* fake_lt_last_stream = 0;
unsigned fake_lt_last_epilogue = 0;
int fake_lt_last_compute = -1;
void* fake_lt_last_ws = 0;
size_t fake_lt_last_ws_size = 0;
int fake_lt_last_in_place = -1; /* 1: C and D were the same pointer */

/* The CUDA context current at each cublasLtCreate (a cuBLASLt context is tied to it), read from the process's
 * libcuda.so.1 when one is loaded (tests/_fake_libcuda.c in tests/_fake_cuda_cases.py's child), else NULL. */
void* fake_lt_create_contexts[8];

static void* current_cuda_context(void) {
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (lib == 0) return 0;
  int (*get)(void**) = (int (*)(void**))dlsym(lib, "cuCtxGetCurrent");
  void* ctx = 0;
  if (get != 0) get(&ctx);
  dlclose(lib);
  return ctx;
}

int cublasLtCreate(void** handle) {
  if (handle == 0) return kInvalidValue;
  fake_lt_create_contexts[fake_lt_creates & 7] = current_cuda_context();
  *handle = (void*)(uintptr_t)(0x17 + fake_lt_creates);
  fake_lt_creates++;
  return kOk;
}

int cublasLtDestroy(void* handle) { return handle == 0 ? kNotInitialized : kOk; }

const char* cublasLtGetStatusName(int status) {
  return status == kInvalidValue ? "CUBLAS_STATUS_INVALID_VALUE" : status == kNotSupported ? "CUBLAS_STATUS_NOT_SUPPORTED"
         : status == kNotInitialized ? "CUBLAS_STATUS_NOT_INITIALIZED" : "CUBLAS_STATUS_OTHER";
}

int cublasLtMatmulDescCreate(void** desc, int compute, int scale) {
  if (desc == 0) return kInvalidValue;
  if ((compute != 68 && compute != 77) || scale != 0) return kInvalidValue;
  LtDesc* d = calloc(1, sizeof(LtDesc));
  d->compute = compute, d->scale = scale, d->epilogue = 1;
  *desc = d;
  fake_lt_live_descriptors++;
  return kOk;
}

int cublasLtMatmulDescDestroy(void* desc) { free(desc); fake_lt_live_descriptors--; return kOk; }

int cublasLtMatmulDescSetAttribute(void* desc, int attr, const void* buf, size_t size) {
  LtDesc* d = desc;
  if (d == 0 || buf == 0) return kInvalidValue;
  if (attr == 3 || attr == 4) {
    int32_t v;
    if (size != sizeof(v)) return kInvalidValue;
    memcpy(&v, buf, sizeof(v));
    if (v != 0 && v != 1) return kInvalidValue;
    if (attr == 3) d->transa = v; else d->transb = v;
  } else if (attr == 7) {
    uint32_t v;
    if (size != sizeof(v)) return kInvalidValue;
    memcpy(&v, buf, sizeof(v));
    if (v != 1 && v != 2 && v != 4 && v != 6 && v != 32 && v != 36) return kInvalidValue;
    d->epilogue = v;
  } else if (attr == 8) {
    if (size != sizeof(void*)) return kInvalidValue;
    memcpy(&d->bias, buf, sizeof(void*));
  } else {
    return kInvalidValue;
  }
  return kOk;
}

int cublasLtMatrixLayoutCreate(void** layout, int type, uint64_t rows, uint64_t cols, int64_t ld) {
  if (layout == 0 || (type != 0 && type != 2 && type != 14)) return kInvalidValue;
  if (ld < (int64_t)(rows > 1 ? rows : 1)) return kInvalidValue;
  LtLayout* l = calloc(1, sizeof(LtLayout));
  l->type = type, l->rows = rows, l->cols = cols, l->ld = ld;
  *layout = l;
  fake_lt_live_descriptors++;
  return kOk;
}

int cublasLtMatrixLayoutDestroy(void* layout) { free(layout); fake_lt_live_descriptors--; return kOk; }

int cublasLtMatmulPreferenceCreate(void** pref) {
  if (pref == 0) return kInvalidValue;
  LtPref* p = calloc(1, sizeof(LtPref));
  for (int i = 0; i < 4; ++i) p->align[i] = 256;
  *pref = p;
  fake_lt_live_descriptors++;
  return kOk;
}

int cublasLtMatmulPreferenceDestroy(void* pref) { free(pref); fake_lt_live_descriptors--; return kOk; }

int cublasLtMatmulPreferenceSetAttribute(void* pref, int attr, const void* buf, size_t size) {
  LtPref* p = pref;
  if (p == 0 || buf == 0) return kInvalidValue;
  if (attr == 1) {
    if (size != sizeof(uint64_t)) return kInvalidValue;
    memcpy(&p->max_ws, buf, sizeof(uint64_t));
  } else if (attr >= 5 && attr <= 8) {
    if (size != sizeof(uint32_t)) return kInvalidValue;
    memcpy(&p->align[attr - 5], buf, sizeof(uint32_t));
  } else {
    return kInvalidValue;
  }
  return kOk;
}

/* The shapes agree: op(A) [m, k], op(B) [k, n], C and D [m, n], one data type; C's layout is D's. */
static int lt_shapes(const LtDesc* op, const LtLayout* A, const LtLayout* B, const LtLayout* C, const LtLayout* D) {
  const uint64_t m = D->rows, n = D->cols;
  const uint64_t am = op->transa ? A->cols : A->rows, ak = op->transa ? A->rows : A->cols;
  const uint64_t bk = op->transb ? B->cols : B->rows, bn = op->transb ? B->rows : B->cols;
  if (am != m || bn != n || ak != bk) return 0;
  if (A->type != B->type || A->type != C->type || A->type != D->type) return 0;
  if (C->rows != D->rows || C->cols != D->cols || C->ld != D->ld) return 0;
  return op->compute != 77 || A->type == 0;
}

int cublasLtMatmulAlgoGetHeuristic(void* handle, void* opd, void* ad, void* bd, void* cd, void* dd, void* prefd,
                                   int requested, void* results, int* returned) {
  const LtPref* pref = prefd;
  if (handle == 0) return kNotInitialized;
  if (requested <= 0 || returned == 0 || results == 0 || opd == 0 || ad == 0 || bd == 0 || cd == 0 || dd == 0 ||
      pref == 0)
    return kInvalidValue;
  fake_lt_heuristic_calls++;
  if (fake_lt_heuristic_status != 0) return fake_lt_heuristic_status;
  if (!lt_shapes(opd, ad, bd, cd, dd)) return kNotSupported;
  fake_lt_last_max_ws = pref->max_ws;
  memcpy(fake_lt_last_align, pref->align, sizeof(fake_lt_last_align));
  *returned = 0;
  if (fake_lt_workspace > pref->max_ws) return kOk; /* nothing within the workspace allowed */
  LtResult r;
  memset(&r, 0, sizeof(r));
  r.algo[0] = kLtAlgoMagic;
  r.algo[1] = ((const LtDesc*)opd)->epilogue;
  r.ws = fake_lt_workspace;
  r.waves = 1.0f;
  *(LtResult*)results = r;
  *returned = 1;
  return kOk;
}

int cublasLtMatmul(void* handle, void* opd, const void* alpha, const void* A, void* ad, const void* B, void* bd,
                   const void* beta, const void* C, void* cd, void* D, void* dd, const void* algo, void* ws,
                   size_t ws_size, void* stream) {
  const LtDesc* op = opd;
  const LtLayout *La = ad, *Lb = bd, *Lc = cd, *Ld = dd;
  const uint64_t* al = algo;
  if (handle == 0) return kNotInitialized;
  if (op == 0 || La == 0 || Lb == 0 || Lc == 0 || Ld == 0 || alpha == 0 || beta == 0 || A == 0 || B == 0 || D == 0)
    return kInvalidValue;
  if (al == 0 || al[0] != kLtAlgoMagic || al[1] != op->epilogue) return kInvalidValue; /* not this call's algorithm */
  if (ws_size < fake_lt_workspace || (ws_size > 0 && ws == 0)) return kInvalidValue;
  if (!lt_shapes(op, La, Lb, Lc, Ld)) return kInvalidValue;
  if ((op->epilogue & 4) && op->bias == 0) return kInvalidValue;
  if (fake_lt_matmul_status != 0) return fake_lt_matmul_status;
  if (ws_size > 0) memset(ws, 0xA5, ws_size); /* it must be writable memory of that size */
  const float a_ = *(const float*)alpha, b_ = *(const float*)beta;
  if (b_ != 0.0f && C == 0) return kInvalidValue;
  const int t = Ld->type;
  const int64_t m = (int64_t)Ld->rows, n = (int64_t)Ld->cols, k = (int64_t)(op->transa ? La->rows : La->cols);
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t i = 0; i < m; ++i) {
      double acc = 0.0;
      for (int64_t l = 0; l < k; ++l) {
        const int64_t ia = op->transa == 0 ? i + l * La->ld : l + i * La->ld;
        const int64_t ib = op->transb == 0 ? l + j * Lb->ld : j + l * Lb->ld;
        acc += load(A, t, ia) * load(B, t, ib);
      }
      double v = a_ * acc;
      if (b_ != 0.0f) v += b_ * load(C, t, i + j * Lc->ld); /* beta == 0: C is not read */
      if (op->epilogue & 4) v += load(op->bias, t, i);       /* one value per row of D */
      if (op->epilogue & 2) v = v > 0.0 ? v : 0.0;           /* NaN -> 0 */
      if (op->epilogue & 32) v = 0.5 * v * (1.0 + tanh(0.7978845608028654 * (v + 0.044715 * v * v * v)));
      store(D, t, i + j * Ld->ld, v);
    }
  }
  fake_lt_matmuls++;
  fake_lt_last_stream = stream;
  fake_lt_last_epilogue = op->epilogue;
  fake_lt_last_compute = op->compute;
  fake_lt_last_ws = ws;
  fake_lt_last_ws_size = ws_size;
  fake_lt_last_in_place = C == D;
  return kOk;
}

/* ---- cuDNN ---------------------------------------------------------------------------------------------- */

enum { kDnnOk = 0, kDnnNotInitialized = 1, kDnnBadParam = 3, kDnnNotSupported = 9 };

typedef struct { int set, format, type, n, c, h, w; } Tensor4d;
typedef struct { int set, type, format, k, c, h, w; } Filter4d;
typedef struct { int set, pad_h, pad_w, u, v, dil_h, dil_w, mode, compute, groups, math; } Conv2d;

int fake_dnn_calls = 0;
int fake_dnn_last_math = -1;
int fake_dnn_last_algo = -1;
void* fake_dnn_bound_stream = 0;
void* fake_dnn_last_stream = 0;
int fake_dnn_set_stream_calls = 0;
int fake_dnn_live_descriptors = 0;
/* the heuristic: its calls, a status to fail with (0: answer), the workspace of the first usable algorithm */
int fake_dnn_heuristic_calls = 0;
int fake_dnn_heuristic_status = 0;
int fake_dnn_heuristic_results = 4; /* how many of the ranking below it returns */
size_t fake_dnn_big_workspace = (size_t)1 << 40;
void* fake_dnn_last_ws = 0;
size_t fake_dnn_last_ws_size = 0;
/* the cudnnTensorFormat_t of the last forward call's X, W and Y descriptors (0 NCHW, 1 NHWC; -1: none yet) */
int fake_dnn_last_x_format = -1, fake_dnn_last_w_format = -1, fake_dnn_last_y_format = -1;

/* cudnnConvolutionFwdAlgoPerf_t */
typedef struct { int algo, status; float time; size_t memory; int determinism, mathType, reserved[3]; } FwdAlgoPerf;

static int cublas_type(int dnn_type) { return dnn_type == 0 ? 0 : dnn_type == 2 ? 2 : dnn_type == 9 ? 14 : -1; }

int cudnnCreateTensorDescriptor(void** d) { *d = calloc(1, sizeof(Tensor4d)); fake_dnn_live_descriptors++; return kDnnOk; }
int cudnnDestroyTensorDescriptor(void* d) { free(d); fake_dnn_live_descriptors--; return kDnnOk; }
int cudnnCreateFilterDescriptor(void** d) { *d = calloc(1, sizeof(Filter4d)); fake_dnn_live_descriptors++; return kDnnOk; }
int cudnnDestroyFilterDescriptor(void* d) { free(d); fake_dnn_live_descriptors--; return kDnnOk; }
int cudnnCreateConvolutionDescriptor(void** d) {
  Conv2d* c = calloc(1, sizeof(Conv2d));
  c->groups = 1;
  *d = c;
  fake_dnn_live_descriptors++;
  return kDnnOk;
}
int cudnnDestroyConvolutionDescriptor(void* d) { free(d); fake_dnn_live_descriptors--; return kDnnOk; }

int cudnnSetTensor4dDescriptor(void* d, int format, int type, int n, int c, int h, int w) {
  if ((format != 0 && format != 1) || cublas_type(type) < 0 || n <= 0 || c <= 0 || h <= 0 || w <= 0) return kDnnBadParam;
  Tensor4d t = {1, format, type, n, c, h, w};
  *(Tensor4d*)d = t;
  return kDnnOk;
}

int cudnnSetFilter4dDescriptor(void* d, int type, int format, int k, int c, int h, int w) {
  if ((format != 0 && format != 1) || cublas_type(type) < 0 || k <= 0 || c <= 0 || h <= 0 || w <= 0) return kDnnBadParam;
  Filter4d f = {1, type, format, k, c, h, w};
  *(Filter4d*)d = f;
  return kDnnOk;
}

int cudnnSetConvolution2dDescriptor(void* d, int pad_h, int pad_w, int u, int v, int dil_h, int dil_w, int mode,
                                    int compute) {
  if (pad_h < 0 || pad_w < 0 || u <= 0 || v <= 0 || dil_h <= 0 || dil_w <= 0 || (mode != 0 && mode != 1)) return kDnnBadParam;
  Conv2d* c = d;
  c->set = 1, c->pad_h = pad_h, c->pad_w = pad_w, c->u = u, c->v = v, c->dil_h = dil_h, c->dil_w = dil_w;
  c->mode = mode, c->compute = compute;
  return kDnnOk;
}

int cudnnSetConvolutionGroupCount(void* d, int groups) {
  if (groups < 1) return kDnnBadParam;
  ((Conv2d*)d)->groups = groups;
  return kDnnOk;
}

int cudnnSetConvolutionMathType(void* d, int math) {
  if (math < 0 || math > 3) return kDnnBadParam;
  ((Conv2d*)d)->math = math;
  return kDnnOk;
}

int cudnnSetStream(void* handle, void* stream) {
  if (handle == 0) return kDnnNotInitialized;
  fake_dnn_bound_stream = stream;
  fake_dnn_set_stream_calls++;
  return kDnnOk;
}

int cudnnGetStream(void* handle, void** stream) {
  if (handle == 0) return kDnnNotInitialized;
  *stream = fake_dnn_bound_stream;
  return kDnnOk;
}

const char* cudnnGetErrorString(int status) { return status == kDnnBadParam ? "CUDNN_STATUS_BAD_PARAM" : "CUDNN_STATUS_OTHER"; }

/* The workspace an algorithm needs here: none for IMPLICIT_GEMM (0), more than any cap for GEMM (2), a
 * shape-dependent size for the others (IMPLICIT_PRECOMP_GEMM, 1, is the one the heuristic offers first). */
static size_t fake_workspace(const Tensor4d* X, int algo) {
  if (algo == 0) return 0;
  if (algo == 2) return fake_dnn_big_workspace;
  return (size_t)X->n * X->c * X->h * X->w * 4 + 256 * (size_t)algo;
}

int cudnnGetConvolutionForwardWorkspaceSize(void* handle, void* xd, void* wd, void* cd, void* yd, int algo,
                                            size_t* size) {
  const Tensor4d* X = xd;
  if (handle == 0) return kDnnNotInitialized;
  if (!X->set || !((Tensor4d*)yd)->set || !((Filter4d*)wd)->set || !((Conv2d*)cd)->set || algo < 0 || algo > 7)
    return kDnnBadParam;
  *size = fake_workspace(X, algo);
  return kDnnOk;
}

/* Ranks FFT_TILING (5, not supported here), GEMM (2, too much workspace), IMPLICIT_PRECOMP_GEMM (1), then
 * IMPLICIT_GEMM (0), each with the descriptor's math type. */
int cudnnGetConvolutionForwardAlgorithm_v7(void* handle, void* xd, void* wd, void* cd, void* yd, int requested,
                                           int* returned, void* results) {
  const Tensor4d* X = xd;
  const Conv2d* C = cd;
  if (handle == 0) return kDnnNotInitialized;
  if (!X->set || !((Tensor4d*)yd)->set || !((Filter4d*)wd)->set || !C->set || requested < 1 || returned == 0)
    return kDnnBadParam;
  fake_dnn_heuristic_calls++;
  if (fake_dnn_heuristic_status != 0) return fake_dnn_heuristic_status;
  const int algos[4] = {5, 2, 1, 0};
  FwdAlgoPerf* perf = results;
  int n = requested < fake_dnn_heuristic_results ? requested : fake_dnn_heuristic_results;
  for (int i = 0; i < n; ++i) {
    FwdAlgoPerf r = {algos[i], algos[i] == 5 ? kDnnNotSupported : kDnnOk, -1.0f, fake_workspace(X, algos[i]), 1,
                     C->math, {0, 0, 0}};
    perf[i] = r;
  }
  *returned = n;
  return kDnnOk;
}

int cudnnConvolutionForward(void* handle, const void* alpha, void* xd, const void* x, void* wd, const void* w,
                            void* cd, int algo, void* ws, size_t ws_size, const void* beta, void* yd, void* y) {
  const Tensor4d* X = xd;
  const Tensor4d* Y = yd;
  const Filter4d* W = wd;
  const Conv2d* C = cd;
  if (handle == 0) return kDnnNotInitialized;
  if (!X->set || !Y->set || !W->set || !C->set) return kDnnBadParam;
  if (algo < 0 || algo > 7 || algo == 5) return kDnnNotSupported;
  if (ws_size < fake_workspace(X, algo) || (ws_size > 0 && ws == 0)) return kDnnBadParam; /* too small a workspace */
  if (ws_size > 0) memset(ws, 0xA5, ws_size); /* it must be writable memory of that size */
  fake_dnn_last_ws = ws;
  fake_dnn_last_ws_size = ws_size;
  if (X->type != W->type || X->type != Y->type || C->compute != 0) return kDnnBadParam;
  const int g = C->groups;
  if (X->c != W->c * g || W->k % g != 0 || Y->c != W->k || Y->n != X->n) return kDnnBadParam;
  const int oh = (X->h + 2 * C->pad_h - C->dil_h * (W->h - 1) - 1) / C->u + 1;
  const int ow = (X->w + 2 * C->pad_w - C->dil_w * (W->w - 1) - 1) / C->v + 1;
  if (Y->h != oh || Y->w != ow) return kDnnBadParam;
  fake_dnn_calls++;
  fake_dnn_last_math = C->math;
  fake_dnn_last_algo = algo;
  fake_dnn_last_stream = fake_dnn_bound_stream;
  fake_dnn_last_x_format = X->format, fake_dnn_last_w_format = W->format, fake_dnn_last_y_format = Y->format;
  const int t = cublas_type(X->type), kg = W->k / g;
  /* element (a, b, h, w) of a 4-D tensor in NCHW (format 0) or NHWC (format 1, a filter's KRSC) */
#define FAKE_AT(fmt, B, H, W_, a, b, hh, ww) \
  ((fmt) == 1 ? ((((int64_t)(a) * (H) + (hh)) * (W_) + (ww)) * (B) + (b)) : ((((int64_t)(a) * (B) + (b)) * (H) + (hh)) * (W_) + (ww)))
  const float al = *(const float*)alpha, be = *(const float*)beta;
  for (int n = 0; n < X->n; ++n)
    for (int k = 0; k < W->k; ++k)
      for (int i = 0; i < oh; ++i)
        for (int j = 0; j < ow; ++j) {
          double acc = 0.0;
          const int grp = k / kg;
          for (int c = 0; c < W->c; ++c)
            for (int r = 0; r < W->h; ++r)
              for (int s = 0; s < W->w; ++s) {
                const int hi = i * C->u - C->pad_h + r * C->dil_h, wi = j * C->v - C->pad_w + s * C->dil_w;
                if (hi < 0 || hi >= X->h || wi < 0 || wi >= X->w) continue;
                const int64_t xi = FAKE_AT(X->format, X->c, X->h, X->w, n, grp * W->c + c, hi, wi);
                const int64_t wi_ = FAKE_AT(W->format, W->c, W->h, W->w, k, c, r, s);
                const int64_t kidx = C->mode == 1 ? wi_ : FAKE_AT(W->format, W->c, W->h, W->w, k, c, W->h - 1 - r, W->w - 1 - s);
                acc += load(x, t, xi) * load(w, t, kidx);
              }
          const int64_t yi = FAKE_AT(Y->format, Y->c, oh, ow, n, k, i, j);
          const double old = be == 0.0f ? 0.0 : load(y, t, yi);
          store(y, t, yi, al * acc + be * old);
        }
  return kDnnOk;
}
