"""A byte-level BPE tokenizer of Llama-3's vocabulary size built without downloads
(`synthetic_tokenizer`), for the grammar compiler and matchers of ``bench/structured``.

No tokenizer can be fetched, and training a 128k BPE takes minutes. What the grammar library's
costs depend on is the vocabulary (how many tokens, how long, which bytes they hold), not the
merge ranks, so the vocabulary is built directly: the 256 byte symbols, then every prefix of
seeded pseudo-words (with and without a leading space, lower and capitalised: how natural
language vocabularies look), number groups and JSON punctuation runs, until `vocab_size`
tokens; each prefix's merge is (prefix less its last symbol, last symbol), so the BPE is valid
and encodes text. The eos token is the one special token, the last id.
"""

from __future__ import annotations

import random
from typing import Any

_ONSETS = ["", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v"]
_ONSETS += ["w", "z", "br", "ch", "cl", "cr", "dr", "fl", "gr", "pl", "pr", "sh", "st", "th"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "ie", "oo", "ou", "y"]
_CODAS = ["", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "ck", "rt", "x"]
_PUNCT = ['"', "{", "}", "[", "]", ":", ",", " ", "\n", "\\", ".", "-", "_", "(", ")"]
EOS_TOKEN = "<|eot_id|>"


def _byte_symbols() -> dict[int, str]:
    """GPT-2's byte -> printable symbol map (what the ByteLevel pre-tokenizer writes)."""
    printable = list(range(ord("!"), ord("~") + 1))
    printable += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    symbols = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in symbols:
            symbols[b] = chr(256 + extra)
            extra += 1
    return symbols


def synthetic_tokenizer(vocab_size: int, seed: int = 0) -> Any:
    """A `PreTrainedTokenizerFast` with exactly `vocab_size` tokens (the last: `EOS_TOKEN`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 512:
        raise ValueError(f"vocab_size={vocab_size} must be >= 512")
    symbols = _byte_symbols()
    vocab: dict[str, int] = {symbols[b]: b for b in range(256)}
    merges: list[tuple[str, str]] = []
    target = vocab_size - 1
    rng = random.Random(seed)
    while len(vocab) < target:
        syllables = rng.choice([1, 1, 2, 2, 2, 3, 3, 4])
        word = "".join(
            rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables)
        )
        for text in _forms(word, rng):
            encoded = "".join(symbols[b] for b in text.encode())
            for end in range(2, len(encoded) + 1):
                piece = encoded[:end]
                if piece not in vocab and len(vocab) < target:
                    merges.append((encoded[: end - 1], encoded[end - 1]))
                    vocab[piece] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS_TOKEN)
    fast.add_special_tokens({"eos_token": EOS_TOKEN})
    if len(fast) != vocab_size:
        raise RuntimeError(f"built {len(fast)} tokens, wanted {vocab_size}")
    return fast


def _forms(word: str, rng: random.Random) -> list[str]:
    """A pseudo-word's token texts: bare, after a space, capitalised; sometimes a number group
    or a punctuation run instead (JSON's own characters among them)."""
    roll = rng.random()
    if roll < 0.03:
        return [str(rng.randint(0, 9999)), " " + str(rng.randint(0, 999))]
    if roll < 0.06:
        return ["".join(rng.choice(_PUNCT) for _ in range(rng.randint(2, 4)))]
    return [word, " " + word, word.capitalize(), " " + word.capitalize()]
