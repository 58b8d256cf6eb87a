"""The tiny built-in tokenizer: a byte-level BPE trained deterministically on a small corpus, with
ChatML-style special tokens and a chat template, saved in Hugging Face directory format.

The tiny base model's hosts (`gpu_runtime.model.tiny.build_tiny_model_dir`) and the control plane
(which tokenizes training files of the `tiny` preset before a job is queued) build it with this
one function, so both count the same tokens. Imports neither torch nor Django.
"""

from __future__ import annotations

from pathlib import Path

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
