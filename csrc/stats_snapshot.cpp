// The step boundary of a CPU stats bank (hookplug._C.snapshot_rows): copy the rows in use
// to the step's snapshot slot and reset them from the empty rows, two memcpy calls in one
// Python call. session.step() runs right after optimizer.step(), cold: the two torch
// copies it replaces cost ~20 us each there, nearly all of it the dispatcher's code and
// data coming back into cache, against ~1 us for the bytes. CUDA banks keep the torch
// copies (stream-ordered); see hookplug._bank._DeviceRows.end_step.
#include <torch/extension.h>

#include <cstdint>
#include <cstring>
#include <mutex>

#include "stats_cpu_iface.h"

namespace hookplug {

namespace {

void check_rows(const at::Tensor& t, const char* name, const at::Tensor& like) {
  TORCH_CHECK_VALUE(t.scalar_type() == at::kDouble && t.is_cpu() && t.is_contiguous() &&
                        t.sizes() == like.sizes(),
                    "snapshot_rows: expected ", name, " as contiguous float64 CPU rows of shape ",
                    like.sizes(), ", got ", t.sizes(), " ", t.scalar_type(), " on ", t.device(),
                    t.is_contiguous() ? "" : " (not contiguous)");
}

bool overlap(const at::Tensor& a, const at::Tensor& b, size_t bytes) {
  const char* pa = static_cast<const char*>(a.const_data_ptr());
  const char* pb = static_cast<const char*>(b.const_data_ptr());
  return pa < pb + bytes && pb < pa + bytes;
}

}  // namespace

// snap <- acc, then acc <- empty. All three: [R, W] contiguous float64 CPU tensors, snap
// sharing memory with neither. The version counters of acc and snap advance, as a torch
// copy_ would advance them.
void snapshot_rows(const at::Tensor& acc, const at::Tensor& empty, const at::Tensor& snap) {
  TORCH_CHECK_VALUE(acc.dim() == 2, "snapshot_rows: expected acc as [R, W] rows, got ",
                    acc.sizes());
  check_rows(acc, "acc", acc);
  check_rows(empty, "empty", acc);
  check_rows(snap, "snap", acc);
  const size_t bytes = static_cast<size_t>(acc.numel()) * sizeof(double);
  TORCH_CHECK_VALUE(!overlap(snap, acc, bytes) && !overlap(snap, empty, bytes),
                    "snapshot_rows: snap must not share memory with acc or empty");
  if (bytes == 0) return;
  // a CPU fold of another thread (a large tensor's op runs without the GIL) must land
  // before the copy or after the reset, never between them (it would be lost)
  std::lock_guard<std::mutex> lock(cpu::fold_mutex());
  std::memcpy(snap.mutable_data_ptr(), acc.const_data_ptr(), bytes);
  std::memmove(acc.mutable_data_ptr(), empty.const_data_ptr(), bytes);
  for (const at::Tensor* t : {&acc, &snap}) {
    if (!t->is_inference()) t->unsafeGetTensorImpl()->bump_version();  // inference: no counter
  }
}

}  // namespace hookplug
