"""Tiny models whose tokenizers carry the real chat templates of Llama 3.1 Instruct and Qwen2.5
Instruct (checked in under `chat_templates/`, copied from the models' `tokenizer_config.json`),
with those families' special tokens added, for the tool-call tests. Nothing is downloaded: the
model is the tiny random one and the tokenizer the tiny trained BPE
(`gpu_runtime.model.tiny`)."""

from __future__ import annotations

from pathlib import Path

from gpu_runtime.model.tiny import build_tiny_model_dir

TEMPLATES = Path(__file__).parent / "chat_templates"
LLAMA3_1_TEMPLATE = (TEMPLATES / "llama3_1_instruct.jinja").read_text()
QWEN2_5_TEMPLATE = (TEMPLATES / "qwen2_5_instruct.jinja").read_text()

MAX_MODEL_LEN = 2048
_FAMILIES: dict[str, tuple[str, str | None, list[str], str, list[str]]] = {
    # family: (architecture, template, special tokens, eos, plain added tokens)
    "llama3.1": (
        "llama",
        LLAMA3_1_TEMPLATE,
        ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"],
        "<|eot_id|>",
        [],
    ),
    "qwen2.5": ("qwen2", QWEN2_5_TEMPLATE, [], "<|im_end|>", ["<tool_call>", "</tool_call>"]),
    # no chat template: the server's documented fallback render (Hermes-style tools)
    "no-template": ("llama", None, [], "<|im_end|>", []),
}


def build_chat_tokenizer(directory: str | Path, family: str) -> None:
    """Rewrite the tiny tokenizer saved in `directory` as `family`'s ("llama3.1", "qwen2.5",
    or "no-template"): its chat template, special tokens and eos."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    _, template, special, eos, plain = _FAMILIES[family]
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    if special:
        tokenizer.add_special_tokens({"additional_special_tokens": special})
    if plain:
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
    tokenizer.eos_token = eos
    tokenizer.chat_template = template
    tokenizer.model_max_length = MAX_MODEL_LEN
    for saved in Path(directory).glob("chat_template.*"):
        saved.unlink()  # else it would be loaded again beside tokenizer_config.json
    tokenizer.save_pretrained(str(directory))


def build_chat_model_dir(directory: str | Path, family: str, seed: int = 0) -> Path:
    """A tiny random model of `family`'s architecture with `family`'s chat tokenizer, for
    contexts of `MAX_MODEL_LEN` tokens (the templates' tool prompts are long)."""
    architecture = _FAMILIES[family][0]
    model_dir = build_tiny_model_dir(
        directory, architecture, seed=seed, max_position_embeddings=MAX_MODEL_LEN
    )
    build_chat_tokenizer(model_dir, family)
    return model_dir
