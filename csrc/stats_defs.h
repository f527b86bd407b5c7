// hookplug stats op: definitions shared by the CPU kernels, the CUDA kernels and the
// bindings. Torch-free and STL-free on purpose: it is included by plain-nvcc .cu files
// and by the CPU kernel translation units compiled for a specific ISA.
//
// THE ROW LAYOUT (the one definition; hookplug/_stats.py checks it against row_layout()):
// statistics live in float64 rows of width kHead + B, B = histogram buckets:
//   kNumel, kNan, kInf, kZero   counts (exact in float64 below 2**53)
//   kMin, kMax                  finite min / max (+inf / -inf while there is none)
//   kMean, kM2                  mean and sum of squared deviations of the finite values
//   kHistLo, kHistHi            the histogram's range (0, 0 when it has none)
//   kFirstBad                   the clock value of the first call that saw NaN/Inf (+inf: none)
//   kCalls                      how many calls were folded in (an empty tensor counts: a
//                               row with kCalls > 0 and kNumel == 0 saw only empty tensors)
//   kHead + i                   histogram bucket i
// An empty row is (0, 0, 0, 0, +inf, -inf, 0, 0, lo, hi, +inf, 0, 0...). Rows merge exactly:
// counts, kCalls and buckets add, extremes and kFirstBad combine, mean/M2 by Chan's formula.
// hookplug::tensor_stats(x, ...) returns one fresh row; hookplug::stats_accumulate_(x, acc,
// row, gate, ...) merges x's statistics into acc[row] in place. acc[0] is the bank's meta
// row: acc[0][kClock] counts accumulate calls (the clock kFirstBad refers to).
//
// Log2 histogram (hist_mode 0), kLog2Bins = 131 buckets, ascending:
//   [0, 65)    negative values, bucket j holds -2^(33-j) < x <= -2^(32-j) i.e. binary
//              exponent e = 32 - j (|x| in [2^e, 2^(e+1)));
//   65         exact zeros (+0 and -0);
//   [66, 131)  positive values, bucket 66 + k holds 2^(k-32) <= x < 2^(k-31), e = k - 32.
//   Exponents are clamped to the window [kLog2MinExp, kLog2MaxExp] = [-32, 32]: tinier
//   magnitudes (subnormals included) fall in the innermost bucket of their sign, larger ones
//   and +-Inf in the outermost. NaN is not counted. So sum(hist_counts) = numel - nan_count.
//   Edges are the nominal bucket limits -2^33, -2^32, ..., -2^-32, 2^-32, ..., 2^33
//   (strictly increasing and finite; the zero bucket nominally spans [-2^-32, 2^-32]).
// Linear histogram (hist_mode 1), `bins` buckets over [lo, hi] (given, with bins / (hi - lo)
//   finite; or the finite min/max, widened to [lo-1, hi+1] when lo == hi, within the finite
//   range, [-1, 1] when there is no finite value; float64 data spread over more than the
//   largest double, or less than bins / the largest double, has no usable auto range):
//   bucket = floor((x - lo) * (bins / (hi - lo))) in float64, x == hi in the last bucket;
//   values outside [lo, hi], NaN and +-Inf are not counted (torch.histc's rule).
//   edges[i] = lo + ((hi - lo) * i) / bins, edges[bins] = hi.
#pragma once

#include <stdint.h>

#if defined(__CUDACC__)
#define HOOKPLUG_HD __host__ __device__ inline
#else
#define HOOKPLUG_HD inline
#endif

namespace hookplug {

constexpr int kLog2MinExp = -32;
constexpr int kLog2MaxExp = 32;
constexpr int kLog2PerSign = kLog2MaxExp - kLog2MinExp + 1;  // 65
constexpr int kLog2ZeroBin = kLog2PerSign;                   // 65
constexpr int kLog2Bins = 2 * kLog2PerSign + 1;              // 131

constexpr int64_t kHistLog2 = 0;
constexpr int64_t kHistLinear = 1;

// Row columns (see the layout above).
constexpr int kNumel = 0, kNan = 1, kInf = 2, kZero = 3, kMin = 4, kMax = 5, kMean = 6,
              kM2 = 7, kHistLo = 8, kHistHi = 9, kFirstBad = 10, kCalls = 11, kHead = 12;
constexpr int64_t kMaxBins = 1 << 16;  // the most histogram buckets a row may have
constexpr int kClock = 0;  // column of the meta row acc[0] that counts accumulate calls

// Log2 bucket of a finite nonzero value with sign `neg` and binary exponent e
// (|x| in [2^e, 2^(e+1))); e is clamped to the window.
HOOKPLUG_HD int log2_bucket(bool neg, int e) {
  e = e < kLog2MinExp ? kLog2MinExp : (e > kLog2MaxExp ? kLog2MaxExp : e);
  return neg ? (kLog2MaxExp - e) : (kLog2ZeroBin + 1 + (e - kLog2MinExp));
}

HOOKPLUG_HD double pow2i(int e) {  // exact 2^e for |e| < 1000, no libm needed
  double r = 1.0, b = e < 0 ? 0.5 : 2.0;
  for (int k = e < 0 ? -e : e; k > 0; --k) r *= b;
  return r;
}

// Edge i (0..kLog2Bins) of the log2 layout.
HOOKPLUG_HD double log2_edge(int i) {
  if (i <= kLog2PerSign) return -pow2i(kLog2MaxExp + 1 - i);
  return pow2i(kLog2MinExp + (i - kLog2PerSign - 1));
}

// Linear bucket of x, or -1 when x is outside [lo, hi] (NaN included).
HOOKPLUG_HD int64_t linear_bucket(double x, double lo, double hi, double scale, int64_t bins) {
  if (!(x >= lo && x <= hi)) return -1;
  int64_t b = static_cast<int64_t>((x - lo) * scale);
  return b >= bins ? bins - 1 : (b < 0 ? 0 : b);
}

HOOKPLUG_HD double linear_edge(double lo, double hi, int64_t i, int64_t bins) {
  return i == bins ? hi : lo + ((hi - lo) * static_cast<double>(i)) / static_cast<double>(bins);
}

// The automatic linear range from the finite min/max (n = number of finite values).
HOOKPLUG_HD void linear_auto_range(double n, double mn, double mx, double* lo, double* hi) {
  if (!(n > 0)) { mn = 0.0; mx = 0.0; }
  if (mn == mx) {  // widened like torch.histc: by 1, or more where 1 is below the value's ulp
    const double a = mn < 0 ? -mn : mn;
    const double w = a * 0x1p-50 > 1.0 ? a * 0x1p-50 : 1.0;
    mn -= w;
    mx += w;
    const double big = 1.7976931348623157e308;  // (a constant at +-max: widened one way only)
    mn = mn < -big ? -big : mn;
    mx = mx > big ? big : mx;
  }
  *lo = mn;
  *hi = mx;
}

// Count, mean and sum of squared deviations of a set of finite values; merged with
// Chan et al.'s parallel formula.
struct Moments {
  double n;
  double mean;
  double m2;
};

HOOKPLUG_HD void moments_merge(Moments& a, double nb, double mean_b, double m2_b) {
  if (nb == 0) return;
  if (a.n == 0) { a.n = nb; a.mean = mean_b; a.m2 = m2_b; return; }
  const double n = a.n + nb;
  const double delta = mean_b - a.mean;
  if (delta - delta == 0) {  // finite
    a.mean += delta * (nb / n);
    a.m2 += m2_b + delta * delta * (a.n * (nb / n));
  } else {  // means of opposite signs near the largest double: their difference overflows
    const double half = 0.5 * mean_b - 0.5 * a.mean;
    a.mean = a.mean * (a.n / n) + mean_b * (nb / n);
    a.m2 += m2_b + 4.0 * half * half * (a.n * (nb / n));  // inf: a spread beyond a double
  }
  a.n = n;
}

// Moments whose mean is relative to `shift`, one of the values or near them (absolute mean:
// shift + mean). The difference of two sets' means, which Chan's merge squares, is then
// (b.shift - a.shift) + (b.mean - a.mean), exact where the shifts are within a factor 2 of
// each other, instead of the difference of two rounded absolute means (float64 data at
// mean/std ~ 1e8 lost ~1e-10 of its std that way, over a GPU's thread partials or the CPU
// kernel's 2048-element blocks).
struct ShiftedMoments {
  double n;
  double shift;
  double mean;
  double m2;
};

HOOKPLUG_HD void shifted_merge(ShiftedMoments& a, double nb, double shift_b, double mean_b, double m2_b) {
  if (nb == 0) return;
  if (a.n == 0) {
    a.n = nb;
    a.shift = shift_b;
    a.mean = mean_b;
    a.m2 = m2_b;
    return;
  }
  const double n = a.n + nb;
  const double delta = (shift_b - a.shift) + (mean_b - a.mean);
  if (delta - delta == 0) {  // finite
    // the merged mean relative to either shift; the nearer shift is kept (an outlier that
    // was a first value would otherwise hold every later merge at its ulp)
    const double ra = a.mean + delta * (nb / n), rb = mean_b - delta * (a.n / n);
    if ((rb < 0.0 ? -rb : rb) < (ra < 0.0 ? -ra : ra)) {
      a.shift = shift_b;
      a.mean = rb;
    } else {
      a.mean = ra;
    }
    a.m2 += m2_b + delta * delta * (a.n * (nb / n));
    a.n = n;
  } else {  // shifts of opposite signs near the largest double: absolute means
    Moments m{a.n, a.shift + a.mean, a.m2};
    moments_merge(m, nb, shift_b + mean_b, m2_b);
    a.n = m.n;
    a.shift = 0.0;
    a.mean = m.mean;
    a.m2 = m.m2;
  }
}

// The statistics of one tensor as a kernel finds them (counts as doubles: exact < 2**53).
struct Summary {
  double numel, nan, inf, zero;
  double n, mean, m2;  // finite values: count, mean, sum of squared deviations
  double mn, mx;       // finite min / max (+inf / -inf when n == 0)
};

// An empty row: no values yet, histogram range (lo, hi) (0, 0: none), buckets zeroed.
HOOKPLUG_HD void init_row(double* row, int64_t nbins, double lo, double hi) {
  const double inf = __builtin_huge_val();
  row[kNumel] = row[kNan] = row[kInf] = row[kZero] = 0.0;
  row[kMin] = inf;
  row[kMax] = -inf;
  row[kMean] = row[kM2] = 0.0;
  row[kHistLo] = lo;
  row[kHistHi] = hi;
  row[kFirstBad] = inf;
  row[kCalls] = 0.0;
  for (int64_t i = 0; i < nbins; ++i) row[kHead + i] = 0.0;
}

// Merges s, one call's statistics, into the head columns of row (the caller adds the
// buckets). `clock` is the call's clock value, kept in kFirstBad when s holds the row's
// first NaN/Inf.
HOOKPLUG_HD void fold_summary(double* row, const Summary& s, double clock) {
  Moments m{row[kNumel] - row[kNan] - row[kInf], row[kMean], row[kM2]};
  moments_merge(m, s.n, s.mean, s.m2);
  row[kNumel] += s.numel;
  row[kNan] += s.nan;
  row[kInf] += s.inf;
  row[kZero] += s.zero;
  row[kMin] = s.mn < row[kMin] ? s.mn : row[kMin];
  row[kMax] = s.mx > row[kMax] ? s.mx : row[kMax];
  row[kMean] = m.mean;
  row[kM2] = m.m2;
  if (s.nan + s.inf > 0 && clock < row[kFirstBad]) row[kFirstBad] = clock;
  row[kCalls] += 1.0;
}

}  // namespace hookplug
