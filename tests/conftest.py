import contextlib
import os
import warnings

import pytest
import torch

import hookplug


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def fresh_python(tmp_path):
    """``fresh_python(source)``: run ``source`` in a new Python process (nothing imported
    yet: torch._dynamo neither) and return its last line of output; fails on its error."""
    import subprocess
    import sys

    def run(source: str) -> str:
        script = tmp_path / "fresh.py"
        script.write_text(source)
        out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout.strip().splitlines()[-1]

    return run


@pytest.fixture
def fresh_discovery():
    """Forget discovered entry points before and after a test that monkeypatches them."""
    hookplug._manager._reset_discovery()
    yield
    hookplug._manager._reset_discovery()


def pytest_report_header(config):
    try:
        backend = hookplug.ops.backend()
    except Exception as exc:  # noqa: BLE001
        backend = f"unavailable ({exc})"
    return [f"torch {torch.__version__}, hookplug ops backend: {backend}, "
            f"HOOKPLUG_REQUIRE_EXT={os.environ.get('HOOKPLUG_REQUIRE_EXT', '')}"]


# ``@pytest.mark.parametrize("device", DEVICES)``: the test on the CPU, and on a CUDA GPU
# where there is one (``from conftest import DEVICES``)
DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])]


@pytest.fixture
def true_output_grads():
    """The reference for gradient tests: ``grads = true_output_grads(model, nn.Linear)``
    records, with plain torch hooks, ``{name: [output grad per call, in backward order]}``."""
    handles = []

    def record(model, cls=torch.nn.Linear):
        grads = {}

        def keep(name):
            def fwd(mod, inp, out):
                out.register_hook(lambda g: grads.setdefault(name, []).append(g.clone()))

            return fwd

        handles.extend(m.register_forward_hook(keep(n)) for n, m in model.named_modules() if isinstance(m, cls))
        return grads

    yield record
    for h in handles:
        h.remove()


class RecordSink:
    """A third-party style sink (no base class) keeping every record in memory; tests import
    it with ``from conftest import RecordSink``."""

    name = "records"

    def __init__(self):
        self.records = []

    @hookplug.hookimpl
    def hookplug_flush(self, records):
        self.records.extend(records)


def fork_child(child):
    """Run ``child()`` in a process forked from this one (``os.fork``: a copy of everything,
    as a DataLoader worker or an async checkpoint writer is) and return ``(pid, fd)`` for
    :func:`join_child`. The child sends ``child()``'s JSON-able result (or its error) through
    a pipe and leaves with ``os._exit`` (no atexit handler, no pytest teardown)."""
    import json
    import traceback

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(r)
            try:
                out = {"result": child()}
            except BaseException as exc:  # noqa: BLE001 - reported to the parent
                out = {"error": "".join(traceback.format_exception(exc))}
            os.write(w, json.dumps(out).encode())
        finally:
            os._exit(0)
    os.close(w)
    return pid, r


def join_child(pid, fd, timeout=10.0):
    """The result of a :func:`fork_child` child; ``{"hung": True}`` (the child killed) when it
    has not ended within ``timeout`` seconds."""
    import json
    import signal
    import time

    deadline = time.monotonic() + timeout
    try:
        while not os.waitpid(pid, os.WNOHANG)[0]:
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return {"hung": True}
            time.sleep(0.01)
        data = b""
        while chunk := os.read(fd, 1 << 16):
            data += chunk
    finally:
        os.close(fd)
    return json.loads(data or b'{"error": "no result"}')


def run_forked(child, timeout=10.0):
    """``child()`` run in a forked process: see :func:`fork_child` and :func:`join_child`."""
    return join_child(*fork_child(child), timeout=timeout)


@contextlib.contextmanager
def no_warnings():
    """Any warning inside is an error (the counterpart of ``pytest.warns``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


class Interruptible(torch.nn.Module):
    """A module whose forward raises ``KeyboardInterrupt`` (Ctrl-C: torch runs no post hook)
    while ``stop`` is set; with ``depth`` it calls itself that many times more on ``x * 2``,
    else returns ``x + 1``."""

    stop = False

    def forward(self, x, depth=0):
        if self.stop:
            raise KeyboardInterrupt
        return self(x * 2, depth - 1) if depth else x + 1

    def interrupted_call(self, model, *args):
        """``model(*args)`` with this module stopping it by Ctrl-C (checked), then armed off."""
        self.stop = True
        try:
            with pytest.raises(KeyboardInterrupt):
                model(*args)
        finally:
            self.stop = False
