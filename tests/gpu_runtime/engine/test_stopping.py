"""Incremental detokenization and stop strings against decoding the whole output every step,
with the tiny byte-level tokenizer (nothing downloaded)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from gpu_runtime.engine.request import Request, RequestStatus, SamplingParams
from gpu_runtime.engine.stopping import StopChecker, StopDecision, decodes_concatenatively
from gpu_runtime.model.tiny import SPECIAL_TOKENS, build_tiny_tokenizer

EOS = 2  # <|im_end|>
TEXTS = ("héllo", " wörld", " €5", " 😀", "中文", " naïve", ". ", "ok", " a", "\n", "🇫🇷")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    directory: Path = tmp_path_factory.mktemp("tiny-tok")
    build_tiny_tokenizer(directory)
    return AutoTokenizer.from_pretrained(str(directory))


class CountingTokenizer:
    """Forwards to a tokenizer, counting `decode` calls and the ids they decode."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls = 0
        self.ids = 0

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        self.calls += 1
        self.ids += len(ids)
        return str(self.inner.decode(ids, **kwargs))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def byte_ids_by_value(tokenizer: Any) -> list[int]:
    """Id of each single-byte token, by byte value (GPT-2's byte-to-character table)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    ids = [tokenizer.convert_tokens_to_ids(chars[b]) for b in range(256)]
    assert all(isinstance(i, int) and i >= len(SPECIAL_TOKENS) for i in ids)
    return ids


def random_ids(tokenizer: Any, rng: random.Random, count: int) -> list[int]:
    """Token ids mixing whole words, characters split into their bytes, invalid byte runs,
    cut characters, special tokens and arbitrary ids."""
    byte_ids = byte_ids_by_value(tokenizer)
    ids: list[int] = []
    while len(ids) < count:
        kind = rng.randrange(7)
        text = rng.choice(TEXTS)
        if kind == 0:
            ids += tokenizer.encode(text, add_special_tokens=False)
        elif kind == 1:  # every byte its own token
            ids += [byte_ids[b] for b in text.encode()]
        elif kind == 2:  # continuation bytes alone: U+FFFD each
            ids += [byte_ids[rng.randrange(0x80, 0xC0)] for _ in range(rng.randrange(1, 12))]
        elif kind == 3:  # a character cut short, then anything
            data = rng.choice(["€", "😀", "中", "é"]).encode()
            ids += [byte_ids[b] for b in data[: rng.randrange(1, len(data))]]
        elif kind == 4:
            ids.append(rng.randrange(len(SPECIAL_TOKENS)))
        elif kind == 5:
            ids.append(rng.randrange(len(tokenizer)))
        else:  # lead bytes and random bytes
            ids += [byte_ids[rng.randrange(256)] for _ in range(rng.randrange(1, 6))]
    return ids[:count]


def _request(params: SamplingParams, prompt_len: int = 3) -> Request:
    return Request("r", list(range(10, 10 + prompt_len)), params)


def _reference(tokenizer: Any, request: Request, max_model_len: int) -> StopDecision:
    """The checker before incremental decoding: the whole output decoded every step."""
    params = request.sampling_params
    output = request.output_token_ids
    text = str(tokenizer.decode(output, skip_special_tokens=True)) if params.detokenize else ""
    last = output[-1]
    if params.stop_token_ids and last in params.stop_token_ids:
        return StopDecision(text, RequestStatus.FINISHED_STOPPED, last)
    if not params.ignore_eos and last == EOS:
        return StopDecision(text, RequestStatus.FINISHED_STOPPED, last)
    if params.stop:
        hits = [(text.find(s), s) for s in params.stop if s in text]
        if hits:
            index, stop = min(hits)
            return StopDecision(text[:index], RequestStatus.FINISHED_STOPPED, stop)
    count = len(output)
    if count >= params.max_tokens or count + len(request.prompt_token_ids) >= max_model_len:
        return StopDecision(text, RequestStatus.FINISHED_LENGTH)
    return StopDecision(text, None)


def _run(checker: StopChecker, ids: list[int], params: SamplingParams) -> list[StopDecision]:
    request = _request(params)
    decisions = []
    for token in ids:
        request.output_token_ids.append(token)
        decision = checker.check(request)
        decisions.append(decision)
        if decision.status is not None:
            break
    return decisions


def _run_reference(tokenizer: Any, ids: list[int], params: SamplingParams) -> list[StopDecision]:
    request = _request(params)
    decisions = []
    for token in ids:
        request.output_token_ids.append(token)
        decision = _reference(tokenizer, request, 10_000)
        decisions.append(decision)
        if decision.status is not None:
            break
    return decisions


def test_the_tiny_tokenizer_decodes_incrementally(tokenizer: Any) -> None:
    assert decodes_concatenatively(tokenizer)
    assert StopChecker(tokenizer, [EOS], 10_000).incremental
    assert not decodes_concatenatively(object())


@pytest.mark.parametrize("seed", range(40))
def test_text_equals_whole_decode_at_every_step(tokenizer: Any, seed: int) -> None:
    rng = random.Random(seed)
    ids = random_ids(tokenizer, rng, 300)
    checker = StopChecker(tokenizer, [EOS], 10_000)
    params = SamplingParams(max_tokens=10_000, ignore_eos=True)
    got = _run(checker, ids, params)
    assert len(got) == len(ids)
    for step, decision in enumerate(got, start=1):
        assert decision.text == tokenizer.decode(ids[:step], skip_special_tokens=True), step
        assert decision.status is None


@pytest.mark.parametrize("seed", range(60))
def test_stop_strings_match_whole_decode(tokenizer: Any, seed: int) -> None:
    """Stop strings cut from the text itself (so they span token boundaries and multi-byte
    characters), several at once, some absent; the same step, cut and reason as before."""
    rng = random.Random(1000 + seed)
    ids = random_ids(tokenizer, rng, 160)
    full = tokenizer.decode(ids, skip_special_tokens=True)
    stops: list[str] = []
    for _ in range(rng.randrange(1, 5)):
        if rng.random() < 0.8 and len(full) > 8:
            start = rng.randrange(len(full) // 4, len(full) - 1)
            stops.append(full[start : start + rng.randrange(1, 9)])
        else:
            stops.append(rng.choice(["zzz", "€€€", "😀😀", "\ufffd"]))
    params = SamplingParams(max_tokens=140, stop=tuple(stops), ignore_eos=seed % 2 == 0)
    checker = StopChecker(tokenizer, [EOS], 10_000)
    assert _run(checker, ids, params) == _run_reference(tokenizer, ids, params)


def test_stop_string_across_tokens_and_earliest_match(tokenizer: Any) -> None:
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog.", add_special_tokens=False)
    checker = StopChecker(tokenizer, [EOS], 10_000)
    params = SamplingParams(max_tokens=100, stop=("lazy dog", "ck br", "over"))
    got = _run(checker, ids, params)
    assert got == _run_reference(tokenizer, ids, params)
    assert got[-1] == StopDecision("The qui", RequestStatus.FINISHED_STOPPED, "ck br")


def test_length_stop_token_and_no_detokenize(tokenizer: Any) -> None:
    ids = random_ids(tokenizer, random.Random(7), 50)
    checker = StopChecker(tokenizer, [EOS], 10_000)
    for params in (
        SamplingParams(max_tokens=20, ignore_eos=True),
        SamplingParams(max_tokens=50, stop_token_ids=(ids[30],), ignore_eos=True),
        SamplingParams(max_tokens=20, detokenize=False, ignore_eos=True),
    ):
        assert _run(checker, ids, params) == _run_reference(tokenizer, ids, params)


def test_rewritten_or_shorter_output_starts_over(tokenizer: Any) -> None:
    """A token replaced after it was seen (an async placeholder), or a shorter output: the
    text is decoded again rather than trusted."""
    byte_ids = byte_ids_by_value(tokenizer)
    checker = StopChecker(tokenizer, [EOS], 10_000)
    request = _request(SamplingParams(max_tokens=100))
    request.output_token_ids += tokenizer.encode("héllo", add_special_tokens=False)
    checker.check(request)
    request.output_token_ids.append(byte_ids[0xE2])
    assert checker.check(request).text == "héllo\ufffd"
    request.output_token_ids[-1] = byte_ids[ord("!")]
    assert checker.check(request).text == "héllo!"
    del request.output_token_ids[-3:]
    expected = tokenizer.decode(request.output_token_ids, skip_special_tokens=True)
    assert checker.check(request).text == expected


def test_finished_requests_release_their_state(tokenizer: Any) -> None:
    checker = StopChecker(tokenizer, [EOS], 10_000)
    request = _request(SamplingParams(max_tokens=3))
    for token in tokenizer.encode("hello world", add_special_tokens=False)[:3]:
        request.output_token_ids.append(token)
        decision = checker.check(request)
    assert decision.status is RequestStatus.FINISHED_LENGTH
    assert request not in checker._detokenizers
    other = _request(SamplingParams(max_tokens=30))
    other.output_token_ids.append(5)
    checker.check(other)
    assert len(checker._detokenizers) == 1
    del other
    assert len(checker._detokenizers) == 0


@pytest.mark.parametrize("garbage", [False, True])
def test_decode_work_per_step_does_not_grow(tokenizer: Any, garbage: bool) -> None:
    """Ids decoded per step stay bounded over a 3000-token output (whole-output decoding would
    decode ~4.5M ids), for text and for a long run of invalid UTF-8 bytes."""
    byte_ids = byte_ids_by_value(tokenizer)
    if garbage:
        ids = [byte_ids[0xE2], byte_ids[0x82]] * 1500  # never a complete character
    else:
        text = " ".join(["héllo wörld, 中文 😀 €5 naïve."] * 200)
        ids = tokenizer.encode(text, add_special_tokens=False)[:3000]
    assert len(ids) == 3000
    counting = CountingTokenizer(tokenizer)
    checker = StopChecker(counting, [EOS], 10_000)
    params = SamplingParams(max_tokens=10_000, stop=("never seen",), ignore_eos=True)
    request = _request(params)
    worst = 0
    for token in ids:
        request.output_token_ids.append(token)
        before = counting.ids
        decision = checker.check(request)
        worst = max(worst, counting.ids - before)
        assert decision.status is None
    assert decision.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert worst <= 50
    assert counting.ids < 20 * len(ids)


def test_tokenizers_that_clean_up_spaces_decode_the_whole_output(tokenizer: Any) -> None:
    """`clean_up_tokenization_spaces` joins across tokens (" ." -> "."): whole-output decoding,
    exactly as before."""
    from transformers import AutoTokenizer

    cleaning = AutoTokenizer.from_pretrained(
        tokenizer.name_or_path,
        clean_up_tokenization_spaces=True,
        clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output=True,
    )
    ids = cleaning.encode("a . b 's", add_special_tokens=False)
    assert cleaning.decode(ids) != tokenizer.decode(ids)
    assert not decodes_concatenatively(cleaning)
    checker = StopChecker(cleaning, [EOS], 10_000)
    assert not checker.incremental
    params = SamplingParams(max_tokens=10_000, stop=("b's",), ignore_eos=True)
    assert _run(checker, ids, params) == _run_reference(cleaning, ids, params)


def test_min_tokens_holds_back_stop_tokens_and_stop_strings(tokenizer: Any) -> None:
    """vLLM's semantics: stop tokens (eos, stop_token_ids) count once the output has
    `min_tokens` tokens; stop strings are searched only once it has more, and only in the text
    added from then on (a stop string complete in the first `min_tokens` tokens is not found)."""
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog.", add_special_tokens=False)
    checker = StopChecker(tokenizer, [EOS], 10_000)
    early = SamplingParams(max_tokens=100, stop=("e",))
    assert _run(checker, ids, early)[-1] == StopDecision("Th", RequestStatus.FINISHED_STOPPED, "e")
    held = SamplingParams(max_tokens=100, stop=("e",), min_tokens=len(ids) // 2)
    last = _run(checker, ids, held)[-1]
    text = tokenizer.decode(ids)
    assert last.status is RequestStatus.FINISHED_STOPPED and last.reason == "e"
    cut = len(last.text)
    assert text[cut] == "e" and cut > len(tokenizer.decode(ids[: len(ids) // 2])) - 1
    stop_id = SamplingParams(max_tokens=100, stop_token_ids=(ids[1],), min_tokens=3)
    decisions = _run(checker, [*ids[:2], ids[1], ids[1]], stop_id)
    assert [d.status for d in decisions] == [None, None, RequestStatus.FINISHED_STOPPED]
    with_eos = SamplingParams(max_tokens=100, min_tokens=2)
    assert [d.status for d in _run(checker, [EOS, EOS], with_eos)] == [
        None,
        RequestStatus.FINISHED_STOPPED,
    ]
