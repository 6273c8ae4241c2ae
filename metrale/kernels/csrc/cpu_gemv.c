/* metrale: few-row float32 projections on the CPU, y[m, o] = x[m, :] . w[o, :] (+ bias[o]).
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

/* One weight row against MM x rows (MM <= 4). */
#define ROW_KERNEL(MM)                                                                       \
  static inline __attribute__((always_inline)) void row##MM(                                 \
      const float *x, long ldx, const float *w, long n, float bias, float *y, long ldy) {    \
    v16 acc[MM][2];                                                                          \
    _Pragma("GCC unroll 4") for (int m = 0; m < MM; m++) acc[m][0] = acc[m][1] = (v16){0};   \
    long n32 = n & ~31L, n16 = n & ~15L;                                                     \
    for (long i = 0; i < n32; i += 32) {                                                     \
      v16 w0 = LD(w + i), w1 = LD(w + i + 16);                                               \
      _Pragma("GCC unroll 4") for (int m = 0; m < MM; m++) {                                 \
        acc[m][0] += w0 * LD(x + m * ldx + i);                                               \
        acc[m][1] += w1 * LD(x + m * ldx + i + 16);                                          \
      }                                                                                      \
    }                                                                                        \
    if (n16 > n32) {                                                                         \
      v16 wv = LD(w + n32);                                                                  \
      _Pragma("GCC unroll 4") for (int m = 0; m < MM; m++) acc[m][0] += wv * LD(x + m * ldx + n32); \
    }                                                                                        \
    _Pragma("GCC unroll 4") for (int m = 0; m < MM; m++) {                                   \
      float s = lanes_sum(acc[m][0] + acc[m][1]);                                            \
      for (long i = n16; i < n; i++) s += x[m * ldx + i] * w[i];                             \
      y[m * ldy] = s + bias;                                                                \
    }                                                                                        \
  }
ROW_KERNEL(1)
ROW_KERNEL(2)
ROW_KERNEL(3)
ROW_KERNEL(4)

/* Output columns [o0, o1) for all `rows` x rows: each weight row is read from memory once and
 * then serves the x rows four at a time (from the L1 cache after the first four). */
static void span(const float *x, long ldx, const float *w, const float *bias, float *y,
                 long rows, long in, long out, long o0, long o1) {
  for (long o = o0; o < o1; o++) {
    const float *wo = w + o * in;
    float b = bias ? bias[o] : 0.0f;
    for (long m = 0; m < rows; m += 4) {
      const float *xm = x + m * ldx;
      float *ym = y + m * out + o;
      switch (rows - m < 4 ? rows - m : 4) {
        case 1: row1(xm, ldx, wo, in, b, ym, out); break;
        case 2: row2(xm, ldx, wo, in, b, ym, out); break;
        case 3: row3(xm, ldx, wo, in, b, ym, out); break;
        default: row4(xm, ldx, wo, in, b, ym, out); break;
      }
    }
  }
}

/* y [rows, out] (contiguous) = x [rows, in] (row stride ldx) @ w [out, in]^T (+ bias [out]),
 * split over `threads` OpenMP threads by contiguous output ranges (multiples of 16 outputs,
 * so no two threads write one cache line of y). */
void metrale_gemv_f32(const float *x, long ldx, const float *w, const float *bias, float *y,
                      long rows, long in, long out, int threads) {
#ifdef _OPENMP
  if (threads > 1 && out >= 32) {
#pragma omp parallel num_threads(threads)
    {
      long n = omp_get_num_threads(), t = omp_get_thread_num();
      long per = ((out + n - 1) / n + 15) & ~15L;
      long a = t * per, b = a + per < out ? a + per : out;
      if (a < b) span(x, ldx, w, bias, y, rows, in, out, a, b);
    }
    return;
  }
#endif
  span(x, ldx, w, bias, y, rows, in, out, 0, out);
}
