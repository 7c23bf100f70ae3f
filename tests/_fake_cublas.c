/* A host-memory stand-in for the four cuBLAS entry points the vendor path calls (custom_ops/vendor.cc), with
 * cuBLAS's real signatures and column-major semantics, so the tests drive dc_vendor_gemm with host pointers.
 * It checks the arguments cuBLAS checks (leading dimensions, sizes) and records the last call for the tests.
 * Data types: CUDA_R_32F (0), CUDA_R_16F (2), CUDA_R_16BF (14); accumulation in double. */
#include <math.h>
#include <stdint.h>
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
