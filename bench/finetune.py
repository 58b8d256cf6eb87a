"""LoRA finetune speed and memory on one GPU: our trainer vs HF transformers + PEFT, plus the
cost of batched multi-LoRA in a decode step.

Training (per LoRA targets x sequence length x micro-batch): Llama-3-8B shape, seeded random bf16
weights, rank 16, alpha 32, dropout 0.05, bf16 autocast, fused AdamW over fp32 adapter
parameters, gradient clipping at 1.0, one optimizer step per micro-batch, every token but the
first a loss target. Ours: `LoraTrainer.step_quantum` over the serving model's own tensors
(fused q|k|v and gate|up, as the decode engine keeps them), each micro-batch's forward and
backward replayed from a CUDA graph (the trainer's default on CUDA; `harli_eager` is the same
trainer with `cuda_graphs=False`, the first two quanta of a graphed row are its warm-up and
capture). Reference: a plain torch loop over
`peft.get_peft_model(LlamaForCausalLM)` built on the same tensors (no second copy in this run;
a separate HF+PEFT process would need its own copy of the base weights, hence
`extra_mem_on_decode_gpu_gb`). Both see the same token ids. Before timing, the first losses of
both (adapters start at B = 0, so both equal the base model's loss) are compared.

Timing: `--warmup` steps, then `--steps` steps each timed on the host after the step's sync
(ours syncs once per quantum; HF reads `loss.item()`); tokens/s = tokens per step / median step.

CUDA-graphed quanta (H200, torch 2.11, the shape above, q/k/v/o, one optimizer step per quantum,
medians of 5 after the warm-up and capture quanta; measured at da11f8a, the JSON is
`bench/results/finetune-quanta-h200-20261130.json`; `--systems harli,harli_eager` gives the same
rows, with `launch_ms_p50` and `host_ms_p50`): a quantum's wall ms eager -> graphed, and its host
ms (its CPU/GIL time before its one sync) eager -> graphed:

    1 x 256   93.4 -> 27.1 ms (3.45x)   host 93.1 -> 5.4 ms (launch of fwd+bwd 88.9 -> 0.7)
    2 x 256   95.3 -> 39.4 ms (2.42x)   host 95.0 -> 5.7 ms
    8 x 256  130.8 -> 127.2 ms (1.03x)  host 107.0 -> 6.6 ms
    4 x 512  131.9 -> 130.9 ms (1.01x)  host 113.7 -> 10.9 ms
    1 x 2048 150.6 -> 133.1 ms (1.13x)  host 148.6 -> 10.7 ms

Losses equal eager ones within 2.5e-4 (same shapes, same dropout masks); peak memory +0.1 GB.
Small quanta were host-bound (about 3,800 kernel launches from Python and autograd per
micro-batch); graphed, they are GPU-bound, and the quantum's CPU work, which competes with the
decode loop for the GIL, drops 10-17x. The first quantum on a stream runs eagerly (warm-up), the
first of each shape after it captures (about 180-370 ms), as `graph_modes` in each row shows.

Multi-LoRA decode (`multi_lora_decode`, through `bench/multilora.py`): `Engine.step()` TPOT at
batch 32, context 512, CUDA graphs on CUDA: base-only rows, every row on one of 8 adapters (rank
16), and mixed, for q/k/v/o and all-linear LoRA (see that file's docstring).

Run: `PYTHONPATH=. python3 bench/finetune.py` (see --help; `--model tiny --device cpu` is a
smoke run). Writes `<out>/finetune-h200-<yyyymmdd>.json` after every row and prints a table last.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from gpu_runtime.finetune.batching import epoch_order
from gpu_runtime.finetune.data import IGNORE_INDEX, TokenizedExample
from gpu_runtime.finetune.hparams import LoraSpec, resolve_hyperparameters
from gpu_runtime.finetune.trainer import LoraTrainer
from gpu_runtime.model import CausalLM, ModelConfig, build_random_model

TARGETS = {"qkvo": ("q_proj", "k_proj", "v_proj", "o_proj"), "all": ("all-linear",)}
GB = 1e9


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def mem_ratio(row: dict[str, Any], ref: dict[str, Any], key: str) -> float | None:
    return round(row[key] / ref[key], 3) if ref[key] else None


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device: torch.device) -> int:
    """Clear the peak counter; returns bytes allocated now (the row's baseline)."""
    gc.collect()
    if device.type != "cuda":
        return 0
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def peak(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def random_examples(vocab: int, count: int, seq: int, seed: int) -> list[TokenizedExample]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (count, seq), generator=generator).tolist()
    return [TokenizedExample(tuple(row), (IGNORE_INDEX, *row[1:])) for row in ids]


def hf_peft_model(serving: CausalLM, spec: LoraSpec, device: torch.device) -> Any:
    """`get_peft_model(LlamaForCausalLM)` whose base parameters are `serving`'s tensors."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.for_model(**serving.config.to_hf_config())
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_config, dtype=serving.lm_head.weight.dtype)
    hf.load_state_dict(serving.state_dict(), assign=True, strict=False)
    hf.tie_weights()
    rotary = hf.model.rotary_emb
    with torch.device(device):
        hf.model.rotary_emb = type(rotary)(config=hf.config)
    hf.config.use_cache = False
    config = LoraConfig(
        r=spec.rank,
        lora_alpha=int(spec.alpha),
        lora_dropout=spec.dropout,
        target_modules=list(spec.target_modules),
        task_type="CAUSAL_LM",
    )
    return get_peft_model(hf, config).train()


def run_ours(
    serving: CausalLM,
    spec: LoraSpec,
    examples: list[TokenizedExample],
    micro: int,
    warmup: int,
    variant: str,
) -> tuple[list[float], list[float], dict[str, Any]]:
    """variant: "harli" (fused forward, CUDA graphs), "harli_eager" (the same, no graphs),
    "harli_peft_tree" (peft modules' own forward), "harli_sliced4" (quanta of 4 decoder-layer
    passes; one timed step = a whole micro-batch), "harli_ckpt" (activation checkpointing).
    Returns step times, losses and how the quanta ran (graph modes, host launch ms)."""
    hparams = resolve_hyperparameters(
        n_train_examples=len(examples),
        n_epochs=1,
        batch_size=micro,
        lora=spec,
        seed=0,
        activation_checkpointing=variant == "harli_ckpt",
    )
    trainer = LoraTrainer(
        serving,
        examples,
        hparams,
        fused_forward=variant != "harli_peft_tree",
        cuda_graphs=False if variant == "harli_eager" else None,
    )
    max_layers = 4 if variant == "harli_sliced4" else None
    times, losses, modes, launches, hosts = [], [], [], [], []
    while not trainer.finished:
        start = time.perf_counter()
        result = trainer.step_quantum(max_examples=micro, max_layers=max_layers)
        while not result.micro_batch_done:
            result = trainer.step_quantum(max_examples=micro, max_layers=max_layers)
        times.append(time.perf_counter() - start)
        assert result.loss is not None
        losses.append(result.loss)
        assert result.optimizer_step and result.examples == micro
        modes.append(result.graph)
        launches.append(result.launch_s)
        hosts.append(result.host_s)
    timed = [x for x in launches[warmup:] if x is not None]
    host = [x for x in hosts[warmup:] if x is not None]
    info: dict[str, Any] = {
        "graph_modes": modes,
        "launch_ms_p50": round(statistics.median(timed) * 1e3, 3) if timed else None,
        "host_ms_p50": round(statistics.median(host) * 1e3, 3) if host else None,
        "graph_fallback": None if trainer.graphs is None else trainer.graphs.disabled,
    }
    del trainer
    return times[warmup:], losses, info


def run_hf(
    model: Any,
    examples: list[TokenizedExample],
    micro: int,
    warmup: int,
    device: torch.device,
) -> tuple[list[float], list[float]]:
    """Train the (reused) HF+PEFT model with a fresh AdamW, one step per micro-batch."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=2e-4, fused=device.type == "cuda")
    # the order our trainer draws (seed 0), so both see the same batches
    order = epoch_order([e.num_tokens for e in examples], micro, seed=0, epoch=0)
    ids = torch.tensor([examples[i].input_ids for i in order], dtype=torch.long)
    times, losses = [], []
    for start_row in range(0, len(examples), micro):
        batch = ids[start_row : start_row + micro].to(device)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.item()))
        times.append(time.perf_counter() - start)
    del optimizer, params
    return times[warmup:], losses


@torch.no_grad()
def multi_lora_decode(
    serving: CausalLM, batch: int, adapters: int, rank: int, iters: int, device: torch.device
) -> list[dict[str, Any]]:
    """`Engine.step()` TPOT at context 512 through `bench/multilora.py`: base-only rows, every
    row on one of `adapters` adapters, and mixed, for q/k/v/o and all-linear LoRA (CUDA graphs
    on CUDA). Each row keeps bench/multilora.py's keys plus `step_ms_p50` and `cuda_graph`."""
    from bench.multilora import run_multilora

    rows, checks = run_multilora(
        serving, batch=batch, context=512, adapters=adapters, rank=rank, steps=iters
    )
    out: list[dict[str, Any]] = []
    for row in rows:
        if row["system"] != "harli":
            out.append(row)  # the previous eager LoRA path, forward only
            continue
        is_base = row["mix"] == "base"
        out.append(
            row
            | {
                "system": "harli_base" if is_base else f"harli_multi_lora_{row['mix']}",
                "step_ms_p50": row["tpot_ms_p50"],
                "cuda_graph": device.type == "cuda" and (is_base or row["lora_graph_steps"] > 0),
                "check": None if is_base else checks[row["lora_targets"]],
            }
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama3-8b", help="ModelConfig preset")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--targets", default="qkvo,all")
    parser.add_argument("--seq", default="512,2048")
    parser.add_argument("--micro", default="1,2,4,8")
    parser.add_argument("--max-tokens", type=int, default=8192, help="skip seq*micro above")
    parser.add_argument("--systems", default="harli,hf_peft")
    parser.add_argument(
        "--ablation",
        action="store_true",
        help="also ours without CUDA graphs (every shape), via the peft tree, layer-sliced and "
        "with activation checkpointing (seq 512, micro-batch 4)",
    )
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--time-budget-s", type=float, default=150.0, help="skip rows after")
    parser.add_argument("--no-decode", action="store_true", help="skip the multi-LoRA decode part")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    parser.add_argument("--commit", default=os.environ.get("GIT_COMMIT", "unknown"))
    args = parser.parse_args()
    started = time.perf_counter()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # smoke runs on a shared machine
    config = ModelConfig.preset(args.model).replace(dtype="bfloat16")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    serving = build_random_model(config, seed=0, device=device, dtype=dtype)
    serving.fuse_projections()  # as the decode engine keeps it
    base_bytes = sum(p.numel() * p.element_size() for p in serving.parameters())
    systems = args.systems.split(",")
    rows: list[dict[str, Any]] = []
    decode_rows: list[dict[str, Any]] = []
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    day = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d")
    out = Path(args.out) / f"finetune-h200-{day}.json"

    def write() -> dict[str, Any]:
        ratios, graph_gains = [], []
        for row in rows:
            if row["system"] != "harli" or row["status"] != "ok":
                continue
            for ref in rows:
                same = all(ref[k] == row[k] for k in ("targets", "seq_len", "micro_batch"))
                if same and ref["system"] == "harli_eager" and ref["status"] == "ok":
                    graph_gains.append(
                        {
                            "targets": row["targets"],
                            "seq_len": row["seq_len"],
                            "micro_batch": row["micro_batch"],
                            "step_ms_graphed": row["step_ms_p50"],
                            "step_ms_eager": ref["step_ms_p50"],
                            "launch_ms_graphed": row.get("launch_ms_p50"),
                            "launch_ms_eager": ref.get("launch_ms_p50"),
                            "host_ms_graphed": row.get("host_ms_p50"),
                            "host_ms_eager": ref.get("host_ms_p50"),
                            "speedup": round(row["tokens_per_s"] / ref["tokens_per_s"], 3),
                        }
                    )
                if same and ref["system"] == "hf_peft" and ref["status"] == "ok":
                    ratios.append(
                        {
                            "targets": row["targets"],
                            "seq_len": row["seq_len"],
                            "micro_batch": row["micro_batch"],
                            "speedup": round(row["tokens_per_s"] / ref["tokens_per_s"], 3),
                            "peak_mem_ratio": mem_ratio(row, ref, "peak_mem_gb"),
                            "extra_mem_ratio": mem_ratio(row, ref, "extra_mem_on_decode_gpu_gb"),
                        }
                    )
        result = {
            "name": "finetune",
            "commit": args.commit,
            "gpu": gpu,
            "torch": torch.__version__,
            "created": datetime.datetime.now(datetime.UTC).isoformat(),
            "config": {
                **vars(args),
                "model_config": config.to_hf_config(),
                "lora": "rank 16, alpha 32, dropout 0.05; AdamW fused, lr 2e-4, clip 1.0",
                "base_weights_gb": base_bytes / GB,
            },
            "rows": rows,
            "multi_lora_decode": decode_rows,
            "ratios": ratios,
            "graph_gains": graph_gains,
            "wall_s": round(time.perf_counter() - started, 1),
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        return result

    plan: list[tuple[str, int, int, str]] = []
    ablations: list[tuple[str, int, int, str]] = []
    for targets in args.targets.split(","):
        for seq in map(int, args.seq.split(",")):
            for micro in map(int, args.micro.split(",")):
                if seq * micro > args.max_tokens:
                    continue
                for system in systems:
                    plan.append((targets, seq, micro, system))
                if args.ablation and seq == 512 and micro == 4:
                    for variant in ("harli_peft_tree", "harli_sliced4", "harli_ckpt"):
                        ablations.append((targets, seq, micro, variant))
                if args.ablation and "harli" in systems and "harli_eager" not in systems:
                    ablations.append((targets, seq, micro, "harli_eager"))  # graphs' gain
    # the headline setting first, ablations last, so a time-boxed run keeps what matters
    plan.sort(key=lambda item: (item[0], item[1], item[2]) != ("qkvo", 512, 4))
    plan += ablations
    first_losses: dict[tuple[str, int, int], float] = {}
    hf_models: dict[str, Any] = {}
    for targets, seq, micro, system in plan:
        spec = LoraSpec(
            rank=args.rank, alpha=2 * args.rank, dropout=0.05, target_modules=TARGETS[targets]
        )
        count = micro * (args.warmup + args.steps)
        examples = random_examples(config.vocab_size, count, seq, seed=seq + micro)
        baseline = reset_peak(device)
        row: dict[str, Any] = {
            "model": args.model,
            "system": system,
            "targets": targets,
            "seq_len": seq,
            "micro_batch": micro,
            "lora_rank": args.rank,
        }
        if time.perf_counter() - started > args.time_budget_s:
            row["status"] = "skipped: time budget"
            rows.append(row)
            continue
        try:
            if system == "hf_peft":
                fresh = targets not in hf_models  # adapters at B = 0: first loss is the base's
                if fresh:
                    hf_models[targets] = hf_peft_model(serving, spec, device)
                baseline = reset_peak(device)
                times, losses = run_hf(hf_models[targets], examples, micro, args.warmup, device)
            else:
                times, losses, info = run_ours(
                    serving, spec, examples, micro, args.warmup, variant=system
                )
                row.update(info)
            step = statistics.median(times)
            peak_bytes = peak(device)
            training = (peak_bytes - baseline) / GB
            row.update(
                {
                    "status": "ok",
                    "tokens_per_s": round(micro * seq / step, 1),
                    "step_ms_p50": round(step * 1e3, 2),
                    "step_ms_p99": round(percentile(times, 99) * 1e3, 2),
                    "peak_mem_gb": round(peak_bytes / GB, 3),
                    "training_mem_gb": round(training, 3),
                    "extra_mem_on_decode_gpu_gb": round(
                        training + (base_bytes / GB if system == "hf_peft" else 0.0), 3
                    ),
                    "first_loss": round(losses[0], 5),
                    "last_loss": round(losses[-1], 5),
                }
            )
            key = (targets, seq, micro)
            if system == "hf_peft" and not fresh:
                pass  # the reused HF adapters were trained by earlier rows
            elif key in first_losses:
                row["first_loss_rel_diff"] = abs(losses[0] - first_losses[key]) / first_losses[key]
            else:
                first_losses[key] = losses[0]
        except torch.cuda.OutOfMemoryError:
            row["status"] = "oom"
        except Exception as exc:  # keep the other rows of a one-shot GPU run
            row["status"] = f"error: {type(exc).__name__}: {exc}"[:300]
        print(json.dumps(row), flush=True)
        rows.append(row)
        write()
    if not args.no_decode:
        reset_peak(device)
        try:
            decode_rows.extend(multi_lora_decode(serving, 32, 8, args.rank, 50, device))
        except Exception as exc:  # keep the training rows
            decode_rows.append({"system": "harli_multi_lora", "status": f"error: {exc}"[:300]})
        for row in decode_rows:
            print(json.dumps(row), flush=True)
    result = write()
    print(f"\nwrote {out} in {result['wall_s']} s")
    print(
        f"{'targets':7s} {'seq':>5s} {'mb':>3s} {'system':16s} {'tok/s':>9s} {'step ms':>8s} "
        f"{'peak GB':>8s} {'extra GB':>8s} {'loss0':>7s}"
    )
    for r in rows:
        if r["status"] != "ok":
            print(
                f"{r['targets']:7s} {r['seq_len']:5d} {r['micro_batch']:3d} {r['system']:16s} "
                f"{r['status']}"
            )
            continue
        print(
            f"{r['targets']:7s} {r['seq_len']:5d} {r['micro_batch']:3d} {r['system']:16s} "
            f"{r['tokens_per_s']:9.0f} {r['step_ms_p50']:8.1f} {r['peak_mem_gb']:8.2f} "
            f"{r['extra_mem_on_decode_gpu_gb']:8.2f} {r['first_loss']:7.3f}"
        )
    for ratio in result["ratios"]:
        print(
            f"speedup {ratio['targets']} seq {ratio['seq_len']} mb {ratio['micro_batch']}: "
            f"{ratio['speedup']:.2f}x tokens/s, peak mem {ratio['peak_mem_ratio']}x, "
            f"extra mem on a decode GPU {ratio['extra_mem_ratio']}x"
        )
    for gain in result["graph_gains"]:
        print(
            f"CUDA graphs {gain['targets']} seq {gain['seq_len']} mb {gain['micro_batch']}: "
            f"step {gain['step_ms_eager']} -> {gain['step_ms_graphed']} ms "
            f"({gain['speedup']:.2f}x), host {gain['host_ms_eager']} -> "
            f"{gain['host_ms_graphed']} ms (launch {gain['launch_ms_eager']} -> "
            f"{gain['launch_ms_graphed']} ms)"
        )
    for d in decode_rows:
        if "step_ms_p50" not in d:
            print(f"decode: {d}")
            continue
        print(
            f"decode batch {d['batch']} {d['system']:16s} adapters {d['adapters']} "
            f"{d['targets']:4s} {d['step_ms_p50']:.3f} ms (+{100 * d['overhead_frac']:.1f}%) "
            f"graph={d['cuda_graph']}"
        )


if __name__ == "__main__":
    main()
