"""Adapters this server cannot serve with HF + peft's numbers are refused at registration with
an error naming the field (or tensor), and the registry is left exactly as it was: an adapter
registered before keeps serving identical tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from gpu_runtime.lora.errors import AdapterConfigError, UnsupportedAdapterError
from tests.gpu_runtime.lora.peft_reference import (
    edit_config,
    engine_greedy,
    engine_with,
    peft_greedy,
    prompts,
    write_base,
    write_peft_adapter,
)

PLAIN: dict[str, Any] = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
REFUSED: dict[str, tuple[str, str, dict[str, Any]]] = {
    "dora": ("llama", "use_dora=True", dict(PLAIN, use_dora=True)),
    "lora-bias": ("llama", "lora_bias=True", dict(PLAIN, lora_bias=True)),
    "modules-to-save": ("llama", "modules_to_save=", dict(PLAIN, modules_to_save=["lm_head"])),
    "pissa": ("llama", "init_lora_weights='pissa'", dict(PLAIN, init_lora_weights="pissa")),
    "lm-head-target": (
        "llama",
        "matches lm_head",
        dict(PLAIN, target_modules=["q_proj", "lm_head"]),
    ),
    "embedding-target": (
        "llama",
        "matches model.embed_tokens",
        dict(PLAIN, target_modules=["embed_tokens", "v_proj"]),
    ),
    "trained-biases": ("qwen2", "bias='all'", dict(PLAIN, bias="all")),
    "trainable-tokens": (
        "llama",
        "trainable_token_indices=",
        dict(PLAIN, trainable_token_indices=[3, 5]),
    ),
    "loha": (
        "llama",
        "peft_type='LOHA'",
        dict(config_class="LoHaConfig", r=4, target_modules=["q_proj"]),
    ),
}
"""name -> (architecture, what the error names, peft options)."""


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bases")
    return {arch: write_base(arch, root / arch) for arch in ("llama", "qwen2")}


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory, bases: dict[str, Path]) -> dict[str, Path]:
    """A plain adapter per architecture, registered before each refused one."""
    root = tmp_path_factory.mktemp("good")
    return {a: write_peft_adapter(bases[a], root / a, seed=1, **PLAIN) for a in ("llama", "qwen2")}


def _assert_refused_and_registry_kept(
    arch: str, good_dir: Path, bad_dir: Path, error: type[Exception], match: str
) -> None:
    engine, runtime = engine_with(arch, {"good": good_dir}, num_slots=2)
    batch = prompts(9, (6, 10))
    before = engine_greedy(engine, batch, ["good", None])
    manager = runtime.manager
    state = (runtime.names(), manager.host_names(), manager.disk_loads, manager.resident())
    with pytest.raises(error, match=match) as raised:
        runtime.register("bad", bad_dir)
    assert "'bad'" in str(raised.value)  # the message names the adapter too
    assert (runtime.names(), manager.host_names(), manager.disk_loads, manager.resident()) == state
    assert not runtime.has("bad")
    assert engine_greedy(engine, batch, ["good", None]) == before


@pytest.mark.parametrize("name", list(REFUSED))
def test_unserved_option_is_refused_at_registration(
    name: str, tmp_path: Path, bases: dict[str, Path], good: dict[str, Path]
) -> None:
    arch, match, options = REFUSED[name]
    bad = write_peft_adapter(bases[arch], tmp_path / name, seed=2, **options)
    _assert_refused_and_registry_kept(arch, good[arch], bad, UnsupportedAdapterError, match)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"task_type": "SEQ_CLS"}, "task_type='SEQ_CLS'"),
        ({"peft_type": "PREFIX_TUNING"}, "peft_type='PREFIX_TUNING'"),
        ({"use_some_future_variant": True}, "use_some_future_variant=True"),
        ({"layer_replication": [[0, 2], [1, 2]]}, "layer_replication="),
        ({"megatron_config": {"tensor_model_parallel_size": 2}}, "megatron_config="),
    ],
)
def test_refused_config_fields(
    fields: dict[str, Any],
    match: str,
    tmp_path: Path,
    bases: dict[str, Path],
    good: dict[str, Path],
) -> None:
    bad = write_peft_adapter(bases["llama"], tmp_path / "bad", seed=2, **PLAIN)
    edit_config(bad, **fields)
    _assert_refused_and_registry_kept("llama", good["llama"], bad, UnsupportedAdapterError, match)


def test_unknown_field_left_off_is_served(tmp_path: Path, bases: dict[str, Path]) -> None:
    """A field this server does not know, at an off value (null, false, empty), changes
    nothing: the adapter is served with peft's numbers."""
    adapter = write_peft_adapter(bases["llama"], tmp_path / "a", seed=4, **PLAIN)
    [prompt] = prompts(1, (8,))
    reference = peft_greedy(bases["llama"], adapter, prompt)
    edit_config(adapter, use_some_future_variant=False, some_future_config=None, more=[])
    engine, _ = engine_with("llama", {"a": adapter})
    [served] = engine_greedy(engine, [prompt], ["a"])
    assert served[0] == reference[0]
    torch.testing.assert_close(served[1], reference[1], rtol=0, atol=2e-4)


def _drop_tensor(directory: Path, contains: str) -> None:
    path = directory / "adapter_model.safetensors"
    tensors = load_file(str(path))
    save_file({k: v for k, v in tensors.items() if contains not in k}, str(path))


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        ("drop-tensor", "lacks base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"),
        ("untargeted-tensor", "does not target as LoRA A/B"),
        ("wrong-rank", r"expected \(8, 64\)"),
    ],
)
def test_tensors_that_disagree_with_the_config_are_refused(
    damage: str, match: str, tmp_path: Path, bases: dict[str, Path], good: dict[str, Path]
) -> None:
    """peft would ignore a tensor its config does not target and initialise a missing one:
    either is refused, not served differently."""
    bad = write_peft_adapter(bases["llama"], tmp_path / "bad", seed=2, **PLAIN)
    if damage == "drop-tensor":
        _drop_tensor(bad, "layers.1.self_attn.v_proj.lora_B")
    elif damage == "untargeted-tensor":
        edit_config(bad, target_modules=["q_proj", "v_proj"])
    else:
        edit_config(bad, r=8)
    _assert_refused_and_registry_kept("llama", good["llama"], bad, AdapterConfigError, match)


def test_every_lora_config_field_is_classified() -> None:
    """Each field of the installed peft's LoraConfig is served, without effect, or refused when
    set: a peft that adds one fails here until it is classified."""
    import dataclasses

    import peft

    from gpu_runtime.lora.adapter_config import NO_EFFECT_FIELDS, REFUSED_WHEN_SET, SERVED_FIELDS

    groups = (SERVED_FIELDS, NO_EFFECT_FIELDS, frozenset(REFUSED_WHEN_SET))
    assert not any(a & b for i, a in enumerate(groups) for b in groups[i + 1 :])
    fields = {f.name for f in dataclasses.fields(peft.LoraConfig)}
    assert fields == SERVED_FIELDS | NO_EFFECT_FIELDS | frozenset(REFUSED_WHEN_SET)


def test_server_entry_point_names_the_refused_option(tmp_path: Path) -> None:
    """``python -m gpu_runtime.server --adapter NAME=DIR`` with an adapter that is not served
    exits with the option named, not a traceback."""
    from gpu_runtime.model.tiny import build_tiny_model_dir
    from gpu_runtime.server.__main__ import build, parse_args

    model_dir = build_tiny_model_dir(tmp_path / "tiny", "llama")
    write_peft_adapter(model_dir, tmp_path / "dora", seed=3, **dict(PLAIN, use_dora=True))
    args = parse_args(
        [
            "--model-dir",
            str(model_dir),
            "--num-kv-blocks",
            "64",
            "--adapter",
            f"d={tmp_path / 'dora'}",
        ]
    )
    with pytest.raises(SystemExit, match=r"--adapter d=.*adapter 'd': use_dora=True: DoRA"):
        build(args)
