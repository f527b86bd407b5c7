// Host replay of the CUDA stats kernel's moment arithmetic (csrc/cuda/stats_moments.h) for
// tests/test_cuda_moments.py: a dense launch's thread partition (16-byte vectors, two in
// flight, grid-stride; the tail on block 0's first warp), the overflow rescue, cub's block
// reduction order (warp shuffles down, then the warps in order) and the last block's merge
// of the blocks' partials. Only the arithmetic: nvcc may contract a * b + c into an FMA
// where g++ does not, so results agree with the device's to rounding, not bitwise.
//
//   cuda_moments_sim f32|f64 GRID FILE   (FILE: the values, raw little-endian)
// prints: n mean m2 min max nan inf zero
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda/stats_moments.h"

using hookplug::cuda::Counts;
using hookplug::cuda::CountSum;
using hookplug::cuda::MergeOp;
using hookplug::cuda::Partial;
using hookplug::cuda::Rescue;
using hookplug::cuda::ThreadAcc;

constexpr int kThreads = 256;

// Calls visit(value) for the elements one thread of the launch reads, in its order.
template <class A, class Visit>
void for_each_element(const std::vector<A>& x, int grid, int tid, Visit&& visit) {
  const int vec = 16 / sizeof(A);
  const int64_t n = static_cast<int64_t>(x.size());
  const int64_t nvec = n / vec, tail0 = nvec * vec;
  const int lane = tid % 32, warp = (tid % kThreads) / 32, block = tid / kThreads;
  const int64_t step = static_cast<int64_t>(grid) * kThreads;
  const int64_t first = static_cast<int64_t>(block) * kThreads + warp * 32;
  for (int64_t u0 = first; u0 < nvec; u0 += 2 * step) {
    const int64_t ua = u0 + lane, ub = u0 + step + lane;
    if (ua < nvec) for (int j = 0; j < vec; ++j) visit(x[ua * vec + j]);
    if (ub < nvec) for (int j = 0; j < vec; ++j) visit(x[ub * vec + j]);
  }
  if (block == 0 && warp == 0)
    for (int64_t i = tail0 + lane; i < n; i += 32) visit(x[i]);
}

template <class T, class Op>
T block_reduce(std::vector<T> v, Op op) {  // v: kThreads values; cub's warp-reductions order
  for (int w = 0; w < kThreads / 32; ++w) {
    T* lane = v.data() + 32 * w;
    for (int off = 1; off < 32; off *= 2) {
      std::vector<T> before(lane, lane + 32);
      for (int i = 0; i + off < 32; ++i) lane[i] = op(before[i], before[i + off]);
    }
  }
  T r = v[0];
  for (int w = 1; w < kThreads / 32; ++w) r = op(r, v[32 * w]);
  return r;
}

template <class A>
int run(int grid, const char* path) {
  std::FILE* f = std::fopen(path, "rb");
  if (!f) return 2;
  std::vector<A> x;
  A buf[4096];
  size_t got;
  while ((got = std::fread(buf, sizeof(A), 4096, f)) > 0) x.insert(x.end(), buf, buf + got);
  std::fclose(f);

  std::vector<Partial> blocks;
  for (int b = 0; b < grid; ++b) {
    std::vector<Partial> mine(kThreads);
    for (int t = 0; t < kThreads; ++t) {
      const int tid = b * kThreads + t;
      ThreadAcc<A> acc;
      acc.init();
      for_each_element(x, grid, tid, [&](A v) { acc.add(v, true); });
      mine[t] = acc.partial();
      if (sizeof(A) == 8 && acc.overflowed()) {
        Rescue r;
        r.init(mine[t].n);
        for_each_element(x, grid, tid, [&](A v) { r.add_scaled(static_cast<double>(v)); });
        r.center();
        for_each_element(x, grid, tid, [&](A v) { r.add_around(static_cast<double>(v)); });
        r.finish(&mine[t]);
      }
    }
    blocks.push_back(block_reduce(mine, MergeOp()));
  }
  // the last block: thread k merges blocks k, k + kThreads, ... (counts apart, 64-bit)
  std::vector<Partial> last(kThreads, hookplug::cuda::empty_partial());
  std::vector<Counts> counts(kThreads, Counts{0, 0, 0});
  for (int b = 0; b < grid; ++b) {
    Partial q = blocks[b];
    counts[b % kThreads] = CountSum()(counts[b % kThreads], Counts{q.nan, q.inf, q.zero});
    q.nan = q.inf = q.zero = 0;
    last[b % kThreads] = MergeOp()(last[b % kThreads], q);
  }
  const Partial t = block_reduce(last, MergeOp());
  const Counts c = block_reduce(counts, CountSum());
  std::printf("%.17g %.17g %.17g %.17g %.17g %llu %llu %llu\n", t.n, t.shift + t.mean,
              t.m2 > 0.0 ? t.m2 : 0.0, t.mn, t.mx, c.nan, c.inf, c.zero);
  return 0;
}

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s f32|f64 GRID FILE\n", argv[0]);
    return 2;
  }
  const int grid = std::atoi(argv[2]);
  if (argv[1][1] == '6') return run<double>(grid, argv[3]);
  return run<float>(grid, argv[3]);
}
