"""``hookplug.plot_features``: a PNG grid of the channels of a feature map (matplotlib).

matplotlib is an optional extra (``pip install 'hookplug[plot]'``); it is imported only when
``plot_features`` runs, and never through pyplot (no GUI backend, no global state).
"""
from __future__ import annotations

import math
import os
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from .._optional import optional_import
from .._options import is_int_at_least, materialise, type_ok
from ..structures import iter_tensors

__all__ = ["plot_features"]

PathLike = Union[str, "os.PathLike[str]"]


def _matplotlib():
    figure, agg = optional_import("matplotlib.figure", "matplotlib.backends.backend_agg",
                                  feature="hookplug.plot_features", extra="plot", package="matplotlib")
    return figure.Figure, agg.FigureCanvasAgg


def _features_of(source: Any) -> Optional[Dict[str, Any]]:
    """``{module: value}`` from a capture plugin, a session holding one, or a dict; None for a
    tensor. From a plugin with ``keep="last"``, a list value is one call's list output: it is
    wrapped as a list of that one call."""
    if isinstance(source, torch.Tensor):
        return None
    if isinstance(source, dict):
        return source
    plugin = source if isinstance(getattr(source, "features", None), dict) else None
    if plugin is None:
        try:  # a Session with a capture plugin
            plugin = source["capture"]
        except (KeyError, TypeError, IndexError):
            plugin = None
    if plugin is not None and isinstance(getattr(plugin, "features", None), dict):
        if getattr(plugin, "keep", None) == "last":
            return {n: [v] if isinstance(v, list) else v for n, v in plugin.features.items()}
        return plugin.features
    raise TypeError(
        "plot_features expects a tensor, a capture plugin (session['capture']), a session with a "
        f"capture plugin, or a dict {{module: tensor}}; got {type(source).__name__}"
    )


def _tensor_of(value: Any, what: str) -> torch.Tensor:
    """The tensor inside a captured value: the last call of a list, the first tensor of a structure."""
    if isinstance(value, list) and value and not isinstance(value[0], torch.Tensor):
        value = value[-1]
    elif isinstance(value, list) and value:
        value = value[-1]
    for _, t in iter_tensors(value):
        return t
    raise ValueError(f"plot_features: {what} holds no tensor")


def _channels(t: torch.Tensor, sample: int) -> Tuple[torch.Tensor, str]:
    """``(C, H, W)`` float32 on the host, and a note on what was taken from ``t``."""
    t = t.detach()
    if t.is_nested or t.layout != torch.strided or t.is_meta:
        what = "a nested" if t.is_nested else ("a meta" if t.is_meta else f"a {t.layout}")
        raise ValueError(f"plot_features: {what} tensor has no image to draw; pass a dense one "
                         "(e.g. t.to_dense(), or one of a nested tensor's t.unbind())")
    if t.numel() == 0:
        raise ValueError(f"plot_features: the tensor of shape {tuple(t.shape)} is empty: nothing to draw")
    if t.is_quantized:
        t = t.dequantize()
    shape = "x".join(str(s) for s in t.shape)
    if t.dim() >= 4:
        if not -t.shape[0] <= sample < t.shape[0]:
            raise IndexError(f"plot_features: sample={sample} is out of range for a batch of {t.shape[0]}")
        t = t[sample]
        note = f"sample {sample} of {shape}"
        while t.dim() > 3:  # (C, D, H, W): the middle slice of each extra dimension
            mid = t.shape[1] // 2
            t = t[:, mid]
            note += f", middle slice {mid}"
    elif t.dim() == 3:
        note = shape
    elif t.dim() == 2:
        t = t.unsqueeze(0)
        note = f"{shape} as one image"
    elif t.dim() == 1:
        t = t.reshape(1, 1, -1)
        note = f"{shape} as one row"
    else:
        t = t.reshape(1, 1, 1)
        note = "scalar"
    if t.is_complex():
        t = t.abs()
    return t.to(device="cpu", dtype=torch.float32), note


def _grid(n: int, ncols: Optional[int]) -> Tuple[int, int]:
    cols = ncols or max(1, math.ceil(math.sqrt(n)))
    cols = min(cols, n)
    return cols, math.ceil(n / cols)


def _plot_one(t: torch.Tensor, path: Path, *, title: str, max_channels: int, ncols: Optional[int],
              cmap: str, normalize: str, sample: int, dpi: int) -> Path:
    Figure, FigureCanvasAgg = _matplotlib()
    chans, note = _channels(t, sample)
    total = chans.shape[0]
    n = min(total, max_channels)
    chans = chans[:n]
    cols, rows = _grid(n, ncols)
    cell = 1.35 if n > 1 else 4.0
    fig = Figure(figsize=(max(cols * cell, 3.0), rows * cell + 0.6), dpi=dpi)
    FigureCanvasAgg(fig)
    finite = chans[torch.isfinite(chans)]
    g_lo = float(finite.min()) if finite.numel() else 0.0
    g_hi = float(finite.max()) if finite.numel() else 1.0
    for i in range(n):
        ax = fig.add_subplot(rows, cols, i + 1)
        img = chans[i]
        if normalize == "channel":
            fin = img[torch.isfinite(img)]
            lo, hi = (float(fin.min()), float(fin.max())) if fin.numel() else (0.0, 1.0)
        else:
            lo, hi = g_lo, g_hi
        if hi <= lo:
            hi = lo + 1e-12
        aspect = "auto" if img.shape[0] == 1 or img.shape[0] * 8 < img.shape[1] else "equal"
        ax.imshow(img.numpy(), cmap=cmap, vmin=lo, vmax=hi, interpolation="nearest", aspect=aspect)
        ax.set_axis_off()
        if n > 1:
            ax.set_title(str(i), fontsize=7, pad=2)
    shown = f"channels 0-{n - 1} of {total}" if n < total else f"{total} channel{'s' if total != 1 else ''}"
    fig.suptitle(f"{title}  ({note}; {shown})" if title else f"{note}; {shown}", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(str(path))
    return path


def plot_features(
    tensor_or_capture: Any,
    path: PathLike,
    *,
    module: Optional[Union[str, Sequence[str]]] = None,
    sample: int = 0,
    max_channels: int = 64,
    ncols: Optional[int] = None,
    cmap: str = "viridis",
    normalize: str = "channel",
    title: Optional[str] = None,
    dpi: int = 100,
) -> Union[Path, List[Path]]:
    """Write a PNG grid of the channels of a feature map and return its path.

    ``tensor_or_capture`` is a tensor (``N x C x H x W``: channels of ``sample``; ``C x H x W``;
    ``N x F`` drawn as one image), a capture plugin (``session["capture"]``), a session with a
    capture plugin, or a dict ``{module: tensor}``. From a capture, ``module`` picks the module
    (default: the first one captured); when ``path`` contains ``{module}``, one file is written
    per module (all of them, or those ``module`` lists) and the list of paths is returned.
    ``max_channels`` bounds the grid (the first channels); ``normalize="channel"`` scales
    each channel to its own range, ``"global"`` uses one range for all.

    Needs matplotlib (``pip install 'hookplug[plot]'``).
    """
    if normalize not in ("channel", "global"):
        raise ValueError(f"plot_features: normalize must be 'channel' or 'global', got {normalize!r}")
    for what, value, optional in (("max_channels", max_channels, False), ("ncols", ncols, True),
                                  ("dpi", dpi, False)):
        if not (is_int_at_least(value, 1) or (optional and value is None)):
            raise ValueError(f"plot_features: {what} must be an int >= 1{' or None' if optional else ''}, "
                             f"got {value!r}")
    if module is not None:  # a name (a str is a Sequence[str]) or names, checked as options are
        module = materialise(module, Sequence[str])
        if not type_ok(module, Sequence[str]):
            raise TypeError(f"plot_features: module must be a module name or a list of names, got {module!r}")
    _matplotlib()  # fail early and clearly when matplotlib is missing
    opts = dict(max_channels=max_channels, ncols=ncols, cmap=cmap, normalize=normalize, sample=sample, dpi=dpi)
    path_text = os.fspath(path)
    features = _features_of(tensor_or_capture)
    if features is None:
        return _plot_one(tensor_or_capture, Path(path_text.replace("{module}", "tensor")),
                         title=title or "", **opts)
    if not features:
        raise ValueError("plot_features: the capture holds no features (did the model run with it attached?)")
    if module is None:
        names = list(features)
    elif isinstance(module, str):
        names = [module]
    else:
        names = list(module)
    missing = [n for n in names if n not in features]
    if missing:
        raise KeyError(f"plot_features: no captured module {missing[0]!r}; captured: {', '.join(features)}")
    if "{module}" in path_text:
        written, skipped = [], []
        for n in names:
            try:  # (a module whose output holds no tensor, or none to draw: the others go on)
                t = _tensor_of(features[n], repr(n))
                _channels(t, sample)
            except ValueError as exc:
                skipped.append(f"{n or '<root>'!r} ({str(exc).removeprefix('plot_features: ')})")
                continue
            written.append(_plot_one(t, Path(path_text.replace("{module}", n or "root")),
                                     title=title or n or "(root)", **opts))
        if skipped:
            warnings.warn(f"plot_features: no file for {'; '.join(skipped)}", RuntimeWarning, stacklevel=2)
        return written
    name = names[0]
    return _plot_one(_tensor_of(features[name], repr(name)), Path(path_text), title=title or name or "(root)",
                     **opts)
