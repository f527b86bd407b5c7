"""The ``hookplug`` command (``plugins``, ``select``, ``profile``) and its reports (table,
JSON, HTML, TensorBoard through the ``tensorboard`` sink): a consumer of the public API
(``attach``, sinks and telemetry records, ``session.report_sections()``)."""
from ._commands import UsageError, main

__all__ = ["main", "UsageError"]
