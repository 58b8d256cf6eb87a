"""Profiling workload from the real decode engine: its ``ModelRunner`` decode step.

``EngineDecode.capture(contexts, 0, stream)`` stages one decode iteration into the runner's static
buffers exactly as ``DecodePath.logits`` does (token, position, KV slot, sequence length
and block table per sequence, padded up to the batch bucket), captures the runner's decode graph
for (bucket, partition) on the partition's stream through ``ModelRunner.capture_cuda_graphs``, and
replays it: fused Triton decode kernels, Triton paged attention over a block-major KV cache, the
LM head. Sampling and the host copy of the sampled ids are not part of the timed graph.

Chunked-prefill iterations: ``capture(contexts, P, ...)`` with ``P > 0`` returns an
``EngineMixedStep`` over the decode tokens and one prompt chunk of ``P`` tokens (or ``chunks``:
several, each after a cached prefix of its prompt), which each
"replay" runs on the caller's stream as ``ModelRunner.execute`` would, without sampling
(``ModelRunner._forward``): by default eagerly through the fused general path with mixed paged
attention (host launch time is part of the measured latency, as it is of the engine's mixed
steps); with ``mixed_graphs=True`` through the engine's piecewise mixed-step graphs (a step that
falls back to the eager path raises ``EngineSourceError``: it would be mislabelled). On CPU (dry
runs, tests) decode steps run the graph's step eagerly over the same buffers.

The runner's decode path holds the static buffers and graphs (``decode.buf_ints``,
``decode.buf_seq_lens``, ``decode.buf_table``, ``decode.buckets``, ``decode.graphs``); mixed
steps use ``states``, ``rows.table_np`` and ``_forward``. A runner without them raises
``EngineSourceError``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from gpu_runtime.model import CausalLM

BLOCK_SIZE = 16
MAX_MODEL_LEN = 8192


def _sm_count(partition: Any) -> int | None:
    """SMs of a partition keyed by its decode SM count (the profiler's keys); None otherwise."""
    return partition if isinstance(partition, int) and not isinstance(partition, bool) else None


class EngineSourceError(RuntimeError):
    """The decode engine lacks what the profiler drives."""


class EngineStep:
    """Replays the runner's graph for (bucket, partition) after restaging this config."""

    def __init__(
        self, source: EngineDecode, bucket: int, partition: int, staged: dict[str, torch.Tensor]
    ) -> None:
        self.source, self.bucket, self.partition, self.staged = source, bucket, partition, staged

    def stage(self) -> None:
        runner = self.source.runner
        runner.decode.buf_ints[:, : self.bucket].copy_(self.staged["ints"])
        runner.decode.buf_seq_lens[: self.bucket].copy_(self.staged["seq_lens"])
        runner.decode.buf_table[: self.bucket].copy_(self.staged["table"])

    def replay(self) -> None:
        runner = self.source.runner
        graphs = runner.decode.graphs
        if graphs is None:
            if self.source.device.type == "cuda":
                raise EngineSourceError("no decode graph was captured")
            # CPU (dry runs): the step the graph holds, eagerly over the same buffers
            runner.decode.stage_seq_lens_np[: self.bucket] = self.staged["seq_lens"].numpy()
            with torch.no_grad():
                runner.decode.decode_forward(self.bucket)
            return
        graphs.replay(self.bucket, self.partition)


class EngineMixedStep:
    """Decode sequences plus prompt chunks, run as ``ModelRunner.execute`` runs such a step.

    Installs one request state per sequence in the runner (rows ``0..B + chunks``, contiguous
    KV blocks); ``replay`` recomputes the same step (the states are not advanced). ``chunks``:
    ``(prefix, length)`` per prompt chunk, the chunk's tokens following ``prefix`` tokens of
    its prompt already in the KV cache (random values); default one chunk of
    ``prefill_tokens`` from position 0.
    """

    def __init__(
        self,
        source: EngineDecode,
        contexts: list[int],
        prefill_tokens: int,
        partition: Any = None,
        chunks: list[tuple[int, int]] | None = None,
    ) -> None:
        from gpu_runtime.engine.model_runner import _RequestState
        from gpu_runtime.engine.request import SamplingParams

        runner = source.runner
        for name in ("states", "rows", "_forward"):
            if not hasattr(runner, name):
                raise EngineSourceError(f"ModelRunner has no {name}; no mixed steps")
        chunks = list(chunks) if chunks is not None else [(0, prefill_tokens)]
        if sum(n for _, n in chunks) != prefill_tokens or min(n for _, n in chunks) < 1:
            raise ValueError(f"chunks {chunks} do not add up to {prefill_tokens} tokens")
        if len(contexts) + len(chunks) > runner.rows.table_np.shape[0]:
            raise ValueError(
                f"{len(contexts)} decode sequences + {len(chunks)} chunks exceed the rows"
            )
        # tokens each one's KV holds once the step ran
        lengths = [c + 1 for c in contexts] + [p + n for p, n in chunks]
        n_blocks = [-(-n // BLOCK_SIZE) for n in lengths]
        if sum(n_blocks) > runner.kv_cache.num_blocks:
            raise ValueError(
                f"{sum(n_blocks)} KV blocks needed, {runner.kv_cache.num_blocks} exist"
            )
        if max(n_blocks) > runner.rows.table_np.shape[1]:
            raise ValueError(f"a sequence of {max(lengths)} tokens exceeds max_model_len")
        vocab = source.model.config.vocab_size
        runner.states.clear()
        start = 0
        self.order: list[tuple[str, int]] = []
        for row, (length, blocks) in enumerate(zip(lengths, n_blocks, strict=True)):
            decode = row < len(contexts)
            chunk = row - len(contexts)
            rid = f"decode{row}" if decode else ("prefill" if chunk == 0 else f"prefill{chunk}")
            block_ids = list(range(start, start + blocks))
            start += blocks
            runner.rows.table_np[row, :blocks] = block_ids
            computed = length - 1 if decode else chunks[chunk][0]
            runner.states[rid] = _RequestState(
                token_ids=source.rng.integers(0, vocab, length).tolist(),
                block_ids=block_ids,
                num_computed_tokens=computed,
                sampling_params=SamplingParams(),
                num_output_tokens=0,
                row=row,
            )
            self.order.append((rid, length - computed))
        self.runner = runner
        self.partition = partition
        self.expect_graphs = source.mixed_graphs and source.device.type == "cuda"

    def replay(self) -> torch.Tensor:
        """One step as ``ModelRunner.execute`` runs it without sampling (``_forward`` under the
        runner's BLAS choice: the mixed-step graphs of ``partition`` when captured, else the
        fused general path on CUDA, the model forward elsewhere); returns its logits."""
        from gpu_runtime.engine.model_runner import ModelRunnerOutput, blas_library

        runner = self.runner
        before = runner.general.num_mixed_graph_steps
        with torch.no_grad():
            with blas_library(getattr(runner, "_blas", None)):
                logits, _ = runner._forward(
                    self.order, [], self.partition, False, False, ModelRunnerOutput()
                )
        if self.expect_graphs and runner.general.num_mixed_graph_steps == before:
            raise EngineSourceError(
                f"a mixed step of {sum(n for _, n in self.order)} tokens ran eagerly: no "
                f"mixed-step graph of its bucket for partition {self.partition}"
            )
        return logits


class EngineDecode:
    """The decode engine's model runner over a KV cache of ``max_kv_tokens`` tokens."""

    def __init__(
        self,
        model: CausalLM,
        max_kv_tokens: int,
        seed: int = 0,
        mixed_graphs: bool = False,
        *,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        graph_batch_sizes: tuple[int, ...] | None = None,
        max_model_len: int = MAX_MODEL_LEN,
    ) -> None:
        """``mixed_graphs``: the engine's piecewise graphs of steps with prefill chunks
        (``EngineConfig.mixed_cuda_graphs``), captured with every decode bucket the first time
        a partition is used. The other arguments are the deployment's ``EngineConfig``
        fields (decode buckets and the step's token budget fix which graph a step replays):
        ``max_num_batched_tokens`` None is 1024 with mixed graphs (chunks of up to 512 tokens
        beside up to 256 rows), else 8192."""
        from gpu_runtime.engine.config import DEFAULT_GRAPH_BATCH_SIZES, EngineConfig
        from gpu_runtime.engine.model_runner import ModelRunner

        device = model.lm_head.weight.device
        budget = max_num_batched_tokens or (1024 if mixed_graphs else 8192)
        self.config = EngineConfig(
            num_kv_blocks=max_kv_tokens // BLOCK_SIZE,
            block_size=BLOCK_SIZE,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_model_len,
            device=str(device),
            # torch attention off CUDA: CPU tests exercise the staging (no graphs there)
            attention_backend="triton" if device.type == "cuda" else "torch",
            static_decode_batches=True,
            use_cuda_graphs=True,
            cuda_graph_batch_sizes=graph_batch_sizes or DEFAULT_GRAPH_BATCH_SIZES,
            mixed_cuda_graphs=mixed_graphs,
        )
        self.runner = ModelRunner(model, self.config)
        if not self.runner.static_decode:
            raise EngineSourceError("ModelRunner has no decode path; the profiler cannot stage")
        gen = torch.Generator(device=device).manual_seed(seed)
        self.runner.kv_cache.storage.normal_(generator=gen)  # never time zeros
        self.model = model
        self.device = device
        # room for rounding every sequence (and a few chunks) up to whole blocks
        self.max_kv_tokens = (max_kv_tokens // BLOCK_SIZE - max_num_seqs - 8) * BLOCK_SIZE
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = budget
        self.max_model_len = max_model_len
        self.rng = np.random.default_rng(seed)
        self.mixed_graphs = mixed_graphs
        self._partitions: set[Any] = set()  # partitions captured whole (mixed_graphs)

    def _staged(self, contexts: list[int], bucket: int) -> dict[str, torch.Tensor]:
        runner = self.runner
        batch, width = len(contexts), runner.decode.buf_table.shape[1]
        pos = np.asarray(contexts, dtype=np.int64)  # the new token's position
        n_blocks = -(-(pos + 1) // BLOCK_SIZE)
        if int(n_blocks.sum()) > runner.kv_cache.num_blocks:
            raise ValueError(
                f"{int(n_blocks.sum())} KV blocks needed, {runner.kv_cache.num_blocks} exist"
            )
        if int(n_blocks.max()) > width:
            raise ValueError(
                f"context {int(pos.max())} exceeds max_model_len {self.config.max_model_len}"
            )
        table = np.zeros((bucket, width), dtype=np.int32)
        starts = np.concatenate([[0], np.cumsum(n_blocks)[:-1]])
        for i in range(batch):
            table[i, : n_blocks[i]] = np.arange(starts[i], starts[i] + n_blocks[i])
        # rows as the runner stages them: token id, position, slot block, slot offset, then
        # (newer runners) the LoRA slot, -1 = base model
        ints = np.zeros((runner.decode.buf_ints.shape[0], bucket), dtype=np.int64)
        ints[0, :batch] = self.rng.integers(0, self.model.config.vocab_size, batch)
        ints[1, :batch] = pos
        ints[2, :batch] = table[np.arange(batch), pos // BLOCK_SIZE]
        ints[3, :batch] = pos % BLOCK_SIZE
        ints[2, batch:] = runner.kv_cache.pad_block
        ints[4:] = -1
        seq_lens = np.zeros(bucket, dtype=np.int32)
        seq_lens[:batch] = pos + 1
        dev = self.device
        return {
            "ints": torch.from_numpy(ints).to(dev),
            "table": torch.from_numpy(table).to(dev),
            "seq_lens": torch.from_numpy(seq_lens).to(dev),
        }

    def capture(
        self,
        contexts: list[int],
        prefill_tokens: int,
        stream: torch.cuda.Stream | None,
        partition: Any = None,
        chunks: list[tuple[int, int]] | None = None,
    ) -> EngineStep | EngineMixedStep:
        """Stage ``contexts`` and return the step for ``partition`` (captured on ``stream``);
        with prefill tokens, the mixed step (``chunks``: see ``EngineMixedStep``)."""
        runner = self.runner
        if self.mixed_graphs and partition not in self._partitions:
            runner.capture_cuda_graphs(
                None, partition=partition, stream=stream, sm_count=_sm_count(partition)
            )
            self._partitions.add(partition)
        if prefill_tokens:
            return EngineMixedStep(self, contexts, prefill_tokens, partition, chunks)
        bucket = next((b for b in runner.decode.buckets if b >= len(contexts)), None)
        if bucket is None:
            raise ValueError(f"batch {len(contexts)} exceeds the largest bucket")
        step = EngineStep(self, bucket, partition, self._staged(contexts, bucket))
        step.stage()
        graphs = runner.decode.graphs
        if graphs is None or not graphs.has(bucket, partition):
            runner.capture_cuda_graphs(
                (bucket,), partition=partition, stream=stream, sm_count=_sm_count(partition)
            )
            step.stage()  # warm-up runs wrote the buffers' KV slots; restage for timing
        return step
