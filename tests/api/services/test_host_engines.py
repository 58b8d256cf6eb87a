"""Hosts by engine: what a heartbeat says a host can do, placement only where it can train,
routing that treats a vLLM host like a Harli host, and deployments of architectures only vLLM
serves (registration, the engine check, nothing written on a refusal)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from api.errors import HarliError
from api.gateway.routing import HostCandidate, rank_hosts
from api.gateway.selectors import routable_hosts
from api.models import (
    BaseModel,
    Deployment,
    FinetuneJob,
    GpuHost,
    HostAgentState,
    PlacementDecision,
)
from api.services.fleet import base_model_register, deployment_create
from tests.api.services.conftest import drain_host_queue, heartbeat, place_now

pytestmark = pytest.mark.django_db

VLLM_CAPS = {"colocation": False, "architectures": ["LlamaForCausalLM"], "max_loras": 4,
             "max_lora_rank": 16}  # fmt: skip


def test_an_old_agents_heartbeat_reads_as_a_harli_host_that_colocates(
    fleet: dict[str, GpuHost],
) -> None:
    state = HostAgentState.objects.get(host__name="h1")
    assert state.engine == "harli"
    assert state.capabilities == {"colocation": True, "architectures": ["llama", "qwen2"],
                                  "max_loras": None, "max_lora_rank": None}  # fmt: skip
    assert state.engine_state == {}


def test_jobs_are_placed_only_on_hosts_that_can_train(
    fleet: dict[str, GpuHost], job: FinetuneJob, django_capture_on_commit_callbacks: Any
) -> None:
    # h2 has the best throughput share but runs vLLM: it cannot train.
    heartbeat("h2", harvestable_tokens_per_s=300.0, engine="vllm", capabilities=VLLM_CAPS,
              engine_state={"state": "ready", "restarts": 1})  # fmt: skip
    state = HostAgentState.objects.get(host__name="h2")
    assert (state.engine, state.capabilities["colocation"]) == ("vllm", False)
    assert state.capabilities["max_loras"] == 4
    assert state.engine_state == {"state": "ready", "restarts": 1}
    placement = place_now(job, django_capture_on_commit_callbacks)
    assert placement is not None and placement.host.name == "h1"
    reasons = PlacementDecision.objects.get(placement=placement).reasons
    why = {row["host"]: row["why"] for row in reasons["candidates"]}
    assert why["h2"] == "host cannot train (engine vllm)"
    assert why["h1"] == "eligible"
    assert drain_host_queue("h2") == []


def test_a_job_waits_while_only_vllm_hosts_serve_its_base_model(
    fleet: dict[str, GpuHost], job: FinetuneJob, django_capture_on_commit_callbacks: Any
) -> None:
    for name in ("h1", "h2", "h4"):
        heartbeat(name, harvestable_tokens_per_s=300.0, engine="vllm", capabilities=VLLM_CAPS)
    assert place_now(job, django_capture_on_commit_callbacks) is None
    assert not job.placements.exists()
    # The same host heartbeating as a Harli host can train again.
    heartbeat("h1", harvestable_tokens_per_s=300.0, engine="harli",
              capabilities={"colocation": True})  # fmt: skip
    placement = place_now(job, django_capture_on_commit_callbacks)
    assert placement is not None and placement.host.name == "h1"


def test_routing_treats_a_vllm_host_serving_the_adapter_as_a_candidate(
    fleet: dict[str, GpuHost],
) -> None:
    adapter = "ft:tiny:acme:abc123"
    heartbeat("h2", engine="vllm", capabilities=VLLM_CAPS, adapters=[adapter],
              serving={"running": 3, "waiting": 0, "kv_free_pages": 10,
                       "kv_total_pages": 10})  # fmt: skip
    heartbeat("h1", serving={"running": 0, "waiting": 0, "kv_free_pages": 10,
                             "kv_total_pages": 10})  # fmt: skip
    candidates = {c.name: c for c in routable_hosts()}
    assert adapter in candidates["h2"].adapters
    ranked = _order(list(candidates.values()), adapter)
    assert ranked[0] == "h2"  # serves the adapter; h1, less loaded, does not report it
    # For the base model both kinds are alike: the less loaded host comes first.
    base = _order(list(candidates.values()), "tiny")
    assert base.index("h1") < base.index("h2")


def _order(hosts: list[HostCandidate], model: str) -> list[str]:
    choices = rank_hosts(hosts, base_model="tiny", model=model, open_requests={})
    return [choice.host.name for choice in choices]


def _checkpoint(tmp_path: Path, config: dict[str, Any]) -> str:
    directory = tmp_path / "ckpt"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


MISTRAL = {"architectures": ["MistralForCausalLM"], "model_type": "mistral",
           "max_position_embeddings": 32768}  # fmt: skip


def test_a_mistral_checkpoint_registers_and_needs_a_vllm_deployment(tmp_path: Path) -> None:
    model = base_model_register(name="mistral-7b", checkpoint_dir=_checkpoint(tmp_path, MISTRAL))
    assert (model.architecture, model.context_length) == ("mistral", 32768)
    with pytest.raises(HarliError) as refused:
        deployment_create(name="m-chat", base_model=model, tpot_slo_ms=50, ttft_slo_ms=500)
    assert refused.value.param == "engine"
    assert refused.value.code == "architecture_needs_vllm"
    assert "is served by vLLM hosts: create the deployment with --engine vllm" in str(refused.value)
    assert not Deployment.objects.exists()
    deployment = deployment_create(name="m-chat", base_model=model, tpot_slo_ms=50,
                                   ttft_slo_ms=500, engine="vllm")  # fmt: skip
    assert Deployment.objects.get(name="m-chat").engine == "vllm" == deployment.engine


def test_the_architecture_falls_back_to_the_configs_architectures(tmp_path: Path) -> None:
    config = {"architectures": ["GemmaForCausalLM"], "max_position_embeddings": 8192}
    model = base_model_register(name="gemma", checkpoint_dir=_checkpoint(tmp_path, config))
    assert model.architecture == "gemma"


def test_bad_architectures_and_engines_are_refused_and_nothing_is_written(
    tmp_path: Path, tiny: BaseModel
) -> None:
    directory = _checkpoint(tmp_path, {"max_position_embeddings": 4096})
    with pytest.raises(HarliError, match="Architecture must be a model type name") as exc:
        base_model_register(name="nameless", checkpoint_dir=directory)
    assert exc.value.param == "architecture"
    with pytest.raises(HarliError, match="Architecture must be a model type name"):
        base_model_register(name="spaced", checkpoint_dir=directory, architecture="a b")
    with pytest.raises(HarliError, match="preset's architecture"):
        base_model_register(name="odd-preset", preset="tiny", architecture="mistral")
    assert list(BaseModel.objects.values_list("name", flat=True)) == ["tiny"]
    with pytest.raises(HarliError, match="engine must be one of harli, vllm") as bad:
        deployment_create(name="x", base_model=tiny, tpot_slo_ms=5, ttft_slo_ms=50, engine="tgi")
    assert bad.value.param == "engine"
    assert not Deployment.objects.exists()
    # A Llama model may be served by either engine.
    assert deployment_create(name="v", base_model=tiny, tpot_slo_ms=5, ttft_slo_ms=50,
                             engine="vllm").engine == "vllm"  # fmt: skip
