"""A model leaves the host with `unload_adapter`: new requests for it are refused at once,
requests already decoding with it finish, then its slot is freed. A job's checkpoint is served
by its model name on its first request, only to keys the control plane allows for it, and
unloaded like an adapter."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import openai
import pytest
import torch

from gpu_runtime.agent.checkpoint_models import CheckpointModels
from gpu_runtime.agent.serving import lora_runtime
from gpu_runtime.contract.hparams import LoraSpec
from gpu_runtime.contract.protocol import check_command, checkpoint_key, checkpoint_model_name
from gpu_runtime.contract.storage import LocalStorage
from gpu_runtime.engine import SamplingParams
from gpu_runtime.engine.engine import UnknownAdapterError
from gpu_runtime.finetune.checkpoint import save_adapter
from gpu_runtime.finetune.lora import adapter_parameters, build_training_model
from gpu_runtime.model.loader import load_model
from gpu_runtime.server import BearerKeys, ModelAccess, create_app
from tests.gpu_runtime.agent.conftest import Host, Reports, make_runtime
from tests.gpu_runtime.server.serving import serve_in_thread

MODEL = "ft:tiny:acme:x:ftjob-7"
CHECKPOINT = checkpoint_model_name(MODEL, 4)


def _store_adapter(model_dir: Path, storage: LocalStorage, key: str, work: Path) -> Path:
    """A random (non-zero B) PEFT adapter of the tiny model, stored as a tree at `key`, with a
    trainer-state file beside it as a checkpoint has."""
    spec = LoraSpec(rank=4, alpha=8)
    tree = build_training_model(load_model(model_dir), spec, seed=1)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in adapter_parameters(tree):
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    save_adapter(tree, spec, work)
    (work / "trainer_state.pt").write_bytes(b"optimizer state the server must not fetch")
    storage.put_tree(key, work)
    return work


def _unload(name: str) -> dict[str, object]:
    return check_command({"command": "unload_adapter", "command_id": "c1", "name": name})


@pytest.fixture()
def idle_host(
    tiny_model_dir: Path, storage: LocalStorage, tmp_path: Path, reports: Reports
) -> Host:
    return make_runtime(tiny_model_dir, storage, tmp_path / "work", reports)


def test_unload_refuses_new_requests_lets_running_ones_finish_then_frees_the_slot(
    idle_host: Host, tiny_model_dir: Path, storage: LocalStorage, tmp_path: Path
) -> None:
    runtime = idle_host.runtime  # driven by hand: the loop thread is not started
    _store_adapter(tiny_model_dir, storage, "adapters/ftjob-7", tmp_path / "a")
    runtime.command({"command": "load_adapter", "command_id": "c0", "name": MODEL,
                     "storage_key": "adapters/ftjob-7"})  # fmt: skip
    lora = lora_runtime(runtime.engine)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    runtime.add_request([5, 6, 7, 8], params, "running", MODEL)
    runtime.add_request([5, 6, 7, 8], params, "base", None)
    outputs = runtime.step()
    assert {o.request_id for o in outputs} == {"running", "base"}
    slot = lora.manager.slot_of(MODEL)
    assert slot is not None

    runtime.command(_unload(MODEL))
    assert runtime.status().adapters == []  # the next heartbeat no longer names it
    assert not lora.has(MODEL)
    with pytest.raises(UnknownAdapterError):
        runtime.add_request([5, 6], params, "late", MODEL)
    assert lora.manager.slot_of(MODEL) == slot  # still decoding with it
    finished: dict[str, int] = {}
    while runtime.has_work():
        for out in runtime.step():
            if out.finished:
                finished[out.request_id] = len(out.output_token_ids)
    assert finished == {"running": 6, "base": 6}
    assert lora.manager.slot_of(MODEL) is None  # freed once the last request released it
    assert lora.weights.a[next(iter(lora.weights.a))][slot * 8 : (slot + 1) * 8].abs().sum() == 0
    assert not (tmp_path / "work" / "adapters").joinpath(MODEL.replace(":", "_")).exists()
    runtime.command(_unload(MODEL))  # a repeated unload is a no-op


def test_checkpoint_is_served_by_name_on_demand_and_only_to_allowed_keys(
    idle_host: Host, tiny_model_dir: Path, storage: LocalStorage, tmp_path: Path
) -> None:
    _store_adapter(tiny_model_dir, storage, checkpoint_key("ftjob-7", 4), tmp_path / "c")
    asked: list[tuple[str, str]] = []

    def allowed(key: str, name: str) -> bool:
        asked.append((key, name))
        return key == "k-acme" and name == CHECKPOINT

    grants = {
        key: ModelAccess(frozenset({"tiny", MODEL}), unlisted=partial(allowed, key))
        for key in ("k-acme", "k-globex")
    }
    idle_host.loop.start()
    loader = CheckpointModels(idle_host.loop, idle_host.runtime)
    keys = BearerKeys(lambda k: grants.get(k or ""))
    app = create_app(idle_host.loop, "tiny", keys, model_loader=loader)
    lora = lora_runtime(idle_host.runtime.engine)
    try:
        with serve_in_thread(app) as url:
            acme = openai.OpenAI(base_url=url, api_key="k-acme", max_retries=0, timeout=60)
            globex = openai.OpenAI(base_url=url, api_key="k-globex", max_retries=0, timeout=60)
            with pytest.raises(openai.NotFoundError):  # another tenant: not even loaded
                globex.completions.create(model=CHECKPOINT, prompt="Q: hi", max_tokens=2)
            assert not lora.has(CHECKPOINT)
            tuned = acme.completions.create(
                model=CHECKPOINT, prompt="Q: hello", max_tokens=5, temperature=0.0
            )
            base = acme.completions.create(
                model="tiny", prompt="Q: hello", max_tokens=5, temperature=0.0
            )
            assert tuned.model == CHECKPOINT and tuned.choices[0].text != base.choices[0].text
            assert lora.has(CHECKPOINT)
            fetched = tmp_path / "work" / "adapters" / CHECKPOINT.replace(":", "_")
            assert sorted(p.name for p in fetched.iterdir()) == [
                "adapter_config.json",
                "adapter_model.safetensors",
            ]  # no trainer state
            chat = acme.chat.completions.create(
                model=CHECKPOINT, messages=[{"role": "user", "content": "hi"}], max_tokens=3
            )
            assert chat.model == CHECKPOINT
            with pytest.raises(openai.NotFoundError):  # loaded now, still not globex's
                globex.completions.create(model=CHECKPOINT, prompt="Q: hi", max_tokens=2)
            # /v1/models lists no checkpoint, as OpenAI's does not
            assert [m.id for m in acme.models.list()] == ["tiny"]
            missing = checkpoint_model_name(MODEL, 8)  # allowed by nobody, stored nowhere
            with pytest.raises(openai.NotFoundError):
                acme.completions.create(model=missing, prompt="Q: hi", max_tokens=2)
            other_base = checkpoint_model_name("ft:llama:acme:x:ftjob-7", 4)
            with pytest.raises(openai.NotFoundError):
                acme.completions.create(model=other_base, prompt="Q: hi", max_tokens=2)
            assert ("k-acme", other_base) not in asked  # not this host's base model: not asked

            idle_host.command(_unload(CHECKPOINT))
            assert not lora.has(CHECKPOINT)
            allowed_before = len(asked)
            grants["k-acme"] = ModelAccess(frozenset({"tiny"}), unlisted=lambda n: False)
            with pytest.raises(openai.NotFoundError):  # deleted: refused, not loaded again
                acme.completions.create(model=CHECKPOINT, prompt="Q: hi", max_tokens=2)
            assert not lora.has(CHECKPOINT) and len(asked) == allowed_before
    finally:
        idle_host.stop()
