"""The shared training-file rule: line numbers as the upload check counts them, the limit, and
the per-format functions (on the tiny tokenizer, loaded as hosts and control plane load it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gpu_runtime.contract.tiny_tokenizer import build_tiny_tokenizer
from gpu_runtime.contract.tokenizer import (
    TokenizerFilesError,
    load_training_tokenizer,
    tokenizer_digest,
)
from gpu_runtime.contract.training_data import (
    FORMAT_TOKENIZERS,
    ExamplesTooLongError,
    TrainingDataError,
    jsonl_lines,
    tokenize_training_lines,
    training_max_seq_len,
)
from gpu_runtime.contract.training_examples import PreferencePair

PAIR = json.dumps({"prompt": "Q: hello", "completion": " A: world"})


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-tokenizer")
    build_tiny_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path) -> Any:
    return load_training_tokenizer(tokenizer_dir)


def test_the_limit_is_the_context_length_at_most_2048() -> None:
    assert [training_max_seq_len(n) for n in (64, 512, 2048, 8192, 131072)] == [
        64, 512, 2048, 2048, 2048,
    ]  # fmt: skip


def test_lines_split_as_the_upload_check_splits_them(tokenizer: Any) -> None:
    """CRLF, CR and blank lines count; a U+2028 inside a JSON string does not split a line."""
    odd = json.dumps({"prompt": "a\u2028b", "completion": " c"}, ensure_ascii=False)
    data = f"{PAIR}\r\n\r\n{odd}\r{PAIR}\n".encode()
    assert len(jsonl_lines(data)) == 4
    tokenized = tokenize_training_lines(jsonl_lines(data), tokenizer, 64, "f")
    assert tokenized.line_numbers == (1, 3, 4) and tokenized.num_lines == 3
    with pytest.raises(TrainingDataError) as info:
        tokenize_training_lines(jsonl_lines(data + b"{}\n"), tokenizer, 64, "training file x")
    assert (info.value.line_number, str(info.value)) == (
        5,
        "training file x, line 5: expected an object with 'messages', with 'prompt' and "
        "'completion', or a preference example ('input', 'preferred_output', "
        "'non_preferred_output'); got keys []",
    )
    with pytest.raises(TrainingDataError, match="line 2: not valid UTF-8"):
        tokenize_training_lines([PAIR.encode(), b"\xff\n"], tokenizer, 64, "f")


def test_every_too_long_example_is_counted_after_the_first_ten(tokenizer: Any) -> None:
    long = json.dumps({"prompt": "word " * 40, "completion": " x"})
    tokens = tokenize_training_lines([long], tokenizer, 512, "f").examples[0].num_tokens
    with pytest.raises(ExamplesTooLongError) as info:
        tokenize_training_lines([PAIR] + [long] * 12, tokenizer, tokens - 1, "f")
    assert [e.line_number for e in info.value.examples] == list(range(2, 14))
    assert {e.num_tokens for e in info.value.examples} == {tokens}
    assert str(info.value).endswith(f"line 11 ({tokens} tokens); and 2 more")
    assert tokenize_training_lines([long], tokenizer, tokens, "f").examples[0].num_tokens == tokens


def test_each_format_is_one_function(tokenizer: Any) -> None:
    assert sorted(FORMAT_TOKENIZERS) == ["chat", "preference", "prompt_completion"]
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    direct = FORMAT_TOKENIZERS["chat"](tokenizer, chat)
    (through,) = tokenize_training_lines([json.dumps(chat)], tokenizer, 64, "f").examples
    assert direct == through


def test_a_preference_pair_is_limited_by_its_longer_row(tokenizer: Any) -> None:
    def pair(preferred: str, other: str) -> str:
        return json.dumps(
            {
                "input": {"messages": [{"role": "user", "content": "which?"}]},
                "preferred_output": [{"role": "assistant", "content": preferred}],
                "non_preferred_output": [{"role": "assistant", "content": other}],
            }
        )

    (short,) = tokenize_training_lines([pair("yes", "no")], tokenizer, 512, "f").examples
    assert isinstance(short, PreferencePair)
    prompt = len(short.chosen.input_ids) - short.chosen.num_loss_tokens
    assert short.chosen.input_ids[:prompt] == short.rejected.input_ids[:prompt]
    assert short.num_loss_tokens == 1
    long_line = pair("yes", "no " * 200)
    (long,) = tokenize_training_lines([long_line], tokenizer, 512, "f").examples
    assert isinstance(long, PreferencePair)
    limit = long.longest_row_tokens - 1
    assert long.rejected.num_tokens == long.longest_row_tokens > long.chosen.num_tokens
    with pytest.raises(ExamplesTooLongError) as info:
        tokenize_training_lines([pair("yes", "no"), long_line], tokenizer, limit, "f")
    assert [(e.line_number, e.num_tokens) for e in info.value.examples] == [
        (2, long.longest_row_tokens)
    ]


def test_a_directory_without_tokenizer_json_has_no_training_tokenizer(tmp_path: Path) -> None:
    with pytest.raises(TokenizerFilesError, match="no tokenizer.json"):
        load_training_tokenizer(tmp_path)


def test_the_tiny_tokenizer_is_deterministic(tokenizer_dir: Path, tmp_path: Path) -> None:
    build_tiny_tokenizer(tmp_path)
    assert tokenizer_digest(tmp_path) == tokenizer_digest(tokenizer_dir)
