"""A stored checkpoint whose adapter uses an option the server does not serve is answered with
an OpenAI-shaped 400 naming the option, not a 500; nothing of it stays on the host, and the
adapters served before keep serving."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
import torch

from gpu_runtime.agent.checkpoint_models import CheckpointModels
from gpu_runtime.agent.serving import lora_runtime
from gpu_runtime.contract.hparams import LoraSpec
from gpu_runtime.contract.protocol import checkpoint_key, checkpoint_model_name
from gpu_runtime.contract.storage import LocalStorage
from gpu_runtime.finetune.checkpoint import save_adapter
from gpu_runtime.finetune.lora import adapter_parameters, build_training_model
from gpu_runtime.model.loader import load_model
from gpu_runtime.server import BearerKeys, ModelAccess, create_app
from tests.gpu_runtime.agent.conftest import Host, Reports, make_runtime
from tests.gpu_runtime.server.serving import serve_in_thread

MODEL = "ft:tiny:acme:x:ftjob-9"


def _store_checkpoint(model_dir: Path, storage: LocalStorage, step: int, work: Path) -> None:
    spec = LoraSpec(rank=4, alpha=8)
    tree = build_training_model(load_model(model_dir), spec, seed=1)
    generator = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for param in adapter_parameters(tree):
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    save_adapter(tree, spec, work)
    storage.put_tree(checkpoint_key("ftjob-9", step), work)


@pytest.fixture()
def idle_host(
    tiny_model_dir: Path, storage: LocalStorage, tmp_path: Path, reports: Reports
) -> Host:
    return make_runtime(tiny_model_dir, storage, tmp_path / "work", reports)


def test_unservable_checkpoint_is_a_400_naming_the_option(
    idle_host: Host, tiny_model_dir: Path, storage: LocalStorage, tmp_path: Path
) -> None:
    good, bad = checkpoint_model_name(MODEL, 2), checkpoint_model_name(MODEL, 4)
    _store_checkpoint(tiny_model_dir, storage, 2, tmp_path / "good")
    config = tmp_path / "bad" / "adapter_config.json"
    _store_checkpoint(tiny_model_dir, storage, 4, tmp_path / "bad")
    config.write_text(json.dumps({**json.loads(config.read_text()), "use_dora": True}))
    storage.put_tree(checkpoint_key("ftjob-9", 4), tmp_path / "bad")
    grants = {"k": ModelAccess(frozenset({"tiny"}), unlisted=lambda name: name in (good, bad))}
    idle_host.loop.start()
    app = create_app(
        idle_host.loop,
        "tiny",
        BearerKeys(lambda k: grants.get(k or "")),
        model_loader=CheckpointModels(idle_host.loop, idle_host.runtime),
    )
    lora = lora_runtime(idle_host.runtime.engine)
    try:
        with serve_in_thread(app) as url:
            client = openai.OpenAI(base_url=url, api_key="k", max_retries=0, timeout=60)
            ask = dict(prompt="Q: hello", max_tokens=5, temperature=0.0)
            before = client.completions.create(model=good, **ask).choices[0].text  # type: ignore[call-overload]
            with pytest.raises(openai.BadRequestError) as refused:
                client.completions.create(model=bad, **ask)  # type: ignore[call-overload]
            error = refused.value.body
            assert isinstance(error, dict)
            assert error["param"] == "model" and error["code"] == "unsupported_adapter"
            assert "use_dora=True" in error["message"] and bad in error["message"]
            assert lora.names() == [good]
            fetched = tmp_path / "work" / "adapters" / bad.replace(":", "_")
            assert not fetched.exists()  # no copy of the refused adapter stays
            again = client.completions.create(model=good, **ask).choices[0].text  # type: ignore[call-overload]
            assert again == before
    finally:
        idle_host.stop()
