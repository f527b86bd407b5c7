// CUDA implementation of hookplug::tensor_stats and stats_accumulate_: checks the arguments (stats_checks.h),
// describes the tensor's memory to the torch-free launcher (stats_kernels.cu) and
// enqueues it on torch's current stream. Built only when torch has CUDA and CUDA_HOME is
// set (setup.py); never synchronizes with the host.
//
// Layout: dimensions are merged as on the CPU (mem_layout), so dense tensors in any
// dimension order (transposed, channels-last) are read as one flat run with vector loads.
// Other strided tensors are read in place with up to kMaxDims merged dimensions; only a
// tensor needing more is copied with .contiguous() first.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "cuda/stats_cuda.h"
#include "stats_checks.h"

namespace hookplug {
namespace {

cuda::DType cuda_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return cuda::kF32;
    case at::kDouble: return cuda::kF64;
    case at::kHalf: return cuda::kF16;
    default: return cuda::kBF16;
  }
}

// Describes x to the launcher and enqueues the launch on torch's current stream.
void launch(const at::Tensor& x_in, const StatsArgs& a, double* row, double* clock,
            const bool* gate, bool fresh, const at::Tensor* row_index = nullptr,
            int64_t bank_rows = 0) {
  const c10::cuda::CUDAGuard guard(x_in.device());
  at::Tensor x = x_in;
  MemLayout L = mem_layout(x);
  if (!L.flat() && L.sizes.size() > static_cast<size_t>(cuda::kMaxDims)) {
    x = x.contiguous();
    L = mem_layout(x);
  }
  if (x.numel() > 0 && reinterpret_cast<uintptr_t>(x.data_ptr()) % x.element_size() != 0) {
    // elements not aligned to their size (a tensor set_ on a byte-offset storage slice): a
    // load of one faults on the GPU, torch's own copy kernels' too. The bytes the tensor
    // spans, copied as bytes (a memcpy) into fresh memory, viewed with its strides again.
    int64_t span = 1;
    for (int64_t d = 0; d < x.dim(); ++d) span += (x.size(d) - 1) * x.stride(d);
    const int64_t nbytes = span * static_cast<int64_t>(x.element_size());
    const at::Tensor src = at::from_blob(x.data_ptr(), {nbytes}, x.options().dtype(at::kByte));
    at::Tensor bytes = at::empty({nbytes}, x.options().dtype(at::kByte));
    bytes.copy_(src);
    x = bytes.view(x.scalar_type()).as_strided(x.sizes(), x.strides());
    L = mem_layout(x);
  }
  cuda::StatsLaunch s{};
  s.data = x.data_ptr();
  s.dtype = cuda_dtype(x.scalar_type());
  s.numel = x.numel();
  s.ndim = L.flat() ? 0 : static_cast<int>(L.sizes.size());
  for (int d = 0; d < s.ndim; ++d) {
    s.sizes[d] = L.sizes[d];
    s.strides[d] = L.strides[d];
  }
  s.nbins = a.nbins;
  s.hist_mode = a.log2 ? static_cast<int>(kHistLog2) : static_cast<int>(kHistLinear);
  s.has_range = a.has_range ? 1 : 0;
  s.lo = a.lo;
  s.hi = a.hi;
  s.num_sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  s.row = row;
  s.row_index = row_index != nullptr ? row_index->data_ptr<int64_t>() : nullptr;
  s.bank_rows = bank_rows;
  s.clock = clock;
  s.gate = gate;
  s.fresh = fresh ? 1 : 0;
  // Stream-ordered scratch: the caching allocator reuses it only after this stream's work.
  at::Tensor workspace = at::empty({static_cast<int64_t>(cuda::stats_workspace_bytes(s))},
                                   x.options().dtype(at::kByte));
  s.workspace = workspace.data_ptr();
  const cudaError_t err = cuda::launch_tensor_stats(s, at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "hookplug: stats CUDA launch failed on ", x.device(), ": ",
              cudaGetErrorString(err));
}

at::Tensor tensor_stats_cuda(const at::Tensor& x, int64_t bins, int64_t hist_mode,
                             std::optional<double> lo, std::optional<double> hi) {
  const StatsArgs a = check_stats_args(x, bins, hist_mode, lo, hi);
  at::Tensor row = empty_stats_row(x, a);
  launch(x, a, row.data_ptr<double>(), nullptr, nullptr, true);
  return row;
}

void stats_accumulate_cuda(const at::Tensor& x, const at::Tensor& acc, int64_t row,
                           const std::optional<at::Tensor>& gate, int64_t bins, int64_t hist_mode,
                           std::optional<double> lo, std::optional<double> hi,
                           bool skip_recompute) {
  const BankTarget t = bank_target(x, acc, row, gate, bins, hist_mode, lo, hi);
  if (in_recompute(skip_recompute)) return;
  launch(x, t.a, t.row, t.clock, gate.has_value() ? gate->data_ptr<bool>() : nullptr, false);
}

// The row index stays in device memory (a module's tensor, see stats_accumulate_at_): the
// kernels read it, and a launch whose index is outside [1, rows) does nothing.
void stats_accumulate_at_cuda(const at::Tensor& x, const at::Tensor& acc, const at::Tensor& row,
                              const std::optional<at::Tensor>& gate, int64_t bins,
                              int64_t hist_mode, std::optional<double> lo,
                              std::optional<double> hi, bool skip_recompute) {
  check_row_tensor(acc, row);
  const BankTarget t = bank_target(x, acc, std::nullopt, gate, bins, hist_mode, lo, hi,
                                   "hookplug::stats_accumulate_at_");
  if (in_recompute(skip_recompute)) return;
  launch(x, t.a, t.row, t.clock, gate.has_value() ? gate->data_ptr<bool>() : nullptr, false,
         &row, acc.size(0));
}

}  // namespace
}  // namespace hookplug

TORCH_LIBRARY_IMPL(hookplug, CUDA, m) {
  m.impl("tensor_stats", &hookplug::tensor_stats_cuda);
  m.impl("stats_accumulate_", &hookplug::stats_accumulate_cuda);
  m.impl("stats_accumulate_at_", &hookplug::stats_accumulate_at_cuda);
}
