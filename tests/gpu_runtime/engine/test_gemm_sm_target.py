"""`gemm_sm_target`: GEMMs captured for a partition plan for its SMs; the process-wide cuBLAS
settings it changes are restored however the block ends."""

from __future__ import annotations

import pytest
import torch

from gpu_runtime.engine.runner_types import gemm_sm_target


def _state() -> tuple[object, object]:
    return torch._C._get_sm_carveout_experimental(), torch.backends.cuda.preferred_blas_library()


@pytest.mark.parametrize("sm_count", [None, 132, 200])
def test_no_target_for_the_whole_device(sm_count: int | None) -> None:
    before = _state()
    with gemm_sm_target(sm_count, 132):
        assert _state() == before
    assert _state() == before


def test_a_partition_sets_the_target_and_restores_it() -> None:
    before = _state()
    try:
        with gemm_sm_target(48, 132):
            assert torch._C._get_sm_carveout_experimental() == 132 - 48
            assert str(torch.backends.cuda.preferred_blas_library()).lower().endswith("cublaslt")
            raise KeyError("the block ends by an error")
    except RuntimeError:  # a CPU-only build cannot select cuBLASLt: refused on entry
        assert not torch.cuda.is_available()
    except KeyError:
        pass
    assert _state() == before


def test_bad_sm_count() -> None:
    with pytest.raises(ValueError, match="sm_count must be >= 1, got 0"), gemm_sm_target(0, 132):
        pass
