"""Requests, their sampling parameters and what the engine reports back per step."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from gpu_runtime.structured.params import StructuredOutputParams

PENALTY_RANGE = 2.0
"""Presence and frequency penalties lie in [-PENALTY_RANGE, PENALTY_RANGE] (OpenAI's range)."""
LOGIT_BIAS_RANGE = 100.0
"""A logit bias lies in [-LOGIT_BIAS_RANGE, LOGIT_BIAS_RANGE] (OpenAI's range)."""


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
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token already in the output (OpenAI), in [-2, 2]."""
    frequency_penalty: float = 0.0
    """Times the token's count in the output, subtracted from its logit (OpenAI), in [-2, 2]."""
    repetition_penalty: float = 1.0
    """> 0; a token seen in the prompt or the output has a positive logit divided by it and a
    negative one multiplied by it (vLLM/HF); 1 is off."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs added to the logits before anything else; bias in [-100, 100],
    each id once (ids are checked against the vocabulary by `check_vocab`)."""
    min_p: float = 0.0
    """In [0, 1]: tokens whose probability (after temperature) is below min_p times the most
    likely token's are dropped; 0 is off."""
    min_tokens: int = 0
    """Until this many tokens are generated, eos and `stop_token_ids` cannot be sampled and
    no stop applies (stop strings only once the output is longer than this, as vLLM)."""
    n: int = 1
    """Sequences generated from the prompt: its prefix is prefilled once, then forked into `n`
    children sharing its KV blocks (`Engine.add_request`); each samples independently."""
    prompt_logprobs: int | None = None
    """None: none; k >= 0: each prompt token's logprob (but the first's) plus the k most likely,
    computed in the prefill (`RequestOutput.prompt_logprobs`)."""
    needs_logits_processing: bool = field(init=False, repr=False, compare=False)
    """Derived: a penalty, logit bias, min_p or min_tokens is set (the sampler's slow path)."""
    needs_token_counts: bool = field(init=False, repr=False, compare=False)
    """Derived: a presence, frequency or repetition penalty is set (per-row token counts)."""

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
        if self.n < 1:
            raise SamplingParamsError(f"n={self.n} must be >= 1")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise SamplingParamsError(f"prompt_logprobs={self.prompt_logprobs} must be >= 0")
        if any(not s for s in self.stop):
            raise SamplingParamsError("stop strings must be non-empty")
        if self.stop and not self.detokenize:
            raise SamplingParamsError("stop strings need detokenize=True")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -PENALTY_RANGE <= value <= PENALTY_RANGE:
                raise SamplingParamsError(f"{name}={value} must be in [-2, 2]")
        if not self.repetition_penalty > 0.0 or self.repetition_penalty == float("inf"):
            raise SamplingParamsError(
                f"repetition_penalty={self.repetition_penalty} must be a finite number > 0"
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingParamsError(f"min_p={self.min_p} must be in [0, 1]")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise SamplingParamsError(
                f"min_tokens={self.min_tokens} must be in [0, max_tokens={self.max_tokens}]"
            )
        if any(t < 0 for t in self.stop_token_ids):
            raise SamplingParamsError(f"stop_token_ids={list(self.stop_token_ids)} must be >= 0")
        ids = [token for token, _ in self.logit_bias]
        if len(set(ids)) != len(ids):
            raise SamplingParamsError(f"logit_bias has a token id more than once: {ids}")
        for token, bias in self.logit_bias:
            if token < 0:
                raise SamplingParamsError(f"logit_bias token id {token} must be >= 0")
            if not -LOGIT_BIAS_RANGE <= bias <= LOGIT_BIAS_RANGE:
                raise SamplingParamsError(f"logit_bias[{token}]={bias} must be in [-100, 100]")
        counts = (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
        processing = counts or bool(self.logit_bias) or self.min_p > 0.0 or self.min_tokens > 0
        object.__setattr__(self, "needs_token_counts", counts)
        object.__setattr__(self, "needs_logits_processing", processing)

    def check_vocab(self, vocab_size: int) -> None:
        """SamplingParamsError when a token id the parameters name (logit_bias,
        stop_token_ids) or the logprob count is outside a vocabulary of `vocab_size`."""
        outside = [t for t, _ in self.logit_bias if t >= vocab_size]
        if outside:
            raise SamplingParamsError(
                f"logit_bias token ids {outside} are outside the vocabulary [0, {vocab_size})"
            )
        outside = [t for t in self.stop_token_ids if t >= vocab_size]
        if outside:
            raise SamplingParamsError(
                f"stop_token_ids {outside} are outside the vocabulary [0, {vocab_size})"
            )
        if self.logprobs is not None and self.logprobs > vocab_size:
            raise SamplingParamsError(
                f"logprobs={self.logprobs} > the vocabulary size {vocab_size}"
            )

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
    num_cached_tokens: int = 0
    """Prompt tokens found in the prefix cache when the request was first admitted."""
    stop_reason: int | str | None = None
    fan_out: int = 1
    """Children this request forks into once every prompt token but the last is cached (its
    `sampling_params.n` when > 1, see `fanout.py`); 1 for ordinary requests and children."""
    parent_id: str | None = None
    """The fan-out parent this request was forked from (None: it was not forked)."""
    index: int = 0
    """The child's index under its parent, 0..n-1 (0 when not forked)."""
    cow_source: int | None = None
    """A child's copy-on-write source: the parent's last, partially filled prompt block, on
    which the child holds one reference until the scheduler allocates its own copy."""
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """Prompt logprobs so far (`SamplingParams.prompt_logprobs`), first entry None."""

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by the generated tokens."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_schedulable_tokens(self) -> int:
        """Tokens the scheduler computes before the request samples or forks: all known, but
        for a fan-out parent its last prompt token (each child computes it and samples)."""
        tokens = len(self.prompt_token_ids) + len(self.output_token_ids)
        return tokens - 1 if self.fan_out > 1 else tokens


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
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache at the request's first admission."""
    parent_id: str | None = None
    """For a child of a fan-out (`SamplingParams.n > 1`): the id `add_request` returned."""
    index: int = 0
    """The child's index under `parent_id` (0..n-1); 0 when not forked."""
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """With `SamplingParams.prompt_logprobs`: one entry per prompt token (the first None),
    complete on every output once the prompt is computed (the request's own list)."""
