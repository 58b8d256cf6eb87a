"""CUDA-only: per-request LoRA in the bf16 engine with captured decode graphs. Each request's
sampled-token logprobs match a dense forward of its merged-weights model, and adapter decode
steps replay the LoRA graphs; the Triton expand-add kernel matches its torch form. Skipped
without CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpu_runtime.contract.hparams import LoraSpec
from gpu_runtime.engine import Engine, EngineConfig, SamplingParams
from gpu_runtime.finetune.checkpoint import save_adapter
from gpu_runtime.finetune.lora import adapter_parameters, build_training_model
from gpu_runtime.lora.groups import LoraGroup, lora_expand_add_reference
from gpu_runtime.lora.host_adapter import HostAdapter
from gpu_runtime.lora.runtime import MultiLoraRuntime
from gpu_runtime.model import CausalLM
from tests.gpu_runtime.small_model import small_config, small_cuda_model

pytestmark = pytest.mark.gpu

CONFIG = small_config("llama")


def _model() -> CausalLM:
    return small_cuda_model("llama")


@torch.no_grad()
def _merged(adapter: HostAdapter) -> CausalLM:
    merged = _model()
    for (layer, module), (a, b) in adapter.weights.items():
        block = merged.model.layers[layer]
        parent = block.mlp if module.endswith(("gate_proj", "up_proj", "down_proj")) else None
        weight = getattr(parent or block.self_attn, module).weight
        delta = b.float() @ a.float()  # b holds its module's scaling
        weight.copy_((weight.float() + delta.to(weight.device)).to(weight.dtype))
    return merged


def test_cuda_engine_serves_adapters_beside_graph_decode(tmp_path: Path) -> None:
    model = _model()
    specs = {"alpha": LoraSpec(rank=8, alpha=16), "beta": LoraSpec(rank=4, alpha=8)}
    for i, (name, spec) in enumerate(specs.items()):
        tree = build_training_model(model, spec, seed=i)
        gen = torch.Generator().manual_seed(10 + i)
        with torch.no_grad():
            for p in adapter_parameters(tree):
                p.copy_(torch.randn(p.shape, generator=gen).to(p) * 0.05)
        save_adapter(tree, spec, tmp_path / name)
    config = EngineConfig(
        num_kv_blocks=256,
        block_size=16,
        max_num_seqs=8,
        max_model_len=256,
        max_num_batched_tokens=512,
        device="cuda",
    )
    runtime = MultiLoraRuntime(model, max_tokens=config.max_num_batched_tokens, num_slots=2)
    for name in specs:
        runtime.register(name, tmp_path / name)
    engine = Engine(model, config, lora=runtime)
    assert engine.runner.decode.fused_lora_decode
    assert engine.capture_cuda_graphs() == [8, 4, 2, 1]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 1000, (n,), generator=gen).tolist() for n in (5, 40, 77, 23)]
    names: list[str | None] = [None, "alpha", "beta", "alpha"]
    params = SamplingParams(
        max_tokens=12, temperature=0.0, logprobs=1, detokenize=False, ignore_eos=True
    )
    ids = [engine.add_request(p, params, lora_name=n) for p, n in zip(prompts, names, strict=True)]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    logprobs: dict[str, list[float]] = {i: [] for i in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            logprobs[out.request_id].extend(lp.logprob for lp in out.new_logprobs)
    references = {n: _merged(HostAdapter.from_directory(n, tmp_path / n, CONFIG)) for n in specs}
    agree = total = 0
    for rid, prompt, lora_name in zip(ids, prompts, names, strict=True):
        reference = _model() if lora_name is None else references[lora_name]
        full = torch.tensor([prompt + tokens[rid]], device="cuda")
        positions = torch.arange(full.shape[1], device="cuda")[None]
        with torch.no_grad():
            logits = reference.compute_logits(reference(full, positions))
        ref = logits.float().log_softmax(-1)[0, len(prompt) - 1 : -1]
        ours = torch.tensor(logprobs[rid], device="cuda")
        theirs = ref.gather(-1, torch.tensor(tokens[rid], device="cuda")[:, None])[:, 0]
        assert torch.allclose(ours, theirs, atol=0.1), (lora_name, ours, theirs)
        agree += int((ref.argmax(-1).cpu() == torch.tensor(tokens[rid])).sum())
        total += len(tokens[rid])
    assert agree >= 0.9 * total
    assert runtime._attached == {}
    assert (
        engine.runner.decode.num_lora_graph_steps >= 8
    )  # adapter decode steps replayed LoRA graphs
    # base-only requests afterwards still take the fixed-shape (graph) decode path
    before = engine.runner.decode.num_static_decode_steps
    engine.generate([prompts[0]], params)
    assert engine.runner.decode.num_static_decode_steps > before


def _adapter_engine(root: Path, async_scheduling: bool) -> tuple[Engine, MultiLoraRuntime]:
    """bf16 engine with graphs over a fresh seeded model, adapters "alpha" (rank 8) and
    "beta" (rank 4, all-linear) saved under `root` on first use, two slots."""
    model = _model()
    specs = {
        "alpha": LoraSpec(rank=8, alpha=16),
        "beta": LoraSpec(rank=4, alpha=8, target_modules=("all-linear",)),
    }
    for i, (name, spec) in enumerate(specs.items()):
        if (root / name).exists():
            continue
        tree = build_training_model(model, spec, seed=i)
        gen = torch.Generator().manual_seed(20 + i)
        with torch.no_grad():
            for p in adapter_parameters(tree):
                p.copy_(torch.randn(p.shape, generator=gen).to(p) * 0.05)
        save_adapter(tree, spec, root / name)
    config = EngineConfig(
        num_kv_blocks=256,
        block_size=16,
        max_num_seqs=8,
        max_model_len=256,
        max_num_batched_tokens=64,
        device="cuda",
        async_scheduling=async_scheduling,
    )
    runtime = MultiLoraRuntime(model, max_tokens=config.max_num_batched_tokens, num_slots=2)
    for name in specs:
        runtime.register(name, root / name)
    engine = Engine(model, config, lora=runtime)
    assert engine.capture_cuda_graphs() == [8, 4, 2, 1]
    return engine, runtime


def _run_adapters(
    engine: Engine, params: SamplingParams, staggered: bool
) -> list[tuple[list[int], list[float], str | None]]:
    """Five requests (two adapters beside base rows), queued up front or one every other
    call; per request: tokens, logprobs, finish reason."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 1000, (n,), generator=gen).tolist() for n in (5, 40, 77, 3, 20)]
    names: list[str | None] = ["alpha", None, "beta", "beta", None]
    pending = list(zip(prompts, names, strict=True))
    ids: list[str] = []
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[float]] = {}
    reasons: dict[str, str | None] = {}
    call = 0
    while pending or engine.has_unfinished_requests():
        while pending and (not staggered or call % 2 == 0):
            prompt, name = pending.pop(0)
            ids.append(engine.add_request(prompt, params, lora_name=name))
            tokens[ids[-1]], logprobs[ids[-1]] = [], []
            if staggered:
                break
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            logprobs[out.request_id] += [lp.logprob for lp in out.new_logprobs]
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        call += 1
    return [(tokens[i], logprobs[i], reasons[i]) for i in ids]


def test_async_scheduling_with_adapters(tmp_path: Path) -> None:
    """Async scheduling over the LoRA graphs. Requests queued up front: the synchronous
    engine's steps, so bit-equal tokens and logprobs (greedy with logprobs, seeded sampling).
    One request every other call, some stopping on a token (their next step, in flight,
    is discarded): rows of some calls run in other kernels than on the synchronous engine
    (see `test_gpu_decode_paths.py`), so within bf16; every slot released at the end."""
    greedy = SamplingParams(
        max_tokens=16, temperature=0.0, logprobs=1, detokenize=False, ignore_eos=True
    )
    seeded = SamplingParams(
        max_tokens=12, temperature=0.8, seed=5, detokenize=False, ignore_eos=True
    )
    for params in (greedy, seeded):
        reference = _run_adapters(_adapter_engine(tmp_path, False)[0], params, False)
        engine, runtime = _adapter_engine(tmp_path, True)
        assert _run_adapters(engine, params, False) == reference
        assert (
            engine.runner.num_overlapped_steps > 0 and engine.runner.decode.num_lora_graph_steps > 0
        )
        assert runtime._attached == {}
    free = _run_adapters(_adapter_engine(tmp_path, False)[0], greedy, True)
    stop = tuple({tokens[6] for tokens, _, _ in free[:3]})
    stopping = SamplingParams(
        max_tokens=16, temperature=0.0, logprobs=1, detokenize=False, stop_token_ids=stop
    )
    for params in (greedy, stopping):
        reference = _run_adapters(_adapter_engine(tmp_path, False)[0], params, True)
        engine, runtime = _adapter_engine(tmp_path, True)
        got = _run_adapters(engine, params, True)
        agree = total = 0
        for (ref_tokens, ref_lps, _), (tokens, lps, _) in zip(reference, got, strict=True):
            same = next(
                (i for i, (a, b) in enumerate(zip(ref_tokens, tokens, strict=False)) if a != b),
                min(len(ref_tokens), len(tokens)),
            )
            agree += same
            total += len(ref_tokens)
            if same:
                diff = torch.tensor(ref_lps[:same]) - torch.tensor(lps[:same])
                assert float(diff.abs().max()) < 0.05, diff
        assert agree >= 0.9 * total
        assert (
            engine.runner.num_overlapped_steps > 0 and engine.runner.decode.num_lora_graph_steps > 0
        )
        assert runtime._attached == {} and not engine.has_unfinished_requests()
        engine.step()
        assert engine.runner.states == {}


@pytest.mark.parametrize(
    ("tokens", "bounds", "rank", "slots"),
    [(5, (256, 320), 8, 3), (37, (512,), 16, 8), (70, (), 4, 2)],
)
def test_expand_kernel_matches_torch_form(
    tokens: int, bounds: tuple[int, ...], rank: int, slots: int
) -> None:
    from gpu_runtime.lora.expand_kernel import lora_expand_add_

    torch.manual_seed(0)
    dev, dt = torch.device("cuda"), torch.bfloat16
    n_total = 384 if bounds == (256, 320) else 1024
    groups = len(bounds) + 1
    width = slots * rank
    group = LoraGroup(
        a=torch.randn(groups * width, 64, device=dev, dtype=dt),
        b=torch.randn(width, n_total, device=dev, dtype=dt) * 0.1,
        bounds=bounds,
        max_rank=rank,
    )
    shrink = torch.randn(tokens, groups * width, device=dev, dtype=dt)
    row_slots = torch.randint(-1, slots, (tokens,), device=dev)
    row_slots[0] = -1
    out = torch.randn(tokens, n_total, device=dev, dtype=dt)
    ref = out.clone()
    lora_expand_add_reference(ref, shrink, group, row_slots)
    before = out.clone()
    lora_expand_add_(out, shrink, group, row_slots)
    base_rows = row_slots < 0
    assert torch.equal(out[base_rows], before[base_rows])
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    assert (out[~base_rows] - before[~base_rows]).abs().max() > 0.1


@pytest.mark.parametrize(
    ("share_gemms", "in_kernels"), [(False, False), (True, False), (False, True), (True, True)]
)
@torch.no_grad()
def test_fused_step_keeps_base_rows(tmp_path: Path, share_gemms: bool, in_kernels: bool) -> None:
    """Separate shrink GEMMs: base rows bit-identical to the base step. Shared GEMMs (A rows
    below the fused weights): the base rows' GEMM may be tiled differently, so equal up to
    bf16 rounding. The adapter row matches the eager LoRA forward (expand terms in the RoPE /
    SwiGLU kernels or in separate expand kernels)."""
    model = _model()
    spec = LoraSpec(rank=8, alpha=16, target_modules=("all-linear",))
    tree = build_training_model(model, spec, seed=0)
    for p in adapter_parameters(tree):
        p.normal_(0, 0.05)
    save_adapter(tree, spec, tmp_path / "x")
    config = EngineConfig(
        num_kv_blocks=64,
        max_num_seqs=8,
        max_model_len=128,
        device="cuda",
        lora_expand_in_kernels=in_kernels,
    )
    runtime = MultiLoraRuntime(
        model, max_tokens=config.max_num_batched_tokens, num_slots=2, share_gemms=share_gemms
    )
    runtime.register("x", tmp_path / "x")
    runtime.attach("r", "x")
    engine = Engine(model, config, lora=runtime)
    runner = engine.runner
    runner.decode.buf_ints[0, :8] = torch.arange(8) + 3
    runner.decode.buf_ints[1, :8] = 0
    runner.decode.buf_ints[2, :8] = torch.arange(8)  # each row its own KV block
    runner.decode.buf_ints[3, :8] = 0
    runner.decode.buf_table[:8, 0] = torch.arange(8)
    runner.decode.buf_seq_lens[:8] = 1
    base = runner.decode.decode_forward(8).clone()
    runner.decode.buf_ints[4, :8] = -1

    def same(x: torch.Tensor, y: torch.Tensor) -> bool:
        if share_gemms:
            return bool(torch.allclose(x.float(), y.float(), rtol=2e-2, atol=2e-2))
        return torch.equal(x, y)

    assert same(runner.decode.decode_forward_lora(8), base)
    runner.decode.buf_ints[4, 2] = runtime.slot_of_request("r")
    mixed = runner.decode.decode_forward_lora(8)
    rows = [0, 1, 3, 4, 5, 6, 7]
    assert same(mixed[rows], base[rows])
    assert (mixed[2].float() - base[2].float()).abs().max() > 1e-2
    runtime.weights.set_token_slots(runner.decode.buf_ints[4, :8].cpu())
    eager = runner.decode.decode_forward(8, runtime.forward)  # the unfused LoRA forward
    effect = float((eager[2].float() - base[2].float()).abs().max())
    assert float((mixed[2].float() - eager[2].float()).abs().max()) < max(0.25 * effect, 2e-2)
