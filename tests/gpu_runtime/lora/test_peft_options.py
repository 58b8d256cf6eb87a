"""Adapters with peft's LoraConfig options, built and saved by peft itself, served by the engine
with HF + peft's greedy tokens and logprobs (CPU, fp32): rslora, alpha and rank patterns, layer
selection, regex and ``all-linear`` targets, excluded modules; and several of them in one
batch beside base rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_runtime.lora.host_adapter import HostAdapter
from tests.gpu_runtime.lora.peft_reference import (
    base_model,
    edit_config,
    engine_greedy,
    engine_with,
    hf_model,
    peft_greedy,
    prompts,
    write_base,
    write_peft_adapter,
)

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL = [*ATTENTION, "gate_proj", "up_proj", "down_proj"]
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "rslora": ("llama", dict(r=8, lora_alpha=16, use_rslora=True, target_modules=ALL)),
    "alpha-pattern": (
        "llama",
        dict(
            r=4,
            lora_alpha=8,
            target_modules=ALL,
            alpha_pattern={"q_proj": 32, r"model\.layers\.1\.mlp\.down_proj": 2},
        ),
    ),
    "rank-pattern": (
        "llama",
        dict(
            r=4,
            lora_alpha=8,
            target_modules=ATTENTION,
            rank_pattern={"v_proj": 12, "layers.0.self_attn.q_proj": 2},
        ),
    ),
    "patterns-rslora-qwen2": (
        "qwen2",
        dict(
            r=6,
            lora_alpha=12,
            use_rslora=True,
            target_modules=ALL,
            rank_pattern={"mlp.up_proj": 10},
            alpha_pattern={"k_proj": 3, "layers.1.mlp.up_proj": 40},
        ),
    ),
    "layers-to-transform": (
        "llama",
        dict(r=4, lora_alpha=16, target_modules=["q_proj", "gate_proj"], layers_to_transform=[1]),
    ),
    "layers-pattern": (
        "qwen2",
        dict(
            r=4,
            lora_alpha=16,
            target_modules=["v_proj", "down_proj"],
            layers_to_transform=0,
            layers_pattern="layers",
        ),
    ),
    "regex-targets": (
        "qwen2",
        dict(r=4, lora_alpha=8, target_modules=r".*\.(k_proj|up_proj)"),
    ),
    "all-linear": ("qwen2", dict(r=2, lora_alpha=4, target_modules="all-linear")),
    "exclude-modules": (
        "llama",
        dict(
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "o_proj", "down_proj"],
            exclude_modules=r"model\.layers\.0\.self_attn\.o_proj",
        ),
    ),
    # peft resets fan_in_fan_out for nn.Linear; bias="all" over a model without biases saves none
    "fan-in-fan-out": (
        "llama",
        dict(r=4, lora_alpha=8, target_modules=ATTENTION, fan_in_fan_out=True),
    ),
    "bias-all-without-biases": ("llama", dict(r=4, lora_alpha=8, target_modules=ALL, bias="all")),
}
"""name -> (architecture, LoraConfig options)."""


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bases")
    return {arch: write_base(arch, root / arch) for arch in ("llama", "qwen2")}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, bases: dict[str, Path]) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("peft-adapters")
    return {
        name: write_peft_adapter(bases[arch], root / name, seed=i, **options)
        for i, (name, (arch, options)) in enumerate(CASES.items())
    }


def _assert_matches_peft(
    served: tuple[list[int], list[float]], reference: tuple[list[int], list[float]]
) -> None:
    assert served[0] == reference[0]
    torch.testing.assert_close(served[1], reference[1], rtol=0, atol=2e-4)


@pytest.mark.parametrize("name", list(CASES))
def test_option_is_served_with_peft_numbers(
    name: str, bases: dict[str, Path], adapters: dict[str, Path]
) -> None:
    arch = CASES[name][0]
    batch = prompts(3, (7, 12))
    engine, _ = engine_with(arch, {name: adapters[name]})
    served = engine_greedy(engine, batch, [name, name])
    for prompt, row in zip(batch, served, strict=True):
        reference = peft_greedy(bases[arch], adapters[name], prompt)
        _assert_matches_peft(row, reference)
        # the adapter changes the logprobs (otherwise the comparison proves nothing)
        base = peft_greedy(bases[arch], None, prompt)
        assert max(abs(a - b) for a, b in zip(reference[1], base[1], strict=False)) > 1e-2


def test_layout_follows_peft_per_module(bases: dict[str, Path], adapters: dict[str, Path]) -> None:
    """The per-module ranks and scalings are peft's own (read off its loaded layers)."""
    from peft import PeftModel

    for name, (arch, _) in CASES.items():
        config = base_model(arch).config
        layout = HostAdapter.from_directory(name, adapters[name], config).layout
        model = PeftModel.from_pretrained(hf_model(bases[arch]), str(adapters[name]))
        expected = {}
        for key, module in model.get_base_model().named_modules():
            if hasattr(module, "scaling") and "default" in getattr(module, "r", {}):
                parts = key.split(".")
                expected[(int(parts[2]), parts[4])] = (
                    module.r["default"],
                    module.scaling["default"],
                )
        got = {k: (m.rank, m.scaling) for k, m in layout.modules.items()}
        assert got.keys() == expected.keys(), name
        for key, (rank, scaling) in expected.items():
            assert got[key][0] == rank and got[key][1] == pytest.approx(scaling), (name, key)


def test_mixed_options_in_one_batch(bases: dict[str, Path], adapters: dict[str, Path]) -> None:
    """Rows of one batch with different options each (and base rows) get their own numbers."""
    for arch in ("llama", "qwen2"):
        names = [n for n, (a, _) in CASES.items() if a == arch]
        engine, runtime = engine_with(arch, {n: adapters[n] for n in names}, num_slots=len(names))
        rows: list[str | None] = [*names, None, names[0]]
        batch = prompts(5, tuple(5 + 2 * i for i in range(len(rows))))
        served = engine_greedy(engine, batch, rows)
        for prompt, name, row in zip(batch, rows, served, strict=True):
            adapter_dir = adapters[name] if name is not None else None
            _assert_matches_peft(row, peft_greedy(bases[arch], adapter_dir, prompt))
        assert runtime.manager.held_slots() == 0


def test_null_target_modules_is_peft_default(tmp_path: Path, bases: dict[str, Path]) -> None:
    """``target_modules: null`` adapts what peft adapts for the architecture (q_proj, v_proj)."""
    adapter = write_peft_adapter(
        bases["qwen2"],
        tmp_path / "a",
        seed=5,
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj"],
    )
    edit_config(adapter, target_modules=None)
    layout = HostAdapter.from_directory("a", adapter, base_model("qwen2").config).layout
    assert layout.projections == {"q_proj", "v_proj"}
    [prompt] = prompts(2, (9,))
    engine, _ = engine_with("qwen2", {"a": adapter})
    [served] = engine_greedy(engine, [prompt], ["a"])
    _assert_matches_peft(served, peft_greedy(bases["qwen2"], adapter, prompt))
