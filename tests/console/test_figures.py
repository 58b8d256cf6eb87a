"""The figure builders: pure data in, plotly figure dicts out."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import plotly.graph_objects as go
import pytest

from console import figures
from console.figures import LatencyPairs, MemorySplit, TimeSeries

T0 = datetime(2026, 11, 30, 7, 0, tzinfo=UTC)


def _series(name: str, values: list[float | None]) -> TimeSeries:
    return TimeSeries(
        name=name, ts=[T0 + timedelta(seconds=10 * i) for i in range(len(values))], values=values
    )


def test_tpot_figure_has_both_percentiles_and_the_slo_line() -> None:
    fig = figures.tpot_figure(
        p50=_series("TPOT p50", [20.0, 21.0, 22.0]),
        p99=_series("TPOT p99", [35.0, 36.0, 90.0]),
        tpot_slo_ms=42.5,
    )
    assert figures.point_counts(fig) == {"TPOT p50": 3, "TPOT p99": 3}
    assert fig["data"][1]["y"] == [35.0, 36.0, 90.0]
    (slo,) = fig["layout"]["shapes"]
    assert (slo["y0"], slo["y1"], slo["xref"]) == (42.5, 42.5, "x domain")
    assert fig["layout"]["annotations"][0]["text"] == "SLO 42.5 ms"
    # plotly.js gets naive UTC strings; the figure validates as a plotly Figure.
    assert fig["data"][0]["x"][0] == "2026-11-30T07:00:00.000"
    go.Figure(fig)


def test_times_are_converted_to_utc() -> None:
    other_zone = datetime(2026, 11, 30, 9, 0, tzinfo=UTC).astimezone(timezone(timedelta(hours=2)))
    assert figures.iso_utc(other_zone) == "2026-11-30T09:00:00.000"


def test_attainment_is_plotted_in_percent_with_the_target_line() -> None:
    fig = figures.attainment_figure(series=[_series("chat", [0.995, None, 0.9])], target_pct=99.0)
    assert fig["data"][0]["y"] == [99.5, None, 90.0]
    assert fig["layout"]["shapes"][0]["y0"] == 99.0
    low, high = fig["layout"]["yaxis"]["range"]
    assert low <= 89.0 and high > 100.0


def test_attainment_without_a_common_target_has_no_line() -> None:
    fig = figures.attainment_figure(series=[_series("a", [1.0])], target_pct=None)
    assert "shapes" not in fig["layout"]


def test_goodput_puts_request_rate_on_a_second_axis() -> None:
    fig = figures.goodput_figure(
        goodput=_series("goodput", [1.0, 2.0]), request_rate=_series("rps", [3.0, 4.0])
    )
    assert fig["data"][1]["yaxis"] == "y2"
    assert fig["layout"]["yaxis2"]["overlaying"] == "y"


def test_memory_split_is_one_stacked_bar_per_host_in_gib() -> None:
    gib = figures.GIB
    fig = figures.memory_split_figure(
        hosts=[
            MemorySplit("gpu-a", 16 * gib, 60 * gib, 20 * gib, 45 * gib),
            MemorySplit("gpu-b", 16 * gib, 2 * gib, 0, 123 * gib),
        ]
    )
    assert fig["layout"]["barmode"] == "stack"
    assert [t["name"] for t in fig["data"]] == [
        "Weights",
        "KV cache in use",
        "Lent to finetuning",
        "Free",
    ]
    assert fig["data"][2]["x"] == [20.0, 0.0]
    assert fig["data"][0]["y"] == ["gpu-a", "gpu-b"]


def test_memory_over_time_is_stacked_in_gib() -> None:
    gib = figures.GIB
    fig = figures.memory_over_time_figure(
        weights=_series("Weights", [16.0 * gib, 16.0 * gib]),
        kv_used=_series("KV cache in use", [60.0 * gib, 70.0 * gib]),
        lent=_series("Lent to finetuning", [20.0 * gib, 10.0 * gib]),
        free=_series("Free", [45.0 * gib, None]),
    )
    assert [t["name"] for t in fig["data"]] == [
        "Weights",
        "KV cache in use",
        "Lent to finetuning",
        "Free",
    ]
    assert fig["data"][2]["y"] == [20.0, 10.0]
    assert fig["data"][3]["y"] == [45.0, None]
    assert {t["stackgroup"] for t in fig["data"]} == {"memory"}


def test_finetune_throughput_is_stacked_per_host() -> None:
    fig = figures.finetune_throughput_figure(
        per_host=[_series("gpu-a", [1.0, 2.0]), _series("gpu-b", [3.0])]
    )
    assert figures.point_counts(fig) == {"gpu-a": 2, "gpu-b": 1}
    assert {t["stackgroup"] for t in fig["data"]} == {"hosts"}


def test_loss_figure_keeps_train_and_validation_apart() -> None:
    fig = figures.loss_figure(
        train_steps=[1, 2, 3], train_loss=[2.0, 1.5, 1.2], valid_steps=[3], valid_loss=[1.4]
    )
    assert figures.point_counts(fig) == {"train loss": 3, "validation loss": 1}
    with pytest.raises(ValueError, match="same length"):
        figures.loss_figure(train_steps=[1], train_loss=[], valid_steps=[], valid_loss=[])


def test_predictor_scatter_draws_the_diagonal_over_the_data() -> None:
    fig = figures.predictor_scatter_figure(
        per_host=[LatencyPairs("gpu-a (v1)", [10.0, 12.0], [11.0, 30.0])]
    )
    assert fig["data"][0]["mode"] == "markers"
    diagonal = fig["layout"]["shapes"][0]
    assert (diagonal["x0"], diagonal["y0"], diagonal["x1"], diagonal["y1"]) == (10, 10, 30, 30)
    assert "shapes" not in figures.predictor_scatter_figure(per_host=[])["layout"]


def test_mismatched_series_are_rejected_with_the_lengths() -> None:
    with pytest.raises(ValueError, match="2 timestamps but 1 values"):
        TimeSeries(name="x", ts=[T0, T0], values=[1.0])
    with pytest.raises(ValueError, match="1 predictions but 2 observations"):
        LatencyPairs("h", [1.0], [1.0, 2.0])


def test_builders_do_not_mutate_their_input() -> None:
    values: list[float | None] = [1.0, 2.0]
    series = _series("x", values)
    figures.throughput_figure(tokens_per_s=series)
    assert values == [1.0, 2.0]
