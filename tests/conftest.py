import os

import pytest
import torch

import hookplug


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


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
