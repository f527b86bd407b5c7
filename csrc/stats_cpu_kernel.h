// CPU block kernels of hookplug::tensor_stats. Torch-free and STL-free: this header is
// compiled once per ISA (stats_cpu_generic.cpp, stats_cpu_avx2.cpp), each time inside its
// own namespace HOOKPLUG_KNS, with GCC/Clang vector extensions that the compiler lowers to
// the target's SIMD (SSE2/NEON for the generic build, AVX2 for the avx2 build).
//
// The including file defines HOOKPLUG_KNS, HOOKPLUG_ISA_NAME, HOOKPLUG_F16C (0/1),
// HOOKPLUG_FMA (0/1) and HOOKPLUG_VBYTES (SIMD bytes: 32 or 16), and includes <stdint.h>,
// stats_cpu_iface.h and stats_defs.h (and <immintrin.h> for F16C/FMA) first.
//
// One block = at most kBlock contiguous elements, read from memory once:
//   one pass in SIMD lanes (block_stats): min, max, zero count and the sums of d = x - K
//   and d^2 around a shift K (the previous block's mean in the chunk, else the mean of 16
//   elements sampled over the block; either rounded to a power-of-two grid well below the
//   spread, see coarse_shift), and the raw log2 histogram: one counter per (sign,
//   exponent field), keys taken straight from the bits, spread over interleaved sub-tables.
//   float32, float64 and bfloat16 count the histogram in the same loop as the moments (the
//   scalar increments, about one element a cycle, hide the SIMD work: 0.09 ns an element of
//   float32 on the CI machine in session 20, a fifth of the op); float16, whose keys need a
//   conversion, counts it in a second pass from L1. Counts are integers: the same in either
//   order.
//   If d^2 is not finite (an Inf/NaN in the block, or a float overflow), the block is redone
//   by the exact scalar path (block_slow); if K is far from the block mean (> 4 std, where
//   the float sums would cancel) by two passes from L1 (block_two_pass: min/max/sum, then
//   deviations around the block mean).
// Block results are combined in float64 by the driver (Chan's formula).

#if defined(__FAST_MATH__)
// is_finite (x - x == 0) and coarse_shift's rounding ((t + C) - C) need IEEE arithmetic;
// -ffast-math folds both away, silently.
#error "hookplug's CPU kernels need IEEE floating point: build without -ffast-math / -Ofast"
#endif

#if defined(__GNUC__) && !defined(__clang__)
// The vector helpers below are internal (static): no ABI crosses a call boundary.
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

namespace hookplug {
namespace cpu {
namespace HOOKPLUG_KNS {

// HOOKPLUG_VBYTES: SIMD width in bytes (32 for AVX2, 16 for the portable build).
constexpr int VB = HOOKPLUG_VBYTES;
typedef float vf __attribute__((vector_size(VB)));
typedef int32_t vi __attribute__((vector_size(VB)));
typedef uint32_t vu __attribute__((vector_size(VB)));
typedef double vd __attribute__((vector_size(VB)));
typedef int64_t vl __attribute__((vector_size(VB)));
typedef uint64_t vul __attribute__((vector_size(VB)));
typedef uint16_t vh __attribute__((vector_size(VB / 2)));
constexpr int WF = VB / 4;  // float lanes
constexpr int WD = VB / 8;  // double lanes

static inline float f32_from_bits(uint32_t b) {
  float f;
  __builtin_memcpy(&f, &b, 4);
  return f;
}
static inline uint32_t key_bits(float f) {
  uint32_t b;
  __builtin_memcpy(&b, &f, 4);
  return b;
}
static inline uint64_t key_bits(double f) {
  uint64_t b;
  __builtin_memcpy(&b, &f, 8);
  return b;
}

static inline float half_to_float(uint16_t h) {
  const uint32_t s = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t em = h & 0x7fffu;
  uint32_t bits;
  if (em >= 0x7c00u) {
    bits = (em << 13) | 0x7f800000u;  // Inf / NaN
  } else if (em >= 0x0400u) {
    bits = (em << 13) + (112u << 23);  // normal: rebias 15 -> 127
  } else {
    bits = key_bits(static_cast<float>(em) * 0x1p-24f);  // subnormal or zero, exact
  }
  return f32_from_bits(bits | s);
}

// WF float16 values -> float32 lanes (exact).
static inline vf halfs_to_float(const uint16_t* p) {
#if HOOKPLUG_F16C && HOOKPLUG_VBYTES == 32
  return (vf)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  vh h;
  __builtin_memcpy(&h, p, sizeof(h));
  const vu w = __builtin_convertvector(h, vu);
  const vu s = (w & 0x8000u) << 16;
  const vu em = w & 0x7fffu;
  const vu normal = (em << 13) + (112u << 23);
  const vu special = (em << 13) | 0x7f800000u;
  const vu sub = (vu)(__builtin_convertvector((vi)em, vf) * 0x1p-24f);
  const vu r = em >= 0x7c00u ? special : (em >= 0x0400u ? normal : sub);
  return (vf)(r | s);
#endif
}

// Geometry of the raw log2 table for a compute type.
template <class S> struct Raw;
template <> struct Raw<float> {
  static constexpr int kShift = 31 - kRawBitsF32;  // 23: sign + exponent field
  static constexpr int kSize = kRawF32;
  static constexpr int kSub = kRawSubF32;
  static constexpr uint32_t kSign = 0x80000000u;
};
template <> struct Raw<double> {
  static constexpr int kShift = 63 - kRawBitsF64;  // 52
  static constexpr int kSize = kRawF64;
  static constexpr int kSub = kRawSubF64;
  static constexpr uint64_t kSign = 0x8000000000000000ull;
};

// Raw log2 histograms of a block, keys read straight from the bits in memory (several
// keys per 64-bit load), counters spread over kSub interleaved sub-tables so that equal
// consecutive keys do not wait on each other's store. The block is in L1 by now, so these
// loops leave the memory bus idle: they prefetch the next block (the memory that follows,
// where the driver's next block lies for dense tensors; a useless prefetch never faults).
#define HOOKPLUG_PREFETCH(p) __builtin_prefetch((p), 0, 3)
#define HOOKPLUG_RESTRICT __restrict__

static inline uint64_t load_u64(const void* p) {
  uint64_t w;
  __builtin_memcpy(&w, p, 8);
  return w;
}

__attribute__((noinline)) static void hist_f32(const void* pv, int64_t n,
                                               uint32_t* HOOKPLUG_RESTRICT h) {
  const uint32_t* p = static_cast<const uint32_t*>(pv);
  constexpr int R = kRawF32, NS = kRawSubF32;
  static_assert(NS % 2 == 0, "two keys per 64-bit load");
  const char* next = static_cast<const char*>(pv) + n * 4;
  int64_t i = 0;
  for (; i + 2 * NS <= n; i += 2 * NS) {  // element i + e goes to sub-table e % NS
    if ((i & 15) == 0) HOOKPLUG_PREFETCH(next + i * 4);
    uint64_t w[NS];
    for (int j = 0; j < NS; ++j) w[j] = load_u64(p + i + 2 * j);
    for (int j = 0; j < NS; ++j) {
      h[((2 * j) % NS) * R + (static_cast<uint32_t>(w[j]) >> 23)] += 1;
      h[((2 * j + 1) % NS) * R + (w[j] >> 55)] += 1;
    }
  }
  for (; i < n; ++i) h[p[i] >> 23] += 1;
}

__attribute__((noinline)) static void hist_bf16(const void* pv, int64_t n,
                                               uint32_t* HOOKPLUG_RESTRICT h) {
  const uint16_t* p = static_cast<const uint16_t*>(pv);
  constexpr int R = kRawF32, NS = kRawSubF32;
  static_assert(NS % 4 == 0, "four keys per 64-bit load");
  const char* next = static_cast<const char*>(pv) + n * 2;
  int64_t i = 0;
  for (; i + 2 * NS <= n; i += 2 * NS) {
    if ((i & 31) == 0) HOOKPLUG_PREFETCH(next + i * 2);
    uint64_t w[NS / 2];
    for (int j = 0; j < NS / 2; ++j) w[j] = load_u64(p + i + 4 * j);
    for (int j = 0; j < NS / 2; ++j) {
      const int t = (4 * j) % NS;
      h[t * R + ((w[j] >> 7) & 0x1ff)] += 1;
      h[(t + 1) * R + ((w[j] >> 23) & 0x1ff)] += 1;
      h[(t + 2) * R + ((w[j] >> 39) & 0x1ff)] += 1;
      h[(t + 3) * R + (w[j] >> 55)] += 1;
    }
  }
  for (; i < n; ++i) h[p[i] >> 7] += 1;
}

__attribute__((noinline)) static void hist_f64(const void* pv, int64_t n,
                                               uint32_t* HOOKPLUG_RESTRICT h) {
  const uint64_t* p = static_cast<const uint64_t*>(pv);
  uint32_t* HOOKPLUG_RESTRICT h0 = h;
  uint32_t* HOOKPLUG_RESTRICT h1 = h + kRawF64;
  const char* next = static_cast<const char*>(pv) + n * 8;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    if ((i & 7) == 0) HOOKPLUG_PREFETCH(next + i * 8);
    const uint64_t w0 = load_u64(p + i), w1 = load_u64(p + i + 1);
    const uint64_t w2 = load_u64(p + i + 2), w3 = load_u64(p + i + 3);
    h0[w0 >> 52] += 1;
    h1[w1 >> 52] += 1;
    h0[w2 >> 52] += 1;
    h1[w3 >> 52] += 1;
  }
  for (; i < n; ++i) h0[p[i] >> 52] += 1;
}


// float16: the key comes from the exact float32 conversion (fp16 subnormals are float32
// normals), converted 8 at a time into a small key buffer.
__attribute__((noinline)) static void hist_f16(const void* pv, int64_t n,
                                               uint32_t* HOOKPLUG_RESTRICT h) {
  const uint16_t* p = static_cast<const uint16_t*>(pv);
  constexpr int R = kRawF32, NS = kRawSubF32;
  const char* next = static_cast<const char*>(pv) + n * 2;
  int64_t i = 0;
  for (; i + WF <= n; i += WF) {
    if ((i & 31) == 0) HOOKPLUG_PREFETCH(next + i * 2);
    uint32_t k[WF];
    const vu kv = (vu)halfs_to_float(p + i) >> 23;
    __builtin_memcpy(k, &kv, sizeof(k));
    static_assert(WF % NS == 0, "i is a multiple of NS");
    for (int l = 0; l < WF; ++l) h[(l % NS) * R + k[l]] += 1;
  }
  for (; i < n; ++i) h[key_bits(half_to_float(p[i])) >> 23] += 1;
}

// Element traits: storage type -> compute lanes.
// float32 and float64: read natively, one element per lane.
template <typename T, typename VT, typename UT, typename IT, int Width,
          void (*Hist)(const void*, int64_t, uint32_t*)>
struct TNative {
  typedef T Store;
  typedef T S;
  typedef VT V;
  typedef UT U;
  typedef IT I;
  static constexpr int W = Width;
  static inline V load(const void* p, int64_t i) {
    V v;
    __builtin_memcpy(&v, static_cast<const T*>(p) + i, sizeof(V));
    return v;
  }
  static inline S load1(const void* p, int64_t i) { return static_cast<const T*>(p)[i]; }
  // 2 * W elements into two vectors (the lane order is free: every use is order-blind).
  static inline void load2(const void* p, int64_t i, V& a0, V& a1) {
    a0 = load(p, i);
    a1 = load(p, i + W);
  }
  static inline void hist(const void* p, int64_t n, uint32_t* h) { Hist(p, n, h); }
  // The raw log2 histogram of the 2 * W elements from i, counted inside block_stats' one
  // pass (the same keys as Hist, spread over the sub-tables the same way).
  static constexpr bool kFusedHist = true;
  static inline void hist_span(const void* p, int64_t i, uint32_t* HOOKPLUG_RESTRICT h) {
    if constexpr (sizeof(T) == 4) {  // two keys per 64-bit load (see hist_f32)
      constexpr int R = kRawF32, NS = kRawSubF32;
      const uint32_t* u = static_cast<const uint32_t*>(p) + i;
      for (int j = 0; j < W; ++j) {
        const uint64_t w = load_u64(u + 2 * j);
        h[((2 * j) % NS) * R + (static_cast<uint32_t>(w) >> 23)] += 1;
        h[((2 * j + 1) % NS) * R + (w >> 55)] += 1;
      }
    } else {  // float64 (see hist_f64)
      constexpr int R = kRawF64, NS = kRawSubF64;
      const uint64_t* u = static_cast<const uint64_t*>(p) + i;
      for (int j = 0; j < 2 * W; ++j) h[(j % NS) * R + (load_u64(u + j) >> 52)] += 1;
    }
  }
};
typedef TNative<float, vf, vu, vi, WF, hist_f32> TF32;
typedef TNative<double, vd, vul, vl, WD, hist_f64> TF64;

struct TBF16 {
  typedef uint16_t Store;
  typedef float S;
  typedef vf V;
  typedef vu U;
  typedef vi I;
  static constexpr int W = WF;
  static inline V load(const void* p, int64_t i) {
    vh h;
    __builtin_memcpy(&h, static_cast<const uint16_t*>(p) + i, sizeof(vh));
    return (vf)(__builtin_convertvector(h, vu) << 16);
  }
  static inline S load1(const void* p, int64_t i) {
    return f32_from_bits(static_cast<uint32_t>(static_cast<const uint16_t*>(p)[i]) << 16);
  }
  // One full-width load, interleaved with zeros: each bfloat16 lands in the high half of
  // a 32-bit lane, which is its float32 value (unpack lo/hi: no shifts, no widening loads).
  static inline void load2(const void* p, int64_t i, V& a0, V& a1) {
    typedef uint16_t vw __attribute__((vector_size(VB)));
    vw h;
    __builtin_memcpy(&h, static_cast<const uint16_t*>(p) + i, sizeof(vw));
    const vw z = {};
#if HOOKPLUG_VBYTES == 32
    a0 = (V)__builtin_shufflevector(z, h, 0, 16, 1, 17, 2, 18, 3, 19,  //
                                    8, 24, 9, 25, 10, 26, 11, 27);
    a1 = (V)__builtin_shufflevector(z, h, 4, 20, 5, 21, 6, 22, 7, 23,  //
                                    12, 28, 13, 29, 14, 30, 15, 31);
#else
    a0 = (V)__builtin_shufflevector(z, h, 0, 8, 1, 9, 2, 10, 3, 11);
    a1 = (V)__builtin_shufflevector(z, h, 4, 12, 5, 13, 6, 14, 7, 15);
#endif
  }
  static inline void hist(const void* p, int64_t n, uint32_t* h) { hist_bf16(p, n, h); }
  static constexpr bool kFusedHist = true;
  static inline void hist_span(const void* p, int64_t i, uint32_t* HOOKPLUG_RESTRICT h) {
    constexpr int R = kRawF32, NS = kRawSubF32;  // four keys per 64-bit load (see hist_bf16)
    static_assert(NS == 4, "one key of each 64-bit load per sub-table");
    const uint16_t* u = static_cast<const uint16_t*>(p) + i;
    for (int j = 0; j < W / 2; ++j) {
      const uint64_t w = load_u64(u + 4 * j);
      h[0 * R + ((w >> 7) & 0x1ff)] += 1;
      h[1 * R + ((w >> 23) & 0x1ff)] += 1;
      h[2 * R + ((w >> 39) & 0x1ff)] += 1;
      h[3 * R + (w >> 55)] += 1;
    }
  }
};

struct TF16 {
  typedef uint16_t Store;
  typedef float S;
  typedef vf V;
  typedef vu U;
  typedef vi I;
  static constexpr int W = WF;
  static inline V load(const void* p, int64_t i) {
    return halfs_to_float(static_cast<const uint16_t*>(p) + i);
  }
  static inline S load1(const void* p, int64_t i) {
    return half_to_float(static_cast<const uint16_t*>(p)[i]);
  }
  static inline void load2(const void* p, int64_t i, V& a0, V& a1) {
    a0 = load(p, i);
    a1 = load(p, i + W);
  }
  static inline void hist(const void* p, int64_t n, uint32_t* h) { hist_f16(p, n, h); }
  // keys come from a conversion: counted in a pass of their own after the moments
  static constexpr bool kFusedHist = false;
  static inline void hist_span(const void*, int64_t, uint32_t*) {}
};

static inline vf vfma(vf a, vf b, vf c) {
#if HOOKPLUG_FMA && HOOKPLUG_VBYTES == 32
  return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}
static inline vd vfma(vd a, vd b, vd c) {
#if HOOKPLUG_FMA && HOOKPLUG_VBYTES == 32
  return (vd)_mm256_fmadd_pd((__m256d)a, (__m256d)b, (__m256d)c);
#else
  return a * b + c;
#endif
}

static inline bool is_finite(double x) { return x - x == 0; }

// 2**e for a normal double exponent e.
static inline double pow2(int e) {
  const uint64_t bits = static_cast<uint64_t>(e + 1023) << 52;
  double x;
  __builtin_memcpy(&x, &bits, sizeof x);
  return x;
}

// The binary exponent of a finite nonzero double (biased field - 1023; subnormals: -1023).
static inline int exponent_of(double x) {
  uint64_t bits;
  __builtin_memcpy(&bits, &x, sizeof bits);
  return static_cast<int>((bits >> 52) & 0x7FF) - 1023;
}

// A shift K: `mean` rounded to a multiple of q = 2**e, a power of two several hundred times
// smaller than the spread of the values. The lane sums of d = x - K round at some unit;
// bits of K below it bias every addition the same way when the data are quantized
// (float16/bfloat16 values, integers): 2.7e-6 x std on the mean of 2045 float16 N(0, 1)
// values around a K 0.96 std off, 4e-9 with K rounded. Moving K by q/2 at most costs
// nothing. `mean` itself where e is out of range or the rounded K would not fit 24 bits
// (exact in float32 unless below its normal range, where blocks take block_slow anyway).
// Integer and multiply-add work only: it sits between two blocks' loops.
static inline double coarse_shift(double mean, int e) {
  if (e < -960 || e > 960 || !is_finite(mean)) return mean;
  const double t = mean * pow2(-e);
  if (!(t < 0x1p23 && t > -0x1p23)) return mean;
  return ((t + 0x1.8p52) - 0x1.8p52) * pow2(e);  // to nearest (|t| < 2^51)
}

// The shift for the block after `r`: its mean on the grid of coarse_shift, q between
// std/2**11 and std/2**9.5 (from the exponents of m2 and n: no division, no square root);
// its mean as it is for a constant block (K is then its value); `prev` where it had no
// finite value.
static inline double next_shift(const BlockResult& r, double prev) {
  if (!r.n) return prev;
  const double mean = r.shift + r.mean;
  if (!(r.m2 > 0x1p-900) || !is_finite(r.m2)) return mean;
  const int d = exponent_of(r.m2) - exponent_of(static_cast<double>(r.n));  // log2(variance), +-1
  const int half = d >= 0 ? d / 2 : -((1 - d) / 2);  // floor(d / 2)
  return coarse_shift(mean, half - 10);
}

// -0.0 values of an all-finite block (only needed with the histogram, and only when the
// block has zeros: the raw table's exponent-0 slot of the negative sign holds them).
template <class T>
static int64_t count_neg_zeros(const void* p, int64_t n) {
  typedef typename T::V V;
  typedef typename T::U U;
  typedef typename T::I I;
  constexpr int W = T::W;
  const U signu = U{} + Raw<typename T::S>::kSign;
  I nz = I{};
  int64_t i = 0;
  for (; i + 2 * W <= n; i += 2 * W) {
    V a0, a1;
    T::load2(p, i, a0, a1);
    nz -= ((U)a0 == signu) + ((U)a1 == signu);
  }
  int64_t c = 0;
  for (int l = 0; l < W; ++l) c += nz[l];
  for (; i < n; ++i) c += key_bits(T::load1(p, i)) == Raw<typename T::S>::kSign;
  return c;
}

// Exact scalar path for a block that holds Inf/NaN (or whose float sum overflowed).
template <class T, bool HIST>
static void block_slow(const void* p, int64_t n, BlockResult* r, uint32_t* hist) {
  typedef typename T::S S;
  typedef Raw<S> RW;
  int64_t nf = 0, zeros = 0, nzeros = 0, pinf = 0, ninf = 0, nan = 0;
  double sum = 0;
  S mn = __builtin_inf(), mx = -__builtin_inf();
  for (int64_t i = 0; i < n; ++i) {
    const S a = T::load1(p, i);
    if (HIST) hist[(i % RW::kSub) * RW::kSize + (key_bits(a) >> RW::kShift)] += 1;
    if (a != a) {
      ++nan;
    } else if (a == static_cast<S>(__builtin_inf())) {
      ++pinf;
    } else if (a == -static_cast<S>(__builtin_inf())) {
      ++ninf;
    } else {
      ++nf;
      sum += a;
      mn = a < mn ? a : mn;
      mx = a > mx ? a : mx;
      if (a == 0) {
        ++zeros;
        nzeros += (key_bits(a) & RW::kSign) != 0;
      }
    }
  }
  const double nd = static_cast<double>(nf);
  double mean = nf ? sum / nd : 0.0, c = 0, m2 = 0, rel = 0;
  if (nf && mn == mx) {  // one finite value (any magnitude): exactly
    mean = static_cast<double>(mn);
  } else if (nf) {
    if (!is_finite(sum)) {  // finite float64 values whose sum overflowed: sum them scaled
      double scaled = 0;
      for (int64_t i = 0; i < n; ++i) {
        const double a = static_cast<double>(T::load1(p, i));
        if (is_finite(a)) scaled += a * 0x1p-32;
      }
      mean = scaled / nd * 0x1p32;
    }
    for (int64_t i = 0; i < n; ++i) {
      const double a = static_cast<double>(T::load1(p, i));
      if (is_finite(a)) {
        const double d = a - mean;
        c += d;
        m2 += d * d;
      }
    }
    if (is_finite(c)) {
      rel = c / nd;  // (kept beside mean: mean + c / nd rounded to one double loses it)
      if (is_finite(m2)) m2 -= c * (c / nd);  // (c^2 <= n * m2: no overflow)
    } else {  // values spanning more than the largest double
      m2 = __builtin_inf();
    }
    // m2 = inf: the sum of squared deviations is past the largest double (std = inf, as
    // torch's); it stays inf rather than becoming inf - inf.
  }
  r->n = nf;
  r->shift = mean;
  r->mean = rel;
  r->m2 = m2 > 0 ? m2 : 0;
  r->mn = mn;
  r->mx = mx;
  r->zeros = zeros;
  r->neg_zeros = nzeros;
  r->pos_inf = pinf;
  r->neg_inf = ninf;
  r->nan = nan;
}

// Two passes over the (L1-resident) block: the exact-enough path for any finite data.
// HIST: the histogram is wanted (-0 counted); COUNT: add this block's raw counts to hist
// (false when block_stats' one pass counted them already).
template <class T, bool HIST, bool COUNT = HIST>
static void block_two_pass(const void* p, int64_t n, BlockResult* r, uint32_t* hist) {
  typedef typename T::S S;
  typedef typename T::V V;
  typedef typename T::I I;
  constexpr int W = T::W;
  const S inf = __builtin_inf();

  // ---- pass 1: min, max, sum (two accumulators each: no register spills on AVX2) -----
  V mn0 = V{} + inf, mn1 = mn0;
  V mx0 = V{} - inf, mx1 = mx0;
  V s0 = V{}, s1 = V{};
  int64_t i = 0;
  // 4 vectors per step, pairs added before the accumulators: one dependent add per
  // accumulator per step (the adds' latency, not their throughput, bounds these loops).
  for (; i + 4 * W <= n; i += 4 * W) {
    V a0, a1, a2, a3;
    T::load2(p, i, a0, a1);
    T::load2(p, i + 2 * W, a2, a3);
    const V l0 = a0 < a2 ? a0 : a2, l1 = a1 < a3 ? a1 : a3;
    const V g0 = a0 > a2 ? a0 : a2, g1 = a1 > a3 ? a1 : a3;
    mn0 = l0 < mn0 ? l0 : mn0;
    mn1 = l1 < mn1 ? l1 : mn1;
    mx0 = g0 > mx0 ? g0 : mx0;
    mx1 = g1 > mx1 ? g1 : mx1;
    s0 += a0 + a2;
    s1 += a1 + a3;
  }
  for (; i + 2 * W <= n; i += 2 * W) {
    V a0, a1;
    T::load2(p, i, a0, a1);
    mn0 = a0 < mn0 ? a0 : mn0;
    mn1 = a1 < mn1 ? a1 : mn1;
    mx0 = a0 > mx0 ? a0 : mx0;
    mx1 = a1 > mx1 ? a1 : mx1;
    s0 += a0;
    s1 += a1;
  }
  const int64_t nv = i;  // elements covered by the vector loops
  S tmn = inf, tmx = -inf, ts = 0;
  for (; i < n; ++i) {
    const S a = T::load1(p, i);
    tmn = a < tmn ? a : tmn;
    tmx = a > tmx ? a : tmx;
    ts += a;
  }
  mn0 = mn0 < mn1 ? mn0 : mn1;
  mx0 = mx0 > mx1 ? mx0 : mx1;
  double sum = ts;
  bool finite = is_finite(ts);
  for (int l = 0; l < W; ++l) {
    const double a = s0[l], b = s1[l];
    finite = finite && is_finite(a) && is_finite(b);
    sum += a + b;
    tmn = mn0[l] < tmn ? mn0[l] : tmn;
    tmx = mx0[l] > tmx ? mx0[l] : tmx;
  }
  if (!finite) {  // an Inf or NaN in the block (or a float overflow of the sum)
    block_slow<T, COUNT>(p, n, r, hist);
    return;
  }

  // ---- pass 2 (from L1): deviations around the block mean (rounded by the range), zeros --
  const double spread = static_cast<double>(tmx) - static_cast<double>(tmn);
  const double mean = sum / static_cast<double>(n);
  const S m = static_cast<S>(spread > 0 ? coarse_shift(mean, exponent_of(spread) - 9) : mean);
  const V mv = V{} + m;
  V t10 = V{}, t11 = V{}, t20 = V{}, t21 = V{};
  I z0 = I{}, z1 = I{};
  for (i = 0; i + 4 * W <= nv; i += 4 * W) {
    V a0, a1, a2, a3;
    T::load2(p, i, a0, a1);
    T::load2(p, i + 2 * W, a2, a3);
    const V d0 = a0 - mv, d1 = a1 - mv, d2 = a2 - mv, d3 = a3 - mv;
    t10 += d0 + d2;
    t11 += d1 + d3;
    t20 += vfma(d0, d0, d2 * d2);
    t21 += vfma(d1, d1, d3 * d3);
    z0 -= (a0 == V{}) + (a2 == V{});
    z1 -= (a1 == V{}) + (a3 == V{});
  }
  for (; i < nv; i += 2 * W) {
    V a0, a1;
    T::load2(p, i, a0, a1);
    const V d0 = a0 - mv, d1 = a1 - mv;
    t10 += d0;
    t11 += d1;
    t20 = vfma(d0, d0, t20);
    t21 = vfma(d1, d1, t21);
    z0 -= (a0 == V{});
    z1 -= (a1 == V{});
  }
  double c1 = 0, c2 = 0;
  int64_t zeros = 0;
  for (; i < n; ++i) {
    const S a = T::load1(p, i);
    const double d = static_cast<double>(a - m);
    c1 += d;
    c2 += d * d;
    zeros += (a == 0);
  }
  for (int l = 0; l < W; ++l) {
    c1 += static_cast<double>(t10[l]) + static_cast<double>(t11[l]);
    c2 += static_cast<double>(t20[l]) + static_cast<double>(t21[l]);
    zeros += z0[l] + z1[l];
  }
  if (!is_finite(c2)) {  // (x - m)^2 overflowed the float lanes: redo exactly
    block_slow<T, COUNT>(p, n, r, hist);
    return;
  }
  const double nd = static_cast<double>(n);
  const double m2 = c2 - c1 * c1 / nd;
  r->n = n;
  r->shift = static_cast<double>(m);
  r->mean = c1 / nd;
  r->m2 = m2 > 0 ? m2 : 0;
  r->mn = tmn;
  r->mx = tmx;
  r->zeros = zeros;
  r->neg_zeros = HIST && zeros ? count_neg_zeros<T>(p, n) : 0;
  r->pos_inf = r->neg_inf = r->nan = 0;
  if (COUNT) T::hist(p, n, hist);  // ---- pass 3 (from L1): raw log2 histogram --------
}

// The mean of up to 16 finite elements spread evenly over a block (0 if none), rounded by
// their range (coarse_shift): a shift near the block mean, so the float sums around it lose
// little to cancellation. (The first value alone may lie several std from the mean: up to
// 17x the rounding error of the sums.)
template <class T>
static inline typename T::S sample_shift(const void* p, int64_t n) {
  typedef typename T::S S;
  constexpr int64_t kSamples = 16;
  const int64_t m = n < kSamples ? n : kSamples;
  const int64_t stride = m ? n / m : 0;
  double sum = 0, lo = __builtin_inf(), hi = -__builtin_inf();
  int64_t count = 0;
  for (int64_t j = 0; j < m; ++j) {
    const double a = static_cast<double>(T::load1(p, j * stride));
    if (is_finite(a)) {
      sum += a / static_cast<double>(m);  // no overflow, even for float64 near its largest
      lo = a < lo ? a : lo;
      hi = a > hi ? a : hi;
      ++count;
    }
  }
  if (!count) return S(0);
  const double mean = sum / static_cast<double>(count) * static_cast<double>(m);
  return static_cast<S>(hi > lo ? coarse_shift(mean, exponent_of(hi - lo) - 9) : mean);
}

// One pass around a shift K (the previous block's mean, or a sampled mean of the block):
// min, max, zeros and the sums of d = x - K and d^2 in SIMD lanes. Falls back to the two-pass
// path when the block holds an Inf/NaN or overflows (d^2 not finite), or when K is far from
// the block mean (|mean - K| > 4 std: the float sums would cancel), so the result is as
// accurate as the two-pass one. *shift: in, K (NaN: none); out, the block mean rounded by its
// std (next_shift): the next block's K.
template <class T, bool HIST>
static void block_stats(const void* p, int64_t n, BlockResult* r, uint32_t* hist, double* shift) {
  typedef typename T::S S;
  typedef typename T::V V;
  typedef typename T::I I;
  constexpr int W = T::W;
  const S inf = __builtin_inf();
  S k = static_cast<S>(*shift);
  if (!(k == k)) k = sample_shift<T>(p, n);  // the first block of a chunk
  if (!is_finite(k)) k = 0;
  const V kv = V{} + k;
  // Two accumulators for the float sums (add/FMA latency), one for min, max and the
  // integer counts (1-cycle latency): no register spills with 16 SIMD registers.
  V mn0 = V{} + inf, mx0 = V{} - inf;
  V t10 = V{}, t11 = V{}, t20 = V{}, t21 = V{};
  I z0 = I{};
  // FUSED: the raw histogram is counted in this loop too (its scalar increments overlap the
  // SIMD moments: one pass over the block instead of two); the fallbacks below then leave
  // it alone. Without a histogram pass after this one (which prefetches the next block),
  // prefetch it from here.
  constexpr bool FUSED = HIST && T::kFusedHist;
  constexpr int kEs = sizeof(typename T::Store);
  const char* next = static_cast<const char*>(p) + n * kEs;
  int64_t i = 0;
  for (; i + 2 * W <= n; i += 2 * W) {
    if (!HIST || FUSED) HOOKPLUG_PREFETCH(next + i * kEs);
    if (FUSED) T::hist_span(p, i, hist);
    V a0, a1;
    T::load2(p, i, a0, a1);
    const V d0 = a0 - kv, d1 = a1 - kv;
    const V l = a0 < a1 ? a0 : a1, g = a0 > a1 ? a0 : a1;
    mn0 = l < mn0 ? l : mn0;
    mx0 = g > mx0 ? g : mx0;
    t10 += d0;
    t11 += d1;
    t20 = vfma(d0, d0, t20);
    t21 = vfma(d1, d1, t21);
    z0 -= (a0 == V{}) + (a1 == V{});
  }
  if (FUSED && i < n) T::hist(static_cast<const char*>(p) + i * kEs, n - i, hist);  // the tail
  S tmn = inf, tmx = -inf;
  double c1 = 0, c2 = 0;
  int64_t zeros = 0;
  for (; i < n; ++i) {
    const S a = T::load1(p, i);
    const double d = static_cast<double>(a - k);
    tmn = a < tmn ? a : tmn;
    tmx = a > tmx ? a : tmx;
    c1 += d;
    c2 += d * d;
    zeros += (a == 0);
  }
  for (int l = 0; l < W; ++l) {
    tmn = mn0[l] < tmn ? mn0[l] : tmn;
    tmx = mx0[l] > tmx ? mx0[l] : tmx;
    c1 += static_cast<double>(t10[l]) + static_cast<double>(t11[l]);
    c2 += static_cast<double>(t20[l]) + static_cast<double>(t21[l]);
    zeros += z0[l];
  }
  // Squared deviations of tiny values underflow in the S lanes (float32: |d| < 2**-63): a
  // block whose largest magnitude is that small takes the exact float64 path.
  const double amax = static_cast<double>(-tmn > tmx ? -tmn : tmx);
  if (amax > 0 && amax < (sizeof(S) == 4 ? 0x1p-50 : 0x1p-480)) {
    block_slow<T, HIST && !FUSED>(p, n, r, hist);
    *shift = next_shift(*r, *shift);
    return;
  }
  const double nd = static_cast<double>(n);
  const double delta = c1 / nd;  // mean - K
  const double m2 = c2 - c1 * delta;
  // c2 finite: every element finite and no float overflow. 16 * m2 / n = (4 std)^2.
  if (!is_finite(c2) || n == 0 || delta * delta * nd > 16 * m2) {
    block_two_pass<T, HIST, HIST && !FUSED>(p, n, r, hist);
    *shift = next_shift(*r, *shift);
    return;
  }
  r->n = n;
  r->shift = static_cast<double>(k);
  r->mean = delta;
  r->m2 = m2 > 0 ? m2 : 0;
  r->mn = tmn;
  r->mx = tmx;
  r->zeros = zeros;
  r->neg_zeros = HIST && zeros ? count_neg_zeros<T>(p, n) : 0;
  r->pos_inf = r->neg_inf = r->nan = 0;
  *shift = next_shift(*r, *shift);
  if (HIST && !FUSED) T::hist(p, n, hist);
}

template <class T>
static void block_entry(const void* p, int64_t n, BlockResult* r, uint32_t* hist, double* shift) {
  if (hist) {
    block_stats<T, true>(p, n, r, hist, shift);
  } else {
    block_stats<T, false>(p, n, r, hist, shift);
  }
}

// Linear histogram of a block: the bucket of stats_defs.h's linear_bucket computed in
// float64 SIMD lanes (same operations, same rounding), out-of-range and NaN lanes sent to
// the spare counter counts[bins], then one scalar increment per element.
template <class T>
static void linear_entry(const void* p, int64_t n, double lo, double hi, double scale,
                         int64_t bins, int64_t* counts) {
  typedef typename T::S S;
  typedef typename T::V V;
  typedef S vs_half __attribute__((vector_size(sizeof(S) * WD)));
  typedef int32_t vi_half __attribute__((vector_size(4 * WD)));
  constexpr int W = T::W;
  constexpr int H = W / WD;  // double vectors per compute vector
  const vd lov = vd{} + lo, hiv = vd{} + hi, sc = vd{} + scale;
  const vi_half top = vi_half{} + static_cast<int32_t>(bins - 1), spare = top + 1, zero = {};
  int64_t i = 0;
  if (bins < (int64_t{1} << 30)) {
    for (; i + W <= n; i += W) {
      const V a = T::load(p, i);
      for (int hh = 0; hh < H; ++hh) {
        vs_half part;
        __builtin_memcpy(&part, reinterpret_cast<const char*>(&a) + hh * sizeof(vs_half),
                         sizeof(vs_half));
        const vd x = __builtin_convertvector(part, vd);
        const vl inside = (x >= lov) & (x <= hiv);
        vi_half b = __builtin_convertvector((x - lov) * sc, vi_half);
        b = b > top ? top : b;
        b = b < zero ? zero : b;
        b = __builtin_convertvector(inside, vi_half) != 0 ? b : spare;
        for (int l = 0; l < WD; ++l) counts[b[l]] += 1;
      }
    }
  }
  for (; i < n; ++i) {
    const int64_t b = linear_bucket(static_cast<double>(T::load1(p, i)), lo, hi, scale, bins);
    counts[b >= 0 ? b : bins] += 1;
  }
}

static const KernelTable kTable = {
    HOOKPLUG_ISA_NAME,
    {&block_entry<TF32>, &block_entry<TF64>, &block_entry<TF16>, &block_entry<TBF16>},
    {&linear_entry<TF32>, &linear_entry<TF64>, &linear_entry<TF16>, &linear_entry<TBF16>},
};

}  // namespace HOOKPLUG_KNS
}  // namespace cpu
}  // namespace hookplug
