/*
 * shardscale's CPU unscale + inf/NaN check: one read and (unless the factor is 1) one write of
 * each gradient, for float32, bfloat16 and float16 tensors in CPU memory.
 *
 * Same results, bit for bit, as torch's _amp_foreach_non_finite_check_and_unscale_ on finite and
 * infinite values: each element is widened to float32, multiplied by the float32 factor and
 * rounded back to nearest-even (NaNs stay NaNs; their payload may differ). found_inf is set to 1.0
 * when any element is inf or NaN and never cleared, as torch's kernel does. The non-finite test
 * works on the bits (exponent all ones), so it is exact whatever the compiler flags.
 *
 * Built at first use by shardscale/_cpukernel.py with the system C compiler and OpenMP; x86-64
 * gets AVX-512 / AVX2 / baseline clones chosen at load time (one binary for every x86-64 CPU).
 * Threads: the caller passes torch.get_num_threads(); small calls run on one thread.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
#if __GNUC__ >= 11
#define SS_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define SS_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#endif
#define SS_F16C 1
#include <immintrin.h>
#else
#define SS_CLONES
#define SS_F16C 0
#endif

#if defined(__aarch64__) && defined(__ARM_FP16_FORMAT_IEEE)
#define SS_ARM_FP16 1
#else
#define SS_ARM_FP16 0
#endif

enum { SS_F32 = 0, SS_BF16 = 1, SS_F16 = 2 };

/* Below this many elements in a call, one thread does all of it (a parallel region costs more). */
#define SS_PARALLEL_MIN 131072
/* ... and unless one tensor has more than this many (torch's parallel grain, at::internal::
 * GRAIN_SIZE; at::parallel_for splits only a range longer than it): a parallel region is then
 * entered only where torch's own per-tensor kernels would enter one too. GNU OpenMP cannot start
 * one in a child forked after the parent used threads: this way such a child hangs in
 * shardscale only where it would hang in torch. */
#define SS_GRAIN 32768

/* The thread count for k tensors: 1 for small work (see above), else the caller's request. */
static int threads_for(const int64_t *lens, int64_t k, int requested, int64_t *total) {
  int64_t sum = 0, largest = 0;
  for (int64_t j = 0; j < k; j++) {
    sum += lens[j];
    largest = lens[j] > largest ? lens[j] : largest;
  }
  *total = sum;
  return requested < 1 || sum < SS_PARALLEL_MIN || largest <= SS_GRAIN ? 1 : requested;
}

SS_CLONES static int f32_run(float *restrict x, int64_t n, float inv, int write) {
  int32_t bad = 0;
  if (write) {
    for (int64_t i = 0; i < n; i++) {
      float v = x[i];
      int32_t b;
      memcpy(&b, &v, 4);
      bad |= (b & 0x7fffffff) > 0x7f7fffff;
      x[i] = v * inv;
    }
  } else {
    for (int64_t i = 0; i < n; i++) {
      int32_t b;
      memcpy(&b, &x[i], 4);
      bad |= (b & 0x7fffffff) > 0x7f7fffff;
    }
  }
  return bad;
}

/* 1 if a 16-bit float of the run is inf or NaN: its magnitude bits exceed `max_finite`
 * (bf16 0x7f7f, fp16 0x7bff). */
SS_CLONES static int check_16(const uint16_t *restrict x, int64_t n, int32_t max_finite) {
  int32_t bad = 0;
  for (int64_t i = 0; i < n; i++) bad |= (int32_t)(x[i] & 0x7fff) > max_finite;
  return bad;
}

SS_CLONES static int bf16_run(uint16_t *restrict x, int64_t n, float inv, int write) {
  int32_t bad = 0;
  if (write) {
    for (int64_t i = 0; i < n; i++) {
      uint32_t h = x[i];
      bad |= (int32_t)(h & 0x7fff) > 0x7f7f;
      uint32_t b = h << 16;
      float v;
      memcpy(&v, &b, 4);
      v *= inv;
      uint32_t r;
      memcpy(&r, &v, 4);
      /* round to nearest even, as c10::BFloat16 */
      r = (v != v) ? 0x7fc00000u : r + 0x7fffu + ((r >> 16) & 1u);
      x[i] = (uint16_t)(r >> 16);
    }
  } else {
    bad = check_16(x, n, 0x7f7f);
  }
  return bad;
}

static int f16_check(const uint16_t *restrict x, int64_t n) { return check_16(x, n, 0x7bff); }

#if SS_F16C
/* float32 bits rounded to nearest even at bit 16, as c10::BFloat16 (the result: the high half). */
__attribute__((target("avx512f"))) static inline __m512i round_bf16_512(__m512i r) {
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(r, 16), _mm512_set1_epi32(1));
  return _mm512_add_epi32(r, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
}

/* bf16_run's write path with AVX-512 intrinsics, 32 elements at a time and the same arithmetic,
 * in fewer instructions than the compiler's vectorisation of it (~5.5 G elements/s per core
 * there, ~9.5 here, measured in L2): each 32-bit lane holds two bfloat16s, the even one widened
 * by a shift, the odd one by a mask; both are multiplied and rounded where they sit and
 * recombined by a blend.
 * A NaN element stays a NaN without the select bf16_run makes: its product keeps the element's
 * payload (x86 returns the NaN operand, quieted), whose low 16 bits are zero, so the rounding
 * carries nothing into the result's half; only the payload may differ from torch's (as torch's
 * own vectorised and scalar paths differ). A NaN factor's payload may have low bits set (the
 * rounding would then carry into the sign: 0x7fffffff becomes -0.0): run() sends NaN factors
 * to bf16_run. The tail goes to bf16_run too. */
__attribute__((target("avx512f,avx512bw"))) static int bf16_run_512(uint16_t *restrict x,
                                                                     int64_t n, float inv) {
  const __m512 f = _mm512_set1_ps(inv);
  const __m512i mag = _mm512_set1_epi16(0x7fff), max_finite = _mm512_set1_epi16(0x7f7f);
  const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
  __mmask32 bad = 0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512i w = _mm512_loadu_si512((const void *)(x + i));
    bad |= _mm512_cmpgt_epi16_mask(_mm512_and_si512(w, mag), max_finite);
    const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(w, high));
    __m512i e = _mm512_castps_si512(_mm512_mul_ps(even, f));
    __m512i o = _mm512_castps_si512(_mm512_mul_ps(odd, f));
    e = round_bf16_512(e);
    o = round_bf16_512(o);
    /* even results move to the low halves; odd 16-bit lanes (mask 0xaaaaaaaa) come from o */
    _mm512_storeu_si512((void *)(x + i),
                        _mm512_mask_blend_epi16(0xaaaaaaaau, _mm512_srli_epi32(e, 16), o));
  }
  return bf16_run(x + i, n - i, inv, 1) | (bad != 0);
}
#endif

#if SS_F16C
/* float16 <-> float32 through the F16C instructions (round to nearest even), 8 lanes at a time. */
__attribute__((target("avx2,f16c"))) static int f16_run(uint16_t *restrict x, int64_t n,
                                                         float inv, int write) {
  if (!write) return f16_check(x, n);
  const __m256 f = _mm256_set1_ps(inv);
  const __m128i mag = _mm_set1_epi16(0x7fff), max_finite = _mm_set1_epi16(0x7bff);
  __m128i bad = _mm_setzero_si128();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm_loadu_si128((const __m128i *)(x + i));
    bad = _mm_or_si128(bad, _mm_cmpgt_epi16(_mm_and_si128(h, mag), max_finite));
    __m256 v = _mm256_mul_ps(_mm256_cvtph_ps(h), f);
    _mm_storeu_si128((__m128i *)(x + i), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
  int tail = f16_check(x + i, n - i);
  for (; i < n; i++) x[i] = _cvtss_sh(_cvtsh_ss(x[i]) * inv, _MM_FROUND_TO_NEAREST_INT);
  return tail | !_mm_testz_si128(bad, bad);
}

/* The same with AVX-512F, 16 lanes at a time (the conversions bound the loop above to ~8 G
 * elements/s per core; ~10.5 here, measured in L2); the tail goes to f16_run. The same shape as
 * f16_run at twice the width, as SIMD code of two widths is. */
__attribute__((target("avx512f,avx2,f16c"))) static int f16_run_512(uint16_t *restrict x,
                                                                     int64_t n, float inv) {
  const __m512 f = _mm512_set1_ps(inv);
  const __m256i mag = _mm256_set1_epi16(0x7fff), max_finite = _mm256_set1_epi16(0x7bff);
  __m256i bad = _mm256_setzero_si256();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256i h = _mm256_loadu_si256((const __m256i *)(x + i));
    bad = _mm256_or_si256(bad, _mm256_cmpgt_epi16(_mm256_and_si256(h, mag), max_finite));
    __m512 v = _mm512_mul_ps(_mm512_cvtph_ps(h), f);
    _mm256_storeu_si256((__m256i *)(x + i), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
  return f16_run(x + i, n - i, inv, 1) | !_mm256_testz_si256(bad, bad);
}
#elif SS_ARM_FP16
static int f16_run(uint16_t *restrict x, int64_t n, float inv, int write) {
  int bad = f16_check(x, n);
  if (write) {
    __fp16 *h = (__fp16 *)x;
    for (int64_t i = 0; i < n; i++) h[i] = (__fp16)((float)h[i] * inv);
  }
  return bad;
}
#endif

/* 1 while float16/bfloat16 writes take the AVX-512 loops (the CPU has AVX-512F and BW), 0 while
 * they take the others; -1 until first asked. */
static int use_avx512 = -1;

/* Turn the AVX-512 loops off (0) or back on where the CPU has them (1), or only ask (-1); returns
 * whether they are in use. Tests turn them off to exercise the other loops (f16_run's AVX2,
 * bf16_run's compiler-vectorised clone) on an AVX-512 machine; not while a kernel call runs. */
int shardscale_avx512(int request) {
#if SS_F16C
  if (request == 0) {
    use_avx512 = 0;
  } else if (request == 1 || use_avx512 < 0) {
    __builtin_cpu_init();
    use_avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  }
#else
  (void)request;
  use_avx512 = 0;
#endif
  return use_avx512;
}

/* 1 if the dtype has a compiled path on this CPU, else 0 (the caller then uses torch's kernel). */
int shardscale_supports(int dtype) {
  if (use_avx512 < 0) shardscale_avx512(-1);
  if (dtype == SS_F32 || dtype == SS_BF16) return 1;
#if SS_F16C
  if (dtype == SS_F16) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  }
#elif SS_ARM_FP16
  if (dtype == SS_F16) return 1;
#endif
  return 0;
}

static int run(int dtype, char *p, int64_t n, float inv, int write) {
  if (dtype == SS_F32) return f32_run((float *)p, n, inv, write);
  if (dtype == SS_BF16) {
#if SS_F16C
    if (write && use_avx512 > 0 && inv == inv) return bf16_run_512((uint16_t *)p, n, inv);
#endif
    return bf16_run((uint16_t *)p, n, inv, write);
  }
#if SS_F16C
  if (write && use_avx512 > 0) return f16_run_512((uint16_t *)p, n, inv);
  return f16_run((uint16_t *)p, n, inv, write);
#elif SS_ARM_FP16
  return f16_run((uint16_t *)p, n, inv, write);
#else
  return 0; /* unreachable: shardscale_supports(SS_F16) is 0 */
#endif
}

/* This thread's share [lo, hi) of `total` elements: equal ranges, cut at multiples of `align`. */
static void thread_range(int64_t total, int64_t align, int64_t *lo, int64_t *hi) {
  const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
  *lo = total * t / nt;
  *hi = total * (t + 1) / nt;
  *lo -= *lo % align;
  if (t + 1 < nt) *hi -= *hi % align;
}

typedef struct {
  uintptr_t lo, hi;
} span_t;

static int span_order(const void *a, const void *b) {
  const uintptr_t x = ((const span_t *)a)->lo, y = ((const span_t *)b)->lo;
  return (x > y) - (x < y);
}

/* 1 if two of the memory ranges [ptrs[j], ptrs[j] + lens[j] * esize) overlap, else 0; -1 if out
 * of memory. Sorts a copy of the ranges by start: O(k log k). */
static int overlapping(char **ptrs, const int64_t *lens, int64_t k, int64_t esize) {
  if (k < 2) return 0;
  span_t *span = malloc(sizeof(span_t) * (size_t)k);
  if (span == NULL) return -1;
  for (int64_t j = 0; j < k; j++) {
    span[j].lo = (uintptr_t)ptrs[j];
    span[j].hi = span[j].lo + (uintptr_t)(lens[j] * esize);
  }
  qsort(span, (size_t)k, sizeof(span_t), span_order);
  int clash = 0;
  uintptr_t reach = span[0].hi; /* the furthest end so far */
  for (int64_t j = 1; j < k && !clash; j++) {
    clash = span[j].lo < reach;
    if (span[j].hi > reach) reach = span[j].hi;
  }
  free(span);
  return clash;
}

/*
 * Multiply the k tensors ptrs[j] (lens[j] elements of one dtype each, contiguous) in place by
 * *inv_scale and set *found_inf = 1.0f if any element is inf or NaN. In one parallel region,
 * each tensor is split into equal ranges cut at multiples of 64 bytes' worth of elements, one
 * per thread (a tensor under that size goes whole to the last thread): the split torch's
 * elementwise kernels make, so each core reads the bytes it last wrote in the op before (the
 * backward pass's, or a benchmark's copy), from its own L2 where they are still there. Splitting
 * the tensors' elements counted end to end instead read 10M float32 elements 1-5 % slower.
 *
 * Returns 0; or, writing nothing at all, 1 if two tensors' memory overlaps (threads would race
 * on it: the caller then passes each memory block once) or -1 if out of memory for that check.
 * With *inv_scale == 1 nothing is written, and overlaps are fine.
 */
int shardscale_unscale(char **ptrs, const int64_t *lens, int64_t k, int dtype,
                       const float *inv_scale, float *found_inf, int num_threads) {
  const float inv = *inv_scale;
  const int write = inv != 1.0f;
  const int64_t esize = dtype == SS_F32 ? 4 : 2;
  const int64_t align = 64 / esize;
  if (write) {
    const int clash = overlapping(ptrs, lens, k, esize);
    if (clash) return clash;
  }
  int64_t total;
  num_threads = threads_for(lens, k, num_threads, &total);
  int bad = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1) reduction(| : bad)
  for (int64_t j = 0; j < k; j++) {
    int64_t s, e;
    thread_range(lens[j], align, &s, &e);
    if (e > s) bad |= run(dtype, ptrs[j] + s * esize, e - s, inv, write);
  }
  if (bad) *found_inf = 1.0f;
  return 0;
}

/* shardscale_unscale with its arguments in one int64 array, in order (ptrs, lens, k, dtype,
 * inv_scale, found_inf, num_threads): one argument for the foreign-function call instead of
 * seven (each costs the caller's ctypes ~1 us right after a backward pass). */
int shardscale_unscale_packed(const int64_t *a) {
  return shardscale_unscale((char **)(intptr_t)a[0], (const int64_t *)(intptr_t)a[1], a[2],
                            (int)a[3], (const float *)(intptr_t)a[4], (float *)(intptr_t)a[5],
                            (int)a[6]);
}

/* ------------------------------------------------------------------------------------ norms */

/* Elements per block: a bf16/fp16 block is widened to float32 in L1, then accumulated, so each
 * gradient is read from memory once. A multiple of SS_LANES. */
#define SS_BLOCK 1024
#define SS_LANES 32

/*
 * p = 2 or 1: acc[0..SS_LANES) += x^2 or |x| in float64 over independent lanes: a fixed order
 * (the same bits on every run with the same thread count), vectorised without reassociation.
 * x^2 of a float is exact in float64, and no sum of them overflows or underflows there, whatever
 * the loss scale: the sum is finite exactly when every element is (see norm_value).
 * p = 0 (inf-norm): macc[l] = max of the magnitude bits (x & 0x7fffffff) as integers, which
 * order like the floats they encode, inf (0x7f800000) and NaN (above it) included.
 */
SS_CLONES static void accumulate(const float *restrict y, int64_t m, int p, double *restrict acc,
                                 uint32_t *restrict macc) {
  int64_t i = 0;
  if (p == 2) {
    for (; i + SS_LANES <= m; i += SS_LANES)
      for (int l = 0; l < SS_LANES; l++) acc[l] += (double)y[i + l] * (double)y[i + l];
    for (; i < m; i++) acc[0] += (double)y[i] * (double)y[i];
  } else if (p == 1) {
    for (; i + SS_LANES <= m; i += SS_LANES)
      for (int l = 0; l < SS_LANES; l++) acc[l] += fabs((double)y[i + l]);
    for (; i < m; i++) acc[0] += fabs((double)y[i]);
  } else {
    for (; i + SS_LANES <= m; i += SS_LANES)
      for (int l = 0; l < SS_LANES; l++) {
        uint32_t b;
        memcpy(&b, &y[i + l], 4);
        b &= 0x7fffffffu;
        macc[l] = b > macc[l] ? b : macc[l];
      }
    for (; i < m; i++) {
      uint32_t b;
      memcpy(&b, &y[i], 4);
      b &= 0x7fffffffu;
      macc[0] = b > macc[0] ? b : macc[0];
    }
  }
}

SS_CLONES static void widen_bf16(const uint16_t *restrict y, int64_t m, float *restrict out) {
  for (int64_t i = 0; i < m; i++) {
    uint32_t b = (uint32_t)y[i] << 16;
    memcpy(&out[i], &b, 4);
  }
}

#if SS_F16C
__attribute__((target("avx2,f16c"))) static void widen_f16(const uint16_t *restrict y, int64_t m,
                                                            float *restrict out) {
  int64_t i = 0;
  for (; i + 8 <= m; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(y + i))));
  for (; i < m; i++) out[i] = _cvtsh_ss(y[i]);
}
#elif SS_ARM_FP16
static void widen_f16(const uint16_t *restrict y, int64_t m, float *restrict out) {
  const __fp16 *h = (const __fp16 *)y;
  for (int64_t i = 0; i < m; i++) out[i] = (float)h[i];
}
#endif

/* The norm piece of one run of n elements: sum x^2 / sum |x| in float64, or (p = 0) the largest
 * magnitude bits. Lanes are reduced in a fixed order. */
typedef union {
  double sum;
  uint32_t max_bits;
} piece_t;

static piece_t norm_run(int dtype, const char *ptr, int64_t n, int p) {
  double acc[SS_LANES] = {0};
  uint32_t macc[SS_LANES] = {0};
  float tmp[SS_BLOCK];
  for (int64_t s = 0; s < n; s += SS_BLOCK) {
    const int64_t m = n - s < SS_BLOCK ? n - s : SS_BLOCK;
    if (dtype == SS_F32) {
      accumulate((const float *)ptr + s, m, p, acc, macc);
      continue;
    }
    const uint16_t *y = (const uint16_t *)ptr + s;
    if (dtype == SS_BF16) widen_bf16(y, m, tmp);
#if SS_F16C || SS_ARM_FP16
    else widen_f16(y, m, tmp);
#endif
    accumulate(tmp, m, p, acc, macc);
  }
  piece_t r;
  if (p == 0) {
    r.max_bits = 0;
    for (int l = 0; l < SS_LANES; l++) r.max_bits = macc[l] > r.max_bits ? macc[l] : r.max_bits;
  } else {
    r.sum = 0.0;
    for (int l = 0; l < SS_LANES; l++) r.sum += acc[l];
  }
  return r;
}

static piece_t combine(piece_t a, piece_t b, int p) {
  if (p == 0) a.max_bits = b.max_bits > a.max_bits ? b.max_bits : a.max_bits;
  else a.sum += b.sum;
  return a;
}

/* Does the tensor hold a NaN? (Only asked when its sum is not finite: an overflow step.) */
static int has_nan(int dtype, const char *ptr, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    if (dtype == SS_F32) {
      uint32_t b;
      memcpy(&b, ptr + 4 * i, 4);
      if ((b & 0x7fffffffu) > 0x7f800000u) return 1;
    } else {
      uint16_t h;
      memcpy(&h, ptr + 2 * i, 2);
      if ((h & 0x7fff) > (dtype == SS_BF16 ? 0x7f80 : 0x7c00)) return 1;
    }
  }
  return 0;
}

/*
 * Per-tensor norms of the k tensors (laid out as for shardscale_unscale), in float64:
 * out[j] = ||tensor j||_p for p = 2, 1 or 0 (the inf-norm); NaN if the tensor holds a NaN, else
 * inf if it holds an inf (as torch's norms). Returns 0, or -1 if out of memory (nothing written).
 *
 * A tensor inside one thread's range is reduced by that thread alone; the (at most two) tensors
 * a thread shares with its neighbours leave a piece in that thread's two edge slots, added in
 * thread order afterwards: O(k + threads) scratch, the same bits on every run.
 */
int shardscale_norms(char **ptrs, const int64_t *lens, int64_t k, int dtype, int p, double *out,
                     int num_threads) {
  int64_t total;
  num_threads = threads_for(lens, k, num_threads, &total);
  piece_t *whole = calloc((size_t)k, sizeof(piece_t));
  int64_t *edge_j = malloc(sizeof(int64_t) * 2 * (size_t)num_threads);
  piece_t *edge = calloc(2 * (size_t)num_threads, sizeof(piece_t));
  if (whole == NULL || edge_j == NULL || edge == NULL) {
    free(whole);
    free(edge_j);
    free(edge);
    return -1;
  }
  for (int64_t i = 0; i < 2 * (int64_t)num_threads; i++) edge_j[i] = -1;
  const int64_t esize = dtype == SS_F32 ? 4 : 2;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
  {
    const int64_t t = omp_get_thread_num();
    int64_t lo, hi;
    thread_range(total, 64 / esize, &lo, &hi);
    int64_t base = 0;
    for (int64_t j = 0; j < k && base < hi; j++) {
      int64_t s = lo > base ? lo - base : 0;
      int64_t e = hi - base < lens[j] ? hi - base : lens[j];
      if (e > s) {
        piece_t r = norm_run(dtype, ptrs[j] + s * esize, e - s, p);
        if (s == 0 && e == lens[j]) {
          whole[j] = r; /* nobody else touches tensor j */
        } else {
          /* a shared tensor: at the start (s > 0) or the end (e < len) of this thread's range */
          const int slot = s > 0 ? 0 : 1;
          edge_j[2 * t + slot] = j;
          edge[2 * t + slot] = r;
        }
      }
      base += lens[j];
    }
  }
  for (int64_t i = 0; i < 2 * (int64_t)num_threads; i++)
    if (edge_j[i] >= 0) whole[edge_j[i]] = combine(whole[edge_j[i]], edge[i], p);
  for (int64_t j = 0; j < k; j++) {
    double r;
    if (p == 0) {
      const uint32_t b = whole[j].max_bits;
      float f;
      memcpy(&f, &b, 4);
      r = b > 0x7f800000u ? NAN : (double)f;
    } else {
      r = whole[j].sum;
      if (!isfinite(r)) r = has_nan(dtype, ptrs[j], lens[j]) ? NAN : INFINITY;
      else if (p == 2) r = sqrt(r);
    }
    out[j] = r;
  }
  free(whole);
  free(edge_j);
  free(edge);
  return 0;
}
