"""Building blocks of the latency model's networks: the MLP and the foldable normaliser."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn


def mlp(n_in: int, hidden: Sequence[int]) -> nn.Sequential:
    """``hidden=()`` is a linear model; the last layer starts at zero (prediction = prior)."""
    layers: list[nn.Module] = []
    width = n_in
    for h in hidden:
        layers += [nn.Linear(width, h), nn.SiLU()]
        width = h
    last = nn.Linear(width, 1)
    nn.init.zeros_(last.weight)
    nn.init.zeros_(last.bias)
    layers.append(last)
    return nn.Sequential(*layers)


class Normalizer(nn.Module):
    """``(f - mean) / std`` with buffers set from training features.

    A feature that is constant in training gets ``std = inf`` (it normalises to 0): it carried no
    information there, and dividing by a tiny std would turn any other value into an enormous
    input (e.g. prefill-chunk tokens when every profiled iteration had none, which drove
    predictions to 0 ms); such a feature acts only through the roofline terms.

    ``fold_into(linear)`` moves the normalisation into the next layer's weights (exactly the
    same function, two fewer ops in the exported graph) and turns this module into identity.
    """

    mean: torch.Tensor
    std: torch.Tensor

    def __init__(self, n: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(n))
        self.register_buffer("std", torch.ones(n))
        self.folded = False

    def fit(self, features: torch.Tensor) -> None:
        if len(features) == 0:  # nothing to learn from (e.g. no chunk steps): identity
            return
        self.mean.copy_(features.mean(0))
        if len(features) > 1:
            std = features.std(0)
            self.std.copy_(torch.where(std > 1e-6, std, math.inf))

    @torch.no_grad()
    def fold_into(self, linear: nn.Linear) -> None:
        scaled = linear.weight / self.std  # [out, in]
        linear.bias.sub_(scaled @ self.mean)
        linear.weight.copy_(scaled)
        self.mean.zero_()
        self.std.fill_(1.0)
        self.folded = True

    def forward(self, f: torch.Tensor) -> torch.Tensor:
        return f if self.folded else (f - self.mean) / self.std
