"""Stop conditions and detokenization of a request's output (host side)."""

from __future__ import annotations

from typing import Any, NamedTuple

from gpu_runtime.engine.request import Request, RequestStatus


class StopDecision(NamedTuple):
    """Output text so far (cut before a stop string) and the finish status, if any."""

    text: str
    status: RequestStatus | None
    reason: int | str | None = None


class StopChecker:
    """Applies, in order: stop tokens (eos unless ignore_eos), stop strings, max_tokens and
    max_model_len. Text is decoded with `skip_special_tokens=True` when a tokenizer is set."""

    def __init__(self, tokenizer: Any | None, eos_token_ids: list[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len

    def decode(self, token_ids: list[int]) -> str:
        """Text of `token_ids` ('' without a tokenizer)."""
        if self.tokenizer is None or not token_ids:
            return ""
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=True))

    def check(self, request: Request) -> StopDecision:
        """Decide whether `request` stops after its latest token."""
        params = request.sampling_params
        output = request.output_token_ids
        text = self.decode(output) if params.detokenize else ""
        last = output[-1]
        if params.stop_token_ids and last in params.stop_token_ids:
            return StopDecision(text, RequestStatus.FINISHED_STOPPED, last)
        if not params.ignore_eos and last in self.eos_token_ids:
            return StopDecision(text, RequestStatus.FINISHED_STOPPED, last)
        if params.stop:
            hits = [(text.find(s), s) for s in params.stop if s in text]
            if hits:
                index, stop = min(hits)
                return StopDecision(text[:index], RequestStatus.FINISHED_STOPPED, stop)
        count = len(output)
        if (
            count >= params.max_tokens
            or count + len(request.prompt_token_ids) >= self.max_model_len
        ):
            return StopDecision(text, RequestStatus.FINISHED_LENGTH)
        return _CONTINUE_WITHOUT_TEXT if not text else StopDecision(text, None)


_CONTINUE_WITHOUT_TEXT = StopDecision("", None)
