"""``hookplug`` on the command line (also ``python -m hookplug``); see ``hookplug --help``."""
from __future__ import annotations

import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    """Run the ``hookplug`` command with ``argv`` (default ``sys.argv[1:]``); return its exit status."""
    from .cli import main as _main

    return _main(argv)


if __name__ == "__main__":
    sys.exit(main())
