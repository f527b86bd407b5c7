// The op schemas (registered once): hookplug::tensor_stats (one fresh stats row),
// hookplug::stats_accumulate_ (merge into a row of a bank in place) and
// hookplug::stats_accumulate_at_ (the same, the row index in a tensor); their Autograd
// registrations (not differentiable: they run below autograd) and the Python module
// hookplug._C (small introspection helpers). Row layout: stats_defs.h.
//
// Per-device kernels: stats_cpu.cpp (CPU), cuda/stats_cuda.cpp (CUDA). The fake (meta)
// kernel is registered from Python (hookplug/ops.py).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/extension.h>
#include <torch/library.h>
#include <pybind11/stl.h>

#include <string>
#include <utility>
#include <vector>

#include "stats_checks.h"
#include "stats_defs.h"

namespace hookplug {
pybind11::tuple rows_to_records(const at::Tensor& rows, const std::optional<at::Tensor>& bad,
                                const pybind11::list& metas, const pybind11::list& stamps,
                                const pybind11::object& rank, const pybind11::object& run_id,
                                const pybind11::tuple& keys, const pybind11::object& log2_edges,
                                bool log2_kind, bool unknown_kind,
                                const pybind11::dict& edges_cache);  // stats_records.cpp
void snapshot_rows(const at::Tensor& acc, const at::Tensor& empty,
                   const at::Tensor& snap);  // stats_snapshot.cpp
namespace cpu {
std::string cpu_isa();
void set_cpu_isa(const std::string& isa);
}  // namespace cpu

namespace {

// Both ops run below autograd: their outputs carry no grad_fn and x's autograd state is
// untouched (x is only read).
at::Tensor tensor_stats_autograd(const at::Tensor& x, int64_t bins, int64_t hist_mode,
                                 std::optional<double> lo, std::optional<double> hi) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("hookplug::tensor_stats", "")
                       .typed<at::Tensor(const at::Tensor&, int64_t, int64_t,
                                         std::optional<double>, std::optional<double>)>();
  at::AutoDispatchBelowADInplaceOrView guard;
  return op.call(x, bins, hist_mode, lo, hi);
}

void stats_accumulate_autograd(const at::Tensor& x, const at::Tensor& acc, int64_t row,
                               const std::optional<at::Tensor>& gate, int64_t bins,
                               int64_t hist_mode, std::optional<double> lo,
                               std::optional<double> hi, bool skip_recompute) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("hookplug::stats_accumulate_", "")
                       .typed<void(const at::Tensor&, const at::Tensor&, int64_t,
                                   const std::optional<at::Tensor>&, int64_t, int64_t,
                                   std::optional<double>, std::optional<double>, bool)>();
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.call(x, acc, row, gate, bins, hist_mode, lo, hi, skip_recompute);
  }
  acc.unsafeGetTensorImpl()->bump_version();  // acc was written in place
}

void stats_accumulate_at_autograd(const at::Tensor& x, const at::Tensor& acc, const at::Tensor& row,
                                  const std::optional<at::Tensor>& gate, int64_t bins,
                                  int64_t hist_mode, std::optional<double> lo,
                                  std::optional<double> hi, bool skip_recompute) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("hookplug::stats_accumulate_at_", "")
                       .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   const std::optional<at::Tensor>&, int64_t, int64_t,
                                   std::optional<double>, std::optional<double>, bool)>();
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.call(x, acc, row, gate, bins, hist_mode, lo, hi, skip_recompute);
  }
  acc.unsafeGetTensorImpl()->bump_version();
}

}  // namespace
}  // namespace hookplug

TORCH_LIBRARY(hookplug, m) {
  m.def(
      "tensor_stats(Tensor x, int bins, int hist_mode, float? lo=None, float? hi=None) "
      "-> Tensor");
  // skip_recompute: a forward hook's call; it does nothing while autograd runs a backward
  // on this thread (an activation-checkpoint recompute re-running compiled forward code,
  // which cannot tell at trace time: eager hooks check the same before calling).
  m.def(
      "stats_accumulate_(Tensor x, Tensor(a!) acc, int row, Tensor? gate, int bins, "
      "int hist_mode, float? lo=None, float? hi=None, bool skip_recompute=False) -> ()");
  // The same with the row index in a tensor on acc's device (read by the kernel there):
  // what compiled code calls, so the graph holds no per-module constant.
  m.def(
      "stats_accumulate_at_(Tensor x, Tensor(a!) acc, Tensor row, Tensor? gate, int bins, "
      "int hist_mode, float? lo=None, float? hi=None, bool skip_recompute=False) -> ()");
}

TORCH_LIBRARY_IMPL(hookplug, Autograd, m) {
  m.impl("tensor_stats", &hookplug::tensor_stats_autograd);
  m.impl("stats_accumulate_", &hookplug::stats_accumulate_autograd);
  m.impl("stats_accumulate_at_", &hookplug::stats_accumulate_at_autograd);
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
  // The eager hot path: the op without the Python operator-call layer (torch.ops parses
  // every argument against the schema: ~5 us a call). Same dispatch below autograd as the
  // Autograd kernel; torch.compile'd code calls torch.ops.hookplug.stats_accumulate_.
  m.def("accumulate", [](const at::Tensor& x, const at::Tensor& acc, int64_t row,
                         const std::optional<at::Tensor>& gate, int64_t bins, int64_t hist_mode,
                         std::optional<double> lo, std::optional<double> hi) {
    // A large read on the CPU lets other threads run meanwhile. A CUDA call only enqueues
    // (microseconds): giving the GIL away there buys nothing, and taking it back can wait a
    // switch interval (5 ms) behind a busy thread (a data loader's).
    std::optional<pybind11::gil_scoped_release> no_gil;
    if (!x.is_cuda() && x.numel() >= (int64_t{1} << 16)) no_gil.emplace();
    hookplug::stats_accumulate_autograd(x, acc, row, gate, bins, hist_mode, lo, hi, false);
  }, "hookplug::stats_accumulate_ for eager callers (see hookplug._bank).");
  m.def("rows_to_records", &hookplug::rows_to_records,
        "Telemetry records from host stats rows (see csrc/stats_records.cpp, hookplug._telemetry).");
  m.def("snapshot_rows", &hookplug::snapshot_rows,
        "A CPU bank's step boundary: snap <- acc, acc <- empty (see csrc/stats_snapshot.cpp).");
  m.def("row_layout", []() {
    using namespace hookplug;
    return std::vector<std::pair<std::string, int>>{
        {"numel", kNumel}, {"nan_count", kNan}, {"inf_count", kInf}, {"zero_count", kZero},
        {"min", kMin}, {"max", kMax}, {"mean", kMean}, {"m2", kM2}, {"hist_lo", kHistLo},
        {"hist_hi", kHistHi}, {"first_bad", kFirstBad}, {"calls", kCalls}, {"head", kHead}, {"clock", kClock},
        {"max_bins", static_cast<int>(kMaxBins)}};
  }, "The stats row layout: (column name, index) pairs (see csrc/stats_defs.h).");
  m.def("log2_layout", []() {
    return std::make_tuple(hookplug::kLog2MinExp, hookplug::kLog2MaxExp, hookplug::kLog2Bins);
  }, "(min_exp, max_exp, buckets) of the log2 histogram.");
}
