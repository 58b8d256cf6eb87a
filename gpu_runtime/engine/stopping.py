"""Stop conditions and detokenization of a request's output (host side).

Both run on the engine thread once per sampled token, so their cost is decode latency. Text is
kept per request incrementally (`IncrementalDetokenizer`): a step decodes only the tokens after
the last character boundary (usually one, looked up in a per-token cache), and stop strings are
searched only in the new text plus the `max(len(stop)) - 1` characters before it. The text and
the stop decisions are exactly those of decoding the whole output every step; tokenizers for which
that is not guaranteed (see `decodes_concatenatively`) keep the whole-output decode.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

from gpu_runtime.engine.request import Request, RequestStatus

_REPLACEMENT = "\ufffd"
_SPLIT_AFTER_TOKENS = 6
"""Pending tokens (text still ending in U+FFFD) after which the window is split: keeps the
per-step decode bounded on a run of invalid UTF-8 bytes."""
_SPLIT_CANDIDATES = 4
"""Token boundaries tried per split (a 4-byte character in 1-byte tokens spans 3)."""
_CLEANUP_PROBE = "a . b , c ! d ? e 's f n't g 'm h 've i 're j ' k"


class StopDecision(NamedTuple):
    """Output text so far (cut before a stop string) and the finish status, if any."""

    text: str
    status: RequestStatus | None
    reason: int | str | None = None


def decodes_concatenatively(tokenizer: Any) -> bool:
    """True when `tokenizer.decode(ids, skip_special_tokens=True)` is the UTF-8 decoding (one
    U+FFFD per invalid subpart) of the concatenated bytes of the kept tokens, so the text of a
    token list split at a character boundary is the two texts joined: a HF fast tokenizer with
    the byte-level decoder (GPT-2, Llama 3, Qwen) and no space clean-up applied after it.
    SentencePiece decoders are not (the first token's space is stripped; byte-fallback runs are
    decoded as a whole), nor is `clean_up_tokenization_spaces` (it joins across tokens)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or type(getattr(backend, "decoder", None)).__name__ != "ByteLevel":
        return False
    if not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return True
    # transformers 5 ignores the flag for BPE models; check what decode does here
    ids = list(tokenizer.encode(_CLEANUP_PROBE, add_special_tokens=False))
    raw = backend.decode(ids, skip_special_tokens=True)
    return bool(tokenizer.decode(ids, skip_special_tokens=True) == raw)


class IncrementalDetokenizer:
    """One request's output text, brought up to date token by token.

    `final` is the text of `ids[:read_offset]`, where `read_offset` is a token boundary at
    which decoding is additive whatever follows (the text there did not end in U+FFFD, or see
    `_split`), so it never changes; `pending` is the text of `ids[read_offset:]` (it may end in
    U+FFFD for a character whose bytes have not all arrived). With a concatenative decode
    (`decodes_concatenatively`), `final + pending == decode(ids)` after every `update`.
    """

    __slots__ = (
        "final",
        "pending",
        "read_offset",
        "consumed",
        "last_id",
        "checked_final",
        "stop_tail",
    )

    def __init__(self, stop_tail: int = 0) -> None:
        self.final = ""
        self.pending = ""
        self.read_offset = 0
        self.consumed = 0
        self.last_id = -1
        self.checked_final = 0
        """len(final) at the last stop-string check: no stop string lies inside final[:it]."""
        self.stop_tail = stop_tail
        """Longest stop string's length - 1: how far before new text a match can start."""

    @property
    def text(self) -> str:
        """The whole text so far."""
        return self.final + self.pending if self.pending else self.final

    def matches(self, ids: list[int]) -> bool:
        """False when `ids` is not an extension of the tokens seen (then start over)."""
        consumed = self.consumed
        return len(ids) >= consumed and (consumed == 0 or ids[consumed - 1] == self.last_id)

    def update(
        self,
        ids: list[int],
        decode: Callable[[list[int]], str],
        token_text: Callable[[int], str],
    ) -> None:
        """Take in `ids[self.consumed:]`. `decode(ids)` is the tokenizer's text of a token list,
        `token_text(id)` the same for one token (cached by the caller). Decodes only the tokens
        after `read_offset` (one, usually)."""
        count = len(ids)
        if count == self.consumed:
            return
        start = self.read_offset
        pending = token_text(ids[start]) if count - start == 1 else decode(ids[start:])
        if not pending.endswith(_REPLACEMENT):
            self.final += pending
            self.read_offset = count
            pending = ""
        elif count - start >= _SPLIT_AFTER_TOKENS:
            pending = self._split(ids, pending, decode, token_text)
        self.pending = pending
        self.consumed = count
        self.last_id = ids[-1]

    def _split(
        self,
        ids: list[int],
        pending: str,
        decode: Callable[[list[int]], str],
        token_text: Callable[[int], str],
    ) -> str:
        """Move `read_offset` to a boundary `j` with at least 3 bytes after it where the two
        halves' texts join to `pending`; returns the new pending text (`pending` when no
        candidate qualifies).

        Exact because a UTF-8 decoder's state after a byte depends only on the last 3 bytes
        (a lead byte always starts a sequence; one is at most 4 bytes): once both decodings
        agree on the text so far and have read the same 3 bytes, they agree on every
        continuation. A kept token has at least one byte (its text is not empty)."""
        start = self.read_offset
        kept = 0
        tried = 0
        for j in range(len(ids) - 1, start, -1):
            kept += bool(token_text(ids[j]))
            if kept < 3:
                continue
            head = decode(ids[start:j])
            tail = decode(ids[j:])
            if head + tail == pending:
                self.final += head
                self.read_offset = j
                return tail
            tried += 1
            if tried == _SPLIT_CANDIDATES:
                break
        return pending


class StopChecker:
    """Applies, in order: stop tokens (eos unless ignore_eos), stop strings, max_tokens and
    max_model_len; stop tokens only once the output has `min_tokens` tokens, stop strings only
    once it has more (vLLM: a stop string ending in the first `min_tokens` is not found).
    Text is decoded with `skip_special_tokens=True` when a tokenizer is set, incrementally
    where `decodes_concatenatively(tokenizer)` (per-request state lives as long as the request
    object or until it finishes), else from all output tokens each step."""

    def __init__(self, tokenizer: Any | None, eos_token_ids: list[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.incremental = tokenizer is not None and decodes_concatenatively(tokenizer)
        self._detokenizers: weakref.WeakKeyDictionary[Request, IncrementalDetokenizer] = (
            weakref.WeakKeyDictionary()
        )
        self._token_texts: dict[int, str] = {}

    def decode(self, token_ids: list[int]) -> str:
        """Text of `token_ids` ('' without a tokenizer)."""
        if self.tokenizer is None or not token_ids:
            return ""
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=True))

    def token_text(self, token_id: int) -> str:
        """Text of one token alone (cached: bounded by the vocabulary)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.decode([token_id])
        return text

    def check(self, request: Request) -> StopDecision:
        """Decide whether `request` stops after its latest token."""
        params = request.sampling_params
        output = request.output_token_ids
        detokenizer = None
        search_from = 0
        if not params.detokenize or self.tokenizer is None:
            text = ""
        elif self.incremental:
            detokenizer = self._detokenizer(request)
            detokenizer.update(output, self.decode, self.token_text)
            text = detokenizer.text
            if params.stop:  # an earlier match would have ended the request
                search_from = max(0, detokenizer.checked_final - detokenizer.stop_tail)
                detokenizer.checked_final = len(detokenizer.final)
        else:
            text = self.decode(output)
        decision = self._decide(request, text, search_from)
        if decision.status is not None and detokenizer is not None:
            self._detokenizers.pop(request, None)
        return decision

    def _detokenizer(self, request: Request) -> IncrementalDetokenizer:
        detokenizer = self._detokenizers.get(request)
        if detokenizer is None or not detokenizer.matches(request.output_token_ids):
            stops = request.sampling_params.stop
            stop_tail = max((len(s) for s in stops), default=1) - 1
            detokenizer = self._detokenizers[request] = IncrementalDetokenizer(stop_tail)
        return detokenizer

    def _decide(self, request: Request, text: str, search_from: int) -> StopDecision:
        params = request.sampling_params
        output = request.output_token_ids
        last = output[-1]
        count = len(output)
        stops = count >= params.min_tokens  # vLLM: no stop before min_tokens
        if stops and params.stop_token_ids and last in params.stop_token_ids:
            return StopDecision(text, RequestStatus.FINISHED_STOPPED, last)
        if stops and not params.ignore_eos and last in self.eos_token_ids:
            return StopDecision(text, RequestStatus.FINISHED_STOPPED, last)
        if params.stop and count > params.min_tokens:
            hits = [(text.find(s, search_from), s) for s in params.stop]
            found = [hit for hit in hits if hit[0] >= 0]
            if found:
                index, stop = min(found)
                return StopDecision(text[:index], RequestStatus.FINISHED_STOPPED, stop)
        if (
            count >= params.max_tokens
            or count + len(request.prompt_token_ids) >= self.max_model_len
        ):
            return StopDecision(text, RequestStatus.FINISHED_LENGTH)
        return _CONTINUE_WITHOUT_TEXT if not text else StopDecision(text, None)


_CONTINUE_WITHOUT_TEXT = StopDecision("", None)
