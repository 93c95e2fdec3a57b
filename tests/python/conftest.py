"""Shared helpers of the Python tests: tensors whose values name their position."""

import os
import sys

import pytest
import torch

# `make test-python` puts the fresh build first on PYTHONPATH; say which module runs.
import rewind

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# `make test-python-guarded`: every cpu cache the tests make keeps its state on the guarded test storage (pages the
# host cannot touch outside rewind's copies), so a path that reads or writes state memory directly faults. Results
# are host copies there, so the tests of zero-copy sharing (marked zero_copy) do not apply and are skipped.
STORAGE = os.environ.get("REWIND_TEST_STORAGE", "host")
if STORAGE not in ("host", "guarded"):
    raise RuntimeError(f"REWIND_TEST_STORAGE={STORAGE}: allowed: host, guarded")
rewind._rewind._set_cpu_storage(STORAGE)


def pytest_report_header(config):
    return f"rewind module: {rewind.__file__} (python {sys.executable}); cpu state on the {STORAGE} storage"


def pytest_configure(config):
    config.addinivalue_line("markers", "zero_copy: asserts that results share the cache's memory (host storage only)")


def pytest_collection_modifyitems(config, items):
    if STORAGE != "guarded":
        return
    skip = pytest.mark.skip(reason="REWIND_TEST_STORAGE=guarded: results are host copies, not views of the state")
    for item in items:
        if "zero_copy" in item.keywords:
            item.add_marker(skip)


def _devices():
    """Every device torch offers that rewind can keep a cache on here."""
    out = ["cpu"]
    if torch.cuda.is_available() and rewind.cuda_built() and rewind.cuda_device_count() > 0:
        out.append("cuda")
    # The device check (scripts/device_check.sh) sets REWIND_REQUIRE_DEVICE=cuda: a machine that was meant to
    # run the cuda cases and cannot is a failure, not a run of the cpu cases alone.
    required = os.environ.get("REWIND_REQUIRE_DEVICE")
    if required and required not in out:
        raise RuntimeError(f"REWIND_REQUIRE_DEVICE={required}, but the tests can run on {out} only (torch cuda: "
                           f"{torch.cuda.is_available()}, rewind.cuda_built(): {rewind.cuda_built()}, "
                           f"rewind.cuda_device_count(): {rewind.cuda_device_count()})")
    return out


@pytest.fixture(params=_devices())
def device(request):
    """Each device the tests run on: cpu, and cuda where torch, rewind's build and the machine all have it."""
    return request.param


def kv(start, n, heads=2, dim=4, batch=1, dtype=torch.float32, device="cpu"):
    """Keys [B, H, n, D] whose every element at token t is the position start + t (plus 1000 * batch row)."""
    pos = torch.arange(start, start + n, dtype=torch.float32).view(1, 1, n, 1)
    rows = (torch.arange(batch, dtype=torch.float32) * 1000).view(batch, 1, 1, 1)
    return (pos + rows).expand(batch, heads, n, dim).contiguous().to(dtype=dtype, device=device)


def positions(t):
    """The positions a [B, H, n, D] keys tensor made by kv() holds (batch row 0)."""
    return [int(x) for x in t[0, 0, :, 0].float().tolist()]


def conv_in(start, n, channels=3, batch=1, device="cpu"):
    """Conv inputs [B, C, n]: value 1 + position (so the zero padding before position 0 is distinguishable)."""
    pos = torch.arange(start, start + n, dtype=torch.float32).view(1, 1, n) + 1
    return pos.expand(batch, channels, n).contiguous().to(device)


def conv_positions(t):
    """Positions of a conv window / state made from conv_in (-1 for zero padding)."""
    return [int(x) - 1 for x in t[0, 0, :].tolist()]


@pytest.fixture
def shipped():
    return os.path.join(REPO, "models")
