"""Metric names shared by the sinks that write to a dashboard (tensorboard, wandb): one
statistic across layers in one group, ``hookplug/<stat>/<module>/<site>``."""
from __future__ import annotations

from typing import Optional

__all__ = ["DEFAULT_SCALARS", "ROOT_NAME", "hist_tag", "scalar_tag"]

#: what the sink writes by default (no numel, no zero_count: counts that never change)
DEFAULT_SCALARS = ("min", "max", "mean", "std", "absmax", "rms", "zero_fraction",
                   "nan_count", "inf_count")
#: the root module's name in tags (its qualified name is "")
ROOT_NAME = "<root>"


def scalar_tag(stat: str, module: str, site: Optional[str] = None,
               phase: Optional[str] = "train") -> str:
    """``hookplug/<stat>/<module>/<site>`` (``hookplug_<phase>/`` for a phase other than
    train; no ``/<site>`` when ``site`` is None). TensorBoard groups by the first two parts,
    so the ``hookplug/max`` card compares every layer's max at a glance."""
    root = "hookplug" if phase in (None, "train") else f"hookplug_{phase}"
    tag = f"{root}/{stat}/{module or ROOT_NAME}"
    return tag if site is None else f"{tag}/{site}"


def hist_tag(module: str, site: str, phase: Optional[str] = "train") -> str:
    """``hookplug/hist/<module>/<site>``."""
    return scalar_tag("hist", module, site, phase)
