import pytest

from gpu_runtime.contract.statistics import median, percentile


def test_percentile_interpolates_between_order_statistics() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 99) == pytest.approx(3.97)
    assert median([5.0]) == 5.0


def test_no_values_is_none_and_q_is_checked() -> None:
    assert percentile([], 99) is None
    with pytest.raises(ValueError, match="got 101"):
        percentile([1.0], 101)
