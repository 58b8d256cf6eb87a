"""The one decoder walk: the order in which it calls its ops, and its two residual forms."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gpu_runtime.model import DenseCausalAttention, build_random_model
from gpu_runtime.model.decoder import post_attention, pre_attention
from gpu_runtime.model.module_ops import ModuleOps
from gpu_runtime.model.tiny import tiny_config

LAYER_STEPS = ["norm", "qkv", "rope_and_attend", "o", "norm", "gate_up", "silu_and_mul", "down"]


class _RecordingOps:
    """Delegates to ``ModuleOps`` and records each call as ``(step, layer index or None)``."""

    def __init__(self, inner: ModuleOps) -> None:
        self.inner = inner
        self.calls: list[tuple[str, int | None]] = []
        self.residual_given: list[bool] = []

    def norm(self, norm: Any, x: torch.Tensor, residual: torch.Tensor | None) -> Any:
        self.calls.append(("norm", None))
        self.residual_given.append(residual is not None)
        return self.inner.norm(norm, x, residual)

    def __getattr__(self, step: str) -> Any:
        method = getattr(self.inner, step)

        def recorded(index: int, *args: Any) -> Any:
            self.calls.append((step, index))
            return method(index, *args)

        return recorded


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_walk_calls_each_step_in_layer_order(architecture: str) -> None:
    model = build_random_model(tiny_config(architecture), seed=3, dtype="float32")
    ids = torch.randint(0, 400, (2, 7), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(7).expand(2, 7)
    cos, sin = model.rope_cos_sin(positions, torch.float32)
    ops = _RecordingOps(ModuleOps(cos, sin, DenseCausalAttention()))
    with torch.no_grad():
        hidden = model.model.run(ops, ids)
        expected = model(ids, positions)
    assert torch.equal(hidden, expected)
    layers = model.config.num_hidden_layers
    steps = [(step, None if step == "norm" else i) for i in range(layers) for step in LAYER_STEPS]
    assert ops.calls == [*steps, ("norm", None)]
    # the embedding enters the first norm alone; every later norm adds a branch output
    assert ops.residual_given == [False] + [True] * (2 * layers)


def test_layer_outputs_equal_the_carried_residual_walk() -> None:
    """Adding each layer's residual at its end (the trainer's unit) equals handing it to the
    next norm (the serving walk), bit for bit."""
    model = build_random_model(tiny_config("qwen2"), seed=3, dtype="float32")
    model.fuse_projections()
    ids = torch.randint(0, 400, (2, 9), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(9).expand(2, 9)
    cos, sin = model.rope_cos_sin(positions, torch.float32)
    ops = ModuleOps(cos, sin, DenseCausalAttention())
    with torch.no_grad():
        x = model.model.embed_tokens(ids)
        for index in range(model.config.num_hidden_layers):
            x = model.model.layer_output(ops, index, x)
        stepped = model.model.final_norm(ops, x)
        walked = model.model.run(ops, ids)
    assert torch.equal(stepped, walked)


def test_the_halves_around_the_attention_are_the_walk() -> None:
    """`pre_attention`, the attention run apart, `post_attention` per layer and `final_norm`
    with the last residual (the mixed-step graphs' pieces) call the walk's steps in its order
    and give its output bit for bit."""
    model = build_random_model(tiny_config("qwen2"), seed=3, dtype="float32")
    ids = torch.randint(0, 400, (2, 6), generator=torch.Generator().manual_seed(4))
    positions = torch.arange(6).expand(2, 6)
    cos, sin = model.rope_cos_sin(positions, torch.float32)
    walked_ops = _RecordingOps(ModuleOps(cos, sin, DenseCausalAttention()))
    ops = _RecordingOps(ModuleOps(cos, sin, DenseCausalAttention()))
    stack = model.model
    with torch.no_grad():
        walked = stack.run(walked_ops, ids)
        x = stack.embed_tokens(ids)
        residual: torch.Tensor | None = None
        for index, layer in enumerate(model.decoder_layers):
            qkv, stream = pre_attention(ops, index, layer, x, residual)
            out = ops.rope_and_attend(index, layer.self_attn, qkv)
            x, residual = post_attention(ops, index, layer, out, stream)
        pieces = stack.final_norm(ops, x, residual)
    assert torch.equal(pieces, walked)
    assert ops.calls == walked_ops.calls
    assert ops.residual_given == walked_ops.residual_given
