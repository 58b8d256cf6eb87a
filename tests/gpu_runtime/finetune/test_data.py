"""Training-file parsing, chat templates and loss masking on the tiny tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gpu_runtime.contract.chat import ChatMessage, render_chat_with_loss_spans
from gpu_runtime.contract.training_data import jsonl_lines
from gpu_runtime.finetune.data import (
    IGNORE_INDEX,
    ExamplesTooLongError,
    TrainingDataError,
    tokenize_lines,
)


def _labelled_text(tokenizer: Any, ids: tuple[int, ...], labels: tuple[int, ...]) -> str:
    return tokenizer.decode([t for t, lab in zip(ids, labels, strict=True) if lab != IGNORE_INDEX])


def _chat_line(*turns: tuple[str, str]) -> str:
    return json.dumps({"messages": [{"role": r, "content": c} for r, c in turns]})


def test_chat_loss_only_on_assistant_tokens(tokenizer: Any) -> None:
    line = _chat_line(
        ("system", "You are terse."),
        ("user", "Hello, how are you?"),
        ("assistant", "I am fine."),
        ("user", "And the fox?"),
        ("assistant", "It jumps."),
    )
    dataset = tokenize_lines([line], tokenizer, max_seq_len=512)
    (example,) = dataset.examples
    assert dataset.data_format == "chat"
    # Labels equal ids where set; the trained text is both answers with their end-of-turn marker.
    for token, label in zip(example.input_ids, example.labels, strict=True):
        assert label in (token, IGNORE_INDEX)
    assert _labelled_text(tokenizer, example.input_ids, example.labels) == (
        "I am fine.<|im_end|>\nIt jumps.<|im_end|>\n"
    )
    full = tokenizer.apply_chat_template(
        [json.loads(line)["messages"]][0], tokenize=False, add_generation_prompt=False
    )
    assert tokenizer.decode(list(example.input_ids)) == full


def test_assistant_weight_zero_is_not_trained(tokenizer: Any) -> None:
    record = {
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Old answer.", "weight": 0},
            {"role": "user", "content": "Again"},
            {"role": "assistant", "content": "New answer."},
        ]
    }
    (example,) = tokenize_lines([json.dumps(record)], tokenizer, 512).examples
    assert _labelled_text(tokenizer, example.input_ids, example.labels) == "New answer.<|im_end|>\n"


def test_fallback_template_when_tokenizer_has_none(tokenizer: Any) -> None:
    tokenizer.chat_template = None
    messages = [ChatMessage("user", "Hi there"), ChatMessage("assistant", "Hello!")]
    rendered = render_chat_with_loss_spans(tokenizer, messages)
    assert rendered.text == (
        "<|begin_of_text|><|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
    )
    ((start, end),) = rendered.loss_spans
    assert rendered.text[start:end] == "Hello!<|im_end|>\n"
    line = _chat_line(("user", "Hi there"), ("assistant", "Hello!"))
    (example,) = tokenize_lines([line], tokenizer, 512).examples
    assert _labelled_text(tokenizer, example.input_ids, example.labels) == "Hello!<|im_end|>\n"


def test_prompt_completion_labels_completion_and_eos(tokenizer: Any) -> None:
    line = json.dumps({"prompt": "The quick brown fox", "completion": " jumps over the lazy dog."})
    dataset = tokenize_lines([line], tokenizer, 512)
    (example,) = dataset.examples
    assert dataset.data_format == "prompt_completion"
    assert example.input_ids[-1] == tokenizer.eos_token_id
    assert example.labels[-1] == tokenizer.eos_token_id
    assert _labelled_text(tokenizer, example.input_ids, example.labels) == (
        " jumps over the lazy dog.<|im_end|>"
    )
    assert example.labels[0] == IGNORE_INDEX


def test_too_long_examples_are_refused_with_their_lines_and_counts(tokenizer: Any) -> None:
    long_prompt = json.dumps({"prompt": "word " * 100, "completion": " end"})
    ok = json.dumps({"prompt": "Hi", "completion": " there friend of mine"})
    with pytest.raises(ExamplesTooLongError) as info:
        tokenize_lines([ok, "", long_prompt, long_prompt], tokenizer, max_seq_len=16, source="f")
    counted = tokenize_lines([long_prompt], tokenizer, max_seq_len=512).examples[0].num_tokens
    assert [(e.line_number, e.num_tokens) for e in info.value.examples] == [
        (3, counted),
        (4, counted),
    ]
    assert str(info.value) == (
        f"f: 2 example(s) longer than the limit of 16 tokens: line 3 ({counted} tokens), "
        f"line 4 ({counted} tokens)"
    )
    assert tokenize_lines([ok], tokenizer, max_seq_len=16).examples[0].num_tokens == 15


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"text": "x"}', "expected an object with 'messages'"),
        ('{"messages": []}', "non-empty list"),
        ('{"messages": [{"role": "robot", "content": "x"}]}', "role is 'robot'"),
        ('{"messages": [{"role": "user", "content": 3}]}', "content must be a string"),
        ('{"messages": [{"role": "user", "content": "x"}]}', "at least one assistant"),
        ('{"prompt": "a", "completion": 5}', "must be strings"),
        ('{"prompt": "a", "completion": ""}', "'completion' is empty"),
    ],
)
def test_malformed_lines_name_file_and_line(
    tokenizer: Any, tmp_path: Path, line: str, message: str
) -> None:
    good = _chat_line(("user", "Hi"), ("assistant", "Hello"))
    if '"prompt"' in line:
        good = json.dumps({"prompt": "Hi", "completion": " there"})
    path = tmp_path / "train.jsonl"
    path.write_text(f"{good}\n\n{line}\n")
    with pytest.raises(TrainingDataError, match=message) as info:
        tokenize_lines(jsonl_lines(path.read_bytes()), tokenizer, 512, str(path))
    assert f"{path}, line 3:" in str(info.value)


def test_mixed_formats_rejected(tokenizer: Any) -> None:
    lines = [_chat_line(("user", "a"), ("assistant", "b")), '{"prompt": "a", "completion": "b"}']
    with pytest.raises(TrainingDataError, match="one format per file"):
        tokenize_lines(lines, tokenizer, 512, source="f.jsonl")


def test_empty_file_rejected(tokenizer: Any, tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    with pytest.raises(TrainingDataError, match="no usable examples"):
        tokenize_lines(jsonl_lines(path.read_bytes()), tokenizer, 512, str(path))


def test_template_errors_name_the_line(tokenizer: Any) -> None:
    tokenizer.chat_template = "{{ raise_exception('no system messages') }}"
    line = _chat_line(("user", "Hi"), ("assistant", "Hello"))
    with pytest.raises(TrainingDataError, match=r"f.jsonl, line 1: chat template failed"):
        tokenize_lines([line], tokenizer, 512, source="f.jsonl")
