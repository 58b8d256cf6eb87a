"""Per-request LoRA adapters in the engine (CPU, fp32): a batch mixing base requests and several
adapters gives each request the tokens of a model with its adapter merged into the weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpu_runtime.contract.hparams import LoraSpec
from gpu_runtime.engine import Engine, EngineConfig, SamplingParams, UnknownAdapterError
from gpu_runtime.finetune.checkpoint import save_adapter
from gpu_runtime.finetune.lora import adapter_parameters, build_training_model
from gpu_runtime.lora.host_adapter import HostAdapter
from gpu_runtime.lora.protocol import LoraRuntime
from gpu_runtime.lora.runtime import MultiLoraRuntime
from gpu_runtime.model import CausalLM, build_random_model
from gpu_runtime.model.tiny import tiny_config

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, detokenize=False, ignore_eos=True)
SEED = 7
SPECS = {
    "support-bot": LoraSpec(rank=4, alpha=8),
    "poet": LoraSpec(rank=8, alpha=8, target_modules=("all-linear",)),
    "coder": LoraSpec(rank=2, alpha=4, target_modules=("v_proj", "down_proj")),
}


def _base() -> CausalLM:
    return build_random_model(tiny_config("llama"), seed=SEED, dtype="float32")


def _config(**overrides: object) -> EngineConfig:
    base: dict[str, object] = dict(
        num_kv_blocks=96,
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=24,
        max_model_len=64,
    )
    base.update(overrides)
    return EngineConfig(**base)  # type: ignore[arg-type]


@torch.no_grad()
def _merged(adapter: HostAdapter) -> CausalLM:
    """The base model with `adapter` folded into its weights (the reference)."""
    merged = _base()
    for (layer, module), (a, b) in adapter.weights.items():
        block = merged.model.layers[layer]
        parent = block.mlp if module.endswith(("gate_proj", "up_proj", "down_proj")) else None
        parent = parent or block.self_attn
        getattr(parent, module).weight.add_(b @ a)  # b holds its module's scaling
    return merged


def write_adapters(root: Path) -> dict[str, Path]:
    """`SPECS`' adapters over `_base()` with seeded random A and B, saved under `root`."""
    base = _base()
    dirs: dict[str, Path] = {}
    for i, (name, spec) in enumerate(SPECS.items()):
        tree = build_training_model(base, spec, seed=i)
        generator = torch.Generator().manual_seed(100 + i)
        with torch.no_grad():
            for p in adapter_parameters(tree):
                p.copy_(torch.randn(p.shape, generator=generator) * 0.2)
        dirs[name] = root / name
        save_adapter(tree, spec, dirs[name])
    return dirs


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_adapters(tmp_path_factory.mktemp("adapters"))


def _prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 480, (n,), generator=gen).tolist() for n in lengths]


def _expected(
    adapter_dirs: dict[str, Path], prompts: list[list[int]], names: list[str | None]
) -> list[list[int]]:
    """Greedy tokens per prompt from the base model or its adapter's merged-weights model."""
    out: list[list[int]] = [[] for _ in prompts]
    config = _base().config
    for name in dict.fromkeys(names):
        model = (
            _base()
            if name is None
            else _merged(HostAdapter.from_directory(name, adapter_dirs[name], config))
        )
        idx = [i for i, n in enumerate(names) if n == name]
        results = Engine(model, _config()).generate([prompts[i] for i in idx], GREEDY)
        for i, r in zip(idx, results, strict=True):
            out[i] = r.output_token_ids
    return out


def _lora_engine(
    adapter_dirs: dict[str, Path], num_slots: int, **overrides: object
) -> tuple[Engine, MultiLoraRuntime]:
    base = _base()
    config = _config(**overrides)
    runtime = MultiLoraRuntime(
        base, max_tokens=config.max_num_batched_tokens, num_slots=num_slots, max_rank=8
    )
    for name, directory in adapter_dirs.items():
        runtime.register(name, directory)
    lora: LoraRuntime = runtime  # the finetune runtime satisfies the engine's protocol
    return Engine(base, config, lora=lora), runtime


def _held_slots(runtime: MultiLoraRuntime) -> int:
    return sum(1 for s in range(runtime.weights.num_slots) if not _slot_free(runtime, s))


def _slot_free(runtime: MultiLoraRuntime, slot: int) -> bool:
    return runtime.manager._refs[slot] == 0


def test_mixed_batch_matches_merged_weights_per_adapter(adapter_dirs: dict[str, Path]) -> None:
    prompts = _prompts(0, (5, 13, 9, 21, 3, 11, 7))
    names: list[str | None] = [None, "support-bot", "poet", None, "coder", "support-bot", "poet"]
    expected = _expected(adapter_dirs, prompts, names)
    engine, runtime = _lora_engine(adapter_dirs, num_slots=3)
    outputs = engine.generate(prompts, GREEDY, lora_names=names)
    assert [o.output_token_ids for o in outputs] == expected
    # the adapters change the tokens (otherwise the comparison above proves nothing)
    base_only = _expected(adapter_dirs, prompts, [None] * len(prompts))
    assert all(expected[i] != base_only[i] for i, n in enumerate(names) if n is not None)
    assert _held_slots(runtime) == 0 and runtime._attached == {}
    # a base-only batch on the same engine equals the plain engine (the runtime is not used)
    again = engine.generate(prompts[:3], GREEDY)
    assert [o.output_token_ids for o in again] == base_only[:3]
    with pytest.raises(UnknownAdapterError, match="'nobody'"):
        engine.add_request([1, 2], lora_name="nobody")


def test_without_free_slots_requests_wait_in_order_and_finish(
    adapter_dirs: dict[str, Path],
) -> None:
    prompts = _prompts(1, (6, 4, 5, 8))
    names: list[str | None] = ["poet", "coder", None, "poet"]
    expected = _expected(adapter_dirs, prompts, names)
    engine, runtime = _lora_engine(adapter_dirs, num_slots=1)
    ids = [engine.add_request(p, GREEDY, lora_name=n) for p, n in zip(prompts, names, strict=True)]
    scheduler = engine.scheduler
    engine.step()
    # one slot, held by the poet request: the coder request waits, and FCFS keeps the base
    # request and the second poet request behind it
    assert [r.request_id for r in scheduler.running] == [ids[0]]
    assert [r.request_id for r in scheduler.waiting] == ids[1:]
    assert runtime.manager.slot_of("poet") == 0
    finished: dict[str, list[int]] = {}
    admitted_after: dict[str, set[str]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.output_token_ids
        for r in scheduler.running:
            admitted_after.setdefault(r.request_id, set(finished))
    assert [finished[i] for i in ids] == expected
    assert ids[0] in admitted_after[ids[1]]  # coder got the slot only once poet was done
    assert ids[1] in admitted_after[ids[3]]  # and poet again only after coder
    assert _held_slots(runtime) == 0


def test_abort_releases_the_slot(adapter_dirs: dict[str, Path]) -> None:
    engine, runtime = _lora_engine(adapter_dirs, num_slots=1)
    first = engine.add_request([3, 4, 5], GREEDY, lora_name="poet")
    second = engine.add_request([6, 7], GREEDY, lora_name="coder")
    engine.step()
    assert runtime._attached == {first: "poet"}
    engine.abort_request(first)
    engine.step()
    assert runtime._attached == {second: "coder"}
    engine.abort_request(second)
    assert _held_slots(runtime) == 0 and not engine.has_unfinished_requests()


def test_preempted_adapter_request_reattaches(adapter_dirs: dict[str, Path]) -> None:
    prompts = _prompts(2, (9, 14, 6, 11))
    names: list[str | None] = [None, "support-bot", "poet", "poet"]
    expected = _expected(adapter_dirs, prompts, names)
    # 14 blocks of 4 tokens cannot hold four sequences of ~18 tokens: the latest-arrived
    # (adapter) requests get preempted and recomputed
    engine, runtime = _lora_engine(adapter_dirs, num_slots=2, num_kv_blocks=14)
    ids = [engine.add_request(p, GREEDY, lora_name=n) for p, n in zip(prompts, names, strict=True)]
    requests = {i: engine.scheduler.requests[i] for i in ids}
    finished: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.output_token_ids
        holders = set(runtime._attached)
        running = {r.request_id for r in engine.scheduler.running}
        assert holders == {i for i in running if requests[i].lora_name is not None}
    assert any(requests[i].num_preemptions >= 1 for i in ids if requests[i].lora_name)
    assert [finished[i] for i in ids] == expected
    assert _held_slots(runtime) == 0


def test_adapter_too_large_for_the_slots_fails_only_its_request(
    adapter_dirs: dict[str, Path],
) -> None:
    base = _base()
    config = _config()
    runtime = MultiLoraRuntime(base, max_tokens=config.max_num_batched_tokens, max_rank=4)
    for name, directory in adapter_dirs.items():
        runtime.register(name, directory)
    engine = Engine(base, config, lora=runtime)
    prompts = _prompts(3, (6, 9, 4))
    names: list[str | None] = ["support-bot", "poet", None]  # poet has rank 8 > 4
    outputs = engine.generate(prompts, GREEDY, lora_names=names)
    assert outputs[1].finished and outputs[1].finish_reason == "abort"
    assert outputs[1].output_token_ids == [] and outputs[1].error is not None
    assert "'poet' cannot be served" in outputs[1].error and "rank 8 > 4" in outputs[1].error
    expected = _expected(adapter_dirs, [prompts[0], prompts[2]], ["support-bot", None])
    assert [outputs[0].output_token_ids, outputs[2].output_token_ids] == expected
    assert outputs[0].error is None and runtime._attached == {}


def test_fixed_shape_decode_steps_apply_adapters(adapter_dirs: dict[str, Path]) -> None:
    """Decode steps with adapters run over the bucketed buffers (padding slots as base tokens)."""
    prompts = _prompts(4, (3, 17, 9, 12, 6))
    names: list[str | None] = ["poet", None, "coder", "support-bot", None]
    expected = _expected(adapter_dirs, prompts, names)
    engine, runtime = _lora_engine(
        adapter_dirs, num_slots=3, static_decode_batches=True, cuda_graph_batch_sizes=(1, 2, 4)
    )
    assert engine.runner.static_decode
    outputs = engine.generate(prompts, GREEDY, lora_names=names)  # 5 rows padded to 8
    assert [o.output_token_ids for o in outputs] == expected
    assert engine.runner.decode.num_static_decode_steps >= GREEDY.max_tokens - 2
    assert runtime._attached == {}


def test_fan_out_children_hold_the_adapter_and_match_merged_weights(
    adapter_dirs: dict[str, Path],
) -> None:
    import dataclasses

    from gpu_runtime.engine.fanout import child_id

    prompt = _prompts(5, (10,))[0]
    expected = _expected(adapter_dirs, [prompt], ["poet"])[0]
    engine, runtime = _lora_engine(adapter_dirs, num_slots=1)
    parent = engine.add_request(prompt, dataclasses.replace(GREEDY, n=3), lora_name="poet")
    engine.step()  # the prefill, then the fork: each child attached, the parent detached
    assert runtime._attached == {child_id(parent, i): "poet" for i in range(3)}
    final: dict[int, list[int]] = {}
    while engine.has_unfinished_requests():
        final |= {o.index: o.output_token_ids for o in engine.step() if o.finished}
    assert final == {0: expected, 1: expected, 2: expected}
    assert _held_slots(runtime) == 0 and runtime._attached == {}
