"""CUDA, at least 2 GPUs: the tensor-parallel model over NCCL, its collectives inside a CUDA
graph, and the same SM split applied on every rank (green contexts per rank). Skipped on a
machine with fewer GPUs; the multi-GPU runs take it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpu_runtime.contract.model_config import ModelConfig
from gpu_runtime.distributed.parallel import TensorParallel
from gpu_runtime.model import build_random_model, load_model, save_model
from tests.gpu_runtime.distributed.ranks import run_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
    ),
]

CONFIG = ModelConfig.preset("tiny")


def _inputs(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 500, (4, 16), generator=torch.Generator().manual_seed(3))
    return ids.to(device), torch.arange(16, device=device).expand(4, 16)


def _eager_graph_and_partition(parallel: TensorParallel, directory: str) -> dict[str, torch.Tensor]:
    device = torch.device("cuda", torch.cuda.current_device())
    model = load_model(directory, device=device, dtype=torch.bfloat16, parallel=parallel)
    ids, positions = _inputs(device)
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        out["eager"] = model.compute_logits(model(ids, positions)).float().cpu()
        # the all-reduces and the all-gather captured in one graph, replayed on new inputs
        static_ids = ids.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            model.compute_logits(model(static_ids, positions))  # warm-up outside capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_logits = model.compute_logits(model(static_ids, positions))
        static_ids.copy_(torch.flip(ids, dims=[0]))
        graph.replay()
        torch.cuda.synchronize()
        out["graph_flipped"] = static_logits.float().cpu()
        # every rank runs its part on a decode partition of the same SM count
        from gpu_runtime.sharing import create_sharing

        sharing = create_sharing(device)
        if sharing is not None:
            with sharing:
                decode_sms = sharing.table.choices[0]
                decode_stream, _ = sharing.partition(decode_sms)
                decode_stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(decode_stream):
                    partitioned = model.compute_logits(model(ids, positions))
                torch.cuda.current_stream().wait_stream(decode_stream)
                torch.cuda.synchronize()
                out["partition"] = partitioned.float().cpu()
                out["decode_sms"] = torch.tensor(decode_sms)
    return out


def test_nccl_ranks_give_one_gpu_logits_eager_in_graphs_and_partitions(tmp_path: Path) -> None:
    whole = build_random_model(CONFIG, seed=1)
    save_model(whole, tmp_path)
    reference = load_model(tmp_path, device="cuda:0", dtype=torch.bfloat16)
    ids, positions = _inputs(torch.device("cuda:0"))
    with torch.no_grad():
        expected = reference.compute_logits(reference(ids, positions)).float().cpu()
        flipped = reference.compute_logits(reference(torch.flip(ids, [0]), positions)).float()
    ranks = run_ranks(2, _eager_graph_and_partition, str(tmp_path), device="cuda")
    for out in ranks:
        torch.testing.assert_close(out["eager"], expected, rtol=0.02, atol=0.02)
        torch.testing.assert_close(out["graph_flipped"], flipped.cpu(), rtol=0.02, atol=0.02)
        if "partition" in out:
            torch.testing.assert_close(out["partition"], out["eager"], rtol=0.02, atol=0.02)
    assert torch.equal(ranks[0]["eager"], ranks[1]["eager"])  # whole rows, the same bits
    if "decode_sms" in ranks[0]:
        assert int(ranks[0]["decode_sms"]) == int(ranks[1]["decode_sms"])
