// CPU implementation of hookplug::tensor_stats.
//
// The elements are visited in memory order (see mem_layout) as a sequence of fixed chunks
// (kChunk elements) split into blocks (kBlock elements). at::parallel_for hands chunks to
// threads; each block is read from memory once (a flat tensor in place, a strided one
// gathered block by block into a thread-local buffer: never a full copy) and passed to
// the ISA-specific block kernel (AVX2 or portable, picked at run time; see
// stats_cpu_kernel.h). Blocks are merged in order within a chunk (the one-pass shift is
// chained block to block inside the chunk only), chunk partials in chunk order, so every
// output is bitwise identical for any number of threads; histogram counts are integers.
// Needs -fopenmp (setup.py): at::parallel_for is inline OpenMP in torch's headers.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>
#include <vector>

#include "stats_checks.h"
#include "stats_cpu_iface.h"
#include "stats_defs.h"

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
#include <xmmintrin.h>
#endif

namespace hookplug {
namespace cpu {

namespace {

// torch.set_flush_denormal(True) sets DAZ/FTZ in the calling thread's MXCSR: subnormals
// would then compare equal to 0 on that thread only (wrong zero counts, negative log2
// buckets, results that depend on the thread count). The kernels run with both off and
// put the caller's mode back; reading MXCSR is all it costs when they are off.
class ExactDenormals {
 public:
#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
  ExactDenormals() : saved_(_mm_getcsr()) {
    if (saved_ & kFlushBits) _mm_setcsr(saved_ & ~kFlushBits);
  }
  ~ExactDenormals() {
    if (saved_ & kFlushBits) _mm_setcsr(saved_);
  }
  ExactDenormals(const ExactDenormals&) = delete;
  ExactDenormals& operator=(const ExactDenormals&) = delete;

 private:
  static constexpr unsigned kFlushBits = 0x8040;  // FTZ (bit 15) | DAZ (bit 6)
  unsigned saved_;
#endif
};

std::atomic<const KernelTable*> g_table{nullptr};

const KernelTable* pick_table(const std::string& isa) {
  if (isa == "generic") return kernels_generic();
  const KernelTable* t = kernels_avx2();
  if (isa == "avx2") {
    TORCH_CHECK_VALUE(t != nullptr, "hookplug: the avx2 CPU kernels are not available here");
    return t;
  }
  return t ? t : kernels_generic();
}

const KernelTable* table() {
  const KernelTable* t = g_table.load(std::memory_order_acquire);
  if (!t) {
    t = pick_table("auto");
    g_table.store(t, std::memory_order_release);
  }
  return t;
}

DType dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return kF32;
    case at::kDouble: return kF64;
    case at::kHalf: return kF16;
    default: return kBF16;
  }
}

// Walks a strided layout in memory order and hands out blocks of contiguous elements.
class BlockSource {
 public:
  BlockSource(const char* base, int64_t elsize, const MemLayout& L)
      : base_(base), es_(elsize), L_(L), flat_(L.flat()), idx_(L.sizes.size(), 0) {}

  void seek(int64_t pos) {
    if (flat_) {
      pos_ = pos;
      return;
    }
    off_ = 0;
    for (int64_t d = static_cast<int64_t>(L_.sizes.size()) - 1; d >= 0; --d) {
      idx_[d] = pos % L_.sizes[d];
      pos /= L_.sizes[d];
      off_ += idx_[d] * L_.strides[d];
    }
  }

  // Pointer to the next n contiguous elements: in place when they are contiguous in
  // memory, else gathered into buf (n * elsize bytes).
  const char* next(int64_t n, char* buf) {
    if (flat_) {
      const char* p = base_ + pos_ * es_;
      pos_ += n;
      return p;
    }
    const int64_t inner = static_cast<int64_t>(L_.sizes.size()) - 1;
    if (L_.strides[inner] == 1 && idx_[inner] + n <= L_.sizes[inner]) {
      const char* p = base_ + off_ * es_;
      advance(n);
      return p;
    }
    char* out = buf;
    while (n > 0) {
      const int64_t m = std::min(n, L_.sizes[inner] - idx_[inner]);
      const int64_t st = L_.strides[inner];
      const char* src = base_ + off_ * es_;
      if (st == 1) {
        std::memcpy(out, src, m * es_);
      } else if (es_ == 4) {
        copy_strided<uint32_t>(src, st, m, out);
      } else if (es_ == 8) {
        copy_strided<uint64_t>(src, st, m, out);
      } else {
        copy_strided<uint16_t>(src, st, m, out);
      }
      out += m * es_;
      n -= m;
      advance(m);
    }
    return buf;
  }

 private:
  template <class W>
  static void copy_strided(const char* src, int64_t st, int64_t m, char* out) {
    const W* s = reinterpret_cast<const W*>(src);
    W* o = reinterpret_cast<W*>(out);
    for (int64_t j = 0; j < m; ++j) o[j] = s[j * st];
  }

  void advance(int64_t m) {  // m never crosses the end of the current inner row
    int64_t d = static_cast<int64_t>(L_.sizes.size()) - 1;
    idx_[d] += m;
    off_ += m * L_.strides[d];
    while (d > 0 && idx_[d] == L_.sizes[d]) {
      off_ -= idx_[d] * L_.strides[d];
      idx_[d] = 0;
      --d;
      idx_[d] += 1;
      off_ += L_.strides[d];
    }
  }

  const char* base_;
  int64_t es_;
  const MemLayout& L_;
  bool flat_;
  int64_t pos_ = 0;
  int64_t off_ = 0;
  std::vector<int64_t> idx_;
};

struct Partial {  // one chunk
  ShiftedMoments m{0, 0, 0, 0};
  double mn = std::numeric_limits<double>::infinity();
  double mx = -std::numeric_limits<double>::infinity();
  int64_t zeros = 0, neg_zeros = 0, pos_inf = 0, neg_inf = 0, nan = 0;

  void add(const BlockResult& r) { add(static_cast<double>(r.n), r.shift, r.mean, r.m2, r); }
  void add(const Partial& o) { add(o.m.n, o.m.shift, o.m.mean, o.m.m2, o); }

  // A block's or another chunk's result: moments by Chan's formula around their shifts
  // (stats_defs.h), the rest by min/max/sum.
  template <typename R>
  void add(double n, double shift, double mean, double m2, const R& r) {
    shifted_merge(m, n, shift, mean, m2);
    mn = r.mn < mn ? r.mn : mn;
    mx = r.mx > mx ? r.mx : mx;
    zeros += r.zeros;
    neg_zeros += r.neg_zeros;
    pos_inf += r.pos_inf;
    neg_inf += r.neg_inf;
    nan += r.nan;
  }
};

// Maps the raw (sign, exponent field) table to the kLog2Bins buckets (stats_defs.h).
void raw_to_log2(const int64_t* raw, int exp_bits, int bias, const Partial& t, int64_t* out) {
  const int64_t half = int64_t{1} << exp_bits;
  const int64_t emax = half - 1;  // Inf / NaN field: taken from the exact counts instead
  for (int s = 0; s < 2; ++s) {
    const int64_t* r = raw + s * half;
    for (int64_t ef = 1; ef < emax; ++ef) {
      if (r[ef]) out[log2_bucket(s == 1, static_cast<int>(ef - bias))] += r[ef];
    }
    const int64_t zeros_s = s ? t.neg_zeros : t.zeros - t.neg_zeros;
    out[log2_bucket(s == 1, kLog2MinExp)] += r[0] - zeros_s;  // subnormals
    out[log2_bucket(s == 1, kLog2MaxExp)] += s ? t.neg_inf : t.pos_inf;
  }
  out[kLog2ZeroBin] += t.zeros;
}

// The final fold into a row runs under fold_mutex(), so threads that share a bank never
// lose an update (the heavy part, reading the tensor, runs outside the lock).

// Folds a tensor's totals and histogram counts into `row` (width kHead + nbins); fresh: the
// row is uninitialized and gets them alone, else *clock (the bank's call counter) advances.
void fold_into_row(const Partial& total, int64_t N, const int64_t* hist, int64_t nbins,
                   double col_lo, double col_hi, double* row, double* clock, bool fresh) {
  Summary S;
  S.numel = static_cast<double>(N);
  S.nan = static_cast<double>(total.nan);
  S.inf = static_cast<double>(total.pos_inf + total.neg_inf);
  S.zero = static_cast<double>(total.zeros);
  S.n = total.m.n;
  S.mean = total.m.shift + total.m.mean;
  S.m2 = std::max(total.m.m2, 0.0);
  S.mn = total.mn;  // +inf / -inf when there is no finite value
  S.mx = total.mx;
  std::lock_guard<std::mutex> lock(fold_mutex());
  if (fresh) init_row(row, nbins, col_lo, col_hi);
  const double now = clock ? *clock : 0.0;
  if (clock) *clock = now + 1.0;
  fold_summary(row, S, now);
  row[kHistLo] = col_lo;
  row[kHistHi] = col_hi;
  for (int64_t i = 0; i < nbins; ++i) row[kHead + i] += static_cast<double>(hist[i]);
}

// Per-thread raw log2 sub-tables (kRawSub tables of kRaw uint32 counters, sized for
// float64), all zero between uses: no allocation or clearing per call.
uint32_t* raw_scratch() {
  thread_local std::vector<uint32_t> sub(
      std::max(kRawF64 * kRawSubF64, kRawF32 * kRawSubF32), 0);
  return sub.data();
}

// Adds the NS sub-tables of R counters at sub into raw[0:R] and zeroes them.
void drain_raw(uint32_t* sub, int R, int NS, int64_t* raw) {
  for (int k = 0; k < NS; ++k) {
    uint32_t* t = sub + static_cast<int64_t>(k) * R;
    for (int j = 0; j < R; ++j) raw[j] += t[j];
    std::fill(t, t + R, 0u);
  }
}

// The small-tensor path: at most one chunk (kChunk elements) that is one dense run of
// memory (most activations of small layers), log2 histogram or none. Read on this thread
// with per-thread scratch: no thread pool, no allocation. The same arithmetic as the
// general path for one chunk (blocks chained in order, then the chunk's partial).
void accumulate_one_chunk(const char* p, int64_t N, int64_t es, DType dt, const StatsArgs& a,
                          const KernelTable* K, double* row, double* clock, bool fresh) {
  ExactDenormals exact;
  const bool is_f64 = dt == kF64;
  uint32_t* sub = a.log2 ? raw_scratch() : nullptr;
  double shift = std::numeric_limits<double>::quiet_NaN();
  Partial part, total;
  for (int64_t pos = 0; pos < N; pos += kBlock) {
    BlockResult r;
    K->block[dt](p + pos * es, std::min(kBlock, N - pos), &r, sub, &shift);
    part.add(r);
  }
  total.add(part);
  int64_t hist[kLog2Bins] = {};
  if (a.log2) {
    const int R = is_f64 ? kRawF64 : kRawF32;
    int64_t raw[kRawF64];
    std::fill(raw, raw + R, int64_t{0});
    drain_raw(sub, R, is_f64 ? kRawSubF64 : kRawSubF32, raw);
    raw_to_log2(raw, is_f64 ? kRawBitsF64 : kRawBitsF32, is_f64 ? kRawBiasF64 : kRawBiasF32,
                total, hist);
  }
  double col_lo, col_hi;
  hist_range_columns(a, &col_lo, &col_hi);
  fold_into_row(total, N, hist, a.nbins, col_lo, col_hi, row, clock, fresh);
}

// Reads x once (twice for a linear histogram with an automatic range) and merges its
// statistics into `row` (width kHead + a.nbins). fresh: row is uninitialized and gets x's
// statistics alone; else it is merged into, and *clock (the bank's call counter) advances.
void accumulate_cpu(const at::Tensor& x, const StatsArgs& a, double* row, double* clock,
                    bool fresh) {
  const int64_t N = x.numel();
  const KernelTable* K = table();
  const DType dt = dtype_code(x.scalar_type());
  const bool is_f64 = dt == kF64;
  const int64_t es = x.element_size();
  const char* base = static_cast<const char*>(x.data_ptr());
  if (N > 0 && N <= kChunk && !a.linear && x.is_non_overlapping_and_dense()) {
    accumulate_one_chunk(base, N, es, dt, a, K, row, clock, fresh);
    return;
  }
  ExactDenormals exact;  // this thread's; each worker below sets its own
  const MemLayout L = mem_layout(x);
  const BlockFn block_fn = K->block[dt];
  const LinearFn linear_fn = K->linear[dt];

  const int raw_size = is_f64 ? kRawF64 : kRawF32;
  const int raw_sub = is_f64 ? kRawSubF64 : kRawSubF32;
  const int64_t nchunks = (N + kChunk - 1) / kChunk;
  std::vector<Partial> parts(nchunks);
  std::vector<int64_t> raw(a.log2 ? raw_size : 0, 0);
  std::vector<int64_t> lin(a.linear ? a.nbins : 0, 0);
  std::mutex mu;
  const double range_scale =
      a.has_range ? static_cast<double>(a.nbins) / (a.hi - a.lo) : 0.0;

  // Pass 1: everything (log2 histogram and linear histogram with a given range included).
  at::parallel_for(0, nchunks, 1, [&](int64_t c0, int64_t c1) {
    ExactDenormals worker_exact;
    uint32_t* sub = a.log2 ? raw_scratch() : nullptr;
    std::vector<int64_t> raw_local(a.log2 ? raw_size : 0, 0);
    std::vector<int64_t> lin_local(a.linear && a.has_range ? a.nbins + 1 : 0, 0);  // + spare
    std::vector<char> buf(L.flat() ? 0 : kBlock * es);  // gather buffer (strided only)
    BlockSource src(base, es, L);
    int64_t since_drain = 0;  // uint32 sub-table counters are drained before they could wrap
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t end = std::min(N, (c + 1) * kChunk);
      src.seek(c * kChunk);
      Partial& part = parts[c];
      double shift = std::numeric_limits<double>::quiet_NaN();  // chunk-local: deterministic
      for (int64_t pos = c * kChunk; pos < end; pos += kBlock) {
        const int64_t n = std::min(kBlock, end - pos);
        const char* p = src.next(n, buf.data());
        BlockResult r;
        block_fn(p, n, &r, sub, &shift);
        part.add(r);
        if (a.linear && a.has_range) {
          linear_fn(p, n, a.lo, a.hi, range_scale, a.nbins, lin_local.data());
        }
      }
      if (a.log2) {
        since_drain += end - c * kChunk;
        if (since_drain > (int64_t{1} << 31)) {
          drain_raw(sub, raw_size, raw_sub, raw_local.data());
          since_drain = 0;
        }
      }
    }
    if (a.log2) drain_raw(sub, raw_size, raw_sub, raw_local.data());
    std::lock_guard<std::mutex> lock(mu);
    for (size_t j = 0; j < raw_local.size(); ++j) raw[j] += raw_local[j];
    for (int64_t j = 0; j < (a.linear && a.has_range ? a.nbins : 0); ++j) lin[j] += lin_local[j];
  });

  Partial total;
  for (const Partial& p : parts) total.add(p);

  const double nan_v = std::numeric_limits<double>::quiet_NaN();
  const double nf = total.m.n;
  const double mn = nf > 0 ? total.mn : nan_v;
  const double mx = nf > 0 ? total.mx : nan_v;

  // Pass 2 (linear histogram without a range): the range is the finite min/max above.
  double lin_lo = a.lo, lin_hi = a.hi;
  if (a.linear && !a.has_range) {
    linear_auto_range(nf, mn, mx, &lin_lo, &lin_hi);
    const double scale = static_cast<double>(a.nbins) / (lin_hi - lin_lo);
    at::parallel_for(0, nchunks, 1, [&](int64_t c0, int64_t c1) {
      ExactDenormals worker_exact;
      std::vector<int64_t> lin_local(a.nbins + 1, 0);  // + the spare counter
      std::vector<char> buf(L.flat() ? 0 : kBlock * es);
      BlockSource src(base, es, L);
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t end = std::min(N, (c + 1) * kChunk);
        src.seek(c * kChunk);
        for (int64_t pos = c * kChunk; pos < end; pos += kBlock) {
          const int64_t n = std::min(kBlock, end - pos);
          linear_fn(src.next(n, buf.data()), n, lin_lo, lin_hi, scale, a.nbins,
                    lin_local.data());
        }
      }
      std::lock_guard<std::mutex> lock(mu);
      for (int64_t j = 0; j < a.nbins; ++j) lin[j] += lin_local[j];
    });
  }

  double col_lo, col_hi;
  hist_range_columns(a, &col_lo, &col_hi);
  if (a.linear && !a.has_range) {
    col_lo = lin_lo;
    col_hi = lin_hi;
  }
  std::vector<int64_t> hist(a.nbins, 0);
  if (a.log2) {
    raw_to_log2(raw.data(), is_f64 ? kRawBitsF64 : kRawBitsF32,
                is_f64 ? kRawBiasF64 : kRawBiasF32, total, hist.data());
  } else if (a.linear) {
    std::copy(lin.begin(), lin.end(), hist.begin());
  }
  fold_into_row(total, N, hist.data(), a.nbins, col_lo, col_hi, row, clock, fresh);
}

at::Tensor tensor_stats_cpu(const at::Tensor& x, int64_t bins, int64_t hist_mode,
                            std::optional<double> lo, std::optional<double> hi) {
  const StatsArgs a = check_stats_args(x, bins, hist_mode, lo, hi);
  at::Tensor row = empty_stats_row(x, a);
  accumulate_cpu(x, a, row.data_ptr<double>(), nullptr, true);
  return row;
}

// Both accumulate ops; who: the op, as its error messages name it.
void accumulate_into_row(const at::Tensor& x, const at::Tensor& acc, int64_t row,
                         const std::optional<at::Tensor>& gate, int64_t bins, int64_t hist_mode,
                         std::optional<double> lo, std::optional<double> hi, bool skip_recompute,
                         const char* who) {
  const BankTarget t = bank_target(x, acc, row, gate, bins, hist_mode, lo, hi, who);
  if (gate.has_value() && !gate->data_ptr<bool>()[0]) return;
  if (in_recompute(skip_recompute)) return;
  accumulate_cpu(x, t.a, t.row, t.clock, false);
}

void stats_accumulate_cpu(const at::Tensor& x, const at::Tensor& acc, int64_t row,
                          const std::optional<at::Tensor>& gate, int64_t bins, int64_t hist_mode,
                          std::optional<double> lo, std::optional<double> hi,
                          bool skip_recompute) {
  accumulate_into_row(x, acc, row, gate, bins, hist_mode, lo, hi, skip_recompute,
                      "hookplug::stats_accumulate_");
}

void stats_accumulate_at_cpu(const at::Tensor& x, const at::Tensor& acc, const at::Tensor& row,
                             const std::optional<at::Tensor>& gate, int64_t bins,
                             int64_t hist_mode, std::optional<double> lo,
                             std::optional<double> hi, bool skip_recompute) {
  check_row_tensor(acc, row);
  accumulate_into_row(x, acc, *row.data_ptr<int64_t>(), gate, bins, hist_mode, lo, hi,
                      skip_recompute, "hookplug::stats_accumulate_at_");
}

}  // namespace

std::string cpu_isa() { return table()->isa; }

void set_cpu_isa(const std::string& isa) {
  TORCH_CHECK_VALUE(isa == "auto" || isa == "generic" || isa == "avx2",
                    "hookplug: expected a CPU kernel ISA 'auto', 'generic' or 'avx2', got '",
                    isa, "'");
  g_table.store(pick_table(isa), std::memory_order_release);
}

std::mutex& fold_mutex() {
  static std::mutex mu;
  return mu;
}

}  // namespace cpu
}  // namespace hookplug

TORCH_LIBRARY_IMPL(hookplug, CPU, m) {
  m.impl("tensor_stats", &hookplug::cpu::tensor_stats_cpu);
  m.impl("stats_accumulate_", &hookplug::cpu::stats_accumulate_cpu);
  m.impl("stats_accumulate_at_", &hookplug::cpu::stats_accumulate_at_cpu);
}
