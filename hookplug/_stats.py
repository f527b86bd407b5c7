"""``TensorStats``: the result of :func:`hookplug.ops.tensor_stats`, mergeable exactly."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

__all__ = ["TensorStats"]

_COUNTS = ("numel", "nan_count", "inf_count", "zero_count")
_MOMENTS = ("min", "max", "mean", "std", "absmax")
_HEAD = len(_COUNTS) + len(_MOMENTS)  # 9


@dataclasses.dataclass(repr=False, eq=False)
class TensorStats:
    """Statistics of one tensor (or of several, merged), as 0-d tensors on its device.

    - ``numel``, ``nan_count``, ``inf_count`` (+Inf and -Inf), ``zero_count`` (+0 and -0):
      int64 counts.
    - ``min``, ``max``, ``mean``, ``std``, ``absmax``: float64, over the *finite* values only;
      ``std`` is the population standard deviation (correction 0), so merging is exact.
      NaN when there is no finite value (empty or all NaN/Inf).
    - ``hist_counts`` (int64 ``[B]``) and ``hist_edges`` (float64 ``[B + 1]``, ascending):
      bucket ``i`` spans ``hist_edges[i]`` to ``hist_edges[i + 1]``. Both empty when the
      histogram is off (``bins=0``).

      ``log2`` (131 buckets): a nonzero finite ``x`` with ``2**e <= |x| < 2**(e+1)`` goes
      to the bucket of its sign and ``e`` clamped to ``[-32, 32]`` (smaller magnitudes,
      subnormals included, in the innermost bucket of their sign; larger ones and +-Inf in
      the outermost); zeros (+0 and -0) have their own middle bucket; NaN is not counted, so
      ``hist_counts.sum() == numel - nan_count``. Buckets ascend: 65 negative (``e`` = 32
      down to -32), zero, 65 positive; ``hist_edges`` are the nominal limits ``-2**33,
      -2**32, ..., -2**-32, 2**-32, ..., 2**33``. Exact and deterministic, mergeable by
      addition. ``linear``: ``bins`` equal buckets over the given range or the finite
      min/max (``floor((x - lo) * (bins / (hi - lo)))`` in float64, ``x == hi`` in the last
      bucket); values outside the range, +-Inf and NaN are not counted.
      TensorBoard: ``add_histogram_raw(..., bucket_limits=hist_edges[1:],
      bucket_counts=hist_counts)``.

    ``merge``/``merge_all`` combine stats exactly (counts add, extremes combine, mean/std by
    Chan's parallel formula, histograms add) on the device without a host sync; ``pack()``
    gives one float64 tensor (``unpack`` inverts it) to move many stats to the host in one
    copy; ``to_dict()`` gives host Python numbers.
    """

    numel: torch.Tensor
    nan_count: torch.Tensor
    inf_count: torch.Tensor
    zero_count: torch.Tensor
    min: torch.Tensor
    max: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    absmax: torch.Tensor
    hist_counts: torch.Tensor
    hist_edges: torch.Tensor

    # Histogram kind, an attribute beside the fields (not a dataclass field): "log2", "none",
    # ("linear", lo, hi) for a given range, "linear" for an automatic one, or None (unknown,
    # e.g. after dataclasses.replace). It lets merge() skip comparing edges (a host sync);
    # correctness never depends on it.
    _hist_kind = None

    # -- construction --------------------------------------------------------------------------

    @classmethod
    def _from_outputs(cls, counts: torch.Tensor, moments: torch.Tensor, hist_counts: torch.Tensor,
                      hist_edges: torch.Tensor, hist_kind: Any = None) -> "TensorStats":
        """From the op's four outputs (views, no copy)."""
        st = cls(*counts.unbind(0), *moments.unbind(0), hist_counts, hist_edges)
        st._hist_kind = hist_kind
        return st

    # -- merging -------------------------------------------------------------------------------

    def merge(self, other: "TensorStats") -> "TensorStats":
        """Stats of the union of the values both describe (exact; no host sync unless two
        linear histograms of unknown ranges must have their edges compared)."""
        if not isinstance(other, TensorStats):
            raise TypeError(f"TensorStats.merge: expected a TensorStats, "
                            f"got {type(other).__name__}")
        hc, he, kind = _merge_hist(self, other)
        f64 = torch.float64
        na = (self.numel - self.nan_count - self.inf_count).to(f64)
        nb = (other.numel - other.nan_count - other.inf_count).to(f64)
        n = na + nb
        a_has, b_has = na > 0, nb > 0
        ma = torch.where(a_has, self.mean, 0.0)
        mb = torch.where(b_has, other.mean, 0.0)
        m2a = torch.where(a_has, self.std * self.std * na, 0.0)
        m2b = torch.where(b_has, other.std * other.std * nb, 0.0)
        delta = mb - ma
        frac_b = nb / torch.where(n > 0, n, 1.0)
        mean = torch.where(a_has, torch.where(b_has, ma + delta * frac_b, ma), other.mean)
        m2 = m2a + m2b + delta * delta * na * frac_b
        std = torch.where(n > 0, torch.sqrt(torch.clamp(m2, min=0.0) / torch.where(n > 0, n, 1.0)),
                          math.nan)
        out = TensorStats(
            numel=self.numel + other.numel,
            nan_count=self.nan_count + other.nan_count,
            inf_count=self.inf_count + other.inf_count,
            zero_count=self.zero_count + other.zero_count,
            min=torch.fmin(self.min, other.min),
            max=torch.fmax(self.max, other.max),
            mean=mean,
            std=std,
            absmax=torch.fmax(self.absmax, other.absmax),
            hist_counts=hc,
            hist_edges=he,
        )
        out._hist_kind = kind
        return out

    __add__ = merge

    @classmethod
    def merge_all(cls, stats: Iterable["TensorStats"]) -> "TensorStats":
        """Merge any number (at least one) of stats at once: a fixed number of device ops
        whatever their count (mean and M2 by the exact two-level sums), no host sync."""
        items = list(stats)
        if not items:
            raise ValueError("TensorStats.merge_all: expected at least one TensorStats, got none")
        for st in items:
            if not isinstance(st, TensorStats):
                raise TypeError(f"TensorStats.merge_all: expected TensorStats, "
                                f"got {type(st).__name__}")
        if len(items) <= 2:
            return items[0] if len(items) == 1 else items[0].merge(items[1])
        kind = items[0]._hist_kind
        for st in items[1:]:
            _, _, kind = _merge_hist(items[0], st, kind_only=True)
        f64 = torch.float64

        def col(name):
            return torch.stack([getattr(st, name) for st in items])

        numel, nan, inf = col("numel"), col("nan_count"), col("inf_count")
        n = (numel - nan - inf).to(f64)
        has = n > 0
        total = n.sum()
        safe_total = torch.where(total > 0, total, 1.0)
        means = torch.where(has, col("mean"), 0.0)
        stds = torch.where(has, col("std"), 0.0)
        mean = (n * means).sum() / safe_total
        dev = torch.where(has, means - mean, 0.0)
        m2 = (n * stds * stds + n * dev * dev).sum()
        ok = total > 0
        hc = items[0].hist_counts
        if hc.numel():
            hc = torch.stack([st.hist_counts for st in items]).sum(0)
        out = TensorStats(
            numel=numel.sum(),
            nan_count=nan.sum(),
            inf_count=inf.sum(),
            zero_count=col("zero_count").sum(),
            min=torch.where(ok, torch.where(has, col("min"), math.inf).amin(), math.nan),
            max=torch.where(ok, torch.where(has, col("max"), -math.inf).amax(), math.nan),
            mean=torch.where(ok, mean, math.nan),
            std=torch.where(ok, torch.sqrt(m2 / safe_total), math.nan),
            absmax=torch.where(ok, torch.where(has, col("absmax"), -math.inf).amax(), math.nan),
            hist_counts=hc,
            hist_edges=items[0].hist_edges,
        )
        out._hist_kind = kind
        return out

    # -- host / transport ----------------------------------------------------------------------

    def pack(self) -> torch.Tensor:
        """One float64 1-D tensor on the device: ``[numel, nan_count, inf_count, zero_count,
        min, max, mean, std, absmax, hist_counts[B], hist_edges[B+1]]`` (length 9, or
        ``10 + 2*B`` with a histogram). Counts are exact below 2**53. Concatenate several
        packs to move them to the host in one copy; split by :meth:`packed_size`."""
        head = torch.stack([getattr(self, f).to(torch.float64) for f in _COUNTS + _MOMENTS])
        if self.hist_counts.numel() == 0:
            return head
        return torch.cat([head, self.hist_counts.to(torch.float64),
                          self.hist_edges.to(torch.float64)])

    @staticmethod
    def packed_size(hist_bins: int) -> int:
        """Length of :meth:`pack`'s tensor for ``hist_bins`` buckets."""
        return _HEAD + (2 * hist_bins + 1 if hist_bins else 0)

    @classmethod
    def unpack(cls, t: torch.Tensor) -> "TensorStats":
        """Inverse of :meth:`pack` (the bucket count follows from the length; no sync)."""
        n = t.numel() if t.dim() == 1 else -1
        if n < _HEAD or (n != _HEAD and (n - _HEAD) % 2 != 1):
            raise ValueError(f"TensorStats.unpack: expected a 1-D tensor of length 9 or 10 + 2*B, "
                             f"got shape {tuple(t.shape)}")
        t = t.to(torch.float64)
        b = (t.numel() - _HEAD - 1) // 2 if t.numel() > _HEAD else 0
        counts = t[:4].to(torch.int64)
        hc = t[_HEAD:_HEAD + b].to(torch.int64)
        he = t[_HEAD + b:] if b else t[:0]
        st = cls(counts[0], counts[1], counts[2], counts[3], t[4], t[5], t[6], t[7], t[8], hc, he)
        st._hist_kind = "none" if b == 0 else None
        return st

    def to(self, device, non_blocking: bool = False) -> "TensorStats":
        """The same stats with every tensor moved to ``device``."""
        out = dataclasses.replace(
            self, **{f.name: getattr(self, f.name).to(device, non_blocking=non_blocking)
                     for f in dataclasses.fields(self) if f.init})
        out._hist_kind = self._hist_kind
        return out

    def to_dict(self) -> Dict[str, Any]:
        """Host Python numbers and lists (one device-to-host copy)."""
        vals: List[float] = self.pack().tolist()
        b = self.hist_counts.numel()
        d: Dict[str, Any] = {f: int(v) for f, v in zip(_COUNTS, vals[:4])}
        d.update({f: float(v) for f, v in zip(_MOMENTS, vals[4:_HEAD])})
        d["hist_counts"] = [int(v) for v in vals[_HEAD:_HEAD + b]]
        d["hist_edges"] = vals[_HEAD + b:] if b else []
        return d

    def __repr__(self) -> str:
        try:
            d = self.to_dict()
        except Exception:  # pragma: no cover - e.g. meta/fake tensors
            return f"TensorStats(<{self.numel.device}>)"
        head = ", ".join(f"{k}={d[k]:.6g}" if isinstance(d[k], float) else f"{k}={d[k]}"
                         for k in _COUNTS + _MOMENTS)
        return f"TensorStats({head}, hist={len(d['hist_counts'])} buckets)"


def _merge_hist(a: TensorStats, b: TensorStats, kind_only: bool = False
                ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor], Any]:
    """The merged histogram of a and b (or only its kind), or a ValueError."""
    ka, kb = a._hist_kind, b._hist_kind
    na, nb = a.hist_counts.numel(), b.hist_counts.numel()
    if na != nb:
        raise ValueError(f"TensorStats.merge: cannot merge a histogram of {na} buckets with one of "
                         f"{nb} buckets (different bins= or hist= settings)")
    if na == 0:
        return (None, None, "none") if kind_only else (a.hist_counts, a.hist_edges, "none")
    if ka is not None and ka == kb and ka != "linear":
        same = True  # both log2, or both linear over the same given range
    elif {ka, kb} & {"log2"} and (ka is not None and kb is not None):
        same = False  # log2 against linear
    else:  # an automatic or unknown range: compare the edges (a host sync)
        same = bool(torch.equal(a.hist_edges, b.hist_edges.to(a.hist_edges.device)))
    if not same:
        raise ValueError(
            "TensorStats.merge: the histograms have different bucket edges (e.g. linear "
            "histograms with automatic ranges, or log2 against linear); pass the same "
            "range=(lo, hi) to hist='linear' or use hist='log2'")
    kind = ka if ka == kb else (ka if ka is not None else kb)
    if kind_only:
        return None, None, kind
    return a.hist_counts + b.hist_counts, a.hist_edges, kind
