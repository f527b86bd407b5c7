"""Optional dependencies, imported lazily with an error that names the pip extra."""
from __future__ import annotations

import importlib
import sys
import threading
from types import ModuleType
from typing import List, Tuple

__all__ = ["optional_import", "import_off_stack"]


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


def import_off_stack(name: str) -> bool:
    """Import ``name`` on a thread of its own if not yet imported (True: it was imported
    now). ``torch.fx.wrap``, run at the first import of ``torch._dynamo``, holds its own
    frame in a reference cycle, and with it every frame below (the caller's locals: the
    user's model) until the cycle collector runs; a fresh thread's stack holds nothing of
    the caller's. What the import sets in thread-local state (``torch._dynamo.config``'s
    settings are per thread from torch 2.13) stays on that thread: set it again."""
    if name in sys.modules:
        return False
    failed: List[BaseException] = []

    def run():
        try:
            importlib.import_module(name)
        except BaseException as exc:  # noqa: BLE001 - raised again on the caller's thread
            failed.append(exc)

    t = threading.Thread(target=run, name=f"hookplug-import-{name}", daemon=True)
    t.start()
    t.join()
    if failed:
        raise failed[0]
    return True
