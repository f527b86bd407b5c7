// CUDA kernels of hookplug::tensor_stats. Only CUDA/CUB headers and the torch-free
// hookplug headers: compiles with plain nvcc (see .ci/nvcc_check.sh).
//
// Pass 1 (one read of the tensor): a grid-stride loop, 16-byte vector loads on the dense
// path (scalar head/tail), per-element offsets on the strided path. Each thread keeps
//   count, sum and sum of squares of (x - K) in float64 (K = the thread's first finite
//   value: a shift that keeps the squares well conditioned; float64 data spanning past the
//   largest double takes its thread's values again, see rescue_moments), finite min/max
//   and the NaN/Inf/zero counts;
// the histogram (log2, or linear with a given range) goes to shared memory: one private
// copy per warp for log2, updates aggregated across the warp with __match_any_sync so
// equal keys cost one atomic. A block reduces its threads with cub::BlockReduce (Chan's
// merge of means relative to a shift, stats_moments.h), writes its partial and adds its histogram to the output with integer atomics;
// the last block to finish (atomic counter + threadfence) merges the partials in block
// order and writes the outputs. Everything is deterministic for a given device: integer
// atomics commute and the float merges happen in a fixed order.
// Pass 2 (linear histogram without a range): reads the finite min/max written by pass 1
// from device memory and histograms a second read. No host synchronization anywhere.
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include <cub/block/block_reduce.cuh>

#include "../stats_defs.h"
#include "stats_cuda.h"
#include "stats_moments.h"

namespace hookplug {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kBlocksPerSm = 3;  // resident blocks per SM (launch bounds: <= 85 registers)
constexpr int64_t kSmemLinearBins = 8192;  // larger linear histograms use global atomics
constexpr int kPartDoubles = 6;  // a block's partial in the workspace: n, shift, mean, m2, mn, mx

// ---- element types -------------------------------------------------------------------
struct F32 {
  typedef float storage;
  typedef float acc;
  static constexpr int kVec = 4;
};
struct F64 {
  typedef double storage;
  typedef double acc;
  static constexpr int kVec = 2;
};
struct F16 {
  typedef unsigned short storage;
  typedef float acc;
  static constexpr int kVec = 8;
};
struct BF16 {
  typedef unsigned short storage;
  typedef float acc;
  static constexpr int kVec = 8;
};

__device__ __forceinline__ float load1(F32, const float* p) { return __ldg(p); }
__device__ __forceinline__ double load1(F64, const double* p) { return __ldg(p); }
__device__ __forceinline__ float load1(F16, const unsigned short* p) {
  return __half2float(__ushort_as_half(__ldg(p)));
}
__device__ __forceinline__ float load1(BF16, const unsigned short* p) {
  return __uint_as_float(static_cast<unsigned>(__ldg(p)) << 16);
}

__device__ __forceinline__ unsigned word(const uint4& r, int k) {
  return k == 0 ? r.x : (k == 1 ? r.y : (k == 2 ? r.z : r.w));
}
// Element j of a 16-byte vector.
__device__ __forceinline__ float unpack(F32, const uint4& r, int j) {
  return __uint_as_float(word(r, j));
}
__device__ __forceinline__ double unpack(F64, const uint4& r, int j) {
  return j == 0 ? __hiloint2double(static_cast<int>(r.y), static_cast<int>(r.x))
                : __hiloint2double(static_cast<int>(r.w), static_cast<int>(r.z));
}
__device__ __forceinline__ unsigned half_bits(const uint4& r, int j) {
  const unsigned w = word(r, j >> 1);
  return (j & 1) ? (w >> 16) : (w & 0xffffu);
}
__device__ __forceinline__ float unpack(F16, const uint4& r, int j) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(half_bits(r, j))));
}
__device__ __forceinline__ float unpack(BF16, const uint4& r, int j) {
  return __uint_as_float(half_bits(r, j) << 16);
}

// ---- histogram keys ------------------------------------------------------------------
__device__ __forceinline__ int log2_key(float x) {
  if (x != x) return -1;
  if (x == 0.0f) return kLog2ZeroBin;
  const unsigned b = __float_as_uint(x);
  return log2_bucket((b >> 31) != 0, static_cast<int>((b >> 23) & 0xffu) - 127);
}
__device__ __forceinline__ int log2_key(double x) {
  if (x != x) return -1;
  if (x == 0.0) return kLog2ZeroBin;
  const unsigned long long b = static_cast<unsigned long long>(__double_as_longlong(x));
  return log2_bucket((b >> 63) != 0, static_cast<int>((b >> 52) & 0x7ffu) - 1023);
}

// All 32 lanes call this together (the loops below are warp-uniform); key < 0: nothing.
__device__ __forceinline__ void hist_add(unsigned* sh, unsigned long long* gl, int key) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
  const unsigned peers = __match_any_sync(0xffffffffu, key);
  if (key >= 0 && static_cast<int>(threadIdx.x & 31) == __ffs(peers) - 1) {
    const unsigned c = static_cast<unsigned>(__popc(peers));
    if (sh) {
      atomicAdd(sh + key, c);
    } else {
      atomicAdd(gl + key, static_cast<unsigned long long>(c));
    }
  }
#else
  if (key >= 0) {
    if (sh) {
      atomicAdd(sh + key, 1u);
    } else {
      atomicAdd(gl + key, 1ull);
    }
  }
#endif
}

struct Work {
  double* part_d;               // 6 per block: n, shift, mean, m2, mn, mx
  unsigned long long* part_c;   // 3 per block: nan, inf, zero
  unsigned long long* hist;     // nbins counters (zeroed per launch), folded into the row
  unsigned* done;               // blocks of pass 1 finished
  unsigned* done2;              // blocks of the linear pass finished
};

// ---- traversal -----------------------------------------------------------------------
__device__ __forceinline__ int64_t strided_offset(const StatsLaunch& s, int64_t i) {
  int64_t off = 0;
#pragma unroll
  for (int d = kMaxDims - 1; d >= 0; --d) {
    if (d < s.ndim) {
      const int64_t q = i / s.sizes[d];
      off += (i - q * s.sizes[d]) * s.strides[d];
      i = q;
    }
  }
  return off;
}

// Calls visit(value, valid) for every element; every lane of a warp makes the same
// number of calls (valid == false past the end), as hist_add needs.
template <class E, bool CONTIG, class Visit>
__device__ __forceinline__ void for_each_element(const StatsLaunch& s, Visit& visit) {
  typedef typename E::storage St;
  typedef typename E::acc A;
  const St* data = static_cast<const St*>(s.data);
  const int64_t n = s.numel;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t step = static_cast<int64_t>(gridDim.x) * kThreads;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kThreads + warp * 32;
  if (CONTIG) {
    const uintptr_t addr = reinterpret_cast<uintptr_t>(data);
    int64_t head = static_cast<int64_t>(((16 - (addr & 15)) & 15) / sizeof(St));
    if (head > n) head = n;
    const int64_t nvec = (n - head) / E::kVec;
    const int64_t tail0 = head + nvec * E::kVec;
    const uint4* vp = reinterpret_cast<const uint4*>(data + head);
    for (int64_t u0 = first; u0 < nvec; u0 += 2 * step) {  // two 16-byte loads in flight
      const int64_t ua = u0 + lane, ub = u0 + step + lane;
      const bool oka = ua < nvec, okb = ub < nvec;
      uint4 ra = make_uint4(0u, 0u, 0u, 0u), rb = ra;
      if (oka) ra = __ldg(vp + ua);
      if (okb) rb = __ldg(vp + ub);
#pragma unroll
      for (int j = 0; j < E::kVec; ++j) visit(unpack(E(), ra, j), oka);
#pragma unroll
      for (int j = 0; j < E::kVec; ++j) visit(unpack(E(), rb, j), okb);
    }
    const int64_t extra = head + (n - tail0);  // < 2 * kVec elements
    if (blockIdx.x == 0 && warp == 0) {
      for (int64_t i0 = 0; i0 < extra; i0 += 32) {
        const int64_t i = i0 + lane;
        const bool ok = i < extra;
        const int64_t idx = i < head ? i : tail0 + (i - head);
        visit(ok ? load1(E(), data + idx) : A(0), ok);
      }
    }
  } else {
    for (int64_t i0 = first; i0 < n; i0 += step) {
      const int64_t i = i0 + lane;
      const bool ok = i < n;
      visit(ok ? load1(E(), data + strided_offset(s, i)) : A(0), ok);
    }
  }
}

// A thread whose float64 sums overflowed reads its values twice more (see Rescue).
template <class E, bool CONTIG>
__device__ __forceinline__ void rescue_moments(const StatsLaunch& s, Partial* p) {
  Rescue r;
  r.init(p->n);
  auto first = [&](double x, bool valid) {
    if (valid) r.add_scaled(x);
  };
  for_each_element<E, CONTIG>(s, first);
  r.center();
  auto second = [&](double x, bool valid) {
    if (valid) r.add_around(x);
  };
  for_each_element<E, CONTIG>(s, second);
  r.finish(p);
}

// The histogram range columns of the row for a launch (0, 0: none, or not known yet).
__device__ __forceinline__ void range_columns(const StatsLaunch& s, double* lo, double* hi) {
  if (s.nbins > 0 && s.hist_mode == kHistLog2) {
    *lo = log2_edge(0);
    *hi = log2_edge(kLog2Bins);
  } else if (s.nbins > 0 && s.has_range) {
    *lo = s.lo;
    *hi = s.hi;
  } else {
    *lo = *hi = 0.0;
  }
}

// The row a launch merges into: s.row, or the bank's row *s.row_index; nullptr for an
// index outside [1, bank_rows) (the launch then does nothing).
__device__ __forceinline__ double* target_row(const StatsLaunch& s) {
  if (s.row_index == nullptr) return s.row;
  const int64_t r = *s.row_index;
  return r >= 1 && r < s.bank_rows ? s.row + r * (kHead + s.nbins) : nullptr;
}

// The last block of a pass: adds (or, for a fresh row, stores) the pass's histogram
// counters into the row's buckets.
__device__ __forceinline__ void fold_buckets(const StatsLaunch& s, const Work& w, double* row) {
  for (int64_t k = threadIdx.x; k < s.nbins; k += kThreads) {
    const double c = static_cast<double>(__ldcg(w.hist + k));
    row[kHead + k] = s.fresh ? c : row[kHead + k] + c;
  }
}

// Every thread's global writes (histogram atomics included) are made visible, then thread
// 0 counts the block as done; true in the block that finished last.
__device__ __forceinline__ bool finish_block(unsigned* done, bool* last) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) *last = atomicAdd(done, 1u) == gridDim.x - 1;
  __syncthreads();
  if (*last) __threadfence();
  return *last;
}

// Adds a block's shared-memory histogram (nsh counters, `copies` private copies of
// stride nb) to the int64 output.
__device__ __forceinline__ void flush_hist(const unsigned* sh, int nb, int copies,
                                           unsigned long long* out) {
  __syncthreads();
  for (int k = threadIdx.x; k < nb; k += kThreads) {
    unsigned c = 0;
    for (int w = 0; w < copies; ++w) c += sh[w * nb + k];
    if (c) atomicAdd(out + k, static_cast<unsigned long long>(c));
  }
}

// MODE 0: no histogram, 1: log2, 2: linear with a given range.
template <class E, int MODE, bool CONTIG>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    stats_pass1(const StatsLaunch s, const Work w, const double scale) {
  typedef typename E::acc A;
  typedef cub::BlockReduce<Partial, kThreads> Reduce;
  typedef cub::BlockReduce<Counts, kThreads> CountReduce;
  __shared__ union {
    typename Reduce::TempStorage partial;
    typename CountReduce::TempStorage counts;
  } tmp;
  __shared__ bool last;
  extern __shared__ unsigned sh[];

  if (s.gate != nullptr && !*s.gate) return;  // the whole launch is off (uniform branch)
  double* const row = target_row(s);
  if (row == nullptr) return;  // likewise
  const int warp = threadIdx.x >> 5;
  const bool linear_smem = MODE == 2 && s.nbins <= kSmemLinearBins;
  const int nsh = MODE == 1 ? kWarps * kLog2Bins : (linear_smem ? static_cast<int>(s.nbins) : 0);
  for (int k = threadIdx.x; k < nsh; k += kThreads) sh[k] = 0;
  __syncthreads();

  unsigned* hsh = MODE == 1 ? sh + warp * kLog2Bins : (nsh ? sh : nullptr);
  unsigned long long* hgl = w.hist;
  ThreadAcc<A> acc;
  acc.init();
  auto visit = [&](A x, bool valid) {
    acc.add(x, valid);
    if (MODE == 1) hist_add(hsh, hgl, valid ? log2_key(x) : -1);
    if (MODE == 2) {
      const int64_t b =
          valid ? linear_bucket(static_cast<double>(x), s.lo, s.hi, scale, s.nbins) : -1;
      hist_add(hsh, hgl, static_cast<int>(b));
    }
  };
  for_each_element<E, CONTIG>(s, visit);

  Partial mine = acc.partial();
  if constexpr (std::is_same<A, double>::value) {
    if (acc.overflowed()) rescue_moments<E, CONTIG>(s, &mine);
  }
  const Partial bp = Reduce(tmp.partial).Reduce(mine, MergeOp());
  if (MODE == 1) flush_hist(sh, kLog2Bins, kWarps, hgl);
  if (MODE == 2 && nsh) flush_hist(sh, nsh, 1, hgl);

  if (threadIdx.x == 0) {
    double* d = w.part_d + kPartDoubles * static_cast<int64_t>(blockIdx.x);
    unsigned long long* c = w.part_c + 3 * static_cast<int64_t>(blockIdx.x);
    d[0] = bp.n;
    d[1] = bp.shift;
    d[2] = bp.mean;
    d[3] = bp.m2;
    d[4] = bp.mn;
    d[5] = bp.mx;
    c[0] = bp.nan;
    c[1] = bp.inf;
    c[2] = bp.zero;
  }
  if (!finish_block(w.done, &last)) return;

  // The last block: merge the partials in block order (their counts as 64-bit sums), fold
  // them into the row.
  Partial p = empty_partial();
  Counts k = {0, 0, 0};
  for (unsigned b = threadIdx.x; b < gridDim.x; b += kThreads) {
    Partial q = empty_partial();
    const double* d = w.part_d + kPartDoubles * static_cast<int64_t>(b);
    const unsigned long long* c = w.part_c + 3 * static_cast<int64_t>(b);
    q.n = __ldcg(d);
    q.shift = __ldcg(d + 1);
    q.mean = __ldcg(d + 2);
    q.m2 = __ldcg(d + 3);
    q.mn = __ldcg(d + 4);
    q.mx = __ldcg(d + 5);
    k.nan += __ldcg(c);
    k.inf += __ldcg(c + 1);
    k.zero += __ldcg(c + 2);
    p = MergeOp()(p, q);
  }
  __syncthreads();  // tmp is reused
  const Partial t = Reduce(tmp.partial).Reduce(p, MergeOp());
  __syncthreads();
  const Counts tc = CountReduce(tmp.counts).Reduce(k, CountSum());
  if (threadIdx.x == 0) {
    double lo, hi;
    range_columns(s, &lo, &hi);
    if (s.fresh) init_row(row, 0, lo, hi);  // buckets: stored by fold_buckets
    const double now = s.clock != nullptr ? *s.clock : 0.0;
    if (s.clock != nullptr) *s.clock = now + 1.0;
    Summary S;
    S.numel = static_cast<double>(s.numel);
    S.nan = static_cast<double>(tc.nan);
    S.inf = static_cast<double>(tc.inf);
    S.zero = static_cast<double>(tc.zero);
    S.n = t.n;
    S.mean = t.shift + t.mean;
    S.m2 = t.m2 > 0.0 ? t.m2 : 0.0;
    S.mn = t.mn;
    S.mx = t.mx;
    fold_summary(row, S, now);
    row[kHistLo] = lo;
    row[kHistHi] = hi;
  }
  if (MODE != 0) fold_buckets(s, w, row);  // (an automatic linear range: the linear pass does it)
}

// Linear histogram whose range is pass 1's finite min/max, read from device memory.
// (hookplug::tensor_stats only: the row is fresh and holds this tensor's pass 1.)
template <class E, bool CONTIG>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    linear_pass(const StatsLaunch s, const Work w) {
  typedef typename E::acc A;
  extern __shared__ unsigned sh[];
  __shared__ bool last;
  const double* row = s.row;
  const double nf = row[kNumel] - row[kNan] - row[kInf];
  double lo, hi;
  linear_auto_range(nf, row[kMin], row[kMax], &lo, &hi);
  const double scale = static_cast<double>(s.nbins) / (hi - lo);
  const int nsh = s.nbins <= kSmemLinearBins ? static_cast<int>(s.nbins) : 0;
  for (int k = threadIdx.x; k < nsh; k += kThreads) sh[k] = 0;
  __syncthreads();
  unsigned long long* hgl = w.hist;
  unsigned* hsh = nsh ? sh : nullptr;
  auto visit = [&](A x, bool valid) {
    const int64_t b = valid ? linear_bucket(static_cast<double>(x), lo, hi, scale, s.nbins) : -1;
    hist_add(hsh, hgl, static_cast<int>(b));
  };
  for_each_element<E, CONTIG>(s, visit);
  if (nsh) flush_hist(sh, nsh, 1, hgl);
  if (!finish_block(w.done2, &last)) return;
  __syncthreads();  // every thread of this block has read the range from the row
  if (threadIdx.x == 0) {
    s.row[kHistLo] = lo;
    s.row[kHistHi] = hi;
  }
  fold_buckets(s, w, s.row);
}

int grid_size(const StatsLaunch& s) {
  const int vec = s.dtype == kF64 ? 2 : (s.dtype == kF32 ? 4 : 8);
  const int64_t units = s.ndim == 0 ? (s.numel + vec - 1) / vec : s.numel;
  int64_t blocks = (units + kThreads - 1) / kThreads;
  const int64_t most = static_cast<int64_t>(s.num_sms > 0 ? s.num_sms : 1) * kBlocksPerSm;
  const int64_t least = (s.numel >> 31) + 1;  // under 2**32 elements a block (Partial's counts)
  if (blocks > most) blocks = most > least ? most : least;
  return static_cast<int>(blocks < 1 ? 1 : blocks);
}

template <class E>
cudaError_t launch_typed(const StatsLaunch& s, const Work& w, int grid, cudaStream_t st) {
  const bool contig = s.ndim == 0;
  const int mode = s.nbins == 0 ? 0 : (s.hist_mode == kHistLog2 ? 1 : (s.has_range ? 2 : 0));
  const bool linear_smem = mode == 2 && s.nbins <= kSmemLinearBins;
  const size_t smem = mode == 1 ? sizeof(unsigned) * kWarps * kLog2Bins
                                : (linear_smem ? sizeof(unsigned) * s.nbins : 0);
  const double scale = s.has_range ? static_cast<double>(s.nbins) / (s.hi - s.lo) : 0.0;
#define HOOKPLUG_PASS1(M)                                                   \
  if (contig) {                                                             \
    stats_pass1<E, M, true><<<grid, kThreads, smem, st>>>(s, w, scale);     \
  } else {                                                                  \
    stats_pass1<E, M, false><<<grid, kThreads, smem, st>>>(s, w, scale);    \
  }
  if (mode == 0) {
    HOOKPLUG_PASS1(0)
  } else if (mode == 1) {
    HOOKPLUG_PASS1(1)
  } else {
    HOOKPLUG_PASS1(2)
  }
#undef HOOKPLUG_PASS1
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  if (s.nbins > 0 && s.hist_mode == kHistLinear && !s.has_range) {
    const size_t smem2 = s.nbins <= kSmemLinearBins ? sizeof(unsigned) * s.nbins : 0;
    if (contig) {
      linear_pass<E, true><<<grid, kThreads, smem2, st>>>(s, w);
    } else {
      linear_pass<E, false><<<grid, kThreads, smem2, st>>>(s, w);
    }
    err = cudaGetLastError();
  }
  return err;
}

}  // namespace

size_t stats_workspace_bytes(const StatsLaunch& s) {
  return (static_cast<size_t>(grid_size(s)) * (kPartDoubles + 3) + static_cast<size_t>(s.nbins)) * 8 + 16;
}

cudaError_t launch_tensor_stats(const StatsLaunch& s, cudaStream_t stream) {
  const int grid = grid_size(s);
  Work w;
  w.part_d = static_cast<double*>(s.workspace);
  w.part_c = reinterpret_cast<unsigned long long*>(w.part_d + kPartDoubles * static_cast<int64_t>(grid));
  w.hist = w.part_c + 3 * static_cast<int64_t>(grid);
  w.done = reinterpret_cast<unsigned*>(w.hist + s.nbins);
  w.done2 = w.done + 1;
  // one memset: the histogram counters and both block counters
  cudaError_t err = cudaMemsetAsync(w.hist, 0, sizeof(unsigned long long) * s.nbins +
                                    2 * sizeof(unsigned), stream);
  if (err != cudaSuccess) return err;
  switch (s.dtype) {
    case kF32: return launch_typed<F32>(s, w, grid, stream);
    case kF64: return launch_typed<F64>(s, w, grid, stream);
    case kF16: return launch_typed<F16>(s, w, grid, stream);
    case kBF16: return launch_typed<BF16>(s, w, grid, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace cuda
}  // namespace hookplug
