import math

import pytest

from gpu_runtime.contract.hparams import LORA_ALPHA_RANGE, HyperparameterError, LoraSpec


@pytest.mark.parametrize("alpha", [0.0, -1.0, math.inf, math.nan, LORA_ALPHA_RANGE[1] * 2])
def test_a_host_refuses_the_alphas_the_api_refuses(alpha: float) -> None:
    with pytest.raises(HyperparameterError, match="alpha must be greater than"):
        LoraSpec(alpha=alpha)


def test_the_range_ends_are_what_they_say() -> None:
    assert LoraSpec(alpha=LORA_ALPHA_RANGE[1]).alpha == LORA_ALPHA_RANGE[1]
