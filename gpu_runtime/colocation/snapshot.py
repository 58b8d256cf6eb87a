"""Read what a policy needs from the decode engine and from a trainer, without changing them."""

from __future__ import annotations

from typing import Any

from gpu_runtime.colocation.types import DecodeSnapshot


def decode_snapshot(engine: Any) -> DecodeSnapshot:
    """The coming iteration's decode work: the scheduler's `preview()` of its next step (the
    decode rows' contexts, the tokens of its prefill chunks, the requests waiting)."""
    preview = engine.scheduler.preview()
    return DecodeSnapshot.from_contexts(
        list(preview.decode_contexts), preview.prefill_tokens, preview.num_waiting
    )


def describe_trainer(trainer: Any) -> tuple[int, int, int]:
    """(mean example tokens, longest example tokens, LoRA rank) of a ``LoraTrainer``.

    Anything else must carry ``seq_len``, ``max_seq_len`` and ``lora_rank`` attributes.
    """
    stream = getattr(trainer, "stream", None)
    examples = getattr(stream, "examples", None)
    if examples:
        lengths = [example.num_tokens for example in examples]
        rank = int(trainer.hparams.lora.rank)
        return round(sum(lengths) / len(lengths)), max(lengths), rank
    try:
        return int(trainer.seq_len), int(trainer.max_seq_len), int(trainer.lora_rank)
    except AttributeError:
        raise TypeError(
            f"{type(trainer).__name__} is neither a LoraTrainer nor carries seq_len, "
            "max_seq_len and lora_rank"
        ) from None


def trainer_layers(trainer: Any) -> int | None:
    """Decoder layers of the model a trainer trains (None when it does not say, or when its
    ``layer_sliced_quanta`` is False: a policy offers layer slices only to jobs with layers)."""
    if getattr(trainer, "layer_sliced_quanta", True) is False:
        return None
    for owner in (trainer, getattr(trainer, "model", None)):
        config = getattr(owner, "config", None)
        layers = getattr(config, "num_hidden_layers", None)
        if isinstance(layers, int) and layers > 0:
            return layers
    layers = getattr(trainer, "layers", None)
    return layers if isinstance(layers, int) and layers > 0 else None


def trainer_replays_graphs(trainer: Any) -> bool:
    """Whether a trainer's whole micro-batches replay CUDA graphs (graphs on, not disabled)."""
    graphs = getattr(trainer, "graphs", None)
    return graphs is not None and graphs.disabled is None
