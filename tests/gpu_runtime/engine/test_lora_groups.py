"""The stacked adapter slots per projection group (what the CUDA decode step reads), on CPU:
the group tensors hold exactly the per-module slots, and the group's shrink + expand adds to
each row its own slot's term (equal to the merged weights' output) and leaves base rows
bit-identical."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpu_runtime.contract.hparams import LoraSpec
from gpu_runtime.engine import Engine, EngineConfig, SamplingParams
from gpu_runtime.finetune.checkpoint import save_adapter
from gpu_runtime.finetune.lora import adapter_parameters, build_training_model
from gpu_runtime.lora.groups import GROUP_MODULES, lora_expand_add_reference
from gpu_runtime.lora.host_adapter import HostAdapter
from gpu_runtime.lora.linear import lora_linear
from gpu_runtime.lora.runtime import MultiLoraRuntime
from gpu_runtime.model import CausalLM, build_random_model
from gpu_runtime.model.tiny import tiny_config

SPECS = {
    "all": LoraSpec(rank=4, alpha=8, target_modules=("all-linear",)),
    "qv": LoraSpec(rank=2, alpha=4, target_modules=("q_proj", "v_proj")),
    "mlp": LoraSpec(rank=4, alpha=4, target_modules=("gate_proj", "down_proj")),
}


def _base() -> CausalLM:
    model = build_random_model(tiny_config("llama"), seed=3, dtype="float32")
    model.fuse_projections()
    return model


@pytest.fixture(scope="module")
def runtime(tmp_path_factory: pytest.TempPathFactory) -> tuple[MultiLoraRuntime, Path]:
    root = tmp_path_factory.mktemp("groups")
    base = _base()
    for i, (name, spec) in enumerate(SPECS.items()):
        tree = build_training_model(base, spec, seed=i)
        gen = torch.Generator().manual_seed(40 + i)
        with torch.no_grad():
            for p in adapter_parameters(tree):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        save_adapter(tree, spec, root / name)
    rt = MultiLoraRuntime(base, max_tokens=16, num_slots=4, max_rank=4)
    for name in SPECS:
        rt.register(name, root / name)
    return rt, root


def _weight(model: CausalLM, layer: int, module: str) -> torch.Tensor:
    block = model.model.layers[layer]
    parent = block.mlp if module in GROUP_MODULES["gate_up"] + ("down_proj",) else block.self_attn
    return getattr(parent, module).weight


def test_groups_hold_each_modules_slots(runtime: tuple[MultiLoraRuntime, Path]) -> None:
    rt, _ = runtime
    weights = rt.weights
    config = weights.config
    layer = weights.groups[1]
    assert list(layer) == ["qkv", "o", "gate_up", "down"]
    width = weights.num_slots * weights.max_rank
    qkv = layer["qkv"]
    nq = config.num_attention_heads * config.head_dim
    nkv = config.num_key_value_heads * config.head_dim
    assert qkv.a.shape == (3 * width, config.hidden_size)
    assert qkv.b.shape == (width, nq + 2 * nkv) and qkv.bounds == (nq, nq + nkv)
    assert layer["gate_up"].bounds == (config.intermediate_size,) and layer["o"].bounds == ()
    # the per-module stacks are views into the group tensors
    assert weights.a[(1, "k_proj")].data_ptr() == qkv.a[width].data_ptr()
    assert weights.b[(1, "v_proj")].data_ptr() == qkv.b[0, nq + nkv].data_ptr()
    assert weights.nbytes == sum(
        t.numel() * 4 for g in weights.groups for grp in g.values() for t in (grp.a, grp.b)
    )


@torch.no_grad()
def test_group_expand_equals_merged_weights_and_keeps_base_rows(
    runtime: tuple[MultiLoraRuntime, Path],
) -> None:
    rt, root = runtime
    names = list(SPECS)
    for i, name in enumerate(names):
        rt.attach(f"r{i}", name)
    try:
        slots = torch.tensor(
            [-1, rt.slot_of_request("r0"), rt.slot_of_request("r1"), -1, rt.slot_of_request("r2")]
        )
        assert rt.slot_of_request("nobody") == -1
        row_names: list[str | None] = [None, *names[:2], None, names[2]]
        base = _base()
        config = base.config
        gen = torch.Generator().manual_seed(0)
        for layer in (0, 1):
            for group_name, modules in GROUP_MODULES.items():
                group = rt.decode_groups()[layer][group_name]
                fan_in = group.a.shape[1]
                x = torch.randn(5, fan_in, generator=gen)
                weight = torch.cat([_weight(base, layer, m) for m in modules])
                out = x @ weight.T
                before = out.clone()
                shrink = torch.nn.functional.linear(x, group.a)
                lora_expand_add_reference(out, shrink, group, slots)
                for row, row_name in enumerate(row_names):
                    if row_name is None:
                        assert torch.equal(out[row], before[row])  # bit-identical base rows
                        continue
                    adapter = HostAdapter.from_directory(row_name, root / row_name, config)
                    merged = []
                    for m in modules:
                        w = _weight(base, layer, m).clone()
                        if (layer, m) in adapter.weights:
                            a, b = adapter.weights[(layer, m)]
                            w += b @ a  # b holds its module's scaling
                        merged.append(w)
                    expected = x[row] @ torch.cat(merged).T
                    torch.testing.assert_close(out[row], expected, rtol=1e-5, atol=1e-5)
    finally:
        for i in range(len(names)):
            rt.detach(f"r{i}")


@torch.no_grad()
def test_shared_gemm_gives_base_output_and_lora_terms(
    runtime: tuple[MultiLoraRuntime, Path],
) -> None:
    """The slots' A rows live below the serving model's fused weights: one GEMM per group."""
    rt, root = runtime
    serving = rt.forward.serving
    rt.attach("s0", "all")
    try:
        slot = rt.slot_of_request("s0")
        slots = torch.tensor([slot, -1, slot])
        adapter = HostAdapter.from_directory("all", root / "all", serving.config)
        gen = torch.Generator().manual_seed(1)
        layer = serving.decoder_layers[1]
        attn, mlp = layer.self_attn, layer.mlp
        bases = {
            "qkv": attn.qkv_weight,
            "o": attn.o_proj.weight,
            "gate_up": mlp.gate_up_weight,
            "down": mlp.down_proj.weight,
        }
        for group_name, modules in GROUP_MODULES.items():
            group = rt.decode_groups()[1][group_name]
            weight = bases[group_name]
            assert weight is not None and group.weight is not None
            assert group.weight.data_ptr() == weight.data_ptr()  # base rows first, then A
            assert group.a.data_ptr() == group.weight[weight.shape[0]].data_ptr()
            x = torch.randn(3, weight.shape[1], generator=gen)
            out = lora_linear(x, weight, None, group, slots)
            torch.testing.assert_close(out[1], x[1] @ weight.T, rtol=1e-6, atol=1e-6)
            merged = []
            for m in modules:
                a, b = adapter.weights[(1, m)]
                merged.append(_weight(serving, 1, m) + b @ a)  # b holds its module's scaling
            expected = x[[0, 2]] @ torch.cat(merged).T
            torch.testing.assert_close(out[[0, 2]], expected, rtol=1e-5, atol=1e-5)
            plain = lora_linear(x, weight, None, None, slots)
            assert torch.equal(plain, x @ weight.T)
    finally:
        rt.detach("s0")


def test_runner_gives_each_decode_row_its_slot(runtime: tuple[MultiLoraRuntime, Path]) -> None:
    """The slot per request the runner stages for the graph path is the runtime's slot."""
    rt, _ = runtime
    base = rt.forward.serving
    config = EngineConfig(num_kv_blocks=64, block_size=4, max_num_seqs=4, max_model_len=32)
    engine = Engine(base, config, lora=rt)
    params = SamplingParams(max_tokens=2, temperature=0.0, detokenize=False, ignore_eos=True)
    ids = [engine.add_request([5, 6, 7], params, lora_name=n) for n in ("qv", None, "mlp")]
    engine.step()
    states = engine.runner.states
    assert [states[i].lora_slot for i in ids] == [
        rt.slot_of_request(ids[0]),
        -1,
        rt.slot_of_request(ids[2]),
    ]
    assert states[ids[0]].lora_slot >= 0 and states[ids[2]].lora_slot >= 0
    while engine.has_unfinished_requests():
        engine.step()
