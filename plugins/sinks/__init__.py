"""Telemetry sinks (plugins implementing ``hookplug_flush``)."""
