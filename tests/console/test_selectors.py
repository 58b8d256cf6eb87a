"""Console reads: ranges, downsampling, job progress and ETA, predictor accuracy."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from api.errors import HarliError
from console import selectors
from console.selectors import Columns, downsample, parse_range, progress_from
from tests.console.seed import (
    DEPLOYMENT_OLD_POINTS,
    DEPLOYMENT_POINTS,
    HOST_A_POINTS,
    JOB_STEPS,
    JOB_TOTAL_STEPS,
    Seeded,
)

T0 = datetime(2026, 11, 30, tzinfo=UTC)


def test_parse_range_knows_four_windows_and_rejects_others() -> None:
    assert parse_range("15m") == timedelta(minutes=15)
    assert parse_range(None) == timedelta(hours=1)
    with pytest.raises(HarliError, match="Unknown time range '2d'") as info:
        parse_range("2d")
    assert info.value.param == "range"


def test_downsample_keeps_short_series_and_buckets_long_ones() -> None:
    short = Columns(ts=[T0], values={"a": [1.0]})
    assert downsample(short, max_points=5) is short
    ts = [T0 + timedelta(seconds=i) for i in range(10)]
    a: list[float | None] = [float(i) for i in range(10)]
    p99: list[float | None] = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 9.0]
    columns = Columns(ts=ts, values={"a": a, "p99": p99})
    result = downsample(columns, max_points=4, aggregate={"p99": "max"})
    # ceil(10 / 4) = 3 rows per bucket: [0,1,2] [3,4,5] [6,7,8] [9]
    assert result.values["a"] == [1.0, 4.0, 7.0, 9.0]
    assert result.values["p99"] == [1.0, 1.0, 1.0, 9.0]
    assert result.ts == [ts[1], ts[4], ts[7], ts[9]]


def test_downsample_keeps_all_null_buckets_null() -> None:
    columns = Columns(ts=[T0] * 4, values={"a": [None, None, 1.0, 3.0]})
    assert downsample(columns, max_points=2).values["a"] == [None, 2.0]
    with pytest.raises(ValueError, match="max_points"):
        downsample(columns, max_points=0)


def test_combine_hosts_adds_rates_keeps_the_worst_p99_and_weights_attainment() -> None:
    names = ["p50", "p99", "attainment", "rate"]
    rows = [
        # bucket [0, 10): host a twice (averaged first), host b once
        (T0, "a", 20.0, 40.0, 1.0, 10.0),
        (T0 + timedelta(seconds=5), "a", 22.0, 50.0, 1.0, 10.0),
        (T0 + timedelta(seconds=6), "b", 30.0, 45.0, 0.5, 30.0),
        # bucket [10, 20): host b alone, one value missing
        (T0 + timedelta(seconds=12), "b", 31.0, 46.0, None, 30.0),
    ]
    combined = selectors.combine_hosts(
        rows,
        names,
        width=timedelta(seconds=10),
        summed=frozenset({"rate"}),
        maxed=frozenset({"p99"}),
        weighted=frozenset({"attainment"}),
        weight="rate",
    )
    assert combined.ts == [T0 + timedelta(seconds=6), T0 + timedelta(seconds=12)]
    assert combined.values["p50"] == [(21.0 + 30.0) / 2, 31.0]
    assert combined.values["p99"] == [50.0, 46.0]
    assert combined.values["rate"] == [40.0, 30.0]
    assert combined.values["attainment"] == [pytest.approx((1.0 * 10 + 0.5 * 30) / 40), None]
    with pytest.raises(ValueError, match="width must be positive"):
        selectors.combine_hosts(rows, names, width=timedelta(0))


def test_bucket_width_grows_only_for_long_windows() -> None:
    assert selectors.bucket_width(timedelta(hours=6)) == timedelta(seconds=10)
    assert selectors.bucket_width(timedelta(hours=24)) == timedelta(seconds=40)


def test_progress_rate_and_eta_come_from_first_and_last_reports() -> None:
    points = [(T0, 10), (T0 + timedelta(seconds=50), 20)]  # 0.2 steps/s
    progress = progress_from(points=points, total_steps=40)
    assert (progress.step, progress.percent, progress.eta_seconds) == (20, 50, 100.0)
    assert progress_from(points=[], total_steps=40).eta_seconds is None
    assert progress_from(points=points, total_steps=None).fraction is None
    # Only the latest reports set the pace: a slow start does not stretch the ETA.
    slow_then_fast = [(T0 + timedelta(seconds=1000 * i), i) for i in range(5)]
    last_ts = slow_then_fast[-1][0]
    slow_then_fast += [(last_ts + timedelta(seconds=i + 1), 5 + i) for i in range(30)]
    assert progress_from(points=slow_then_fast, total_steps=100).eta_seconds == pytest.approx(66.0)


def test_seeded_series_counts_and_ranges(seeded: Seeded) -> None:
    since_1h = seeded.now - timedelta(hours=1)
    columns = selectors.deployment_series(deployment=seeded.deployment, since=since_1h)
    assert len(columns) == DEPLOYMENT_POINTS
    since_6h = seeded.now - timedelta(hours=6)
    wide = selectors.deployment_series(deployment=seeded.deployment, since=since_6h)
    assert len(wide) == DEPLOYMENT_POINTS + DEPLOYMENT_OLD_POINTS
    per_host = selectors.host_finetune_series(since=since_1h)
    assert len(per_host[seeded.hosts[0].pk]) == HOST_A_POINTS
    latest = selectors.host_memory_latest()
    assert set(latest) == {seeded.hosts[0].pk, seeded.hosts[1].pk}
    assert latest[seeded.hosts[0].pk].ts == seeded.now


def test_job_progress_uses_the_runtime_step_count(seeded: Seeded) -> None:
    job = seeded.running_job
    assert selectors.estimated_total_steps(job=job) == JOB_TOTAL_STEPS
    progress = selectors.job_progress_map(jobs=[job])[job.pk]
    assert progress.step == JOB_STEPS
    assert progress.percent == 50
    # one step per 10 s, 15 steps left
    assert progress.eta_seconds == pytest.approx(150.0)


def test_job_filters(seeded: Seeded) -> None:
    assert {j.pk for j in selectors.job_list(tenant="globex")} == {seeded.queued_job.pk}
    assert {j.pk for j in selectors.job_list(host="gpu-a")} == {seeded.running_job.pk}
    assert {j.pk for j in selectors.job_list(status="cancelled", tenant="acme")} == {
        seeded.cancelled_job.pk
    }


def test_predictor_accuracy_per_host_and_version(seeded: Seeded) -> None:
    rows = selectors.predictor_accuracy(since=seeded.now - timedelta(hours=1))
    by_key = {(r.host, r.version): r for r in rows}
    assert set(by_key) == {("gpu-a", "v1"), ("gpu-b", "v2")}
    a = by_key[("gpu-a", "v1")]
    assert a.samples == DEPLOYMENT_POINTS // 2
    # predicted = observed + 1 ms with observed in {20, 21, 22}
    expected = [100.0 / (20.0 + i % 3) for i in range(0, DEPLOYMENT_POINTS, 2)]
    assert a.mape_pct == pytest.approx(sum(expected) / len(expected))
    assert a.p95_ape_pct == pytest.approx(5.0)
