"""The benchmarks' GPU state reading: nvidia-smi's CSV line parsed, no GPU needed."""

from __future__ import annotations

import shutil

import pytest

from bench.common.gpu_state import FIELDS, gpu_state, parse_query

KEYS = tuple(k for _, k in FIELDS)


def test_a_query_line_becomes_numbers_and_text() -> None:
    state = parse_query("1980, 3201, 54, 312.45, 0x0000000000000000\n", KEYS)
    assert state == {
        "sm_clock_mhz": 1980.0,
        "mem_clock_mhz": 3201.0,
        "temperature_c": 54.0,
        "power_w": 312.45,
        "clock_event_reasons": "0x0000000000000000",
    }
    assert parse_query("1755, 3201, 71, [N/A]", KEYS[:-1])["power_w"] == "[N/A]"


def test_a_line_with_missing_values_is_refused() -> None:
    with pytest.raises(ValueError, match="expected 5 values, got 3"):
        parse_query("1980, 3201, 54", KEYS)


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this host has nvidia-smi")
def test_without_nvidia_smi_there_is_no_state() -> None:
    assert gpu_state() is None
