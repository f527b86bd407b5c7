// hookplug::tensor_stats: argument checks, output allocation and memory-layout analysis,
// written once and used by the CPU and the CUDA implementations.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/autograd/graph_task.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "stats_defs.h"

namespace hookplug {

inline const char* torch_dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "torch.float32";
    case at::kDouble: return "torch.float64";
    case at::kHalf: return "torch.float16";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kLong: return "torch.int64";
    case at::kInt: return "torch.int32";
    case at::kShort: return "torch.int16";
    case at::kChar: return "torch.int8";
    case at::kByte: return "torch.uint8";
    case at::kBool: return "torch.bool";
    case at::kComplexHalf: return "torch.complex32";
    case at::kComplexFloat: return "torch.complex64";
    case at::kComplexDouble: return "torch.complex128";
    default: return c10::toString(t);
  }
}

struct StatsArgs {
  int64_t nbins;   // histogram buckets: 0 (off), kLog2Bins or bins
  bool log2;       // log2 histogram on
  bool linear;     // linear histogram on
  bool has_range;  // linear with a given range
  double lo, hi;
};

// who: the op the caller is, as error messages name it.
inline StatsArgs check_stats_args(const at::Tensor& x, int64_t bins, int64_t hist_mode,
                                  std::optional<double> lo, std::optional<double> hi,
                                  const char* who = "hookplug::tensor_stats") {
  TORCH_CHECK_TYPE(x.layout() == at::kStrided,
                   who, ": expected a dense (strided) tensor, got layout ",
                   x.layout());
  const auto t = x.scalar_type();
  TORCH_CHECK_TYPE(t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16,
                   who, ": expected a floating tensor (float32, float64, "
                   "float16, bfloat16), got ",
                   torch_dtype_name(t));
  TORCH_CHECK_VALUE(hist_mode == kHistLog2 || hist_mode == kHistLinear,
                    who, ": expected hist_mode 0 (log2) or 1 (linear), got ",
                    hist_mode);
  TORCH_CHECK_VALUE(bins >= 0 && bins <= kMaxBins,  // kMaxBins == hookplug._stats.MAX_BINS
                    who, ": expected 0 <= bins <= ", kMaxBins,
                    " (0 turns the histogram off), got ", bins);
  TORCH_CHECK_VALUE(lo.has_value() == hi.has_value(),
                    who, ": a range needs both lo and hi, got lo=",
                    lo.has_value() ? std::to_string(*lo) : "None",
                    ", hi=", hi.has_value() ? std::to_string(*hi) : "None");
  StatsArgs a{};
  a.has_range = lo.has_value();
  if (a.has_range) {
    TORCH_CHECK_VALUE(hist_mode == kHistLinear,
                      who, ": a range applies to the linear histogram "
                      "(hist_mode=1) only, got hist_mode=",
                      hist_mode, " (log2)");
    // NaN, inf, a width past the largest, or one so narrow that bins / width overflows
    TORCH_CHECK_VALUE(*lo < *hi && std::isfinite(*hi - *lo) &&
                          std::isfinite(static_cast<double>(bins > 0 ? bins : 1) / (*hi - *lo)),
                      who, ": expected a finite range with lo < hi (hi - lo finite, and "
                      "bins / (hi - lo) finite), got (", *lo, ", ", *hi, ")");
    a.lo = *lo;
    a.hi = *hi;
  }
  a.log2 = bins > 0 && hist_mode == kHistLog2;
  a.linear = bins > 0 && hist_mode == kHistLinear;
  a.nbins = bins == 0 ? 0 : (a.log2 ? kLog2Bins : bins);
  return a;
}

// The histogram range columns (kHistLo, kHistHi) of a row for these arguments; a linear
// histogram with an automatic range gets its range from the data (tensor_stats only).
inline void hist_range_columns(const StatsArgs& a, double* lo, double* hi) {
  if (a.log2) {
    *lo = log2_edge(0);
    *hi = log2_edge(kLog2Bins);
  } else if (a.linear && a.has_range) {
    *lo = a.lo;
    *hi = a.hi;
  } else {
    *lo = *hi = 0.0;  // no histogram (or a range not known yet)
  }
}

// A fresh row for hookplug::tensor_stats (filled by the kernels).
inline at::Tensor empty_stats_row(const at::Tensor& x, const StatsArgs& a) {
  return at::empty({kHead + a.nbins}, x.options().dtype(at::kDouble));
}

// The bank arguments of hookplug::stats_accumulate_(x, acc, row, gate, ...) (row: none
// when the kernel reads it from device memory and checks it there).
inline void check_bank(const at::Tensor& x, const at::Tensor& acc, std::optional<int64_t> row,
                       const std::optional<at::Tensor>& gate, const StatsArgs& a, const char* who) {
  TORCH_CHECK_TYPE(acc.scalar_type() == at::kDouble && acc.dim() == 2 && acc.is_contiguous(),
                   who, ": expected acc to be a contiguous 2-D float64 tensor, got a ",
                   acc.dim(), "-D ", torch_dtype_name(acc.scalar_type()), " tensor");
  TORCH_CHECK_VALUE(acc.size(1) == kHead + a.nbins, who, ": expected acc rows of width ",
                    kHead + a.nbins, " (", kHead, " + ", a.nbins,
                    " histogram buckets), got width ", acc.size(1));
  TORCH_CHECK_VALUE(!row || (*row >= 1 && *row < acc.size(0)), who, ": expected a row in [1, ",
                    acc.size(0), ") (row 0 is the bank's meta row), got ", row.value_or(0));
  TORCH_CHECK(acc.device() == x.device(), who, ": expected acc on ", x.device(), " (x's device), got ",
              acc.device());
  TORCH_CHECK_VALUE(!(a.linear && !a.has_range), who,
                    ": an accumulated linear histogram needs a fixed range (lo, hi)");
  if (gate.has_value()) {
    TORCH_CHECK_TYPE(gate->scalar_type() == at::kBool && gate->numel() == 1, who,
                     ": expected gate to be a one-element bool tensor, got ",
                     torch_dtype_name(gate->scalar_type()), " with ", gate->numel(), " elements");
    TORCH_CHECK(gate->device() == x.device(), who, ": expected gate on ", x.device(), ", got ",
                gate->device());
  }
}

// The row argument of hookplug::stats_accumulate_at_: the row index as a one-element int64
// tensor on acc's device (compiled code passes a module's own: no constant in the graph).
inline void check_row_tensor(const at::Tensor& acc, const at::Tensor& row) {
  const char* who = "hookplug::stats_accumulate_at_";
  TORCH_CHECK_TYPE(row.scalar_type() == at::kLong && row.numel() == 1, who,
                   ": expected row to be a one-element int64 tensor, got ",
                   torch_dtype_name(row.scalar_type()), " with ", row.numel(), " elements");
  TORCH_CHECK(row.device() == acc.device(), who, ": expected row on ", acc.device(),
              " (acc's device), got ", row.device());
}

// Whether a stats_accumulate_ call passed skip_recompute (a forward hook's) runs while
// autograd's engine runs a backward on this thread: an activation-checkpoint recompute of
// compiled forward code, which must not be counted again (eager hooks check the same in
// Python). Grad-site calls, which run in backward, pass false.
inline bool in_recompute(bool skip_recompute) {
  return skip_recompute && torch::autograd::get_current_graph_task_id() != -1;
}

// Where hookplug::stats_accumulate_ merges: the checked arguments, acc[row] (acc[0] for a
// row the kernel reads from device memory) and the clock.
struct BankTarget {
  StatsArgs a;
  double* row;
  double* clock;
};

inline BankTarget bank_target(const at::Tensor& x, const at::Tensor& acc, std::optional<int64_t> row,
                              const std::optional<at::Tensor>& gate, int64_t bins,
                              int64_t hist_mode, std::optional<double> lo,
                              std::optional<double> hi,
                              const char* who = "hookplug::stats_accumulate_") {
  const StatsArgs a = check_stats_args(x, bins, hist_mode, lo, hi, who);
  check_bank(x, acc, row, gate, a, who);
  double* base = acc.data_ptr<double>();
  return BankTarget{a, base + row.value_or(0) * acc.size(1), base + kClock};
}

// The tensor's elements as an iteration over memory: dimensions of size 1 dropped, the
// rest ordered by decreasing stride and merged where they are contiguous with each other
// (so transposed, permuted and channels-last dense tensors become one flat run).
struct MemLayout {
  std::vector<int64_t> sizes;    // outer -> inner
  std::vector<int64_t> strides;  // in elements
  bool flat() const { return sizes.empty() || (sizes.size() == 1 && strides[0] == 1); }
};

inline MemLayout mem_layout(const at::Tensor& x) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size)
  for (int64_t d = 0; d < x.dim(); ++d) {
    if (x.size(d) != 1) dims.emplace_back(x.stride(d), x.size(d));
  }
  std::stable_sort(dims.begin(), dims.end(),
                   [](const auto& p, const auto& q) { return p.first > q.first; });
  MemLayout L;
  for (const auto& [st, sz] : dims) {
    if (!L.sizes.empty() && L.strides.back() == st * sz) {
      L.sizes.back() *= sz;
      L.strides.back() = st;
    } else {
      L.sizes.push_back(sz);
      L.strides.push_back(st);
    }
  }
  return L;
}

}  // namespace hookplug
