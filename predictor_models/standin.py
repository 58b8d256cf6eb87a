"""Profiling workloads built from the serving model itself, for when the engine is not usable.

``StandInDecode`` runs one decode iteration exactly as the model computes it (our ``CausalLM``
forward with fused projections, the LM head and greedy sampling), with a padded KV cache:
each layer's cache is ``[batch, kv_heads, context_max, head_dim]`` and decode attention reads it
once with grouped-query batched GEMMs, so the bytes moved per iteration equal a paged engine's
up to padding to the batch's longest context. An optional chunked-prefill piece of ``P`` prompt
tokens goes through the same forward with causal attention over itself. The iteration is captured
in a CUDA graph on the caller's stream, as the engine captures decode steps per batch bucket.

``LoraQuantum`` is a finetune quantum: a LoRA (peft) forward or backward of one micro-batch on a
training tree that shares the serving model's base weights (``build_training_model``), under bf16
autocast with a chunked cross-entropy loss, as the finetune engine trains.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from gpu_runtime.model import CausalLM


class PaddedDecodeAttention:
    """AttentionFn for ``[T]`` flattened tokens: ``batch`` decode tokens, then a prefill chunk.

    The decode tokens' K/V are written at each sequence's current length, then each query
    attends to its sequence's cache (masked past its length). Tensors are views made once, so
    the object is safe to use inside a captured CUDA graph.
    """

    def __init__(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        lengths: torch.Tensor,
        prefill_tokens: int,
    ) -> None:
        # k_cache/v_cache: [L, B, kv_heads, ctx_max, D]; lengths: [B] (context before this token)
        self.k_cache, self.v_cache = k_cache, v_cache
        self.batch = k_cache.shape[1]
        self.prefill_tokens = prefill_tokens
        self.rows = torch.arange(self.batch, device=lengths.device)
        self.lengths = lengths
        ctx_max = k_cache.shape[3]
        visible = torch.arange(ctx_max, device=lengths.device)[None, :] <= lengths[:, None]
        zero = torch.zeros((), dtype=torch.float32, device=lengths.device)
        # [B, 1, 1, ctx_max] additive mask, fp32 (scores are fp32)
        self.bias = torch.where(visible, zero, -math.inf)[:, None, None, :]

    def __call__(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        b, kvh, d = self.batch, k.shape[-2], k.shape[-1]
        outs = []
        if b:
            kc, vc = self.k_cache[layer_idx], self.v_cache[layer_idx]  # [B, kvh, ctx, D]
            kc[self.rows, :, self.lengths] = k[:b]
            vc[self.rows, :, self.lengths] = v[:b]
            groups = q.shape[-2] // kvh
            qg = q[:b].reshape(b, kvh, groups, d)
            scores = torch.matmul(qg, kc.transpose(-1, -2)).float() / math.sqrt(d)
            probs = torch.softmax(scores + self.bias, dim=-1).to(q.dtype)
            outs.append(torch.matmul(probs, vc).reshape(b, kvh * groups, d))
        if self.prefill_tokens:
            groups = q.shape[-2] // kvh
            qp = q[b:].transpose(0, 1)[None]  # [1, H, P, D]
            kp = k[b:].transpose(0, 1).repeat_interleave(groups, dim=0)[None]
            vp = v[b:].transpose(0, 1).repeat_interleave(groups, dim=0)[None]
            out = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True)
            outs.append(out[0].transpose(0, 1))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)


class StandInDecode:
    """Decode iterations of ``model`` over a KV pool of ``max_kv_tokens`` padded slots."""

    def __init__(self, model: CausalLM, max_kv_tokens: int, seed: int = 0) -> None:
        cfg = model.config
        self.model = model
        self.device = model.lm_head.weight.device
        self.dtype = model.lm_head.weight.dtype
        self.max_kv_tokens = max_kv_tokens
        shape = (cfg.num_hidden_layers, max_kv_tokens * cfg.num_key_value_heads * cfg.head_dim)
        gen = torch.Generator(device=self.device).manual_seed(seed)
        self.k_pool = torch.empty(shape, device=self.device, dtype=self.dtype)
        self.v_pool = torch.empty(shape, device=self.device, dtype=self.dtype)
        self.k_pool.normal_(generator=gen)
        self.v_pool.normal_(generator=gen)
        self.pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None

    def build_step(self, contexts: list[int], prefill_tokens: int) -> Callable[[], torch.Tensor]:
        """One iteration (batch = len(contexts)) over static buffers; returns the next ids."""
        cfg = self.model.config
        b, ctx_max = len(contexts), max(contexts, default=0) + 1
        if b * ctx_max > self.max_kv_tokens:
            raise ValueError(
                f"batch {b} x context {ctx_max} exceeds the KV pool ({self.max_kv_tokens} tokens)"
            )
        view = (cfg.num_hidden_layers, b, cfg.num_key_value_heads, ctx_max, cfg.head_dim)
        n = b * cfg.num_key_value_heads * ctx_max * cfg.head_dim
        k_cache = self.k_pool[:, :n].view(view)
        v_cache = self.v_pool[:, :n].view(view)
        lengths = torch.tensor(contexts, device=self.device, dtype=torch.long)
        positions = torch.cat([lengths, torch.arange(prefill_tokens, device=self.device)])
        gen = torch.Generator(device=self.device).manual_seed(b * 7919 + prefill_tokens)
        input_ids = torch.randint(
            cfg.vocab_size, (b + prefill_tokens,), device=self.device, generator=gen
        )
        attention = PaddedDecodeAttention(k_cache, v_cache, lengths, prefill_tokens)
        last = torch.cat(
            [
                torch.arange(b, device=self.device),
                torch.full(
                    (1 if prefill_tokens else 0,), b + prefill_tokens - 1, device=self.device
                ),
            ]
        )

        def step() -> torch.Tensor:
            hidden = self.model(input_ids, positions, attention)  # [T, hidden]
            logits = self.model.compute_logits(hidden[last])  # [B(+1), vocab]
            next_ids = logits.argmax(dim=-1)
            input_ids[:b].copy_(next_ids[:b])
            return next_ids

        return step

    def capture(
        self,
        contexts: list[int],
        prefill_tokens: int,
        stream: torch.cuda.Stream,
        partition: object = None,
    ) -> CapturedStep:
        """A graph of one iteration captured on ``stream`` (it replays on that stream's SMs).

        ``partition`` is accepted for interface parity with the engine source; each call
        captures a fresh graph."""
        step = self.build_step(contexts, prefill_tokens)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.no_grad(), torch.cuda.stream(stream):
            step()  # warm-up on the capture stream (cuBLAS workspace, allocator)
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                step()
        return CapturedStep(graph, step)


class CapturedStep:
    """A captured iteration and the closure owning its static input tensors.

    The graph reads and writes those tensors by address, so they must live as long as the
    graph: dropping the closure would free them to the caching allocator while replays still
    use them.
    """

    def __init__(self, graph: torch.cuda.CUDAGraph, step: Callable[[], torch.Tensor]) -> None:
        self.graph = graph
        self.step = step

    def replay(self) -> None:
        self.graph.replay()


class LoraQuantum:
    """Forward and backward of one LoRA micro-batch ``[micro_batch, seq_len]`` on ``tree``."""

    def __init__(
        self, tree: CausalLM, tokens: int, seq_len: int, seed: int = 0, loss_chunk: int = 1024
    ) -> None:
        if tokens % seq_len:
            raise ValueError(f"quantum tokens {tokens} must be a multiple of seq_len {seq_len}")
        self.tree = tree
        device = tree.lm_head.weight.device
        gen = torch.Generator(device=device).manual_seed(seed)
        vocab = tree.config.vocab_size
        self.input_ids = torch.randint(
            vocab, (tokens // seq_len, seq_len), device=device, generator=gen
        )
        self.positions = torch.arange(seq_len, device=device).expand_as(self.input_ids)
        self.labels = torch.roll(self.input_ids, -1, dims=1)
        self.loss_chunk = loss_chunk
        self.loss: torch.Tensor | None = None
        self._graph: torch.cuda.CUDAGraph | None = None

    def _loss(self) -> torch.Tensor:
        device_type = self.input_ids.device.type
        with torch.autocast(
            device_type, dtype=torch.bfloat16, enabled=device_type == "cuda", cache_enabled=False
        ):
            hidden = self.tree(self.input_ids, self.positions).flatten(0, 1)
            labels = self.labels.flatten()
            total = hidden.new_zeros((), dtype=torch.float32)
            for start in range(0, hidden.shape[0], self.loss_chunk):
                logits = self.tree.compute_logits(hidden[start : start + self.loss_chunk])
                total = total + F.cross_entropy(
                    logits.float(), labels[start : start + self.loss_chunk], reduction="sum"
                )
            return total / labels.numel()

    def forward_only(self) -> None:
        """The forward quantum's kernels (no graph kept, so it can be repeated)."""
        with torch.no_grad():
            self._loss()

    def capture_forward(self, stream: torch.cuda.Stream) -> Callable[[], None]:
        """The forward quantum as a CUDA graph replay on ``stream`` (eager if capture fails).

        A graph enqueues in microseconds, so the host never starves the finetune stream.
        """
        with torch.cuda.stream(stream):
            self.forward_only()  # warm-up on the capture stream
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, stream=stream):
                self.forward_only()
        except RuntimeError:
            return self.forward_only
        self._graph = graph
        return graph.replay

    def prepare_backward(self) -> None:
        """Run the forward with autograd, keeping the graph for ``backward``."""
        self.loss = self._loss()

    def backward(self) -> None:
        """The backward quantum (repeatable: the autograd graph is retained)."""
        if self.loss is None:
            raise RuntimeError("call prepare_backward() first")
        self.loss.backward(retain_graph=True)

    def release(self) -> None:
        self.loss = None
        self._graph = None
