"""``stats``: fused tensor statistics of module inputs, outputs and output gradients.

    opts = {"sites": ("output", "grad")}
    with hookplug.attach(model, "Conv2d|Linear", plugins=("stats", opts)) as s:
        model(x).sum().backward()
    st = s["stats"].results()["layer1.0.conv1"]["output"]     # a hookplug.TensorStats
    st.max, st.std, st.hist_counts                             # device tensors

Options (keyword-only):

- ``sites=("output",)``: any of ``"input"`` (the positional and keyword arguments, before
  ``forward``), ``"output"``, ``"grad"`` (the gradient of each output tensor, seen in
  backward). A single string is accepted.
- ``bins``: passed to :func:`hookplug.ops.tensor_stats`: ``0`` turns the histogram off;
  for ``hist="linear"`` the number of buckets (``None``: the op's default, 100). The log2
  histogram always has its fixed sign/exponent buckets.
- ``hist="log2"|"linear"`` and ``range=(lo, hi)``: the histogram kind and, for ``"linear"``,
  its fixed range. A linear histogram is merged over calls, so it needs a fixed ``range``.
- ``max_pending_steps=1024``: how many steps of per-step stats wait for telemetry
  (``hookplug_collect``) when the session has a sink that is never flushed; older steps are
  folded into ``results()`` only, with one warning. With no telemetry consumer (no sink, and
  ``session.flush()`` never called) nothing piles up: at each ``session.step()`` the steps
  before the one that just ended are folded into the totals on the device (no sync, no
  warning), so ``session.flush()`` right after ``step()`` still returns that step's records.

Every floating tensor of the structure is measured and keyed by its path: ``"output"``,
``"output[1]"``, ``"output.logits"``; ``"input[0]"``, ``"input.mask"`` (keyword argument
``mask``); ``"grad"``, ``"grad[1]"`` (the gradient of ``output``, ``output[1]``). Integer,
bool and complex tensors are skipped.

``results()`` is ``{module: {path: TensorStats}}`` merged exactly over every call and step
(the merge runs lazily, at ``results()`` time, on the device). The hooks never synchronize
with the device: each call appends the op's device-side result; at ``session.step()`` (and
every 16 calls of one module within a step) those are merged on the device into one
``TensorStats`` per ``(step, module, path)``, which ``hookplug_collect`` hands to telemetry.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

import hookplug
from hookplug import hookimpl
from hookplug.structures import iter_tensors

__all__ = ["StatsPlugin"]

_SITES = ("input", "output", "grad")
_HISTS = ("log2", "linear")
_STRIDED = torch.strided
_COMPACT_AT = 16  # per-call stats of one (step, module, path) merged on device at this length


def _merge_all(items: Sequence[Any]):
    if len(items) == 1:
        return items[0]
    return type(items[0]).merge_all(items)


class StatsPlugin(hookplug.Plugin):
    """Per module and site, a :class:`hookplug.TensorStats` of every floating tensor, merged
    over calls and steps. See the module docstring for the options."""

    name = "stats"

    def __init__(
        self,
        *,
        sites: Sequence[str] = ("output",),
        bins: Optional[int] = None,
        hist: str = "log2",
        range: Optional[Tuple[float, float]] = None,  # noqa: A002 - the op's own name
        max_pending_steps: int = 1024,
    ):
        if isinstance(sites, str):
            sites = (sites,)
        try:
            sites = tuple(sites)
        except TypeError:
            raise ValueError(
                f"stats: sites must be a string or a sequence of {_SITES}, got {sites!r}"
            ) from None
        bad = [s for s in sites if s not in _SITES]
        if bad or not sites:
            raise ValueError(f"stats: sites must be a non-empty subset of {_SITES}, got {sites!r}")
        if bins is not None and (not isinstance(bins, int) or isinstance(bins, bool) or bins < 0):
            raise ValueError(f"stats: bins must be None or an int >= 0, got {bins!r}")
        if hist not in _HISTS:
            raise ValueError(f"stats: hist must be one of {_HISTS}, got {hist!r}")
        if range is not None:
            try:
                lo, hi = (float(v) for v in range)
            except (TypeError, ValueError):
                raise ValueError(f"stats: range must be None or (lo, hi), got {range!r}") from None
            if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
                raise ValueError(f"stats: range must be finite with lo < hi, got {range!r}")
            range = (lo, hi)
        if hist == "linear" and range is None and bins != 0:
            raise ValueError(
                "stats: hist='linear' needs range=(lo, hi): per-call linear histograms are merged "
                "over calls and steps, which needs the same bucket edges every time "
                "(or use hist='log2', which needs no range)"
            )
        if (
            not isinstance(max_pending_steps, int)
            or isinstance(max_pending_steps, bool)
            or max_pending_steps < 1
        ):
            raise ValueError(
                f"stats: max_pending_steps must be an int >= 1, got {max_pending_steps!r}"
            )
        self.sites = sites
        self.bins = bins
        self.hist = hist
        self.range = range
        self.max_pending_steps = max_pending_steps
        kw: Dict[str, Any] = {"hist": hist}
        if bins is not None:
            kw["bins"] = bins
        if range is not None:
            kw["range"] = range
        self._op_kwargs = kw
        self._op = None
        # Switch off the hooks of sites not asked for, so the core registers no torch hook
        # for them (pluggy ignores an instance attribute that is not a function).
        if "input" not in sites:
            self.hookplug_forward_input = None
        if "output" not in sites:  # "grad" alone: the core still hooks outputs for their grads
            self.hookplug_forward_output = None
        if "grad" not in sites:
            self.hookplug_output_grad = None
        self._module_order: Dict[str, int] = {}
        self.reset()

    # -- state ---------------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget every stat gathered so far (pending telemetry included)."""
        # step -> {(module, path): [per-call TensorStats]} not yet collected by telemetry
        self._pending: Dict[int, Dict[Tuple[str, str], List[Any]]] = {}
        # (module, path) -> stats already collected (or folded), merged on device now and then
        self._done: Dict[Tuple[str, str], List[Any]] = {}
        self._seen: Dict[Tuple[str, str], int] = {}  # first-seen order of (module, path)
        self._folded_steps = 0
        self._warned_fold = False
        self._collected = False  # hookplug_collect was called: someone consumes per-step stats
        self._warned_layout = False

    def _stats_op(self):
        op = self._op
        if op is None:
            from hookplug import ops

            op = self._op = ops.tensor_stats
        return op

    def _record(self, ctx, path: str, t) -> None:
        if not t.is_floating_point():
            return
        if t.is_nested or t.layout is not _STRIDED:
            t = self._strided(ctx, path, t)
            if t is None:
                return
        st = (self._op or self._stats_op())(t.detach(), **self._op_kwargs)
        bucket = self._pending.get(ctx.step)
        if bucket is None:
            bucket = self._pending[ctx.step] = {}
        key = (ctx.name, path)
        lst = bucket.get(key)
        if lst is None:
            bucket[key] = [st]
            if key not in self._seen:
                self._seen[key] = len(self._seen)
        else:
            lst.append(st)
            if len(lst) >= _COMPACT_AT:
                bucket[key] = [_merge_all(lst)]

    def _strided(self, ctx, path: str, t):
        """What the op measures of a tensor that is not a plain strided one: a nested
        tensor's elements (no padding), or None (skipped, one warning) for other layouts."""
        if t.is_nested:
            t = t.detach()
            try:
                if t.is_contiguous():
                    return t.values().reshape(-1)
                return torch.cat([u.reshape(-1) for u in t.unbind()])
            except (RuntimeError, NotImplementedError, TypeError) as exc:
                why = f"a nested tensor whose elements cannot be read ({type(exc).__name__}: {exc})"
        else:
            why = f"layout {t.layout}"
        if not self._warned_layout:
            self._warned_layout = True
            warnings.warn(
                f"hookplug plugin 'stats': {path} of {ctx.name or '<root>'!r} has {why}; "
                "the stats op reads strided tensors only, such tensors are skipped",
                RuntimeWarning,
                stacklevel=2,
            )
        return None

    # -- hooks (hot path) ------------------------------------------------------------------------

    @hookimpl
    def hookplug_forward_input(self, ctx, args, kwargs):
        for path, t in iter_tensors(args, "input"):
            self._record(ctx, path, t)
        if kwargs:
            for path, t in iter_tensors(kwargs, "input"):
                self._record(ctx, path, t)

    @hookimpl
    def hookplug_forward_output(self, ctx, output):
        # output is None when forward raised: iter_tensors yields nothing
        for path, t in iter_tensors(output):
            self._record(ctx, path, t)

    @hookimpl
    def hookplug_output_grad(self, ctx, grad, path):
        self._record(ctx, "grad" + path[6:] if path.startswith("output") else f"grad.{path}", grad)

    # -- session and telemetry -------------------------------------------------------------------

    @hookimpl
    def hookplug_session_start(self, session):
        self._module_order = {n: i for i, n in enumerate(session.modules_of(self))}

    @hookimpl
    def hookplug_step(self, session, step):
        """Merge the ended step's per-call stats on the device (no sync) and bound what waits."""
        bucket = self._pending.get(step)
        if bucket:
            for key, lst in bucket.items():
                if len(lst) > 1:
                    bucket[key] = [_merge_all(lst)]
        if not self._collected and not _has_consumer(session):
            # nobody reads per-step stats: keep only the step that just ended (for a
            # session.flush() right after step()), fold the older ones into the totals
            old = [s for s in self._pending if s < step]
            if old:
                self._fold(old)
        elif len(self._pending) > self.max_pending_steps:
            self._fold_oldest()

    def _fold(self, steps) -> None:
        """Move the pending ``steps`` into the totals (device ops only, no sync)."""
        done = self._done
        for step in steps:
            for key, lst in self._pending.pop(step).items():
                st = _merge_all(lst)
                acc = done.get(key)
                if acc is None:
                    done[key] = [st]
                else:
                    acc.append(st)
                    if len(acc) >= 4 * _COMPACT_AT:  # merge_all: a fixed number of device ops
                        done[key] = [_merge_all(acc)]
        self._folded_steps += len(steps)

    def _fold_oldest(self) -> None:
        """A sink exists but no telemetry was collected for too long: move the oldest half of
        the pending steps into the totals (kept for ``results()``, no longer emitted)."""
        steps = sorted(self._pending)
        self._fold(steps[: max(len(steps) - self.max_pending_steps, len(steps) // 2)])
        if not self._warned_fold:
            self._warned_fold = True
            warnings.warn(
                f"hookplug plugin 'stats': more than {self.max_pending_steps} steps of stats were "
                "not collected by telemetry (no session.flush()); older steps are kept in "
                "results() only. Set flush_every= or call session.flush().",
                RuntimeWarning,
                stacklevel=3,
            )

    @hookimpl
    def hookplug_collect(self, session, step):
        """Per ``(step, module, path)`` stats gathered since the last collection, each merged
        on the device: ``[({"step", "module", "site"}, TensorStats), ...]``."""
        self._collected = True
        pending, self._pending = self._pending, {}
        out = []
        done = self._done
        for st_step in sorted(pending):
            for (mod, site), lst in pending[st_step].items():
                st = _merge_all(lst)
                out.append(({"step": st_step, "module": mod, "site": site}, st))
                acc = done.get((mod, site))
                if acc is None:
                    done[(mod, site)] = [st]
                else:
                    acc.append(st)
                    if len(acc) >= 4 * _COMPACT_AT:  # merge_all: a fixed number of device ops
                        done[(mod, site)] = [_merge_all(acc)]
        return out or None

    # -- results ----------------------------------------------------------------------------------

    def _merged(self) -> Dict[Tuple[str, str], Any]:
        groups: Dict[Tuple[str, str], List[Any]] = {k: list(v) for k, v in self._done.items()}
        for bucket in self._pending.values():
            for key, lst in bucket.items():
                groups.setdefault(key, []).extend(lst)
        order = self._module_order
        big = len(order)
        seen = self._seen
        keys = sorted(
            groups, key=lambda k: (order.get(k[0], big), _site_rank(k[1]), seen.get(k, 0))
        )
        return {k: _merge_all(groups[k]) for k in keys}

    def results(self) -> Dict[str, Dict[str, Any]]:
        """``{module: {path: TensorStats}}`` merged over every call and step (device tensors)."""
        out: Dict[str, Dict[str, Any]] = {}
        for (mod, site), st in self._merged().items():
            out.setdefault(mod, {})[site] = st
        return out

    def report(self) -> str:
        merged = self._merged()
        if not merged:
            return ""
        rows = list(merged.items())
        cols = ("numel", "nan_count", "inf_count", "min", "max", "mean", "std")
        vals = torch.stack(
            [
                torch.stack(
                    [
                        getattr(st, c).detach().to(device="cpu", dtype=torch.float64).reshape(())
                        for c in cols
                    ]
                )
                for _, st in rows
            ]
        ).tolist()  # one host transfer per stat; report() is not on the hot path
        header = ("module", "site", "numel", "nan", "inf", "min", "max", "mean", "std")
        table = [header]
        for ((mod, site), _), v in zip(rows, vals):
            table.append(
                (
                    mod or "<root>",
                    site,
                    f"{int(v[0])}",
                    f"{int(v[1])}",
                    f"{int(v[2])}",
                    *(_fmt(x) for x in v[3:]),
                )
            )
        widths = [max(len(r[i]) for r in table) for i in range(len(header))]
        lines = []
        for j, r in enumerate(table):
            lines.append(
                "  ".join(
                    c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))
                ).rstrip()
            )
            if j == 0:
                lines.append("  ".join("-" * w for w in widths))
        return "\n".join(lines)


def _has_consumer(session) -> bool:
    """Whether the session's telemetry has a sink (``hookplug_flush``) to hand records to."""
    tel = getattr(session, "_telemetry", None)
    if tel is None:  # not a hookplug.Session: assume someone collects
        return True
    return bool(tel.has_consumers(session))


def _site_rank(site: str) -> int:
    for i, s in enumerate(_SITES):
        if site.startswith(s):
            return i
    return len(_SITES)


def _fmt(x: float) -> str:
    if math.isnan(x):
        return "nan"
    return f"{x:.4g}"
