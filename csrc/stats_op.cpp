// hookplug::tensor_stats: the op schema (registered once), its Autograd registration
// (the statistics are not differentiable: the op runs below autograd and its outputs carry
// no grad_fn) and the Python module hookplug._C (small introspection helpers).
//
// Per-device kernels: stats_cpu.cpp (CPU), cuda/stats_cuda.cpp (CUDA). The fake (meta)
// kernel is registered from Python (hookplug/ops.py).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <string>

#include "stats_checks.h"
#include "stats_defs.h"

namespace hookplug {
namespace cpu {
std::string cpu_isa();
void set_cpu_isa(const std::string& isa);
}  // namespace cpu

namespace {

StatsOutputs tensor_stats_autograd(const at::Tensor& x, int64_t bins, int64_t hist_mode,
                                   std::optional<double> lo, std::optional<double> hi) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("hookplug::tensor_stats", "")
                       .typed<StatsOutputs(const at::Tensor&, int64_t, int64_t,
                                           std::optional<double>, std::optional<double>)>();
  at::AutoDispatchBelowADInplaceOrView guard;
  return op.call(x, bins, hist_mode, lo, hi);
}

}  // namespace
}  // namespace hookplug

TORCH_LIBRARY(hookplug, m) {
  m.def(
      "tensor_stats(Tensor x, int bins, int hist_mode, float? lo=None, float? hi=None) "
      "-> (Tensor counts, Tensor moments, Tensor hist_counts, Tensor hist_edges)");
}

TORCH_LIBRARY_IMPL(hookplug, Autograd, m) {
  m.impl("tensor_stats", &hookplug::tensor_stats_autograd);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "hookplug compiled ops (hookplug::tensor_stats); use hookplug.ops.";
  m.def("has_cuda", []() {
#ifdef HOOKPLUG_WITH_CUDA
    return true;
#else
    return false;
#endif
  }, "Whether the CUDA kernels were built into this extension.");
  m.def("cpu_isa", &hookplug::cpu::cpu_isa, "The CPU kernel variant in use ('avx2' or 'generic').");
  m.def("set_cpu_isa", &hookplug::cpu::set_cpu_isa,
        "Select the CPU kernel variant: 'auto', 'avx2' or 'generic' (tests, benchmarks).");
  m.def("log2_layout", []() {
    return std::make_tuple(hookplug::kLog2MinExp, hookplug::kLog2MaxExp, hookplug::kLog2Bins);
  }, "(min_exp, max_exp, buckets) of the log2 histogram.");
}
