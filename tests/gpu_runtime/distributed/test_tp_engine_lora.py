"""LoRA adapters in a tensor-parallel engine group on CPU (gloo, 2 ranks, fp32 tiny model): the
same script of registrations, requests and unregistrations gives exactly the one-GPU engine's
greedy tokens.

The script (one spawned group runs all of it, async scheduling on): an adapter refused at
registration (on rank 0 only: nothing reaches the followers); base requests beside two
adapters (one rslora with an alpha pattern over all seven projections, one rank 2 on v and
down) in mixed batches; with two slots, a third adapter registered while requests run waits for
a free slot (an eviction: the followers' slots must follow rank 0's); an adapter unregistered
while its request runs lets that request finish and refuses new ones.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_runtime.contract.hparams import LoraSpec
from gpu_runtime.contract.model_config import ModelConfig
from gpu_runtime.distributed.control import DriverChannel
from gpu_runtime.engine import Engine, EngineConfig, SamplingParams, UnknownAdapterError
from gpu_runtime.engine.engine_group import ModelSource, start_engine_group
from gpu_runtime.engine.tp_lora import MirroredLoraRuntime
from gpu_runtime.engine.tp_messages import LoraSettings
from gpu_runtime.finetune.checkpoint import save_adapter
from gpu_runtime.finetune.lora import adapter_parameters, build_training_model
from gpu_runtime.lora.errors import UnsupportedAdapterError
from gpu_runtime.lora.runtime import MultiLoraRuntime
from gpu_runtime.model import build_random_model
from tests.gpu_runtime.threads import one_cpu_thread  # noqa: F401

MODEL = dataclasses.replace(ModelConfig.preset("tiny"), vocab_size=509)
SEED = 7
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SPECS = {
    "patterned": LoraSpec(rank=4, alpha=8, target_modules=ALL),
    "narrow": LoraSpec(rank=2, alpha=4, target_modules=("v_proj", "down_proj")),
    "late": LoraSpec(rank=8, alpha=8, target_modules=("q_proj", "up_proj")),
}
SETTINGS = LoraSettings(num_slots=2, max_rank=8)
CONFIG = EngineConfig(
    num_kv_blocks=64,
    block_size=4,
    max_num_seqs=4,
    max_num_batched_tokens=24,
    max_model_len=96,
    async_scheduling=True,
)


def _write_adapters(root: Path) -> dict[str, Path]:
    base = build_random_model(MODEL, seed=SEED)
    dirs: dict[str, Path] = {}
    for i, (name, spec) in enumerate(SPECS.items()):
        tree = build_training_model(base, spec, seed=i)
        generator = torch.Generator().manual_seed(100 + i)
        with torch.no_grad():
            for p in adapter_parameters(tree):
                p.copy_(torch.randn(p.shape, generator=generator) * 0.2)
        dirs[name] = root / name
        save_adapter(tree, spec, dirs[name])
    config_path = dirs["patterned"] / "adapter_config.json"
    raw = json.loads(config_path.read_text())
    raw.update(use_rslora=True, alpha_pattern={"o_proj": 24, r"model\.layers\.1\.mlp\.up_proj": 3})
    config_path.write_text(json.dumps(raw))
    dirs["dora"] = root / "dora"  # a served model's adapter with an option that is not served
    shutil.copytree(dirs["narrow"], dirs["dora"])
    dora_config = dirs["dora"] / "adapter_config.json"
    dora_config.write_text(json.dumps({**json.loads(dora_config.read_text()), "use_dora": True}))
    return dirs


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)


def _prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 500, (n,), generator=gen).tolist() for n in lengths]


def _run(engine: Engine, lora: MultiLoraRuntime, dirs: dict[str, Path]) -> dict[str, Any]:
    """The script (module docstring); per request label its tokens, plus what was refused."""
    tokens: dict[str, list[int]] = {}
    labels: dict[str, str] = {}

    def add(label: str, prompt: list[int], name: str | None, max_tokens: int = 10) -> None:
        labels[engine.add_request(prompt, _greedy(max_tokens), lora_name=name)] = label
        tokens[label] = []

    def step() -> None:
        for out in engine.step():
            tokens[labels[out.request_id]] += out.new_token_ids

    def drain() -> None:
        while engine.has_unfinished_requests():
            step()

    lora.register("patterned", dirs["patterned"])
    lora.register("narrow", dirs["narrow"])
    refused_register = ""
    try:  # refused on rank 0: nothing is sent, the followers never see it
        lora.register("dora", dirs["dora"])
    except UnsupportedAdapterError as exc:
        refused_register = str(exc)
    mixed = _prompts(1, (5, 9, 3, 12, 7))
    for i, (prompt, name) in enumerate(
        zip(mixed, [None, "patterned", "narrow", "patterned", None], strict=True)
    ):
        add(f"mixed-{i}", prompt, name)
    add("same-base", mixed[1], None)
    drain()
    staggered = _prompts(2, (6, 4, 8, 5))
    add("run-patterned", staggered[0], "patterned", max_tokens=16)
    add("run-narrow", staggered[1], "narrow", max_tokens=6)
    step()
    step()
    lora.register("late", dirs["late"])  # both slots held: its request waits for one
    add("late", staggered[2], "late")
    step()
    assert lora.unregister("patterned")  # its running request keeps its slot to the end
    refused = ""
    try:
        engine.add_request(staggered[3], _greedy(4), lora_name="patterned")
    except UnknownAdapterError as exc:
        refused = str(exc)
    add("after", staggered[3], "narrow")
    drain()
    return {
        "tokens": tokens,
        "refused": refused,
        "refused_register": refused_register,
        "names": lora.names(),
    }


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return _write_adapters(tmp_path_factory.mktemp("tp-engine-lora"))


def test_two_ranks_serve_adapters_with_the_one_gpu_tokens(dirs: dict[str, Path]) -> None:
    model = build_random_model(MODEL, seed=SEED)
    runtime = MultiLoraRuntime(
        model, max_tokens=CONFIG.max_num_batched_tokens, num_slots=2, max_rank=8
    )
    want = _run(Engine(model, CONFIG, lora=runtime), runtime, dirs)
    tokens = want["tokens"]
    assert tokens["mixed-1"] != tokens["same-base"]  # the adapters change the tokens
    assert tokens["mixed-2"] != tokens["mixed-1"]
    assert "'patterned'" in want["refused"] and want["names"] == ["late", "narrow"]
    assert "use_dora" in want["refused_register"]
    with start_engine_group(
        ModelSource(config=MODEL, seed=SEED), CONFIG, 2, cpu_threads=1, timeout_s=120, lora=SETTINGS
    ) as group:
        lora = group.engine.lora
        assert isinstance(lora, MirroredLoraRuntime)
        got = _run(group.engine, lora, dirs)
        assert lora.manager.held_slots() == 0 and lora._attached == {}
        group.engine.add_request([1, 2, 3], _greedy(3))  # the followers are still in step
        while group.engine.has_unfinished_requests():
            group.engine.step()
    assert got == want
    assert [p.exitcode for p in group.processes] == [0]


def test_a_tensor_parallel_engine_refuses_an_unmirrored_runtime() -> None:
    with pytest.raises(TypeError, match="takes LoraSettings"):
        start_engine_group(ModelSource(config=MODEL), CONFIG, 2, lora=object())  # type: ignore[arg-type]
    from gpu_runtime.distributed.parallel import TensorParallel
    from gpu_runtime.model import CausalLM

    fake = object()  # never used: nothing below communicates
    rank0 = TensorParallel(rank=0, size=2, group=fake, finetune_group=fake, control_group=fake)
    model = CausalLM(MODEL, parallel=rank0)
    plain = MultiLoraRuntime(model, max_tokens=24, num_slots=1, max_rank=4)
    with pytest.raises(TypeError, match="through a MirroredLoraRuntime"):
        Engine(model, CONFIG, lora=plain, control=DriverChannel.__new__(DriverChannel))
