"""`python -m bench.sharing.carveout` on CPU: the SM-target context restores what it changed, the
layer's GEMMs are the forward and input-gradient products, and bad options are refused (timing needs
CUDA)."""

from __future__ import annotations

import pytest
import torch

from bench.sharing.carveout import layer_gemms, parse_args, sm_target


def test_sm_target_sets_and_restores_the_carveout_and_library() -> None:
    before = torch._C._get_sm_carveout_experimental()
    library = torch.backends.cuda.preferred_blas_library()
    with sm_target(32, "cublas"):  # a CPU build cannot select cuBLASLt
        assert torch._C._get_sm_carveout_experimental() == 32
        assert str(torch.backends.cuda.preferred_blas_library()).lower().endswith("cublas")
    assert torch._C._get_sm_carveout_experimental() == before
    assert torch.backends.cuda.preferred_blas_library() == library
    with pytest.raises(RuntimeError), sm_target(48, "cublas"):
        raise RuntimeError("restored even when the block raises")
    assert torch._C._get_sm_carveout_experimental() == before


def test_layer_gemms_compute_forward_and_input_gradient() -> None:
    weights = [torch.randn(6, 4), torch.randn(3, 6)]
    forward = layer_gemms(5, weights, backward=False)()
    assert [tuple(t.shape) for t in forward] == [(5, 6), (5, 3)]
    both = layer_gemms(5, weights, backward=True)()
    assert [tuple(t.shape) for t in both] == [(5, 6), (5, 4), (5, 3), (5, 6)]


@pytest.mark.parametrize(
    "argv",
    [
        ["--decode-groups", "0"],
        ["--decode-groups", "a"],
        ["--decode-rows", "8,x"],
        ["--decode-rows", "0"],
        ["--reps", "1"],
        ["--layers", "0"],
    ],
)
def test_bad_options_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)


def test_default_groups_and_rows() -> None:
    args = parse_args([])
    assert args.decode_groups == [4, 6, 12] and args.decode_rows == [8, 64]
