"""Stats rows and ``TensorStats``: the one layout every part of hookplug reads.

A *row* is a float64 vector of ``HEAD + B`` numbers (``B`` histogram buckets), written by
the C++/CUDA kernels (``csrc/stats_defs.h`` defines the same columns; ``hookplug.ops``
checks both agree when the extension loads):

==========================  =====================================================
``numel, nan_count,``       counts (exact in float64 below 2**53)
``inf_count, zero_count``
``min, max``                finite min / max (+inf / -inf while there is none)
``mean, m2``                mean and sum of squared deviations of the finite values
``hist_lo, hist_hi``        the histogram's range (0, 0 when there is none)
``first_bad``               clock of the first call that saw a NaN/Inf (+inf: none)
``calls``                   how many calls were folded in (empty tensors count)
``HEAD + i``                histogram bucket ``i``
==========================  =====================================================

Rows merge exactly with :func:`merge_rows` (counts, calls and buckets add, extremes combine,
mean/M2 by the parallel formula) — the one merge used by ``TensorStats.merge``, the stats
plugin's step boundary and the distributed reduction. A bank (``empty_rows``) is a 2-D
tensor of rows; its row 0 is a meta row whose column ``CLOCK`` counts accumulate calls.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Tuple

import torch

__all__ = ["TensorStats", "StatsBlock", "merge_rows", "empty_rows", "touched", "ROW_LAYOUT", "HEAD"]

# -- the layout ------------------------------------------------------------------------
COUNT_COLUMNS = ("numel", "nan_count", "inf_count", "zero_count", "calls")
ROW_LAYOUT: Dict[str, int] = {
    "numel": 0, "nan_count": 1, "inf_count": 2, "zero_count": 3, "min": 4, "max": 5,
    "mean": 6, "m2": 7, "hist_lo": 8, "hist_hi": 9, "first_bad": 10, "calls": 11, "head": 12,
    "clock": 0, "max_bins": 1 << 16,
}
NUMEL, NAN, INF, ZERO = 0, 1, 2, 3
MIN, MAX, MEAN, M2 = 4, 5, 6, 7
HIST_LO, HIST_HI, FIRST_BAD, CALLS, HEAD = 8, 9, 10, 11, 12
CLOCK = 0

LOG2_MIN_EXP = -32
LOG2_MAX_EXP = 32
LOG2_BINS = 2 * (LOG2_MAX_EXP - LOG2_MIN_EXP + 1) + 1  # 131
MAX_BINS = ROW_LAYOUT["max_bins"]  # the most linear-histogram buckets a row may have


def linear_range_ok(lo: float, hi: float, bins: int) -> bool:
    """Whether ``(lo, hi)`` can be a linear histogram's range of ``bins`` buckets (as the
    C++ check, csrc/stats_checks.h): lo < hi, and neither the width nor ``bins / width``
    overflows (NaN, inf, a width past the largest double, or one so narrow that the bucket
    scale does)."""
    return lo < hi and math.isfinite(hi - lo) and math.isfinite(max(bins, 1) / (hi - lo))


def empty_rows(n: int, bins: int, lo: float = 0.0, hi: float = 0.0,
               device=None) -> torch.Tensor:
    """``n`` empty rows for ``bins`` buckets with histogram range ``(lo, hi)``, made where
    they live (fills: no copy from the host, which would wait for a CUDA stream)."""
    rows = torch.zeros(n, HEAD + bins, dtype=torch.float64, device=device)
    for col, value in ((MIN, math.inf), (MAX, -math.inf), (HIST_LO, lo), (HIST_HI, hi),
                       (FIRST_BAD, math.inf)):
        if value != 0.0 or math.copysign(1.0, value) < 0:  # (zeros already, but for -0.0)
            rows[:, col].fill_(value)
    return rows


def host_to_device(values, dtype: torch.dtype, device) -> torch.Tensor:
    """A tensor of the host ``values`` on ``device`` without a host sync: a CUDA copy goes
    through pinned memory, non-blocking (``torch.tensor(..., device="cuda")`` copies from
    pageable memory and waits for the stream)."""
    t = torch.tensor(values, dtype=dtype)
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def touched(rows: torch.Tensor) -> torch.Tensor:
    """Which rows of ``[..., HEAD + B]`` some call folded into (a bool tensor ``[...]``):
    ``calls > 0``, or ``numel > 0`` for rows a producer filled without counting calls."""
    return (rows[..., CALLS] > 0) | (rows[..., NUMEL] > 0)


def merge_rows(rows: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Merge the rows of ``rows`` along ``dim`` (e.g. ``[K, R, W] -> [R, W]``): exact
    counts and buckets, combined extremes and ``first_bad``, mean/M2 by the parallel
    formula about the merged mean. A fixed number of device ops, no host sync."""
    rows = rows.movedim(dim, 0)
    n_k = rows[..., NUMEL] - rows[..., NAN] - rows[..., INF]
    n = n_k.sum(0)
    safe_n = torch.where(n > 0, n, 1.0)
    mean_k = rows[..., MEAN]
    mean = ((n_k / safe_n) * mean_k).sum(0)  # weights first: n_k * mean_k can overflow
    dev = torch.where(n_k > 0, mean_k - mean, 0.0)
    m2 = (rows[..., M2] + n_k * dev * dev).sum(0)
    out = rows.sum(0)  # counts and buckets
    lo, hi = rows[..., MIN].amin(0), rows[..., MAX].amax(0)
    out[..., MIN], out[..., MAX] = lo, hi
    # the weighted mean may round an ulp past the extremes: constant data keeps mean = min
    # and M2 = 0 exactly (a std == 0 check for dead units), any other stays within them
    same = lo == hi
    out[..., MEAN] = torch.where(n > 0, torch.where(same, lo, torch.minimum(torch.maximum(mean, lo), hi)), 0.0)
    out[..., M2] = torch.where(same, 0.0, m2)
    out[..., HIST_LO] = rows[0, ..., HIST_LO]
    out[..., HIST_HI] = rows[0, ..., HIST_HI]
    out[..., FIRST_BAD] = rows[..., FIRST_BAD].amin(0)
    return out


_LOG2_EDGES = tuple([-math.ldexp(1.0, e) for e in range(LOG2_MAX_EXP + 1, LOG2_MIN_EXP - 1, -1)]
                    + [math.ldexp(1.0, e) for e in range(LOG2_MIN_EXP, LOG2_MAX_EXP + 2)])
_LOG2_EDGES_LIST = list(_LOG2_EDGES)  # shared by records (read-only by convention)


def log2_edges(device=None) -> torch.Tensor:
    """The 132 edges of the log2 histogram (float64): -2**33 .. -2**-32, 2**-32 .. 2**33
    (on a CUDA device without a host sync: see ``host_to_device``)."""
    return host_to_device(_LOG2_EDGES, torch.float64, "cpu" if device is None else device)


def _edges(lo: float, hi: float, hist: Any, b: int) -> List[float]:
    """The ``b + 1`` bucket edges of a row with histogram range ``(lo, hi)`` as host floats;
    log2 rows share one list."""
    if b == LOG2_BINS and (hist == "log2" or (hist is None and lo == _LOG2_EDGES[0]
                                              and hi == _LOG2_EDGES[-1])):
        return _LOG2_EDGES_LIST
    return [lo + ((hi - lo) * i) / b for i in range(b)] + [hi]


def is_log2_edges(edges: List[float]) -> bool:
    """Whether ``edges`` are the log2 histogram's (a record's ``hist_edges``)."""
    return len(edges) == LOG2_BINS + 1 and list(edges) == _LOG2_EDGES_LIST


def hist_outside(rec: Dict[str, Any]) -> Tuple[int, int]:
    """``(below, above)``: the finite values of a record a linear histogram left out (outside
    the given range), by side. The record's ``min``/``max`` tell the side; a record with
    values on both sides counts them all ``above`` (the split is not measured). ``(0, 0)``
    for log2 (it counts every value but NaN)."""
    counts = rec.get("hist") or ()
    out = int(rec["numel"] - rec["nan_count"] - rec["inf_count"] - sum(counts))
    if out <= 0:
        return 0, 0
    edges = rec["hist_edges"]
    below = rec["min"] < edges[0] and not rec["max"] > edges[-1]
    return (out, 0) if below else (0, out)


def hist_upper_bounds(edges: List[float]) -> List[float]:
    """The inclusive upper bound of each bucket (Prometheus' ``le``): a bucket holds
    ``edges[i] <= x < edges[i + 1]``, so its bound is the float just below its right edge,
    except where the bucket includes that edge: a linear histogram's last (``x == hi``),
    and log2's negative buckets, ``-2**(e+1) < x <= -2**e``; log2's innermost negative
    bucket holds every negative down to the smallest, its zero bucket only zeros. (A linear
    histogram's kernel computes the bucket index, ``floor((x - lo) * bins / (hi - lo))``,
    which may round a value within a few ulp of an edge into the neighbouring bucket.)"""
    b = len(edges) - 1
    if not is_log2_edges(edges):
        return [math.nextafter(edges[i + 1], -math.inf) for i in range(b - 1)] + [edges[-1]]
    zero = b // 2
    out = [edges[i + 1] for i in range(zero - 1)] + [-math.ulp(0.0), 0.0]
    return out + [math.nextafter(edges[i + 1], -math.inf) for i in range(zero + 1, b)]


class TensorStats:
    """Statistics of one tensor (or of several, merged): a view of one stats row on the
    tensor's device. Every field is a 0-d device tensor computed on access (no host sync).

    - ``numel``, ``nan_count``, ``inf_count`` (+Inf and -Inf), ``zero_count`` (+0 and -0):
      int64 counts. ``calls``: how many tensors were folded in (1 for ``tensor_stats``; a
      bank row counts its calls, empty tensors included, so ``calls > 0`` with
      ``numel == 0`` means the site ran but saw only empty tensors).
    - ``min``, ``max``, ``mean``, ``std``, ``absmax``, ``l2`` (L2 norm), ``rms``: float64,
      over the *finite* values only; ``std`` is the population standard deviation
      (correction 0), so merging is exact. NaN when there is no finite value.
      ``zero_fraction`` = ``zero_count / numel``.
    - ``hist_counts`` (int64 ``[B]``) and ``hist_edges`` (float64 ``[B + 1]``, ascending):
      bucket ``i`` spans ``hist_edges[i]`` to ``hist_edges[i + 1]``; both empty with
      ``bins=0``. ``log2`` (131 buckets): a nonzero finite ``x`` with
      ``2**e <= |x| < 2**(e+1)`` goes to the bucket of its sign and ``e`` clamped to
      ``[-32, 32]`` (subnormals in the innermost bucket of their sign; larger magnitudes and
      +-Inf in the outermost); zeros have the middle bucket; NaN is not counted, so
      ``hist_counts.sum() == numel - nan_count``. ``linear``: ``bins`` equal buckets over
      the given range or the finite min/max (``floor((x - lo) * (bins / (hi - lo)))``,
      ``x == hi`` in the last bucket); values outside, +-Inf and NaN are not counted.
      TensorBoard: ``add_histogram_raw(..., bucket_limits=hist_edges[1:],
      bucket_counts=hist_counts)``.

    ``merge``/``merge_all`` combine stats exactly on the device; ``row`` is the packed
    float64 row (``pack()``; ``TensorStats(row)`` inverts it); ``to_dict()`` gives host
    numbers (one device-to-host copy).
    """

    __slots__ = ("row", "hist")

    def __init__(self, row: torch.Tensor, hist: Any = None):
        if not isinstance(row, torch.Tensor) or row.dim() != 1 or row.numel() < HEAD:
            raise ValueError(f"TensorStats: expected a 1-D float64 stats row of length >= {HEAD}, "
                             f"got {tuple(row.shape) if isinstance(row, torch.Tensor) else row!r}")
        self.row = row if row.dtype == torch.float64 else row.to(torch.float64)
        # the histogram kind when known on the host: "none", "log2", ("linear", lo, hi) for a
        # given range, "linear" for an automatic one, None (unknown). It lets merge() skip
        # comparing ranges (a host sync); correctness never depends on it.
        self.hist = hist if hist is not None else ("none" if row.numel() == HEAD else None)

    # -- fields ------------------------------------------------------------------------
    def _count(self, col: int) -> torch.Tensor:
        return self.row[col].to(torch.int64)

    numel = property(lambda self: self._count(NUMEL))
    nan_count = property(lambda self: self._count(NAN))
    inf_count = property(lambda self: self._count(INF))
    zero_count = property(lambda self: self._count(ZERO))
    calls = property(lambda self: self._count(CALLS))

    @property
    def _n(self) -> torch.Tensor:
        r = self.row
        return r[NUMEL] - r[NAN] - r[INF]

    def _finite(self, value: torch.Tensor) -> torch.Tensor:
        return torch.where(self._n > 0, value, math.nan)

    min = property(lambda self: self._finite(self.row[MIN]))
    max = property(lambda self: self._finite(self.row[MAX]))
    mean = property(lambda self: self._finite(self.row[MEAN]))

    @property
    def std(self) -> torch.Tensor:
        n = self._n
        return self._finite(torch.sqrt(self.row[M2].clamp_min(0) / torch.where(n > 0, n, 1.0)))

    @property
    def absmax(self) -> torch.Tensor:
        return self._finite(torch.maximum(self.row[MIN].abs(), self.row[MAX].abs()))

    @property
    def _sumsq(self) -> torch.Tensor:
        r = self.row
        return r[M2].clamp_min(0) + self._n * r[MEAN] * r[MEAN]

    @property
    def l2(self) -> torch.Tensor:
        """L2 norm of the finite values (0 for an empty tensor, as torch.linalg.norm)."""
        return torch.sqrt(self._sumsq)

    @property
    def rms(self) -> torch.Tensor:
        n = self._n
        return self._finite(torch.sqrt(self._sumsq / torch.where(n > 0, n, 1.0)))

    @property
    def zero_fraction(self) -> torch.Tensor:
        numel = self.row[NUMEL]
        return torch.where(numel > 0, self.row[ZERO] / torch.where(numel > 0, numel, 1.0), math.nan)

    @property
    def first_bad(self) -> torch.Tensor:
        """The bank clock of the first call that saw NaN/Inf (+inf: none)."""
        return self.row[FIRST_BAD]

    @property
    def hist_counts(self) -> torch.Tensor:
        return self.row[HEAD:].to(torch.int64)

    @property
    def hist_edges(self) -> torch.Tensor:
        b = self.row.numel() - HEAD
        if b == 0:
            return self.row[:0]
        lo, hi = self.row[HIST_LO], self.row[HIST_HI]
        i = torch.arange(b + 1, dtype=torch.float64, device=self.row.device)
        linear = lo + ((hi - lo) * i) / b
        linear[b] = hi
        if b != LOG2_BINS or self.hist == "linear" or isinstance(self.hist, tuple):
            return linear
        is_log2 = (lo == -math.ldexp(1.0, LOG2_MAX_EXP + 1)) & (hi == math.ldexp(1.0, LOG2_MAX_EXP + 1))
        if self.hist == "log2":
            return log2_edges(self.row.device)
        return torch.where(is_log2, log2_edges(self.row.device), linear)

    FIELDS = COUNT_COLUMNS + ("min", "max", "mean", "std", "absmax")

    # -- merging -----------------------------------------------------------------------
    def merge(self, other: "TensorStats") -> "TensorStats":
        """Stats of the union of the values both describe (exact; no host sync unless two
        linear histograms of unknown ranges must have their ranges compared)."""
        return TensorStats.merge_all([self, other])

    __add__ = merge

    @classmethod
    def merge_all(cls, stats: Iterable["TensorStats"]) -> "TensorStats":
        """Merge any number (at least one) of stats at once: a fixed number of device ops."""
        items = list(stats)
        if not items:
            raise ValueError("TensorStats.merge_all: expected at least one TensorStats, got none")
        for st in items:
            if not isinstance(st, TensorStats):
                raise TypeError(f"TensorStats.merge: expected TensorStats, got {type(st).__name__}")
        if len(items) == 1:
            return items[0]
        kind = items[0].hist
        for st in items[1:]:
            kind = _merged_kind(items[0], st, kind)
        dev = items[0].row.device
        return cls(merge_rows(torch.stack([st.row.to(dev) for st in items])), kind)

    # -- host / transport ----------------------------------------------------------------
    def pack(self) -> torch.Tensor:
        """The stats row (float64, ``HEAD + B`` long); ``TensorStats(row)`` inverts it."""
        return self.row

    @staticmethod
    def packed_size(hist_bins: int) -> int:
        return HEAD + hist_bins

    @classmethod
    def unpack(cls, t: torch.Tensor) -> "TensorStats":
        return cls(t)

    def to(self, device, non_blocking: bool = False) -> "TensorStats":
        return TensorStats(self.row.to(device, non_blocking=non_blocking), self.hist)

    def to_dict(self) -> Dict[str, Any]:
        """Host Python numbers and lists (one device-to-host copy)."""
        return row_to_dict(self.row.detach().cpu(), self.hist)

    def __repr__(self) -> str:
        try:
            d = self.to_dict()
        except Exception:  # pragma: no cover - meta/fake tensors
            return f"TensorStats(<{self.row.device}>)"
        head = ", ".join(f"{k}={d[k]:.6g}" if isinstance(d[k], float) else f"{k}={d[k]}"
                         for k in self.FIELDS)
        return f"TensorStats({head}, hist={len(d['hist_counts'])} buckets)"

    def __reduce__(self):
        # a row of a larger tensor (results() rows are views of the merged bank) is saved
        # alone: torch.save writes a view's whole storage
        row = self.row
        if row.untyped_storage().nbytes() != row.numel() * row.element_size():
            row = row.clone()
        return (_rebuild_tensor_stats, (row, self.hist))


def _rebuild_tensor_stats(row: Any, hist: Any) -> TensorStats:
    """A pickled TensorStats (``__reduce__``), checked as the constructor checks a row; the
    histogram kind is one the op makes, else None (unknown: merge compares the ranges)."""
    ok = (hist is None or hist in ("none", "log2", "linear")
          or (type(hist) is tuple and len(hist) == 3 and hist[0] == "linear"
              and all(type(v) in (int, float) for v in hist[1:])))
    return TensorStats(row, hist if ok else None)


# ``torch.save`` of results (a checkpoint dict with ``session.results()`` in it) loads with
# ``torch.load``'s default ``weights_only=True``: the loader may call this rebuild, which
# takes a float64 row tensor and a histogram kind, and nothing else of hookplug.
torch.serialization.add_safe_globals([_rebuild_tensor_stats])


class StatsBlock(NamedTuple):
    """What a telemetry producer may return from ``hookplug_collect`` instead of one
    ``(meta, TensorStats)`` pair per record: ``metas[i]`` (``{"step", "module", "site",
    ...}``) describes ``rows[i]`` of a ``[R, HEAD + B]`` float64 device tensor. Rows no call
    touched (``calls`` and ``numel`` 0) produce no record. ``dropped_through``: the producer
    dropped its steps up to this one (a bound on what it keeps between flushes); under
    torch.distributed every rank then leaves those steps out, so no merged record holds
    only some ranks' data."""

    metas: List[Dict[str, Any]]
    rows: torch.Tensor
    hist: Any = None
    dropped_through: Optional[int] = None


_FLOAT_FIELDS = ("min", "max", "mean", "std", "absmax", "l2", "rms", "zero_fraction")
STAT_FIELDS = COUNT_COLUMNS + _FLOAT_FIELDS  # every record's statistics, rows_to_values' order


def rows_to_values(rows: torch.Tensor, hist: Any = None) -> List[Tuple[list, list, list]]:
    """Host rows ``[R, HEAD + B]`` as ``(values, hist_counts, hist_edges)`` per row, with
    ``values`` in ``STAT_FIELDS`` order (ints, then floats): the same numbers as the
    :class:`TensorStats` fields, computed on Python floats (float64, the same operations in
    the same order) after two conversions to Python lists, the row heads and the buckets
    (a flush runs cold, after a training step: every torch op costs there)."""
    if rows.shape[0] == 0:
        return []
    r = rows.to(torch.float64)
    heads = r[:, :HEAD].tolist()
    buckets = r[:, HEAD:].to(torch.int64).tolist()
    b = rows.shape[1] - HEAD
    nan, sqrt = math.nan, math.sqrt
    out = []
    for head, counts in zip(heads, buckets):
        numel, n_nan, n_inf, zero, mn, mx, mean, m2, lo, hi = head[:HIST_HI + 1]
        calls = head[CALLS]
        n = numel - n_nan - n_inf
        m2 = 0.0 if m2 < 0.0 else m2  # clamp_min(0); a NaN stays NaN
        if n > 0:
            sumsq = m2 + n * mean * mean
            amn, amx = abs(mn), abs(mx)
            absmax = amx if amx >= amn or amx != amx else amn  # torch.maximum: NaN wins
            floats = [mn, mx, mean, sqrt(m2 / n), absmax, sqrt(sumsq),
                      sqrt(sumsq / n)]
        else:  # no finite value: NaN statistics, an L2 norm of 0
            floats = [nan, nan, nan, nan, nan, 0.0, nan]
        floats.append(zero / numel if numel > 0 else nan)
        out.append(([int(numel), int(n_nan), int(n_inf), int(zero), int(calls), *floats], counts,
                     _edges(lo, hi, hist, b) if b > 0 else []))
    return out


def rows_to_dicts(rows: torch.Tensor, hist: Any = None) -> List[Dict[str, Any]]:
    """Host rows ``[R, HEAD + B]`` as ``{field: number}`` dicts plus ``hist_counts`` and
    ``hist_edges`` lists (see :func:`rows_to_values`)."""
    out = []
    for values, buckets, edges in rows_to_values(rows, hist):
        d = dict(zip(STAT_FIELDS, values))
        d["hist_counts"] = buckets
        d["hist_edges"] = edges
        out.append(d)
    return out


def row_to_dict(row: torch.Tensor, hist: Any = None) -> Dict[str, Any]:
    """One host row as :func:`rows_to_dicts` gives it."""
    return rows_to_dicts(row.reshape(1, -1), hist)[0]


def _merged_kind(a: TensorStats, b: TensorStats, kind: Any) -> Any:
    """The histogram kind of a merge of a and b, or a ValueError when they differ."""
    na, nb = a.row.numel(), b.row.numel()
    if na != nb:
        raise ValueError(f"TensorStats.merge: cannot merge a histogram of {na - HEAD} buckets with "
                         f"one of {nb - HEAD} buckets (different bins= or hist= settings)")
    if na == HEAD:
        return "none"
    ka, kb = a.hist, b.hist
    if ka is not None and ka == kb and ka != "linear":
        same = True  # both log2, or both linear over the same given range
    elif ka is not None and kb is not None and "log2" in (ka, kb):
        same = False
    else:  # an automatic or unknown range: compare the ranges (a host sync)
        same = bool(torch.equal(a.row[HIST_LO:HIST_HI + 1], b.row[HIST_LO:HIST_HI + 1].to(a.row.device)))
    if not same:
        raise ValueError(
            "TensorStats.merge: the histograms have different bucket edges (e.g. linear "
            "histograms with automatic ranges, or log2 against linear); pass the same "
            "range=(lo, hi) to hist='linear' or use hist='log2'")
    return kind if kind == kb else (kind if kind is not None else kb)


def _stack_rows(items: List[TensorStats], device: Optional[torch.device] = None) -> torch.Tensor:
    dev = device if device is not None else items[0].row.device
    return torch.stack([st.row.to(dev) for st in items])
