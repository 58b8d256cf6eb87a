"""Requests, their sampling parameters and what the engine reports back per step."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from gpu_runtime.structured.params import StructuredOutputParams


class SamplingParamsError(ValueError):
    """Sampling parameters out of range; the message names the field and value."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop, per request."""

    max_tokens: int = 16
    """Most tokens to generate."""
    temperature: float = 1.0
    """0 means greedy; otherwise logits are divided by it before sampling."""
    top_p: float = 1.0
    """Nucleus mass kept, in (0, 1]."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 means all."""
    seed: int | None = None
    """Per-request seed: the same seed and prompt give the same tokens whatever the batch."""
    stop: tuple[str, ...] = ()
    """Stop strings; the output text is cut before the first one (needs a tokenizer)."""
    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end generation (in addition to eos unless ignore_eos)."""
    ignore_eos: bool = False
    """Keep generating past the model's eos tokens."""
    logprobs: int | None = None
    """None: no logprobs; n >= 0: the sampled token's logprob plus the n most likely."""
    detokenize: bool = True
    """Produce output text (needed for stop strings)."""
    structured_output: StructuredOutputParams | None = None
    """Constrain the output to a grammar (JSON schema, regex, EBNF, structural tag;
    `gpu_runtime.structured`): its logits rows are masked to the tokens the grammar allows,
    eos only where it is complete, and the request stops when the grammar has ended."""

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise SamplingParamsError(f"max_tokens={self.max_tokens} must be >= 1")
        if not 0.0 <= self.temperature <= 100.0:
            raise SamplingParamsError(f"temperature={self.temperature} must be in [0, 100]")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise SamplingParamsError(f"top_k={self.top_k} must be >= 0")
        if self.logprobs is not None and self.logprobs < 0:
            raise SamplingParamsError(f"logprobs={self.logprobs} must be >= 0")
        if any(not s for s in self.stop):
            raise SamplingParamsError("stop strings must be non-empty")
        if self.stop and not self.detokenize:
            raise SamplingParamsError("stop strings need detokenize=True")

    @property
    def greedy(self) -> bool:
        """True when the token is the argmax."""
        return self.temperature == 0.0


class RequestStatus(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        """True for the three finished states."""
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
        )


@dataclass(eq=False)
class Request:
    """One generation request as the scheduler tracks it.

    `all_token_ids` is prompt + output; `num_computed_tokens` counts the prefix whose KV is in
    the cache (reset to 0 on preemption: the request is recomputed from its tokens).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    lora_name: str | None = None
    """Adapter to apply (None: base model). Reserved: the engine rejects names it has no
    adapter registry entry for."""
    tenant: str = ""
    """Who asked (the server passes the caller of `ModelAccess`): the scheduler admits waiting
    requests round-robin across tenants, FIFO within one (`waiting_queue.WaitingQueue`)."""
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    stop_reason: int | str | None = None

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by the generated tokens."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)


@dataclass(frozen=True)
class TokenLogprob:
    """Logprob of one token and the most likely alternatives at that step."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(slots=True)
class RequestOutput:
    """A request's state after a step: new tokens of this step and everything so far.

    `output_token_ids` is the request's own list (not a copy, to keep steps O(batch)): it keeps
    growing while the request runs and is final on the output with `finished=True`.
    """

    request_id: str
    new_token_ids: list[int]
    output_token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    error: str | None = None
    """Set when the request failed without running (e.g. its adapter cannot be loaded);
    then `finished` is True and `finish_reason` is "abort"."""
