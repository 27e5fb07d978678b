"""read_each_gpu, on the fake NVML: a GPU lost before the inventory is not asked, one lost after it is a line
of the run's error, and the others are read in order."""

from __future__ import annotations

import pynvml
import pytest

from conftest import node_for
from detector.core.inventory import nvml_error_name, read_inventory
from detector.core.per_gpu import read_each_gpu
from fake_nvml.faults import Fault
from fake_nvml.nvml import FakeNvml


def test_lost_gpus_are_skipped_or_reported_and_the_others_read():
    node = node_for("h100-sxm-8")
    nvml = FakeNvml(node)
    nvml.nvmlInit()
    node.inject(Fault("lost", 1))                     # before the inventory: it has no handle
    inventory = read_inventory(nvml, 5.0, threaded=False)
    assert inventory.gpus[1].error == "GpuIsLost"
    node.inject(Fault("lost", 5))                     # after it: its next call fails
    asked = []

    def temperature(gpu):
        asked.append(gpu.index)
        return nvml.nvmlDeviceGetTemperature(gpu.handle, pynvml.NVML_TEMPERATURE_GPU)

    read = read_each_gpu(inventory.gpus, temperature)
    assert asked == [0, 2, 3, 4, 5, 6, 7]
    assert [gpu.index for gpu, _ in read.readings] == [0, 2, 3, 4, 6, 7]
    assert all(isinstance(celsius, int) for _, celsius in read.readings)
    assert read.errors == [f"GPU 5: {pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)}"]
    assert read_each_gpu(inventory.gpus, temperature, describe=nvml_error_name).errors == ["GPU 5: GpuIsLost"]


def test_errors_other_than_nvml_ones_are_not_caught():
    node = node_for("h100-sxm-8")
    nvml = FakeNvml(node)
    nvml.nvmlInit()
    inventory = read_inventory(nvml, 5.0, threaded=False)

    def broken(gpu):
        raise KeyError(gpu.index)

    with pytest.raises(KeyError):
        read_each_gpu(inventory.gpus, broken)
