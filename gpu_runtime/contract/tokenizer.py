"""The training tokenizer of a base model: what both halves tokenize training files with.

A host trains with the tokenizer :func:`load_training_tokenizer` loads from its model directory
and publishes those same files (:data:`TOKENIZER_FILES`) to shared storage; the control plane
loads them with the same function to count an example's tokens before a job is queued, so the
two counts are equal by construction. The loader is the `transformers` fast tokenizer over
`tokenizer.json` (whose import needs no torch, unlike `AutoTokenizer`), with the special tokens
and chat template of `tokenizer_config.json` / `chat_template.jinja`.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from gpu_runtime.contract.chat import ChatTokenizer

REQUIRED_TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_FILES = (
    REQUIRED_TOKENIZER_FILE,
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
"""The files of a model directory that define its training tokenizer (those present)."""


class TokenizerFilesError(ValueError):
    """A directory without the tokenizer files a training tokenizer needs."""


def tokenizer_files(directory: str | Path) -> list[Path]:
    """The tokenizer files present in `directory`; TokenizerFilesError without tokenizer.json."""
    root = Path(directory)
    if not (root / REQUIRED_TOKENIZER_FILE).is_file():
        raise TokenizerFilesError(f"no {REQUIRED_TOKENIZER_FILE} in the model directory")
    return [root / name for name in TOKENIZER_FILES if (root / name).is_file()]


def tokenizer_digest(directory: str | Path) -> str:
    """sha256 over the names and bytes of the tokenizer files: equal digests, equal tokenizers."""
    digest = hashlib.sha256()
    for path in tokenizer_files(directory):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def load_training_tokenizer(directory: str | Path) -> ChatTokenizer:
    """The training tokenizer saved in `directory` (see the module docstring)."""
    tokenizer_files(directory)
    from transformers import PreTrainedTokenizerFast

    tokenizer: ChatTokenizer = PreTrainedTokenizerFast.from_pretrained(str(directory))
    return tokenizer
