/* metrale: few-row float32 projections on the CPU, y[m, o] = x[m, :] . w[o, :] (+ bias[o]),
 * decode attention over the paged KV cache (metrale_paged_decode_attention_f32; the lean CPU
 * ops, metrale/kernels/cpu_ops.py) and, built on them, the fused decode step of the dense
 * decoder (metrale_decode_stack_f32, at the end of this file; metrale/kernels/cpu_decode.py).
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

/* exp(x) for x <= 0 in 16 lanes (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-6
 * polynomial for e^r, 2^n from the exponent bits; within ~2 ulp of libm's expf); x below
 * -87.3 gives 0. */
typedef int vi16 __attribute__((vector_size(64)));
static inline v16 select16(vi16 mask, v16 a, v16 b) { /* a where mask, else b */
  vi16 ai, bi;
  __builtin_memcpy(&ai, &a, sizeof ai);
  __builtin_memcpy(&bi, &b, sizeof bi);
  vi16 r = (mask & ai) | (~mask & bi);
  v16 out;
  __builtin_memcpy(&out, &r, sizeof out);
  return out;
}
static inline v16 exp16_nonpositive(v16 x) {
  const v16 zero = {0};
  vi16 under = x < -87.3f;
  v16 xc = select16(under, zero - 87.3f, x);
  vi16 n = __builtin_convertvector(xc * 1.44269504088896341f - 0.5f, vi16); /* round, t <= 0 */
  v16 nf = __builtin_convertvector(n, v16);
  v16 r = xc - nf * 0.693359375f + nf * 2.12194440e-4f;
  v16 p = 1.9875691500e-4f * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  vi16 bits = (n + 127) << 23;
  v16 scale;
  __builtin_memcpy(&scale, &bits, sizeof scale);
  return select16(under, zero, p * scale);
}

/* Decode attention of one-token rows over a paged float32 KV cache: for row r and query head
 * hq (its KV head g = hq / (q_heads / kv_heads)), softmax(scale * q . k_t) over the row's
 * seq_lens[r] cached positions t (block tables[r][t / block_size], slot t % block_size), then
 * the weighted sum of v_t. q [rows, q_stride] holds the query heads at the row's start; out
 * [rows, out_stride] gets them the same way. The heads of one KV head share each k_t / v_t
 * read. Arithmetic per (row, head), whatever the threads: each dot product in 16 lanes (the
 * head dimension's chunks of 16 added lane by lane, then the lanes as `lanes_sum`; in order
 * when the head dimension is not a multiple of 16), the max, exp(s - max) (16 positions at a
 * time by exp16_nonpositive, the rest by expf) summed in position order and divided by that sum, then each output lane accumulated in position order. scores: at least
 * threads * (q_heads / kv_heads) * max(seq_lens) floats. */
static void paged_decode_attention(const float *q, long q_stride, const float *k_cache,
                                   const float *v_cache, long rows, long q_heads, long kv_heads,
                                   long dim, long block_size, const int *seq_lens,
                                   const int *tables, long table_stride, float scale, float *out,
                                   long out_stride, float *scores, int threads) {
  long group = q_heads / kv_heads, kv_n = kv_heads * dim, max_len = 0;
  for (long r = 0; r < rows; r++)
    if (seq_lens[r] > max_len) max_len = seq_lens[r];
  int vec = dim % 16 == 0;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (long item = 0; item < rows * kv_heads; item++) {
    long r = item / kv_heads, g = item % kv_heads, len = seq_lens[r];
#ifdef _OPENMP
    float *sc = scores + (long)omp_get_thread_num() * group * max_len;
#else
    float *sc = scores;
#endif
    const int *table = tables + r * table_stride;
    const float *qg = q + r * q_stride + g * group * dim;
    float *og = out + r * out_stride + g * group * dim;
    /* scores: position by position, block by block (no division per position) */
    for (long start = 0, b = 0; start < len; start += block_size, b++) {
      long end = start + block_size < len ? start + block_size : len;
      const float *k = k_cache + (long)table[b] * block_size * kv_n + g * dim;
      for (long t = start; t < end; t++, k += kv_n)
        for (long j = 0; j < group; j++) {
          const float *qh = qg + j * dim;
          float s;
          if (vec) {
            v16 acc = LD(qh) * LD(k);
            for (long c = 16; c < dim; c += 16) acc += LD(qh + c) * LD(k + c);
            s = lanes_sum(acc);
          } else {
            s = 0.0f;
            for (long i = 0; i < dim; i++) s += qh[i] * k[i];
          }
          sc[j * max_len + t] = s * scale;
        }
    }
    for (long j = 0; j < group; j++) {
      float *sj = sc + j * max_len, m = -INFINITY, total = 0.0f;
      for (long t = 0; t < len; t++)
        if (sj[t] > m) m = sj[t];
      long t = 0;
      for (; t + 16 <= len; t += 16) { /* the lanes summed in position order, as the tail */
        v16 e = exp16_nonpositive(LD(sj + t) - m);
        *(v16u *)(sj + t) = e;
        for (int i = 0; i < 16; i++) total += e[i];
      }
      for (; t < len; t++) {
        sj[t] = expf(sj[t] - m);
        total += sj[t];
      }
      for (t = 0; t < len; t++) sj[t] /= total;
    }
    /* out = sum over positions of p_t v_t, 16 lanes of one head at a time, positions in order */
    for (long j = 0; j < group; j++) {
      const float *pj = sc + j * max_len;
      float *oh = og + j * dim;
      for (long c = 0; c < dim; c += vec ? 16 : 1) {
        if (vec) {
          v16 acc = {0};
          for (long start = 0, b = 0; start < len; start += block_size, b++) {
            long end = start + block_size < len ? start + block_size : len;
            const float *v = v_cache + (long)table[b] * block_size * kv_n + g * dim + c;
            for (long t = start; t < end; t++, v += kv_n) acc += pj[t] * LD(v);
          }
          *(v16u *)(oh + c) = acc;
        } else {
          float acc = 0.0f;
          for (long start = 0, b = 0; start < len; start += block_size, b++) {
            long end = start + block_size < len ? start + block_size : len;
            const float *v = v_cache + (long)table[b] * block_size * kv_n + g * dim + c;
            for (long t = start; t < end; t++, v += kv_n) acc += pj[t] * *v;
          }
          oh[c] = acc;
        }
      }
    }
  }
}

/* paged_decode_attention for the lean CPU ops (metrale/kernels/cpu_ops.py): plain decode rows
 * of a float32 cache, `threads` OpenMP threads over (row, KV head) pairs. */
void metrale_paged_decode_attention_f32(const float *q, long q_stride, const float *k_cache,
                                        const float *v_cache, long rows, long q_heads,
                                        long kv_heads, long dim, long block_size,
                                        const int *seq_lens, const int *tables,
                                        long table_stride, float scale, float *out,
                                        long out_stride, float *scores, int threads) {
  paged_decode_attention(q, q_stride, k_cache, v_cache, rows, q_heads, kv_heads, dim,
                         block_size, seq_lens, tables, table_stride, scale, out, out_stride,
                         scores, threads);
}

/* The sampler's whole result for greedy rows of unprocessed float32 logits [rows, stride]
 * (metrale/kernels/cpu_ops.py, the CPU form of sampling_reference.greedy_logprobs): each logit
 * read with NaN as -inf and +inf as FLT_MAX; ids[r] the first index of the row's largest value
 * (0 for a row without a finite one); packed[r] = (id, logprob = max - (max + log(sum of
 * exp(x - max))) in float32, -inf for a row without a finite logit; rank 1; samplable 1 or 0).
 * The exponentials 16 lanes at a time (exp16_nonpositive), each chunk's lanes summed as
 * lanes_sum and the chunks' sums (then the tail's expf terms, in order) added in double, the
 * total rounded to float32 once: fixed arithmetic, within float32 rounding of torch's
 * logsumexp at any vocabulary size. */
static inline float read_logit(float v) { /* NaN as -inf, +inf as FLT_MAX */
  return v != v ? -INFINITY : (v > 3.40282347e38f ? 3.40282347e38f : v);
}

void metrale_greedy_logprobs_f32(const float *x, long rows, long vocab, long stride, long *ids,
                                 double *packed) {
  const float big = 3.40282347e38f;
  for (long r = 0; r < rows; r++) {
    const float *row = x + r * stride;
    float m = -INFINITY;
    for (long t = 0; t < vocab; t++) {
      float v = read_logit(row[t]);
      if (v > m) m = v;
    }
    long arg = 0;
    double logprob = -INFINITY;
    if (m > -INFINITY) {
      for (long t = 0; t < vocab; t++)
        if (read_logit(row[t]) == m) {
          arg = t;
          break;
        }
      double total = 0.0;
      long t = 0;
      const v16 zero = {0};
      for (; t + 16 <= vocab; t += 16) {
        v16 v = LD(row + t);
        v = select16(v != v, zero - INFINITY, v);
        v = select16(v > big, zero + big, v);
        total += lanes_sum(exp16_nonpositive(v - m));
      }
      for (; t < vocab; t++) total += expf(read_logit(row[t]) - m);
      float lse = m + logf((float)total);
      logprob = m - lse;
    }
    ids[r] = arg;
    packed[4 * r] = (double)arg;
    packed[4 * r + 1] = logprob;
    packed[4 * r + 2] = 1.0;
    packed[4 * r + 3] = m > -INFINITY ? 1.0 : 0.0;
  }
}

/* The sampler's result for greedy rows whose logits only a few banned ids change (min_tokens'
 * stop ids: metrale/kernels/cpu_ops.py, `stop_masked_greedy`), as the torch path computes it
 * from float32 logits [rows, stride] none of which is NaN or +inf (else it returns 1 at once,
 * and the caller runs the torch form): the token the first index of the largest logit, the
 * row's banned ids (banned[starts[r] .. starts[r + 1]), each in [0, vocab)) read as -inf;
 * samplable when that logit is above -inf, else the token the first index of the row's
 * largest logit (the raw argmax fallback). packed[r] = (token, logprob = its logit - lse[r]
 * in float32 (torch's logsumexp of the row, computed by the caller; NaN, a row of -inf only,
 * as -inf), rank = 1 + the logits above the token's, samplable 1 or 0). Comparisons and one
 * float32 subtraction: exactly the torch path's values. Returns 0. */
long metrale_stop_masked_greedy_f32(const float *x, long rows, long vocab, long stride,
                                    const long *starts, const long *banned, const float *lse,
                                    long *ids, double *packed) {
  for (long r = 0; r < rows; r++) {
    const float *row = x + r * stride;
    for (long t = 0; t < vocab; t++)
      if (row[t] != row[t] || row[t] > 3.40282347e38f) return 1;
  }
  for (long r = 0; r < rows; r++) {
    const float *row = x + r * stride;
    long b0 = starts[r], b1 = starts[r + 1];
    float m = -INFINITY, best = -INFINITY;
    long arg = 0, raw_arg = 0;
    for (long t = 0; t < vocab; t++) {
      float v = row[t];
      if (v > best) {
        best = v;
        raw_arg = t;
      }
      if (v > m) {
        int is_banned = 0;
        for (long b = b0; b < b1; b++) is_banned |= banned[b] == t;
        if (!is_banned) {
          m = v;
          arg = t;
        }
      }
    }
    int samplable = m > -INFINITY;
    if (!samplable) arg = raw_arg;
    float c = row[arg], lp = c - lse[r];
    long above = 0;
    for (long t = 0; t < vocab; t++) above += row[t] > c;
    ids[r] = arg;
    packed[4 * r] = (double)arg;
    packed[4 * r + 1] = lp != lp ? -INFINITY : (double)lp;
    packed[4 * r + 2] = (double)(above + 1);
    packed[4 * r + 3] = samplable ? 1.0 : 0.0;
  }
  return 0;
}

long metrale_decode_scratch(long rows, long hidden, long q_heads, long kv_heads, long dim,
                            long inter, long max_len) {
  return rows * (3 * hidden + (q_heads + 2 * kv_heads) * dim + q_heads * dim + 3 * inter) +
         (q_heads / kv_heads) * max_len + 64;
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
    paged_decode_attention(qkv, qkv_n, k_cache, v_cache, rows, q_heads, kv_heads, dim,
                           block_size, seq_lens, tables, table_stride, scale, attn, q_n, scores,
                           1);
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
