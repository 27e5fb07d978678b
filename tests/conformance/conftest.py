"""Backends for the NVML conformance tests: the fake (always) and the real `pynvml` (on a GPU machine).

`nvml` is parametrized over both. Tests taking it assert only what real NVML guarantees (shapes, types,
invariants), so a failure on the real backend means the test is wrong, and one on the fake means the
fake is.
"""

from __future__ import annotations

from typing import Any, Iterator

import pynvml
import pytest

from fake_nvml.node import FakeNode
from fake_nvml.nvml import FakeNvml
from fake_nvml.scenario import load_scenario

NO_GPU = "no NVIDIA GPU/driver here: real-NVML conformance runs on a GPU machine"

REAL = pytest.param("real", marks=pytest.mark.gpu)
BACKENDS = ["fake", REAL]


def node_of(scenario: str, name: str | None = None) -> FakeNode:
    return load_scenario(scenario).build(name)


def _real_nvml() -> Iterator[Any]:
    try:
        pynvml.nvmlInit()
    except (pynvml.NVMLError_LibraryNotFound, pynvml.NVMLError_DriverNotLoaded):
        pytest.skip(NO_GPU)
    try:
        if pynvml.nvmlDeviceGetCount() == 0:
            pytest.skip(NO_GPU)
        yield pynvml
    finally:
        pynvml.nvmlShutdown()


def _fake_nvml() -> Iterator[Any]:
    nvml = FakeNvml(node_of("h100-sxm-8"))
    nvml.nvmlInit()
    yield nvml
    nvml.nvmlShutdown()


@pytest.fixture(params=BACKENDS)
def nvml(request: pytest.FixtureRequest) -> Iterator[Any]:
    """An initialised NVML: a FakeNvml over a healthy 8x H100 node, or the real pynvml module."""
    if request.param == "real":
        yield from _real_nvml()
    else:
        yield from _fake_nvml()


@pytest.fixture
def handles(nvml: Any) -> list[Any]:
    """A handle for every GPU NVML enumerates, in index order."""
    return [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
