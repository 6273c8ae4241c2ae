/* metrale: few-row float32 projections on the CPU, y[m, o] = x[m, :] . w[o, :] (+ bias[o]),
 * and, built on them, the fused decode step of the dense decoder (metrale_decode_stack_f32,
 * at the end of this file; metrale/kernels/cpu_decode.py).
 *
 * Built at run time by metrale/kernels/cpu_gemv.py (cc -O3 -march=native -fopenmp) and called
 * through ctypes. Why: a decode step of a small model on the CPU reads every weight once, so a
 * projection of a few rows is bound by the weight reads; this kernel reads each weight row once,
 * front to back (the hardware prefetcher's easiest pattern), and serves every x row from it.
 *
 * Arithmetic (fixed, whatever the number of rows or threads): for each output, 32 float32
 * partial sums (two 16-lane accumulators over the row's 32-element chunks, fused multiply-add),
 * then a last 16-element chunk into the first accumulator, the two accumulators added, the 16
 * lanes summed as a fixed tree, then a scalar tail of the last (in % 16) elements in order, then
 * the bias. A row's result therefore does not depend on the other rows or the thread count.
 */
#include <stddef.h>
#ifdef _OPENMP
#include <omp.h>
#endif

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));
#define LD(p) (*(const v16u *)(p))

typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

/* The 16 lanes as a fixed tree: lane j + lane j+8, then +4, +2, +1. */
static inline float lanes_sum(v16 v) {
  v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

/* Weights as stored: float32, or bfloat16 (the high half of a float32: widened exactly by a
 * 16-bit shift, so a bf16 weight's products and sums are float32 ones; `METRALE_CPU_WEIGHTS`). */
typedef unsigned short bf16;
typedef unsigned short u16x16 __attribute__((vector_size(32), aligned(2)));
typedef unsigned int u32x16 __attribute__((vector_size(64)));
#define LDW_f32(p) LD(p)
#define W1_f32(p) (*(p))
static inline v16 LDW_bf16(const bf16 *p) {
  u32x16 wide = __builtin_convertvector(*(const u16x16 *)p, u32x16) << 16;
  return (v16)wide;
}
static inline float W1_bf16(const bf16 *p) {
  union { unsigned int u; float f; } v = {.u = (unsigned int)*p << 16};
  return v.f;
}

/* One weight row against MM x rows (MM <= 4), weights of type WT (suffix T). */
#define ROW_KERNEL(MM, T, WT)                                                                \
  static inline __attribute__((always_inline)) void row##MM##_##T(                           \
      const float *x, long ldx, const WT *w, long n, float bias, float *y, long ldy) {       \
    v16 acc[MM][2];                                                                          \
    _Pragma("GCC unroll 4") for (int m = 0; m < MM; m++) acc[m][0] = acc[m][1] = (v16){0};   \
    long n32 = n & ~31L, n16 = n & ~15L;                                                     \
    for (long i = 0; i < n32; i += 32) {                                                     \
      v16 w0 = LDW_##T(w + i), w1 = LDW_##T(w + i + 16);                                     \
      _Pragma("GCC unroll 4") for (int m = 0; m < MM; m++) {                                 \
        acc[m][0] += w0 * LD(x + m * ldx + i);                                               \
        acc[m][1] += w1 * LD(x + m * ldx + i + 16);                                          \
      }                                                                                      \
    }                                                                                        \
    if (n16 > n32) {                                                                         \
      v16 wv = LDW_##T(w + n32);                                                             \
      _Pragma("GCC unroll 4") for (int m = 0; m < MM; m++) acc[m][0] += wv * LD(x + m * ldx + n32); \
    }                                                                                        \
    _Pragma("GCC unroll 4") for (int m = 0; m < MM; m++) {                                   \
      float s = lanes_sum(acc[m][0] + acc[m][1]);                                            \
      for (long i = n16; i < n; i++) s += x[m * ldx + i] * W1_##T(w + i);                    \
      y[m * ldy] = s + bias;                                                                \
    }                                                                                        \
  }

/* Output columns [o0, o1) for all `rows` x rows: each weight row is read from memory once and
 * then serves the x rows four at a time (from the L1 cache after the first four). */
#define SPAN(T, WT)                                                                          \
  ROW_KERNEL(1, T, WT)                                                                       \
  ROW_KERNEL(2, T, WT)                                                                       \
  ROW_KERNEL(3, T, WT)                                                                       \
  ROW_KERNEL(4, T, WT)                                                                       \
  static void span_##T(const float *x, long ldx, const WT *w, const float *bias, float *y,   \
                       long rows, long in, long out, long o0, long o1) {                     \
    for (long o = o0; o < o1; o++) {                                                         \
      const WT *wo = w + o * in;                                                             \
      float b = bias ? bias[o] : 0.0f;                                                       \
      for (long m = 0; m < rows; m += 4) {                                                   \
        const float *xm = x + m * ldx;                                                       \
        float *ym = y + m * out + o;                                                         \
        switch (rows - m < 4 ? rows - m : 4) {                                               \
          case 1: row1_##T(xm, ldx, wo, in, b, ym, out); break;                              \
          case 2: row2_##T(xm, ldx, wo, in, b, ym, out); break;                              \
          case 3: row3_##T(xm, ldx, wo, in, b, ym, out); break;                              \
          default: row4_##T(xm, ldx, wo, in, b, ym, out); break;                             \
        }                                                                                    \
      }                                                                                      \
    }                                                                                        \
  }

/* y [rows, out] (contiguous) = x [rows, in] (row stride ldx) @ w [out, in]^T (+ bias [out]),
 * split over `threads` OpenMP threads by contiguous output ranges (multiples of 16 outputs,
 * so no two threads write one cache line of y). */
#ifdef _OPENMP
#define GEMV(T, WT)                                                                          \
  SPAN(T, WT)                                                                                \
  void metrale_gemv_##T(const float *x, long ldx, const WT *w, const float *bias, float *y,  \
                        long rows, long in, long out, int threads) {                         \
    if (threads > 1 && out >= 32) {                                                          \
      _Pragma("omp parallel num_threads(threads)") {                                        \
        long n = omp_get_num_threads(), t = omp_get_thread_num();                            \
        long per = ((out + n - 1) / n + 15) & ~15L;                                          \
        long a = t * per, b = a + per < out ? a + per : out;                                 \
        if (a < b) span_##T(x, ldx, w, bias, y, rows, in, out, a, b);                        \
      }                                                                                      \
      return;                                                                                \
    }                                                                                        \
    span_##T(x, ldx, w, bias, y, rows, in, out, 0, out);                                     \
  }
#else
#define GEMV(T, WT)                                                                          \
  SPAN(T, WT)                                                                                \
  void metrale_gemv_##T(const float *x, long ldx, const WT *w, const float *bias, float *y,  \
                        long rows, long in, long out, int threads) {                         \
    (void)threads;                                                                           \
    span_##T(x, ldx, w, bias, y, rows, in, out, 0, out);                                     \
  }
#endif
GEMV(f32, float)
GEMV(bf16, bf16)

/* ---------------------------------------------------------------------------------------------
 * One decode step of the dense pre-norm decoder (Llama / Mistral / Qwen2 / Qwen3: RMSNorm,
 * fused QKV with optional bias, optional per-head q/k RMSNorm, rotate-half rotary over the whole
 * head, paged GQA attention, SiLU-gated MLP) for `rows` one-token rows, every layer in one call:
 * the torch path spends most of a small model's CPU step in ~30 calls per layer
 * (metrale/kernels/cpu_decode.py says when this runs). Float32 throughout; the projections are
 * metrale_gemv_f32 (its fixed arithmetic), the rest plain loops in a fixed order.
 *
 * h [rows, hidden]: in, the token embeddings; out, the final RMSNorm of the last residual.
 * w: per layer 9 pointers (input norm, qkv weight, qkv bias or NULL, q norm or NULL, k norm or
 * NULL, o weight, post-attention norm, gate_up weight [2 * inter, hidden], down weight).
 * kv: per layer the key and value caches [blocks, block_size, kv_heads, head_dim].
 * positions / slots (int64) and seq_lens (int32, the length including this token) per row;
 * tables [rows, table_stride] int32 block ids; cos_sin [positions, 2, head_dim / 2].
 * scratch: at least metrale_decode_scratch(...) floats. weights_bf16: the four projection
 * weights of every layer are bfloat16 (METRALE_CPU_WEIGHTS=bf16; the qkv bias and norms stay
 * float32), else float32.
 */
#include <math.h>

long metrale_decode_scratch(long rows, long hidden, long q_heads, long kv_heads, long dim,
                            long inter, long max_len) {
  return rows * (3 * hidden + (q_heads + 2 * kv_heads) * dim + q_heads * dim + 3 * inter) +
         max_len + 64;
}

static void rms_norm_rows(const float *x, const float *w, float eps, float *out, long rows,
                          long n) {
  for (long r = 0; r < rows; r++) {
    const float *xr = x + r * n;
    float ss = 0.0f;
    for (long i = 0; i < n; i++) ss += xr[i] * xr[i];
    float scale = 1.0f / sqrtf(ss / (float)n + eps);
    for (long i = 0; i < n; i++) out[r * n + i] = (xr[i] * scale) * w[i];
  }
}

/* One head in place: optional RMSNorm with `w`, then the rotate-half rotation at `pos`. */
static void norm_rotate(float *x, const float *w, float eps, const float *cos_sin, long pos,
                        long dim) {
  if (w) {
    float ss = 0.0f;
    for (long i = 0; i < dim; i++) ss += x[i] * x[i];
    float scale = 1.0f / sqrtf(ss / (float)dim + eps);
    for (long i = 0; i < dim; i++) x[i] = (x[i] * scale) * w[i];
  }
  long half = dim / 2;
  const float *c = cos_sin + pos * dim, *s = c + half;
  for (long i = 0; i < half; i++) {
    float a = x[i], b = x[i + half];
    x[i] = a * c[i] - b * s[i];
    x[i + half] = b * c[i] + a * s[i];
  }
}

/* A projection of the stack: its weight pointer holds bf16 values when `weights_bf16`. */
#define PROJECT(X, LDX, W, B, Y, ROWS, IN, OUT)                                              \
  (weights_bf16 ? metrale_gemv_bf16(X, LDX, (const bf16 *)(W), B, Y, ROWS, IN, OUT, threads)  \
                : metrale_gemv_f32(X, LDX, W, B, Y, ROWS, IN, OUT, threads))

void metrale_decode_stack_f32(float *h, long rows, long hidden, long layers,
                              const float *const *w, float *const *kv, const float *final_norm,
                              float eps, long q_heads, long kv_heads, long dim, long inter,
                              long block_size, const long *positions, const long *slots,
                              const int *seq_lens, const int *tables, long table_stride,
                              const float *cos_sin, float scale, float *scratch, int threads,
                              int weights_bf16) {
  long qkv_n = (q_heads + 2 * kv_heads) * dim, q_n = q_heads * dim, kv_n = kv_heads * dim;
  long group = q_heads / kv_heads;
  float *residual = scratch, *x = residual + rows * hidden, *o = x + rows * hidden;
  float *qkv = o + rows * hidden, *attn = qkv + rows * qkv_n, *gu = attn + rows * q_n;
  float *act = gu + rows * 2 * inter, *scores = act + rows * inter;
  for (long i = 0; i < rows * hidden; i++) residual[i] = h[i];
  for (long l = 0; l < layers; l++) {
    const float *const *lw = w + 9 * l;
    float *k_cache = kv[2 * l], *v_cache = kv[2 * l + 1];
    if (l > 0)
      for (long i = 0; i < rows * hidden; i++) residual[i] = residual[i] + h[i];
    rms_norm_rows(residual, lw[0], eps, x, rows, hidden);
    PROJECT(x, hidden, lw[1], lw[2], qkv, rows, hidden, qkv_n);
    for (long r = 0; r < rows; r++) {
      float *row = qkv + r * qkv_n;
      for (long hq = 0; hq < q_heads; hq++)
        norm_rotate(row + hq * dim, lw[3], eps, cos_sin, positions[r], dim);
      for (long g = 0; g < kv_heads; g++)
        norm_rotate(row + q_n + g * dim, lw[4], eps, cos_sin, positions[r], dim);
      float *kd = k_cache + slots[r] * kv_n, *vd = v_cache + slots[r] * kv_n;
      for (long i = 0; i < kv_n; i++) {
        kd[i] = row[q_n + i];
        vd[i] = row[q_n + kv_n + i];
      }
    }
    for (long r = 0; r < rows; r++) {
      long len = seq_lens[r];
      const int *table = tables + r * table_stride;
      for (long hq = 0; hq < q_heads; hq++) {
        const float *q = qkv + r * qkv_n + hq * dim;
        long g = hq / group;
        float m = -INFINITY;
        for (long t = 0; t < len; t++) {
          const float *k = k_cache + ((long)table[t / block_size] * block_size + t % block_size) * kv_n + g * dim;
          float s = 0.0f;
          for (long i = 0; i < dim; i++) s += q[i] * k[i];
          s *= scale;
          scores[t] = s;
          if (s > m) m = s;
        }
        float total = 0.0f;
        for (long t = 0; t < len; t++) {
          scores[t] = expf(scores[t] - m);
          total += scores[t];
        }
        float *out = attn + r * q_n + hq * dim;
        for (long i = 0; i < dim; i++) out[i] = 0.0f;
        for (long t = 0; t < len; t++) {
          const float *v = v_cache + ((long)table[t / block_size] * block_size + t % block_size) * kv_n + g * dim;
          float p = scores[t] / total;
          for (long i = 0; i < dim; i++) out[i] += p * v[i];
        }
      }
    }
    PROJECT(attn, q_n, lw[5], NULL, o, rows, q_n, hidden);
    for (long i = 0; i < rows * hidden; i++) residual[i] = residual[i] + o[i];
    rms_norm_rows(residual, lw[6], eps, x, rows, hidden);
    PROJECT(x, hidden, lw[7], NULL, gu, rows, hidden, 2 * inter);
    for (long r = 0; r < rows; r++)
      for (long i = 0; i < inter; i++) {
        float g = gu[r * 2 * inter + i], u = gu[r * 2 * inter + inter + i];
        act[r * inter + i] = (g / (1.0f + expf(-g))) * u;
      }
    PROJECT(act, inter, lw[8], NULL, h, rows, inter, hidden);
  }
  for (long i = 0; i < rows * hidden; i++) residual[i] = residual[i] + h[i];
  rms_norm_rows(residual, final_norm, eps, h, rows, hidden);
}
