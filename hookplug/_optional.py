"""Optional dependencies, imported lazily with an error that names the pip extra."""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import Tuple

__all__ = ["optional_import"]


def optional_import(*modules: str, feature: str, extra: str, package: str) -> Tuple[ModuleType, ...]:
    """Import ``modules`` (returned in order) or raise ``ImportError`` saying that
    ``feature`` needs ``package`` and how to install it."""
    try:
        return tuple(importlib.import_module(m) for m in modules)
    except ImportError as exc:
        raise ImportError(
            f"{feature} needs the {package} package: pip install 'hookplug[{extra}]' "
            f"(or pip install {package}) [{exc}]"
        ) from exc
