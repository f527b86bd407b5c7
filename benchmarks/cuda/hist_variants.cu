// Which part of the CUDA stats kernel caps its bandwidth? A standalone A/B of the log2
// histogram update (torch-free; run it on a GPU machine in one call):
//
//   nvcc -O3 -std=c++17 -arch=sm_90 -I csrc -o /tmp/hv benchmarks/cuda/hist_variants.cu && /tmp/hv
//   (scripts/gpu_check.sh hist does this)
//
// Session 4 (H100) measured the op at 41 % (float32) / 22 % (bfloat16) of the copy's read
// rate with the log2 histogram and 91 % / 60 % without: the same ~150 G elements/s for both
// dtypes, so a per-element cost, not bytes, caps it. Every variant below runs the kernel's
// per-thread float64 moments (as ThreadAcc in csrc/cuda/stats_kernels.cu) over the same
// 16-byte vector loads (one wave of blocks); they differ only in the histogram update:
//   none     no histogram (bins=0)
//   match    the kernel's: __match_any_sync per element, one shared atomic per distinct key
//            in the warp, one shared copy per warp
//   atomic   one shared copy per warp, a plain shared atomicAdd per element (no match)
//   private  one uint16 counter per (bucket, thread) in shared memory, no atomics: a
//            thread's two buckets 2k, 2k+1 share one 32-bit word, words laid out
//            [bucket pair][thread], so a warp's 32 lanes hit 32 banks; summed per block
//            at the end (67.6 KB a block: the grid is sized by occupancy per variant)
// Data: N(0, 1) (the case that crowds few buckets), fresh per size. Every variant's counts
// must equal `match`'s: the table says so. Time: cudaEvent, median of 25 launches after 5
// warm-up, rotating over 4 input buffers of >= 64 MiB each (larger than an H100/H200 L2).
// The copy line is a device-to-device cudaMemcpy of one buffer (read + write); "% copy
// read" is copy time / kernel time, as bench_stats.py prints it (a read-only kernel can
// exceed 100 %).
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <algorithm>
#include <vector>

#include "stats_defs.h"

#define CK(x)                                                                          \
  do {                                                                                 \
    cudaError_t e_ = (x);                                                              \
    if (e_ != cudaSuccess) {                                                           \
      fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      exit(1);                                                                         \
    }                                                                                  \
  } while (0)

namespace {

constexpr int kThreads = 256, kWarps = kThreads / 32, kBlocksPerSm = 3;
constexpr int kBins = hookplug::kLog2Bins;
constexpr int kPairs = (kBins + 1) / 2;  // private: 32-bit words per thread
enum Variant { kNone = 0, kMatch = 1, kAtomic = 2, kPrivate = 3 };
const char* kNames[] = {"none", "match", "atomic", "private"};

__device__ __forceinline__ int log2_key(float x) {
  if (x != x) return -1;
  if (x == 0.0f) return hookplug::kLog2ZeroBin;
  const unsigned b = __float_as_uint(x);
  return hookplug::log2_bucket((b >> 31) != 0, static_cast<int>((b >> 23) & 0xffu) - 127);
}

struct Acc {  // the kernel's per-thread float64 moments (shift 0 here)
  double s1 = 0, s2 = 0;
  unsigned nf = 0, nan = 0, inf = 0, zero = 0;
  float mn = __builtin_huge_valf(), mx = -__builtin_huge_valf();
  __device__ __forceinline__ void add(float x, bool valid) {
    const bool is_nan = x != x, is_inf = isinf(x), fin = valid && !is_nan && !is_inf;
    const double d = fin ? static_cast<double>(x) : 0.0;
    s1 += d;
    s2 = fma(d, d, s2);
    nf += fin;
    nan += valid && is_nan;
    inf += valid && is_inf;
    zero += fin && x == 0.0f;
    mn = fin && x < mn ? x : mn;
    mx = fin && x > mx ? x : mx;
  }
};

template <bool BF16>
__device__ __forceinline__ float elem(const uint4& r, int j) {
  const int k = BF16 ? j >> 1 : j;  // constant after unrolling: no local memory
  const unsigned w = k == 0 ? r.x : (k == 1 ? r.y : (k == 2 ? r.z : r.w));
  if (!BF16) return __uint_as_float(w);
  return __uint_as_float(((j & 1) ? (w >> 16) : (w & 0xffffu)) << 16);
}

template <bool BF16, int V>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    stats_kernel(const uint4* data, int64_t nvec, unsigned long long* hist, double* sink) {
  extern __shared__ unsigned sh[];
  constexpr int kVec = BF16 ? 8 : 4;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nsh = V == kPrivate ? kPairs * kThreads : (V == kNone ? 0 : kWarps * kBins);
  for (int k = threadIdx.x; k < nsh; k += kThreads) sh[k] = 0;
  __syncthreads();
  unsigned* wsh = sh + warp * kBins;
  unsigned short* psh = reinterpret_cast<unsigned short*>(sh) + 2 * threadIdx.x;
  Acc acc;
  auto visit = [&](float x, bool ok) {
    acc.add(x, ok);
    const int key = ok ? log2_key(x) : -1;
    if (V == kMatch) {
      const unsigned peers = __match_any_sync(0xffffffffu, key);
      if (key >= 0 && lane == __ffs(peers) - 1) atomicAdd(wsh + key, __popc(peers));
    } else if (V == kAtomic) {
      if (key >= 0) atomicAdd(wsh + key, 1u);
    } else if (V == kPrivate) {
      // word (pair, thread), half key & 1; < 65536 elements a thread (checked on the host)
      if (key >= 0) psh[(key >> 1) * 2 * kThreads + (key & 1)] += 1;
    }
  };
  const int64_t step = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t u0 = static_cast<int64_t>(blockIdx.x) * kThreads + warp * 32; u0 < nvec; u0 += 2 * step) {
    const int64_t ua = u0 + lane, ub = u0 + step + lane;
    const bool oka = ua < nvec, okb = ub < nvec;
    uint4 ra = make_uint4(0u, 0u, 0u, 0u), rb = ra;
    if (oka) ra = __ldg(data + ua);
    if (okb) rb = __ldg(data + ub);
#pragma unroll
    for (int j = 0; j < kVec; ++j) visit(elem<BF16>(ra, j), oka);
#pragma unroll
    for (int j = 0; j < kVec; ++j) visit(elem<BF16>(rb, j), okb);
  }
  __syncthreads();
  if (V == kMatch || V == kAtomic) {
    for (int k = threadIdx.x; k < kBins; k += kThreads) {
      unsigned c = 0;
      for (int w = 0; w < kWarps; ++w) c += sh[w * kBins + k];
      if (c) atomicAdd(hist + k, static_cast<unsigned long long>(c));
    }
  } else if (V == kPrivate) {  // warp w sums buckets w, w + kWarps, ...: lanes read across threads
    const unsigned short* p = reinterpret_cast<const unsigned short*>(sh);
    for (int k = warp; k < kBins; k += kWarps) {
      unsigned c = 0;
      for (int t = lane; t < kThreads; t += 32) c += p[(k >> 1) * 2 * kThreads + 2 * t + (k & 1)];
      for (int o = 16; o > 0; o >>= 1) c += __shfl_down_sync(0xffffffffu, c, o);
      if (lane == 0 && c) atomicAdd(hist + k, static_cast<unsigned long long>(c));
    }
  }
  // keep the moments alive (one write per thread would be noise: one per block)
  if (acc.s1 == 12345.678 && acc.s2 == acc.mn + acc.mx + acc.nf + acc.nan + acc.inf + acc.zero)
    sink[blockIdx.x] = acc.s1;
}

__device__ __forceinline__ uint32_t mix(uint64_t x) {
  x ^= x >> 33; x *= 0xff51afd7ed558ccdull; x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ull; x ^= x >> 33;
  return static_cast<uint32_t>(x);
}

__global__ void fill_normal(void* out, int64_t n, bool bf16, uint64_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float u1 = (mix(seed + 2 * i) + 1.0f) * 2.3283064e-10f;  // (0, 1]
    const float u2 = mix(seed + 2 * i + 1) * 2.3283064e-10f;
    const float x = sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
    if (bf16) {
      static_cast<unsigned short*>(out)[i] = static_cast<unsigned short>(__float_as_uint(x) >> 16);
    } else {
      static_cast<float*>(out)[i] = x;
    }
  }
}

constexpr size_t smem_bytes(int v) {
  return v == kPrivate ? sizeof(unsigned) * kPairs * kThreads
                       : (v == kNone ? 0 : sizeof(unsigned) * kWarps * kBins);
}

template <bool BF16, int V>
void launch(const void* buf, int64_t n, int grid, unsigned long long* hist, double* sink) {
  constexpr size_t smem = smem_bytes(V);
  const int64_t nvec = n / (BF16 ? 8 : 4);
  stats_kernel<BF16, V><<<grid, kThreads, smem>>>(static_cast<const uint4*>(buf), nvec, hist, sink);
}

typedef void (*LaunchFn)(const void*, int64_t, int, unsigned long long*, double*);

template <bool BF16>
LaunchFn pick(int v) {
  switch (v) {
    case kNone: return launch<BF16, kNone>;
    case kMatch: return launch<BF16, kMatch>;
    case kAtomic: return launch<BF16, kAtomic>;
    default: return launch<BF16, kPrivate>;
  }
}

// Resident blocks per SM of a variant (at most kBlocksPerSm, as the op's grid): one wave.
template <bool BF16, int V>
int blocks_per_sm() {
  int b = 0;
  if (V == kPrivate) {
    CK(cudaFuncSetAttribute(stats_kernel<BF16, V>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                            static_cast<int>(smem_bytes(V))));
  }
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, stats_kernel<BF16, V>, kThreads, smem_bytes(V)));
  return b < kBlocksPerSm ? b : kBlocksPerSm;
}

int occupancy(bool bf16, int v) {
  switch (v) {
    case kNone: return bf16 ? blocks_per_sm<true, kNone>() : blocks_per_sm<false, kNone>();
    case kMatch: return bf16 ? blocks_per_sm<true, kMatch>() : blocks_per_sm<false, kMatch>();
    case kAtomic: return bf16 ? blocks_per_sm<true, kAtomic>() : blocks_per_sm<false, kAtomic>();
    default: return bf16 ? blocks_per_sm<true, kPrivate>() : blocks_per_sm<false, kPrivate>();
  }
}

float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int dev = 0, sms = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, dev));
  const int grid = sms * kBlocksPerSm;  // the most any variant launches
  printf("hist_variants: %s, %d SMs, %d threads a block; blocks per SM (f32/bf16):", prop.name,
         sms, kThreads);
  for (int v = 0; v < 4; ++v) printf(" %s %d/%d", kNames[v], occupancy(false, v), occupancy(true, v));
  printf("\n");
  const int64_t sizes[] = {int64_t{1} << 25, int64_t{1} << 26, int64_t{1} << 28};
  constexpr int kBufs = 4, kWarm = 5, kReps = 25;
  unsigned long long* hist;
  double* sink;
  CK(cudaMalloc(&hist, sizeof(unsigned long long) * kBins * 4));
  CK(cudaMalloc(&sink, sizeof(double) * grid));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  bool all_equal = true;
  printf("%-6s %10s %-8s %9s %9s %12s %8s\n", "dtype", "elements", "variant", "ms", "GB/s read",
         "% copy read", "counts");
  for (int bf = 0; bf < 2; ++bf) {
    for (int64_t n : sizes) {
      const size_t bytes = static_cast<size_t>(n) * (bf ? 2 : 4);
      const int64_t nvec = n / (bf ? 8 : 4), threads = static_cast<int64_t>(sms) * kThreads;
      if ((nvec + threads - 1) / threads * (bf ? 8 : 4) > 65535) continue;  // private's uint16 counters
      std::vector<void*> bufs(kBufs);
      for (int b = 0; b < kBufs; ++b) {
        CK(cudaMalloc(&bufs[b], bytes));
        fill_normal<<<sms * 8, 256>>>(bufs[b], n, bf != 0, 0x9e3779b97f4a7c15ull * (b + 1) + n);
        CK(cudaGetLastError());
      }
      void* dst;
      CK(cudaMalloc(&dst, bytes));
      std::vector<float> ts;
      for (int r = 0; r < kWarm + kReps; ++r) {
        CK(cudaEventRecord(e0));
        CK(cudaMemcpyAsync(dst, bufs[r % kBufs], bytes, cudaMemcpyDeviceToDevice));
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        if (r >= kWarm) ts.push_back(ms);
      }
      const float copy_ms = median(ts);
      printf("%-6s %10lld %-8s %9.3f %9.0f %12s %8s\n", bf ? "bf16" : "f32", static_cast<long long>(n),
             "copy", copy_ms, bytes / copy_ms / 1e6, "(r+w)", "");
      std::vector<unsigned long long> ref(kBins), got(kBins);
      for (int v = 0; v < 4; ++v) {
        const LaunchFn fn = bf ? pick<true>(v) : pick<false>(v);
        const int vgrid = sms * occupancy(bf != 0, v);
        // counts of one launch over buffer 0, then the timing
        CK(cudaMemset(hist, 0, sizeof(unsigned long long) * kBins));
        fn(bufs[0], n, vgrid, hist, sink);
        CK(cudaGetLastError());
        CK(cudaMemcpy(got.data(), hist, sizeof(unsigned long long) * kBins, cudaMemcpyDeviceToHost));
        const char* verdict = "-";
        if (v == kMatch) {
          ref = got;
          unsigned long long total = 0;
          for (auto c : got) total += c;
          verdict = total == static_cast<unsigned long long>(n) ? "sum ok" : "SUM BAD";
          all_equal = all_equal && total == static_cast<unsigned long long>(n);
        } else if (v != kNone) {
          const bool eq = got == ref;
          verdict = eq ? "equal" : "DIFFER";
          all_equal = all_equal && eq;
        }
        ts.clear();
        for (int r = 0; r < kWarm + kReps; ++r) {
          CK(cudaEventRecord(e0));
          fn(bufs[r % kBufs], n, vgrid, hist + kBins, sink);
          CK(cudaEventRecord(e1));
          CK(cudaEventSynchronize(e1));
          float ms;
          CK(cudaEventElapsedTime(&ms, e0, e1));
          if (r >= kWarm) ts.push_back(ms);
        }
        CK(cudaGetLastError());
        const float ms = median(ts);
        printf("%-6s %10lld %-8s %9.3f %9.0f %11.0f%% %8s\n", bf ? "bf16" : "f32",
               static_cast<long long>(n), kNames[v], ms, bytes / ms / 1e6,
               100.0 * (bytes / ms) / (bytes / copy_ms), verdict);
      }
      for (void* b : bufs) CK(cudaFree(b));
      CK(cudaFree(dst));
    }
  }
  printf("hist_variants: counts of every variant equal match's: %s\n", all_equal ? "yes" : "NO");
  return all_equal ? 0 : 1;
}
