"""One finished adapter in host memory, read from its PEFT directory and checked against the
serving model's projection shapes
(:func:`gpu_runtime.contract.footprint.projection_shapes`).

:class:`HostAdapter` holds each adapted projection's ``A [r, in]`` and ``scaling * B [out, r]``
in fp32 (pinned on CUDA hosts, so copies into GPU slots are asynchronous), ``r`` and
``scaling`` being that module's (:func:`gpu_runtime.lora.adapter_config.adapter_layout`: rslora,
rank and alpha patterns). The tensors of the directory must be exactly the ``lora_A`` and
``lora_B`` of the modules its config targets, with the module's rank and the projection's
shape: peft would ignore a tensor of an untargeted module and initialise a missing one, so
either is refused rather than served differently.

On a tensor-parallel rank (``shard`` of size > 1) the file is checked against the whole
model's shapes, then each tensor is cut to the rank's slice (:meth:`ShardShape.take`, the base
weights' split: ``B`` rows of column-parallel, ``A`` columns of row-parallel projections, the
rest whole), so ``weights`` hold the shapes of the rank's projections.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from gpu_runtime.contract.footprint import projection_shapes
from gpu_runtime.distributed.shard import ShardShape
from gpu_runtime.finetune.checkpoint import read_adapter
from gpu_runtime.finetune.lora import PEFT_KEY_PREFIX
from gpu_runtime.lora.adapter_config import AdapterLayout, ProjectionKey, adapter_layout, module_key
from gpu_runtime.lora.errors import AdapterConfigError, UnsupportedAdapterError
from gpu_runtime.model import ModelConfig


@dataclass(frozen=True)
class HostAdapter:
    """One adapter in host memory: ``weights[(layer, module)] = (A [r, in], scaling * B
    [out, r])`` with that module's rank and scaling (``layout``)."""

    name: str
    layout: AdapterLayout
    weights: dict[ProjectionKey, tuple[torch.Tensor, torch.Tensor]]

    @property
    def rank(self) -> int:
        """The largest module rank (the slot rank it needs)."""
        return self.layout.max_rank

    @property
    def projections(self) -> frozenset[str]:
        return self.layout.projections

    @classmethod
    def from_directory(
        cls,
        name: str,
        directory: str | Path,
        config: ModelConfig,
        pin: bool = False,
        shard: ShardShape | None = None,
    ) -> HostAdapter:
        """Read a PEFT adapter, resolve its config and check every tensor against it and the
        whole model's shapes (:class:`AdapterConfigError` / :class:`UnsupportedAdapterError`,
        the message prefixed with the adapter's name); with ``shard`` (a tensor-parallel rank
        of ``config``), keep that rank's slice of each tensor."""
        raw, tensors = read_adapter(directory)
        if shard is not None and shard.config != config:
            raise ValueError(f"shard of {shard.config} does not shard {config}")
        try:
            layout = adapter_layout(raw, config)
            weights = _weights(layout, tensors, config, str(raw.get("bias", "none")), shard)
        except UnsupportedAdapterError as exc:
            raise UnsupportedAdapterError(f"adapter {name!r}: {exc}") from exc
        except AdapterConfigError as exc:
            raise AdapterConfigError(f"adapter {name!r}: {exc}") from exc
        if pin:
            weights = {k: (a.pin_memory(), b.pin_memory()) for k, (a, b) in weights.items()}
        return cls(name=name, layout=layout, weights=weights)


def _weights(
    layout: AdapterLayout,
    tensors: dict[str, torch.Tensor],
    config: ModelConfig,
    bias: str,
    shard: ShardShape | None,
) -> dict[ProjectionKey, tuple[torch.Tensor, torch.Tensor]]:
    """Each targeted module's ``(A, scaling * B)`` in fp32, cut to ``shard``'s slice when
    given; every tensor accounted for."""
    shapes = projection_shapes(config)
    left = dict(tensors)
    weights: dict[ProjectionKey, tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), lora in layout.modules.items():
        prefix = f"{PEFT_KEY_PREFIX}{module_key(layer, module)}"
        fan_in, fan_out = shapes[module]
        pair = []
        for which, expected in (("lora_A", (lora.rank, fan_in)), ("lora_B", (fan_out, lora.rank))):
            key = f"{prefix}.{which}.weight"
            tensor = left.pop(key, None)
            if tensor is None:
                raise AdapterConfigError(f"its config targets {prefix} but the file lacks {key}")
            if tuple(tensor.shape) != expected:
                raise AdapterConfigError(
                    f"{key} has shape {tuple(tensor.shape)}, expected {expected} (rank "
                    f"{lora.rank} from r / rank_pattern)"
                )
            if shard is not None:
                tensor = shard.take(key, tensor)
            pair.append(tensor.float())
        a, b = pair
        weights[(layer, module)] = (a.contiguous(), (b * lora.scaling).contiguous())
    if left:
        key = sorted(left)[0]
        if key.endswith(".bias") and bias != "none":
            raise UnsupportedAdapterError(
                f"bias={bias!r}: the file holds trained biases ({key}, {len(left)} tensors in "
                f"all), which are not served; train with bias='none'"
            )
        raise AdapterConfigError(
            f"the file holds {len(left)} tensors its config does not target as LoRA A/B "
            f"(first {key})"
        )
    return weights
