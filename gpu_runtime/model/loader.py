"""Build a `CausalLM` from a HF-format directory (config.json + safetensors) or from a seed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from gpu_runtime.contract.model_config import ModelConfig
from gpu_runtime.distributed.parallel import SINGLE, TensorParallel
from gpu_runtime.model.llama import CausalLM

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(RuntimeError):
    """A model directory is missing files or holds tensors that do not fit the config."""


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    """`"bfloat16"` -> `torch.bfloat16` (a torch.dtype passes through)."""
    if isinstance(name, torch.dtype):
        return name
    if name not in _DTYPES:
        raise ValueError(f"dtype {name!r} not in {sorted(_DTYPES)}")
    return _DTYPES[name]


def _empty_model(
    config: ModelConfig,
    device: torch.device | str,
    dtype: torch.dtype,
    parallel: TensorParallel = SINGLE,
) -> CausalLM:
    with torch.device("meta"):
        model = CausalLM(config, dtype=dtype, parallel=parallel)
    model = model.to_empty(device=device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.reset_rope(device)
    return model


@torch.no_grad()
def build_random_model(
    config: ModelConfig,
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | str | None = None,
    parallel: TensorParallel = SINGLE,
) -> CausalLM:
    """A model with seeded random weights (same seed and device -> same weights).

    Linear/embedding weights and biases ~ N(0, 0.02); norm weights ~ N(1, 0.1), so a wrong norm
    shows up in comparisons. Random numbers are drawn on `device` directly (fast on GPU).
    A tensor-parallel rank draws each whole tensor in turn and keeps its slice, so its shard
    is exactly the one-GPU model's (one whole tensor at a time is ever held).
    """
    dt = torch_dtype(dtype or config.dtype)
    model = _empty_model(config, device, dt, parallel)
    params = dict(model.named_parameters())
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, shape in _whole_shapes(config, dt).items():
        whole: torch.Tensor
        if parallel.size == 1:
            whole = params[name]
        else:
            whole = torch.empty(shape, device=device, dtype=dt)
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            whole.normal_(1.0, 0.1, generator=generator)
        else:
            whole.normal_(0.0, 0.02, generator=generator)
        if parallel.size > 1 and model.shard.holds(name):
            params[name].copy_(model.shard.take(name, whole))
    return model.eval()


def _whole_shapes(
    config: ModelConfig, dtype: torch.dtype, remove_duplicate: bool = True
) -> dict[str, tuple[int, ...]]:
    """Every parameter's name and shape in the one-GPU model, in `named_parameters` order
    (a tied LM head too, without `remove_duplicate`)."""
    with torch.device("meta"):
        whole = CausalLM(config, dtype=dtype)
    named = whole.named_parameters(remove_duplicate=remove_duplicate)
    return {name: tuple(p.shape) for name, p in named}


def _weight_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [directory / name for name in sorted(set(weight_map.values()))]
    single = directory / "model.safetensors"
    if single.exists():
        return [single]
    shards = sorted(directory.glob("*.safetensors"))
    if not shards:
        raise ModelLoadError(f"no safetensors files in {directory}")
    return shards


def load_config(directory: str | Path) -> ModelConfig:
    """`ModelConfig` from `directory/config.json`."""
    path = Path(directory) / "config.json"
    if not path.exists():
        raise ModelLoadError(f"{path} does not exist")
    return ModelConfig.from_hf_config(json.loads(path.read_text()))


@torch.no_grad()
def load_model(
    directory: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | str | None = None,
    parallel: TensorParallel = SINGLE,
) -> CausalLM:
    """Load HF config.json + (sharded) safetensors into a `CausalLM` on `device`.

    Every parameter must be present (lm_head may be absent when embeddings are tied); extra
    tensors other than rotary caches are an error. A tensor-parallel rank reads only its
    slice of each tensor from the files (`ShardShape.take` over a lazy safetensors slice).
    """
    directory = Path(directory)
    config = load_config(directory)
    dt = torch_dtype(dtype or config.dtype)
    model = _empty_model(config, device, dt, parallel)
    params = dict(model.named_parameters(remove_duplicate=False))
    whole = _whole_shapes(config, dt, remove_duplicate=False)
    seen: set[str] = set()
    unexpected: list[str] = []
    for shard in _weight_files(directory):
        with safe_open(str(shard), framework="pt", device="cpu") as tensors:
            for name in tensors.keys():
                if not model.shard.holds(name):
                    seen.add(name)
                    continue
                if name not in params:
                    if "rotary_emb" not in name:
                        unexpected.append(name)
                    continue
                lazy = tensors.get_slice(name)
                stored = tuple(lazy.get_shape())
                if stored != whole.get(name):
                    raise ModelLoadError(
                        f"{name}: checkpoint shape {stored} != model shape {whole.get(name)}"
                    )
                params[name].copy_(model.shard.take(name, lazy))
                seen.add(name)
    if config.tie_word_embeddings and "model.embed_tokens.weight" in seen:
        seen.add("lm_head.weight")
    missing = sorted(set(params) - seen)
    if missing or unexpected:
        raise ModelLoadError(f"missing tensors {missing[:8]}, unexpected {unexpected[:8]}")
    return model.eval()


def save_model(model: CausalLM, directory: str | Path, max_shard_bytes: int = 1 << 30) -> None:
    """Write config.json and safetensors shards (with an index when more than one)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config: dict[str, Any] = model.config.to_hf_config()
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.detach().contiguous().cpu()
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(directory / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        filename = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / filename), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, filename))
    index = {"metadata": {}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def load_tokenizer(directory: str | Path) -> Any:
    """The tokenizer saved in `directory` (a `transformers` fast tokenizer)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))
