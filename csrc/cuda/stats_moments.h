// The CUDA kernels' moment arithmetic (stats_kernels.cu): per-thread one-pass sums, their
// float64 overflow rescue, and the Chan merge of partials. Host and device code: the
// kernels use it, and tests/test_cuda_moments.py compiles it for the host (g++) and
// replays a launch's thread partition and merge order on it, so the arithmetic is tested
// where no GPU is. No CUDA intrinsics here: IEEE comparisons only (no fast-math build).
#pragma once

#include <math.h>

#include "../stats_defs.h"

namespace hookplug {
namespace cuda {

HOOKPLUG_HD bool finite(double x) { return x - x == 0.0; }  // false for NaN and +-inf

// A set of finite values: count, mean and sum of squared deviations (Chan's merge), finite
// min/max, and the NaN/Inf/zero counts. `mean` is relative to `shift`, one of the values
// (absolute mean: shift + mean; see ShiftedMoments in stats_defs.h: float64 data at
// mean/std ~ 1e8 lost ~2e-10 of its std over 2M thread partials with absolute means).
// The counts are a block's at most: fewer than 2**32 elements a block (grid_size), and
// 32-bit counts keep the kernels at 74-78 registers without spills (the last block adds the
// blocks' counts as Counts).
struct Partial {
  double n, shift, mean, m2, mn, mx;
  unsigned nan, inf, zero;
};

struct Counts {
  unsigned long long nan, inf, zero;
};

struct CountSum {
  HOOKPLUG_HD Counts operator()(const Counts& a, const Counts& b) const {
    Counts r;
    r.nan = a.nan + b.nan;
    r.inf = a.inf + b.inf;
    r.zero = a.zero + b.zero;
    return r;
  }
};

HOOKPLUG_HD Partial empty_partial() {
  Partial p;
  p.n = p.shift = p.mean = p.m2 = 0.0;
  p.mn = __builtin_huge_val();
  p.mx = -__builtin_huge_val();
  p.nan = p.inf = p.zero = 0;
  return p;
}

// Chan's merge of b's moments into a's, around their shifts (stats_defs.h).
HOOKPLUG_HD void merge_moments(Partial& a, const Partial& b) {
  ShiftedMoments m{a.n, a.shift, a.mean, a.m2};
  shifted_merge(m, b.n, b.shift, b.mean, b.m2);
  a.n = m.n;
  a.shift = m.shift;
  a.mean = m.mean;
  a.m2 = m.m2;
}
struct MergeOp {
  HOOKPLUG_HD Partial operator()(const Partial& a, const Partial& b) const {
    Partial r = a;
    merge_moments(r, b);
    r.mn = b.mn < a.mn ? b.mn : a.mn;
    r.mx = b.mx > a.mx ? b.mx : a.mx;
    r.nan = a.nan + b.nan;
    r.inf = a.inf + b.inf;
    r.zero = a.zero + b.zero;
    return r;
  }
};

// One thread's values (A: float for 16/32-bit data, double for float64).
template <class A>
struct ThreadAcc {
  double shift, s1, s2;
  unsigned nf, nan, inf, zero;
  A mn, mx;

  HOOKPLUG_HD void init() {
    shift = 0.0;
    s1 = s2 = 0.0;
    nf = nan = inf = zero = 0;
    mn = static_cast<A>(__builtin_huge_val());
    mx = -mn;
  }
  HOOKPLUG_HD void add(A x, bool valid) {
    const bool is_nan = x != x;
    const bool is_inf = !is_nan && !(x - x == A(0));
    const bool fin = valid && !is_nan && !is_inf;
    // The shift is the thread's first finite value: a constant sums to exactly 0, and as it
    // is one of the thread's values, s1^2/n <= n * m2 whatever the tensor's first element
    // (NaN, an outlier) or the data's offset: the cancellation in partial() stays bounded
    // by the thread's count, a few elements per thread below ~1e8 elements.
    if (fin && nf == 0) shift = static_cast<double>(x);
    const double d = fin ? static_cast<double>(x) - shift : 0.0;
    s1 += d;
    s2 = fma(d, d, s2);
    nf += fin;
    nan += valid && is_nan;
    inf += valid && is_inf;
    zero += fin && x == A(0);
    mn = fin && x < mn ? x : mn;
    mx = fin && x > mx ? x : mx;
  }
  // float64 values spanning past the largest double overflow the one-pass sums.
  HOOKPLUG_HD bool overflowed() const { return nf && !(finite(s1) && finite(s2)); }
  HOOKPLUG_HD Partial partial() const {
    Partial p;
    p.n = static_cast<double>(nf);
    p.shift = shift;
    p.mean = nf ? s1 / p.n : 0.0;
    const double m2 = nf ? s2 - s1 * (s1 / p.n) : 0.0;  // (s1 / n first: s1^2 may overflow)
    p.m2 = m2 > 0.0 ? m2 : 0.0;
    p.mn = static_cast<double>(mn);
    p.mx = static_cast<double>(mx);
    p.nan = nan;
    p.inf = inf;
    p.zero = zero;
    return p;
  }
};

// A thread whose one-pass sums overflowed takes its values twice more, as the CPU kernel
// does (rare: only float64 data spanning past the largest double pays it): the mean from
// values scaled by 2**-32, then halved deviations from it; neither overflows, and a sum of
// squared deviations past the largest double is inf (std inf, as torch's), never
// inf - inf = NaN (which became 0).
struct Rescue {
  double n, scaled, mean, c, q;

  HOOKPLUG_HD void init(double count) {
    n = count;
    scaled = mean = c = q = 0.0;
  }
  HOOKPLUG_HD void add_scaled(double x) {  // first read
    if (finite(x)) scaled += x * 0x1p-32;
  }
  HOOKPLUG_HD void center() { mean = scaled / n * 0x1p32; }
  HOOKPLUG_HD void add_around(double x) {  // second read, after center()
    if (finite(x)) {
      const double d = 0.5 * x - 0.5 * mean;
      c += d;
      q = fma(d, d, q);
    }
  }
  HOOKPLUG_HD void finish(Partial* p) const {  // the moments of p, absolute (shift 0)
    p->shift = 0.0;
    if (finite(c)) {
      p->mean = mean + 2.0 * (c / n);
      // (q finite: c^2 <= n * q, no overflow; q inf: c * (c / n) may be, and inf - inf is NaN)
      const double m2 = finite(q) ? 4.0 * (q - c * (c / n)) : q;
      p->m2 = m2 > 0.0 ? m2 : 0.0;
    } else {  // same-signed halves past the largest double in a row (as the CPU kernel)
      p->mean = mean;
      p->m2 = __builtin_huge_val();  // the spread is past a double
    }
  }
};

}  // namespace cuda
}  // namespace hookplug
