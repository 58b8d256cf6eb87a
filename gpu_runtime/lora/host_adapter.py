"""One finished adapter in host memory, read from its PEFT directory and checked against the
serving model's projection shapes
(:func:`gpu_runtime.contract.footprint.projection_shapes`).

:class:`HostAdapter` holds each adapted projection's ``A [r, in]`` and ``B [out, r]`` in fp32
(pinned on CUDA hosts, so copies into GPU slots are asynchronous); every tensor of the directory
must name a projection of a layer the model has, with that projection's shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from gpu_runtime.contract.footprint import projection_shapes
from gpu_runtime.contract.hparams import LoraSpec
from gpu_runtime.finetune.checkpoint import read_adapter
from gpu_runtime.finetune.lora import PEFT_KEY_PREFIX
from gpu_runtime.model import ModelConfig


@dataclass(frozen=True)
class HostAdapter:
    """One adapter in host memory: ``weights[(layer, module)] = (A [r, in], B [out, r])``."""

    name: str
    spec: LoraSpec
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def rank(self) -> int:
        return self.spec.rank

    @property
    def scaling(self) -> float:
        return self.spec.scaling

    @classmethod
    def from_directory(
        cls, name: str, directory: str | Path, config: ModelConfig, pin: bool = False
    ) -> HostAdapter:
        """Read a PEFT adapter and check every tensor against the model's shapes."""
        spec, tensors = read_adapter(directory)
        shapes = projection_shapes(config)
        pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        for key, tensor in tensors.items():
            parts = key.removeprefix(PEFT_KEY_PREFIX).split(".")
            # model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight
            if len(parts) != 7 or parts[:2] != ["model", "layers"] or parts[4] not in shapes:
                raise ValueError(f"adapter {name}: unexpected tensor {key}")
            layer, module, which = int(parts[2]), parts[4], parts[5]
            if not 0 <= layer < config.num_hidden_layers or which not in ("lora_A", "lora_B"):
                raise ValueError(f"adapter {name}: unexpected tensor {key}")
            fan_in, fan_out = shapes[module]
            expected = (spec.rank, fan_in) if which == "lora_A" else (fan_out, spec.rank)
            if tuple(tensor.shape) != expected:
                raise ValueError(
                    f"adapter {name}: {key} has shape {tuple(tensor.shape)}, expected {expected}"
                )
            host = tensor.float().contiguous()
            pairs.setdefault((layer, module), {})[which] = host.pin_memory() if pin else host
        weights = {}
        for projection, pair in pairs.items():
            if set(pair) != {"lora_A", "lora_B"}:
                raise ValueError(f"adapter {name}: {projection} lacks lora_A or lora_B")
            weights[projection] = (pair["lora_A"], pair["lora_B"])
        return cls(name=name, spec=spec, weights=weights)
