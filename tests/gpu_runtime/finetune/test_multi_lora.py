"""Several adapters by name beside base requests in one batch; slots and host LRU."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_runtime.contract.hparams import LoraSpec
from gpu_runtime.finetune.checkpoint import save_adapter
from gpu_runtime.finetune.lora import adapter_parameters, build_training_model
from gpu_runtime.lora.adapter_store import (
    AdapterManager,
    NoFreeAdapterSlotError,
    UnknownAdapterError,
)
from gpu_runtime.lora.host_adapter import HostAdapter
from gpu_runtime.lora.runtime import MultiLoraRuntime
from gpu_runtime.lora.stacked import StackedLoraWeights
from gpu_runtime.model import CausalLM, build_random_model
from gpu_runtime.model.attention import DenseCausalAttention
from gpu_runtime.model.tiny import tiny_config


def gathered_lora_delta(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor, max_rank: int
) -> torch.Tensor:
    """Per-token gather + bmm form of `StackedLoraWeights.delta` (reference math).

    x `[T, in]`, a `[S*R, in]`, b `[S*R, out]`, token_slots `[T]` (`-1` = base).
    """
    num_slots = a.shape[0] // max_rank
    a_slots = a.view(num_slots, max_rank, -1)
    b_slots = b.view(num_slots, max_rank, -1)
    index = token_slots.clamp(min=0)
    shrink = torch.bmm(a_slots[index], x.to(a.dtype)[:, :, None])  # [T, R, 1]
    out = torch.bmm(b_slots[index].transpose(1, 2), shrink)[:, :, 0]  # [T, out]
    return out * (token_slots >= 0)[:, None].to(out.dtype)


def _write_adapter(serving: CausalLM, spec: LoraSpec, directory: Path, seed: int) -> None:
    tree = build_training_model(serving, spec, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapter_parameters(tree):
            p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    save_adapter(tree, spec, directory)


@torch.no_grad()
def _merged(serving: CausalLM, adapter: HostAdapter) -> CausalLM:
    merged = copy.deepcopy(serving)
    block: Any
    for block in merged.model.layers:  # deepcopy un-views fused weights: use the projections
        block.self_attn.qkv_weight = block.self_attn.qkv_bias = None
        block.mlp.gate_up_weight = None
    for (layer, module), (a, b) in adapter.weights.items():
        block = merged.model.layers[layer]
        parent = (
            block.self_attn
            if module.endswith(("q_proj", "k_proj", "v_proj", "o_proj"))
            else block.mlp
        )
        getattr(parent, module).weight.add_(b @ a)  # b holds its module's scaling
    return merged


@pytest.fixture()
def adapters(tmp_path: Path) -> tuple[CausalLM, dict[str, Path]]:
    serving = build_random_model(tiny_config("qwen2"), seed=4, dtype="float32")
    paths = {
        "support-bot": tmp_path / "x",
        "poet": tmp_path / "y",
        "coder": tmp_path / "z",
    }
    _write_adapter(serving, LoraSpec(rank=4, alpha=8), paths["support-bot"], seed=1)
    _write_adapter(
        serving, LoraSpec(rank=8, alpha=8, target_modules=("all-linear",)), paths["poet"], 2
    )
    _write_adapter(
        serving, LoraSpec(rank=2, alpha=4, target_modules=("v_proj",)), paths["coder"], 3
    )
    return serving, paths


def test_mixed_batch_matches_merged_weights(adapters: tuple[CausalLM, dict[str, Path]]) -> None:
    serving, paths = adapters
    seq = 10
    runtime = MultiLoraRuntime(serving, max_tokens=4 * seq, num_slots=3, max_rank=8)
    for adapter_name, path in paths.items():
        runtime.register(adapter_name, path)
    assert runtime.names() == ["coder", "poet", "support-bot"] and runtime.has("poet")
    rows: list[str | None] = [None, "support-bot", "poet", "support-bot"]  # ONE batch
    for i, name in enumerate(rows):
        if name is not None:
            runtime.attach(f"req-{i}", name)
    assert runtime.set_batch([(f"req-{i}", seq) for i in range(len(rows))])
    ids = torch.randint(0, 400, (len(rows), seq), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(seq).expand(len(rows), seq)
    with torch.no_grad():
        logits = serving.compute_logits(runtime.forward(ids, positions))
        base = serving.compute_logits(serving(ids, positions))
    assert torch.equal(logits[0], base[0])  # base request: exactly the serving model's output
    for row, name in enumerate(rows):
        if name is None:
            continue
        merged = _merged(serving, HostAdapter.from_directory(name, paths[name], serving.config))
        with torch.no_grad():
            expected = merged.compute_logits(merged(ids[row : row + 1], positions[:1]))[0]
        assert not torch.allclose(expected, base[row], atol=1e-3)
        torch.testing.assert_close(logits[row], expected, rtol=1e-5, atol=1e-5)
    for i in (1, 2, 3):
        runtime.detach(f"req-{i}")
    runtime.detach("req-0")  # no adapter: ignored
    assert not runtime.set_batch([("req-1", seq)])  # detached: base model again
    assert runtime.manager.has_free_slot() and runtime.can_admit("coder")


def test_gathered_form_equals_masked_form() -> None:
    config = tiny_config("llama")
    weights = StackedLoraWeights(
        config, num_slots=4, max_rank=4, max_tokens=16, dtype=torch.float32
    )
    generator = torch.Generator().manual_seed(0)
    for key in weights.a:
        weights.a[key].copy_(torch.randn(weights.a[key].shape, generator=generator))
        weights.b[key].copy_(torch.randn(weights.b[key].shape, generator=generator))
    slots = torch.tensor([-1, 0, 3, 1, 1, -1, 2])
    weights.set_token_slots(slots)
    x = torch.randn(7, config.hidden_size, generator=generator)
    masked = weights.delta(1, "q_proj", x)
    assert masked is not None
    gathered = gathered_lora_delta(x, weights.a[(1, "q_proj")], weights.b[(1, "q_proj")], slots, 4)
    torch.testing.assert_close(masked, gathered, rtol=1e-5, atol=1e-5)
    assert masked[0].abs().max() == 0 and masked[5].abs().max() == 0


def test_slots_are_reference_counted_and_evicted_lru(
    adapters: tuple[CausalLM, dict[str, Path]],
) -> None:
    serving, paths = adapters
    weights = StackedLoraWeights(
        serving.config, num_slots=2, max_rank=8, max_tokens=8, dtype=torch.float32
    )
    manager = AdapterManager(weights, max_host_adapters=2)
    for name in ("support-bot", "poet", "coder"):
        manager.register(name, paths[name])
    assert manager.names() == ["coder", "poet", "support-bot"]
    assert manager.host_names() == ["poet", "coder"]  # support-bot fell out of the host LRU
    assert manager.disk_loads == 3
    assert manager.acquire("support-bot") == 0  # read from disk again
    assert manager.disk_loads == 4
    assert manager.acquire("poet") == 1
    assert manager.acquire("support-bot") == 0  # already resident: shared, no copy
    with pytest.raises(NoFreeAdapterSlotError):
        manager.acquire("coder")  # both slots held by running requests
    manager.release("poet")
    assert manager.acquire("coder") == 1  # poet's slot was the only free one
    assert manager.slot_of("poet") is None
    manager.release("support-bot")
    manager.release("support-bot")
    manager.release("coder")
    # both free now; slot 0 (support-bot) was used least recently
    assert manager.acquire("poet") == 0
    assert manager.slot_of("support-bot") is None and manager.slot_of("coder") == 1
    with pytest.raises(RuntimeError, match="released more often"):
        manager.release("coder")  # acquired once, released once already
    with pytest.raises(UnknownAdapterError):
        manager.acquire("nobody")


def test_adapter_too_large_for_slots_is_rejected(
    adapters: tuple[CausalLM, dict[str, Path]],
) -> None:
    serving, paths = adapters
    small = StackedLoraWeights(
        serving.config,
        num_slots=1,
        max_rank=4,
        max_tokens=4,
        dtype=torch.float32,
        target_modules=("q_proj", "k_proj", "v_proj", "o_proj"),
    )
    manager = AdapterManager(small)
    manager.register("poet", paths["poet"])
    with pytest.raises(ValueError, match="rank 8 > 4"):
        manager.acquire("poet")
    other = build_random_model(tiny_config("llama", hidden_size=32, head_dim=8), dtype="float32")
    with pytest.raises(ValueError, match="expected"):
        HostAdapter.from_directory("poet", paths["poet"], other.config)


class _Segments:
    """Causal attention over flattened ``[T]`` tokens made of whole sequences (test helper)."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths

    def __call__(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        dense = DenseCausalAttention()
        parts = zip(
            q.split(self.lengths), k.split(self.lengths), v.split(self.lengths), strict=True
        )
        return torch.cat([dense(layer_idx, a[None], b[None], c[None])[0] for a, b, c in parts])


@torch.no_grad()
def test_flattened_tokens_with_fused_serving_model(
    adapters: tuple[CausalLM, dict[str, Path]],
) -> None:
    serving, paths = adapters
    serving.fuse_projections()  # as the decode engine keeps it
    runtime = MultiLoraRuntime(serving, max_tokens=32, num_slots=2, max_rank=8)
    runtime.register("poet", paths["poet"])
    runtime.attach("b", "poet")
    lengths = [7, 5, 9]  # requests a (base), b (poet), c (base), flattened [T] as in decode
    ids = torch.randint(0, 400, (sum(lengths),), generator=torch.Generator().manual_seed(2))
    positions = torch.cat([torch.arange(n) for n in lengths])
    assert runtime.set_batch(list(zip("abc", lengths, strict=True)))
    hidden = runtime.forward(ids, positions, _Segments(lengths))
    rows = list(ids.split(lengths))
    merged = _merged(serving, HostAdapter.from_directory("poet", paths["poet"], serving.config))
    starts = [0, 7, 12]
    for name, row, start in zip("abc", rows, starts, strict=True):
        n = row.numel()
        reference_model = merged if name == "b" else serving
        expected = reference_model(row[None], torch.arange(n)[None])[0]
        got = hidden[start : start + n]
        if name == "b":
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        else:  # base requests: the serving model's own result, bit for bit
            assert torch.equal(got, serving(ids, positions, _Segments(lengths))[start : start + n])
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="set_token_slots gave"):
        runtime.forward(ids[:5], positions[:5], _Segments([5]))
