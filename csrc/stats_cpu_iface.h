// Interface between the CPU driver (stats_cpu.cpp, uses torch) and the CPU block kernels
// (stats_cpu_kernel.h, torch-free, compiled once per ISA). Torch-free.
#pragma once

#include <stdint.h>

#include <mutex>

namespace hookplug {
namespace cpu {

// Element types the kernels read natively.
enum DType : int { kF32 = 0, kF64 = 1, kF16 = 2, kBF16 = 3, kNumDTypes = 4 };

// Statistics of one block of at most kBlock contiguous elements.
struct BlockResult {
  int64_t n;        // finite values
  double shift;     // a value near them (the kernel's K): the mean is shift + mean
  double mean;      // of the finite values, relative to shift (0 when n == 0)
  double m2;        // sum of squared deviations from the mean
  double mn, mx;    // finite min / max (+inf / -inf when n == 0)
  int64_t zeros;    // +0 and -0
  int64_t neg_zeros;  // -0 only (filled only when a raw histogram is requested)
  int64_t pos_inf, neg_inf, nan;
};

constexpr int64_t kBlock = 2048;       // elements per block (L1-resident)
constexpr int64_t kChunkBlocks = 8;    // blocks per chunk (unit of parallel work): a 32K-element
                                       // activation already runs on two threads
constexpr int64_t kChunk = kBlock * kChunkBlocks;

// Raw log2 table: one counter per (sign, biased exponent field) of the value, read from
// the float32 bits for float32/float16/bfloat16 (exact conversion) and from the float64
// bits for float64. kRawSub interleaved sub-tables break store-to-load dependencies.
constexpr int kRawBitsF32 = 8, kRawBiasF32 = 127, kRawF32 = 2 << kRawBitsF32;     // 512
constexpr int kRawBitsF64 = 11, kRawBiasF64 = 1023, kRawF64 = 2 << kRawBitsF64;  // 4096
constexpr int kRawSubF32 = 4;
constexpr int kRawSubF64 = 2;

// hist: kRawSub sub-tables of kRaw uint32 counters each (added to), or nullptr.
// shift: in, a value near the block's mean (the previous block's; NaN: none); out, this
// block's mean rounded to a grid well below its std (see coarse_shift in
// stats_cpu_kernel.h). Chained through a chunk, it keeps one-pass sums well conditioned.
typedef void (*BlockFn)(const void* p, int64_t n, BlockResult* r, uint32_t* hist,
                        double* shift);
// Adds the linear-histogram counts of p[0:n) to counts[0:bins] (see stats_defs.h
// linear_bucket); values outside the range are counted in the spare counts[bins].
typedef void (*LinearFn)(const void* p, int64_t n, double lo, double hi, double scale,
                         int64_t bins, int64_t* counts);

struct KernelTable {
  const char* isa;
  BlockFn block[kNumDTypes];
  LinearFn linear[kNumDTypes];
};

const KernelTable* kernels_generic();
const KernelTable* kernels_avx2();  // nullptr when not built for this target

// Held while a tensor's statistics are folded into a bank row (stats_cpu.cpp), and by
// snapshot_rows (stats_snapshot.cpp) while it copies and resets a CPU bank: a merge from
// a thread running without the GIL lands wholly before or wholly after a step boundary.
std::mutex& fold_mutex();

}  // namespace cpu
}  // namespace hookplug
