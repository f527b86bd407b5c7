// Telemetry records from host stats rows (hookplug._C.rows_to_records): the numbers of
// hookplug._stats.rows_to_values and the dicts of hookplug._telemetry's record loop, built
// here because a flush runs right after a training step, cold, and its Python loop over
// rows was the largest share of every-step telemetry on the CPU. The Python code stays the
// reference (the "reference" backend runs it); tests compare the two record for record.
//
// Float results are bitwise those of the Python code: the same IEEE operations in the same
// order, with FMA contraction off (Python never fuses a multiply and an add).
#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>

#include "stats_defs.h"

#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace py = pybind11;

namespace hookplug {

namespace {

// The record keys in order (_telemetry._RECORD_KEYS): 7 meta keys, 4 counts, 8 floats,
// hist, hist_edges, first_nonfinite.
constexpr int kMetaKeys = 7, kCounts = 5, kFloats = 8, kRecordKeys = kMetaKeys + kCounts + kFloats + 3;

py::object steal(PyObject* o) {
  if (o == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(o);
}

// dict[key] = value, the value a new reference.
void set_new(PyObject* d, PyObject* key, PyObject* value) {
  if (value == nullptr || PyDict_SetItem(d, key, value) < 0) {
    Py_XDECREF(value);
    throw py::error_already_set();
  }
  Py_DECREF(value);
}

// meta[key] (a new reference); a KeyError as Python's meta[key] raises it when missing.
py::object item(PyObject* meta, PyObject* key) {
  PyObject* v = PyDict_GetItemWithError(meta, key);
  if (v == nullptr) {
    if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, key);
    throw py::error_already_set();
  }
  return py::reinterpret_borrow<py::object>(v);
}

}  // namespace

// rows: [R, W] float64 on the host, any strides (W = kHead + buckets); bad: [R] float64,
// each row's first_bad clock, or None for rows[:, kFirstBad]. metas/stamps: R dicts and R
// step end times. keys: the 22 record keys. log2_edges: the shared log2 edge list;
// log2_kind / unknown_kind: the group's histogram kind is "log2" / None (see
// _stats._edges). edges_cache: {(lo, hi, buckets): edges} shared by the groups of one
// flush, so records with equal edges share one list. Returns (records, [(record, clock)
// for rows whose clock is finite]); rows no call touched (calls and numel 0) give no record. Reads the
// tensors in place: no torch op runs (each would cost a flush microseconds, cold).
py::tuple rows_to_records(const at::Tensor& rows, const std::optional<at::Tensor>& bad,
                          const py::list& metas, const py::list& stamps, const py::object& rank,
                          const py::object& run_id, const py::tuple& keys,
                          const py::object& log2_edges, bool log2_kind, bool unknown_kind,
                          const py::dict& edges_cache) {
  TORCH_CHECK_VALUE(rows.dim() == 2 && rows.scalar_type() == at::kDouble && rows.is_cpu() &&
                        rows.size(1) >= kHead,
                    "rows_to_records: expected float64 CPU rows [R, >= ", kHead, "], got ",
                    rows.sizes(), " ", rows.scalar_type(), " on ", rows.device());
  const int64_t R = rows.size(0), W = rows.size(1), B = W - kHead;
  const int64_t rs = rows.stride(0), cs = rows.stride(1);
  const double* data = rows.const_data_ptr<double>();
  const double* clocks = nullptr;  // none: each row's own kFirstBad column
  int64_t bs = 0;
  if (bad.has_value()) {
    TORCH_CHECK_VALUE(bad->numel() == R && bad->scalar_type() == at::kDouble && bad->is_cpu() &&
                          (bad->dim() == 1 || (bad->dim() == 2 && bad->size(1) == 1)),
                      "rows_to_records: expected ", R, " float64 CPU first_bad clocks ([R] or "
                      "[R, 1]), got ", bad->sizes(), " ", bad->scalar_type(), " on ",
                      bad->device());
    clocks = bad->const_data_ptr<double>();
    bs = bad->stride(0);
  }
  TORCH_CHECK_VALUE(static_cast<int64_t>(metas.size()) == R &&
                        static_cast<int64_t>(stamps.size()) == R,
                    "rows_to_records: expected ", R, " metas and stamps, got ", metas.size(),
                    " and ", stamps.size());
  TORCH_CHECK_VALUE(static_cast<int>(keys.size()) == kRecordKeys, "rows_to_records: expected ",
                    kRecordKeys, " record keys, got ", keys.size());
  PyObject* const* key = &PySequence_Fast_ITEMS(keys.ptr())[0];
  const py::str k_step("step"), k_module("module"), k_site("site"), k_phase("phase");
  const py::str train("train");
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double edge0 = log2_edge(0), edgeN = log2_edge(kLog2Bins);

  py::list records, bads;
  for (int64_t r = 0; r < R; ++r) {
    const double* h = data + r * rs;  // column c at h[c * cs]
    const double numel = h[kNumel * cs], calls = h[kCalls * cs];
    if (!(numel >= 1.0) && !(calls >= 1.0)) {  // a row no call touched (Python: touched())
      for (int k : {kNumel, kNan, kInf, kZero, kCalls}) {  // int() of a NaN/Inf count raises there too
        if (!std::isfinite(h[k * cs])) steal(PyLong_FromDouble(h[k * cs]));
      }
      continue;
    }
    // Owned references: allocations below may run arbitrary Python code (a GC pass).
    const py::object meta_o = py::reinterpret_borrow<py::object>(PyList_GET_ITEM(metas.ptr(), r));
    PyObject* meta = meta_o.ptr();
    if (!PyDict_Check(meta)) {
      throw py::type_error("rows_to_records: every meta must be a dict");
    }
    // -- the numbers, as rows_to_values computes them
    const double n_nan = h[kNan * cs], n_inf = h[kInf * cs], zero = h[kZero * cs];
    const double mn = h[kMin * cs], mx = h[kMax * cs], mean = h[kMean * cs];
    const double lo = h[kHistLo * cs], hi = h[kHistHi * cs];
    const double m2 = h[kM2 * cs] < 0.0 ? 0.0 : h[kM2 * cs];  // clamp_min(0); a NaN stays NaN
    const double n = numel - n_nan - n_inf;
    double f[kFloats];
    if (n > 0) {
      const double nm = n * mean;
      const double sumsq = m2 + nm * mean;
      const double amn = std::fabs(mn), amx = std::fabs(mx);
      f[0] = mn;
      f[1] = mx;
      f[2] = mean;
      f[3] = std::sqrt(m2 / n);
      f[4] = (amx >= amn || amx != amx) ? amx : amn;  // torch.maximum: NaN wins
      f[5] = std::sqrt(sumsq);
      f[6] = std::sqrt(sumsq / n);
    } else {  // no finite value: NaN statistics, an L2 norm of 0
      f[0] = f[1] = f[2] = f[3] = f[4] = f[6] = nan;
      f[5] = 0.0;
    }
    f[7] = numel > 0 ? zero / numel : nan;
    // -- the record, keys in _RECORD_KEYS order
    py::object rec = steal(PyDict_New());
    PyObject* d = rec.ptr();
    PyObject* phase = PyDict_GetItemWithError(meta, k_phase.ptr());
    if (phase == nullptr && PyErr_Occurred()) throw py::error_already_set();
    const bool has_phase = phase != nullptr;
    const py::object meta_vals[kMetaKeys] = {
        item(meta, k_step.ptr()),
        py::reinterpret_borrow<py::object>(PyList_GET_ITEM(stamps.ptr(), r)),
        rank,
        item(meta, k_module.ptr()),
        item(meta, k_site.ptr()),
        has_phase ? py::reinterpret_borrow<py::object>(phase) : py::object(train),
        run_id};
    for (int k = 0; k < kMetaKeys; ++k) {
      if (PyDict_SetItem(d, key[k], meta_vals[k].ptr()) < 0) throw py::error_already_set();
    }
    const double counts[kCounts] = {numel, n_nan, n_inf, zero, calls};
    for (int k = 0; k < kCounts; ++k) set_new(d, key[kMetaKeys + k], PyLong_FromDouble(counts[k]));
    for (int k = 0; k < kFloats; ++k) set_new(d, key[kMetaKeys + kCounts + k], PyFloat_FromDouble(f[k]));
    PyObject* hist = PyList_New(B);
    if (hist == nullptr) throw py::error_already_set();
    for (int64_t b = 0; b < B; ++b) {  // torch's float64 -> int64 cast, then int
      PyObject* c = PyLong_FromLongLong(static_cast<long long>(h[(kHead + b) * cs]));
      if (c == nullptr) {
        Py_DECREF(hist);
        throw py::error_already_set();
      }
      PyList_SET_ITEM(hist, b, c);
    }
    set_new(d, key[kRecordKeys - 3], hist);
    py::object edges;
    if (B == 0) {
      edges = steal(PyList_New(0));
    } else if (B == kLog2Bins && (log2_kind || (unknown_kind && lo == edge0 && hi == edgeN))) {
      edges = log2_edges;
    } else {
      py::tuple ck = py::make_tuple(lo, hi, B);
      PyObject* hit = PyDict_GetItemWithError(edges_cache.ptr(), ck.ptr());
      if (hit != nullptr) {
        edges = py::reinterpret_borrow<py::object>(hit);
      } else {
        if (PyErr_Occurred()) throw py::error_already_set();
        PyObject* e = PyList_New(B + 1);
        if (e == nullptr) throw py::error_already_set();
        edges = steal(e);
        for (int64_t i = 0; i < B; ++i) {
          PyList_SET_ITEM(e, i, steal(PyFloat_FromDouble(lo + ((hi - lo) * static_cast<double>(i)) /
                                                        static_cast<double>(B))).release().ptr());
        }
        PyList_SET_ITEM(e, B, steal(PyFloat_FromDouble(hi)).release().ptr());
        if (PyDict_SetItem(edges_cache.ptr(), ck.ptr(), e) < 0) throw py::error_already_set();
      }
    }
    if (PyDict_SetItem(d, key[kRecordKeys - 2], edges.ptr()) < 0) throw py::error_already_set();
    if (PyDict_SetItem(d, key[kRecordKeys - 1], Py_False) < 0) throw py::error_already_set();
    // -- a producer's own meta keys are kept
    if (PyDict_GET_SIZE(meta) > 4 || !has_phase) {
      PyObject *mk, *mv;
      Py_ssize_t pos = 0;
      while (PyDict_Next(meta, &pos, &mk, &mv)) {
        const py::object k = py::reinterpret_borrow<py::object>(mk);  // a key's __eq__ may run
        const py::object v = py::reinterpret_borrow<py::object>(mv);
        const int has = PyDict_Contains(d, k.ptr());
        if (has < 0) throw py::error_already_set();
        if (!has && PyDict_SetItem(d, k.ptr(), v.ptr()) < 0) throw py::error_already_set();
      }
    }
    const double clock = clocks ? clocks[r * bs] : h[kFirstBad * cs];
    if (std::isfinite(clock)) bads.append(py::make_tuple(rec, clock));
    records.append(rec);
  }
  return py::make_tuple(records, bads);
}

}  // namespace hookplug
