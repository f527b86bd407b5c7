"""The TensorBoard tag layout of the ``tensorboard`` sink (which ``hookplug profile
--tensorboard`` attaches): one stat across layers sits in one group, as HF's ``train/...`` does.

- scalars: ``hookplug/<stat>/<module>/<site>`` (``hookplug_eval/...`` for eval-phase records),
  e.g. ``hookplug/max/encoder.layer.0.fc1/output``: TensorBoard groups by the first two
  parts, so the ``hookplug/max`` card compares every layer's max at a glance;
- histograms: ``hookplug/hist/<module>/<site>``;
- per-module numbers without a site: ``hookplug/<stat>/<module>``.

Constant scalars (``numel``, ``zero_count``...) are not written by default:
:data:`DEFAULT_SCALARS` are the stats that move.
"""
from __future__ import annotations

from typing import Optional

__all__ = ["scalar_tag", "hist_tag", "DEFAULT_SCALARS", "ROOT_NAME"]

#: what the sink writes by default (no numel, no zero_count: counts that never change)
DEFAULT_SCALARS = ("min", "max", "mean", "std", "absmax", "rms", "zero_fraction",
                   "nan_count", "inf_count")
#: the root module's name in tags (its qualified name is "")
ROOT_NAME = "<root>"


def _root(phase: Optional[str]) -> str:
    return "hookplug" if phase in (None, "train") else f"hookplug_{phase}"


def scalar_tag(stat: str, module: str, site: Optional[str] = None,
               phase: Optional[str] = "train") -> str:
    """``hookplug/<stat>/<module>/<site>`` (``hookplug_<phase>/`` for a phase other than
    train; no ``/<site>`` when ``site`` is None)."""
    tag = f"{_root(phase)}/{stat}/{module or ROOT_NAME}"
    return tag if site is None else f"{tag}/{site}"


def hist_tag(module: str, site: str, phase: Optional[str] = "train") -> str:
    """``hookplug/hist/<module>/<site>``."""
    return scalar_tag("hist", module, site, phase)
