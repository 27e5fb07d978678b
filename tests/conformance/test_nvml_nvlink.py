"""NVML conformance for the nvlink check's calls: link state, error counters (the per-link call and the
batched field values). Part 1 asserts only what real NVML guarantees and runs on both backends; part 2
is the fake's behaviour: which models answer what, and the faults over node time."""

from __future__ import annotations

from typing import Any

import pynvml
import pytest

from fake_nvml.faults import Fault
from fake_nvml.nvml import FakeNvml
from fake_nvml.scenario import load_scenario

from conftest import Clock
from .test_nvml_conformance import started

NO_LINK = (pynvml.NVMLError_NotSupported, pynvml.NVMLError_InvalidArgument)
NOT_HERE = (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound)
DL_FIELDS = (pynvml.NVML_FI_DEV_NVLINK_ERROR_DL_REPLAY, pynvml.NVML_FI_DEV_NVLINK_ERROR_DL_RECOVERY,
             pynvml.NVML_FI_DEV_NVLINK_ERROR_DL_CRC)


def links_of(nvml: Any, h: Any) -> dict[int, int]:
    states = {}
    for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
        try:
            states[link] = nvml.nvmlDeviceGetNvLinkState(h, link)
        except NO_LINK:
            continue
    return states


# ---- part 1: what real NVML guarantees ---------------------------------------------------------


def test_link_state_is_enabled_or_disabled_and_absent_links_raise(nvml: Any, handles: list[Any]) -> None:
    for h in handles:
        states = links_of(nvml, h)
        assert set(states.values()) <= {pynvml.NVML_FEATURE_DISABLED, pynvml.NVML_FEATURE_ENABLED}
        assert len(states) <= pynvml.NVML_NVLINK_MAX_LINKS


def test_error_counters_are_non_negative_ints_or_not_supported(nvml: Any, handles: list[Any]) -> None:
    for h in handles:
        for link in list(links_of(nvml, h))[:2]:
            for counter in (pynvml.NVML_NVLINK_ERROR_DL_REPLAY, pynvml.NVML_NVLINK_ERROR_DL_RECOVERY,
                            pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT, pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA):
                try:
                    value = nvml.nvmlDeviceGetNvLinkErrorCounter(h, link, counter)
                except NOT_HERE:
                    continue
                assert isinstance(value, int) and value >= 0


def test_field_values_answer_each_request_in_order_with_its_own_return(nvml: Any, handles: list[Any]) -> None:
    h = handles[0]
    links = list(links_of(nvml, h))[:3] or [0]
    request = [(fid, link) for link in links for fid in DL_FIELDS] + [pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT]
    try:
        values = nvml.nvmlDeviceGetFieldValues(h, request)
    except NOT_HERE:
        pytest.skip("nvmlDeviceGetFieldValues not available here")
    assert len(values) == len(request)
    for v, asked in zip(values, request):
        fid, scope = asked if isinstance(asked, tuple) else (asked, 0)
        assert (v.fieldId, v.scopeId) == (fid, scope)
        assert isinstance(v.nvmlReturn, int)
        if v.nvmlReturn == pynvml.NVML_SUCCESS:
            assert v.valueType in range(pynvml.NVML_VALUE_TYPE_COUNT)
            if fid in DL_FIELDS:
                assert v.value.ullVal >= 0


# ---- part 2: the fake ---------------------------------------------------------------------------


def timed(scenario: str) -> tuple[FakeNvml, Any, Clock]:
    clock = Clock(0.0)
    node = load_scenario(scenario).build(clock=clock)
    nvml = FakeNvml(node)
    nvml.nvmlInit()
    return nvml, node, clock


@pytest.mark.parametrize("scenario,links", [("h100-sxm-8", 18), ("v100-sxm-8", 6)])
def test_sxm_models_have_their_links_and_reject_the_rest_with_invalid_argument(scenario, links) -> None:
    nvml, _ = started(scenario)
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    assert links_of(nvml, h) == dict.fromkeys(range(links), pynvml.NVML_FEATURE_ENABLED)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetNvLinkState(h, links)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetNvLinkErrorCounter(h, 0, 99)


@pytest.mark.parametrize("scenario", ["a100-pcie-4", "rtx-4090-1"])
def test_cards_without_nvlink_answer_not_supported_everywhere(scenario) -> None:
    nvml, _ = started(scenario)
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetNvLinkState(h, 0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetNvLinkErrorCounter(h, 0, pynvml.NVML_NVLINK_ERROR_DL_REPLAY)
    values = nvml.nvmlDeviceGetFieldValues(h, [(pynvml.NVML_FI_DEV_NVLINK_ERROR_DL_REPLAY, 0),
                                               pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT])
    assert values[0].nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED
    assert (values[1].nvmlReturn, values[1].value.uiVal) == (pynvml.NVML_SUCCESS, 0)


def test_nvlink_down_fault_shows_in_the_state_until_recover() -> None:
    nvml, node = started("h100-sxm-8-nvlink-down")
    h = nvml.nvmlDeviceGetHandleByIndex(2)
    assert nvml.nvmlDeviceGetNvLinkState(h, 4) == pynvml.NVML_FEATURE_DISABLED
    assert nvml.nvmlDeviceGetNvLinkState(h, 5) == pynvml.NVML_FEATURE_ENABLED
    node.inject(Fault("recover", 2))
    assert nvml.nvmlDeviceGetNvLinkState(h, 4) == pynvml.NVML_FEATURE_ENABLED


def test_rising_counter_moves_with_node_time_in_both_apis_and_a_reset_zeroes_it() -> None:
    nvml, node, clock = timed("h100-sxm-8-nvlink-replay")
    h = nvml.nvmlDeviceGetHandleByIndex(3)
    replay = pynvml.NVML_NVLINK_ERROR_DL_REPLAY
    assert nvml.nvmlDeviceGetNvLinkErrorCounter(h, 7, replay) == 40
    clock.now = 120.0                                                     # 2 minutes at 5 a minute
    assert nvml.nvmlDeviceGetNvLinkErrorCounter(h, 7, replay) == 50
    field = nvml.nvmlDeviceGetFieldValues(h, [(pynvml.NVML_FI_DEV_NVLINK_ERROR_DL_REPLAY, 7)])[0]
    assert (field.nvmlReturn, field.value.ullVal) == (pynvml.NVML_SUCCESS, 50)
    assert nvml.nvmlDeviceGetNvLinkErrorCounter(h, 6, replay) == 0
    node.inject(Fault("recover", 3))
    clock.now = 600.0
    assert nvml.nvmlDeviceGetNvLinkErrorCounter(h, 7, replay) == 0


def test_a_flapping_link_is_down_part_of_each_period_and_retrains_each_time() -> None:
    nvml, node, clock = timed("h100-sxm-8-nvlink-flap")
    h = nvml.nvmlDeviceGetHandleByIndex(6)
    recovery = pynvml.NVML_NVLINK_ERROR_DL_RECOVERY
    seen = []
    for t in (0.0, 19.0, 21.0, 119.0, 121.0, 141.0, 250.0):
        clock.now = t
        seen.append((nvml.nvmlDeviceGetNvLinkState(h, 11), nvml.nvmlDeviceGetNvLinkErrorCounter(h, 11, recovery)))
    assert seen == [(0, 0), (0, 0), (1, 0), (1, 0), (0, 1), (1, 1), (0, 2)]
    node.inject(Fault("reboot"))
    assert (nvml.nvmlDeviceGetNvLinkState(h, 11), nvml.nvmlDeviceGetNvLinkErrorCounter(h, 11, recovery)) == (1, 0)


def test_errors_fault_checks_its_counter_name() -> None:
    _, node = started("h100-sxm-8")
    with pytest.raises(ValueError, match="counter must be one of"):
        node.inject(Fault("nvlink_errors", 0, {"link": 1, "counter": "bogus"}))
    with pytest.raises(ValueError, match="down_s < period_s"):
        node.inject(Fault("nvlink_flap", 0, {"link": 1, "period_s": 10.0, "down_s": 10.0}))
