"""The optimizer step's gradient work on a tensor-parallel rank: :class:`ShardedGradients`.

A rank's LoRA parameters are of three kinds (:mod:`gpu_runtime.distributed.shard`):

* **sharded** (``lora_B`` of a column-parallel, ``lora_A`` of a row-parallel projection): the
  rank holds a slice and computes that slice's whole gradient;
* **replicated** (``lora_A`` of a column-parallel, ``lora_B`` of a row-parallel projection,
  ``ShardShape.is_replicated_gradient``): every rank holds the whole tensor but computes only
  its part of the gradient, so the gradients are summed over all ranks;
* **KV replicas** (``lora_B`` of ``k_proj`` and ``v_proj`` when the group has more ranks than
  the model has KV heads): the ranks sharing a KV head hold the same rows, each computing the
  part of their gradient that its query heads see, so the gradients are summed over the ranks
  of that head alone (one all-reduce over the group of a ``[kv_heads, n]`` buffer in which each
  rank fills its head's row).

:meth:`ShardedGradients.clip_` makes every replicated gradient whole (one all-reduce of one
flat buffer), then clips by the **global** norm, the norm one GPU would compute over the whole
adapter: the squares of each rank's sharded gradients summed over ranks, a replicated gradient
counted once (on rank 0), a KV replica once per head (on its head's first rank). Every rank then
holds the same clipped gradients of the tensors it shares, so AdamW keeps them equal.

Collectives run on the trainer's communicator (the finetune one, ``parallel.for_finetune()``).
At one GPU the trainer does not build this object (``torch.nn.utils.clip_grad_norm_`` as before).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gpu_runtime.distributed.parallel import TensorParallel
from gpu_runtime.distributed.shard import ShardShape


class ShardedGradients:
    """Reduce and clip one rank's adapter gradients (see the module docstring)."""

    def __init__(
        self,
        parallel: TensorParallel,
        shard: ShardShape,
        named_params: Sequence[tuple[str, torch.nn.Parameter]],
    ) -> None:
        if parallel.size != shard.size or parallel.rank != shard.rank:
            raise ValueError(
                f"parallel rank {parallel.rank} of {parallel.size} does not hold shard "
                f"{shard.rank} of {shard.size}"
            )
        self.parallel = parallel
        self.shard = shard
        kv_heads = shard.config.num_key_value_heads
        self.kv_heads = kv_heads if parallel.size > kv_heads else 0
        """KV heads shared by several ranks (0: none, every rank holds its own)."""
        replicas = parallel.size // kv_heads if self.kv_heads else 1
        self.replicated: list[torch.nn.Parameter] = []
        self.kv_replicas: list[torch.nn.Parameter] = []
        self.counted: list[torch.nn.Parameter] = []
        """The parameters whose squared gradients this rank adds to the global norm."""
        for name, param in named_params:
            if shard.is_replicated_gradient(name):
                self.replicated.append(param)
                if parallel.is_driver:
                    self.counted.append(param)
            elif self.kv_heads and _is_kv_lora_b(name):
                self.kv_replicas.append(param)
                if parallel.rank % replicas == 0:
                    self.counted.append(param)
            else:
                self.counted.append(param)

    def reduce_(self) -> None:
        """Sum the replicated gradients over the ranks that share them, in place."""
        replicated = [p.grad for p in self.replicated if p.grad is not None]
        kv = [p.grad for p in self.kv_replicas if p.grad is not None]
        if not replicated and not kv:
            return
        pieces = [g.reshape(-1) for g in replicated]
        kv_width = sum(g.numel() for g in kv)
        kv_rows = None
        if kv:
            sample = kv[0]
            kv_rows = sample.new_zeros(self.kv_heads, kv_width)
            kv_rows[self.shard.kv_head_start] = torch.cat([g.reshape(-1) for g in kv])
            pieces.append(kv_rows.reshape(-1))
        flat = torch.cat(pieces)
        self.parallel.all_reduce_(flat)
        offset = 0
        for grad in replicated:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()
        if kv_rows is not None:
            own = flat[offset:].view(self.kv_heads, kv_width)[self.shard.kv_head_start]
            start = 0
            for grad in kv:
                grad.copy_(own[start : start + grad.numel()].view_as(grad))
                start += grad.numel()

    def global_norm(self) -> torch.Tensor:
        """The whole adapter's gradient L2 norm (fp32, on device; after :meth:`reduce_`)."""
        grads = [p.grad for p in self.counted if p.grad is not None]
        device = self.counted[0].device if self.counted else torch.device("cpu")
        squares = torch.zeros((), dtype=torch.float32, device=device)
        if grads:
            norms = torch._foreach_norm(grads, 2.0)
            squares = torch.stack([n.float() for n in norms]).square().sum()
        return self.parallel.all_reduce_(squares).sqrt()

    def clip_(self, params: Sequence[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        """Reduce, then scale every gradient of ``params`` by ``min(1, max_norm / (norm +
        1e-6))`` (``clip_grad_norm_``'s rule) with the global norm; returns that norm."""
        self.reduce_()
        norm = self.global_norm()
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            torch._foreach_mul_(grads, scale.to(grads[0].dtype))
        return norm


def _is_kv_lora_b(name: str) -> bool:
    parts = name.split(".")
    return "lora_B" in parts and parts[parts.index("lora_B") - 1] in ("k_proj", "v_proj")
