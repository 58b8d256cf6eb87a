"""`python -m gpu_runtime.agent` options: validated settings with the value in the message."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpu_runtime.agent.cli import parse_args

BASE = ["--host", "h1", "--broker", "redis://127.0.0.1:6379/0"]


def test_defaults_and_options() -> None:
    config = parse_args(BASE)
    assert config.memory_pool is None and config.predictor_path is None  # pool: CUDA only
    assert (config.lora_slots, config.lora_max_rank) == (8, 64)
    assert config.decode_groups == (6, 8, 12)
    assert parse_args([*BASE, "--decode-groups", "all"]).decode_groups is None
    assert parse_args([*BASE, "--decode-groups", "2,6"]).decode_groups == (2, 6)
    config = parse_args([*BASE, "--memory-pool", "on", "--memory-pool-gb", "0.5",
                         "--predictor", "predictor_models/artifacts", "--policy", "harli",
                         "--lora-slots", "4"])  # fmt: skip
    assert config.memory_pool is True and config.memory_pool_bytes == 2**29
    assert config.predictor_path == Path("predictor_models/artifacts")
    assert (config.policy, config.lora_slots) == ("harli", 4)
    assert parse_args([*BASE, "--memory-pool", "off"]).memory_pool is False
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (64, 512)
    assert config.mixed_cuda_graphs is True
    config = parse_args([*BASE, "--max-num-seqs", "32", "--max-batched-tokens", "256",
                         "--no-mixed-graphs"])  # fmt: skip
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (32, 256)
    assert config.mixed_cuda_graphs is False
    assert parse_args(BASE).ttft_slo_ms is None
    assert parse_args([*BASE, "--ttft-slo-ms", "120"]).ttft_slo_ms == 120.0


def test_the_outbox_lives_under_the_work_dir_unless_moved(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HARLI_OUTBOX_DIR", raising=False)
    config = parse_args(BASE)
    assert config.outbox_path() == Path("var/agents/h1/outbox")
    assert (config.outbox_max_reports, config.outbox_max_bytes) == (10_000, 64 * 2**20)
    assert parse_args([*BASE, "--work-dir", "/w"]).outbox_path() == Path("/w/outbox")
    monkeypatch.setenv("HARLI_OUTBOX_DIR", "/local/outbox")
    assert parse_args(BASE).outbox_path() == Path("/local/outbox")
    config = parse_args([*BASE, "--outbox-dir", "/other", "--outbox-max-reports", "5",
                         "--outbox-max-mb", "0.5"])  # fmt: skip
    assert config.outbox_path() == Path("/other")
    assert (config.outbox_max_reports, config.outbox_max_bytes) == (5, 2**19)


def test_request_limits_default_to_the_servers_and_can_be_set() -> None:
    from gpu_runtime.server.limits import RequestLimits

    assert parse_args(BASE).request_limits() == RequestLimits()
    config = parse_args([*BASE, "--max-prompts-per-request", "16",
                         "--max-request-prompt-tokens", "4096"])  # fmt: skip
    assert config.request_limits() == RequestLimits(16, 4096)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--memory-pool", "on"], "a memory pool on the CPU needs its size"),
        (["--lora-slots", "0"], "lora_slots must be >= 1, got 0"),
        (["--ttft-slo-ms", "0"], "ttft_slo_ms must be > 0, got 0.0"),
        (["--heartbeat-s", "0"], "heartbeat_s must be > 0, got 0.0"),
        (["--decode-groups", "4,x"], "expected comma-separated integers"),
        (["--decode-groups", "0"], "expected positive integers"),
        (["--max-num-seqs", "0"], "max_num_seqs must be >= 1, got 0"),
        (["--max-prompts-per-request", "0"], "max_prompts_per_request must be >= 1, got 0"),
        (["--max-request-prompt-tokens", "0"], "max_request_prompt_tokens must be >= 1, got 0"),
        (["--outbox-max-reports", "0"], "outbox_max_reports must be >= 1, got 0"),
        (["--outbox-max-mb", "0"], "outbox_max_bytes must be >= 1, got 0"),
        (
            ["--max-num-seqs", "64", "--max-batched-tokens", "32"],
            "max_num_batched_tokens (32) must be >= max_num_seqs (64)",
        ),
    ],
)
def test_bad_settings_name_the_value(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse_args([*BASE, *extra])
    assert message in capsys.readouterr().err


def test_host_key_from_a_file_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpu_runtime.contract.grants import host_key

    key, other = host_key("secret", "h1"), host_key("secret", "h2")
    monkeypatch.delenv("HARLI_HOST_KEY", raising=False)
    config = parse_args(BASE)
    assert config.host_key is None and config.allow_tenant_keys is False
    assert parse_args([*BASE, "--allow-tenant-keys"]).allow_tenant_keys is True
    monkeypatch.setenv("HARLI_HOST_KEY", f" {key}\n")
    config = parse_args(BASE)
    assert config.host_key == key and key not in repr(config)
    path = tmp_path / "host.key"
    path.write_text(other + "\n")
    assert parse_args([*BASE, "--host-key-file", str(path)]).host_key == other  # the file wins


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "host.key: cannot read it (FileNotFoundError)"),
        ("\n", "host.key is empty"),
        ("not-a-key", "the host key must be the 64 hex characters `manage.py hosts key NAME`"),
    ],
)
def test_a_bad_host_key_is_refused_without_echoing_it(
    content: str | None, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "host.key"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit):
        parse_args([*BASE, "--host-key-file", str(path)])
    err = capsys.readouterr().err
    assert message in err and "not-a-key" not in err
