"""A tiny random model and a tiny locally-trained tokenizer, in HF directory format.

Tests and the CPU run command use this instead of downloading anything. The tokenizer is a
byte-level BPE trained (deterministically) on a small built-in corpus, with ChatML-style special
tokens and a chat template.
"""

from __future__ import annotations

from pathlib import Path

from gpu_runtime.model.config import ModelConfig
from gpu_runtime.model.loader import build_random_model, save_model

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TOKENIZER_VOCAB = 480

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A decode engine reads every weight once per step, so batching is nearly free.",
    "Paged attention stores keys and values in fixed-size blocks of tokens.",
    "Hello, world! How are you today? I am fine, thank you.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 42 100 256 1024 2048.",
    "The scheduler admits requests while free blocks remain and preempts when they run out.",
    "Fine-tuning with low-rank adapters trains a small number of parameters.",
    "Once upon a time there was a small model that answered every question.",
    "user assistant system: please write a short poem about the sea and the sky.",
    "Continuous batching lets new requests join a running batch at every step.",
]


def build_tiny_tokenizer(directory: str | Path, model_max_length: int = 512) -> int:
    """Train and save the tiny tokenizer into `directory`; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|begin_of_text|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=model_max_length,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(directory))
    return int(tokenizer.get_vocab_size())


def tiny_config(architecture: str = "llama", **overrides: object) -> ModelConfig:
    """The tiny preset for `architecture` ("llama" or "qwen2"), with overrides."""
    base = ModelConfig.preset("tiny")
    if architecture == "qwen2":
        base = base.replace(architecture="qwen2", attention_bias=True, tie_word_embeddings=True)
    elif architecture == "llama":
        base = base.replace(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        )
    return base.replace(**overrides) if overrides else base


def build_tiny_model_dir(
    directory: str | Path,
    architecture: str = "llama",
    seed: int = 0,
    max_shard_bytes: int = 1 << 30,
    **overrides: object,
) -> Path:
    """Write a tiny random model (fp32) plus the tiny tokenizer into `directory`.

    eos is `<|im_end|>`; `max_shard_bytes` small forces several safetensors shards.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vocab = build_tiny_tokenizer(directory)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(directory))
    config = tiny_config(architecture, **overrides).replace(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id
    )
    if config.vocab_size < vocab:
        raise ValueError(f"vocab_size={config.vocab_size} < tokenizer vocabulary {vocab}")
    model = build_random_model(config, seed=seed, device="cpu", dtype="float32")
    save_model(model, directory, max_shard_bytes=max_shard_bytes)
    return directory
