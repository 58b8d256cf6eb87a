"""Prompt logprobs (`SamplingParams.prompt_logprobs`): the logprob of each prompt token under
the model's distribution at the position before it, computed in the prefill chunks of the
requests that ask, on the general step path only (decode rows never predict a prompt token).

`prompt_rows` finds, in a step's flattened tokens (`flat_batch.flatten_step`'s order), the rows
whose logits predict a prompt token; the general path computes those rows' logits beside the
sampled ones, and `prompt_logprobs` turns them into `TokenLogprob`s. Reading them back is one
host sync of its own, taken only by steps that hold such rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from gpu_runtime.engine.request import TokenLogprob
from gpu_runtime.engine.runner_types import _RequestState


@dataclass(frozen=True)
class PromptRows:
    """Rows of a flattened step predicting prompt tokens, and what they predict."""

    flat_index: list[int]
    """Index of each row's token in the step's flattened tokens."""
    targets: list[int]
    """The prompt token each row predicts (the token after it)."""
    request_ids: list[str]
    positions: list[int]
    """Prompt position of each target token (>= 1)."""
    top: list[int]
    """Top-logprob count of each row's request."""


def prompt_rows(
    order: list[tuple[str, int]], states: Mapping[str, _RequestState]
) -> PromptRows | None:
    """The step's rows predicting prompt tokens of requests asking for prompt logprobs (None:
    no such row). `order`: the step's `(request_id, count)` in batch order."""
    rows = PromptRows([], [], [], [], [])
    offset = 0
    for rid, count in order:
        state = states[rid]
        wanted = state.sampling_params.prompt_logprobs
        if wanted is not None:
            num_prompt = len(state.token_ids) - state.num_output_tokens
            start = state.num_computed_tokens
            for position in range(start, min(start + count, num_prompt - 1)):
                rows.flat_index.append(offset + position - start)
                rows.targets.append(state.token_ids[position + 1])
                rows.request_ids.append(rid)
                rows.positions.append(position + 1)
                rows.top.append(wanted)
        offset += count
    return rows if rows.flat_index else None


def prompt_logprobs(
    logits: torch.Tensor, rows: PromptRows
) -> dict[str, list[tuple[int, TokenLogprob]]]:
    """logits `[len(rows.flat_index), vocab]` -> per request, `(position, TokenLogprob)` of the
    prompt token at each position (its logprob and its row's top tokens), read to the host."""
    logprobs = logits.float().log_softmax(dim=-1)
    targets = torch.tensor(rows.targets, dtype=torch.long, device=logits.device)
    chosen = logprobs.gather(-1, targets[:, None])[:, 0].tolist()
    k = max(rows.top)
    top_values: list[list[float]] = []
    top_ids: list[list[int]] = []
    if k > 0:
        values, indices = logprobs.topk(k, dim=-1)
        top_values, top_ids = values.tolist(), indices.tolist()
    out: dict[str, list[tuple[int, TokenLogprob]]] = {}
    for i, rid in enumerate(rows.request_ids):
        wanted = rows.top[i]
        top = tuple(zip(top_ids[i][:wanted], top_values[i][:wanted], strict=True)) if wanted else ()
        entry = TokenLogprob(rows.targets[i], float(chosen[i]), top)
        out.setdefault(rid, []).append((rows.positions[i], entry))
    return out
