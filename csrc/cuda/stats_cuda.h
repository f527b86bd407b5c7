// hookplug::tensor_stats / stats_accumulate_ on CUDA: the launcher interface between the torch binding
// (stats_cuda.cpp) and the kernels (stats_kernels.cu). Torch-free: only CUDA headers, so
// the kernels compile with plain nvcc (.ci/nvcc_check.sh).
#pragma once

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

namespace hookplug {
namespace cuda {

constexpr int kMaxDims = 8;  // strided inputs with more (merged) dims are made contiguous

enum DType : int { kF32 = 0, kF64 = 1, kF16 = 2, kBF16 = 3 };

struct StatsLaunch {
  const void* data;  // first element
  int dtype;         // DType
  int64_t numel;
  int ndim;  // 0: dense, numel elements from data on; else sizes/strides, outer -> inner
  int64_t sizes[kMaxDims];
  int64_t strides[kMaxDims];  // in elements
  int64_t nbins;              // 0 (no histogram), kLog2Bins or the linear bins
  int hist_mode;              // 0 log2, 1 linear
  int has_range;              // linear: lo/hi given (else read from the pass-1 min/max)
  double lo, hi;
  int num_sms;
  // The row the statistics are merged into (device memory, width kHead + nbins; see
  // stats_defs.h). fresh: the kernels initialize it first (hookplug::tensor_stats); else
  // they merge into it and advance *clock (hookplug::stats_accumulate_).
  double* row;
  // Or, where row_index is not nullptr: row is the bank's acc[0] and the row to merge into
  // is acc[*row_index] (read on the device; an index outside [1, bank_rows): no merge).
  const int64_t* row_index;
  int64_t bank_rows;
  double* clock;     // the bank's call counter (acc[0][kClock]), or nullptr
  const bool* gate;  // nullptr, or a device flag: when false the launch does nothing
  int fresh;
  void* workspace;  // stats_workspace_bytes() bytes of device memory
};

// Device memory the launch needs as scratch (per-block partials and a counter).
size_t stats_workspace_bytes(const StatsLaunch& s);

// Enqueues everything on `stream` (no host synchronization). Returns the first error.
cudaError_t launch_tensor_stats(const StatsLaunch& s, cudaStream_t stream);

}  // namespace cuda
}  // namespace hookplug
