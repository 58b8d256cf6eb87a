"""The message contract's trust rules: signatures over the whole payload, and storage keys
only under the job's own prefix (reports the agent builds, commands it takes)."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from gpu_runtime.contract.grants import host_key
from gpu_runtime.contract.message_auth import (
    SIGNATURE_FIELD,
    MessageAuthError,
    message_key,
    message_sign,
    message_verify,
)
from gpu_runtime.contract.protocol import (
    ProtocolError,
    adapter_key,
    check_command,
    check_job_key,
    checkpoint_key,
    report,
)

KEY = message_key(host_key("fleet-secret", "h1"))
JOB = "ftjob-abc"


def test_a_signed_message_verifies_after_a_json_round_trip() -> None:
    message = report("job_progress", "h1", placement_id=3, job_id=JOB, step=2, train_loss=0.1,
                     learning_rate=3e-5, tokens_per_s=1234.5678, nested={"b": [1, 2.0], "a": None})
    signed = message_sign(message, KEY)
    assert signed[SIGNATURE_FIELD].startswith("v1.") and SIGNATURE_FIELD not in message
    travelled = json.loads(json.dumps(signed))  # as the broker carries it, keys in any order
    travelled = dict(reversed(list(travelled.items())))
    assert message_verify(travelled, KEY) == message
    assert message_sign(signed, KEY) == signed  # signing again replaces the signature


def test_a_report_with_a_nan_loss_still_verifies() -> None:
    message = report("job_progress", "h1", placement_id=3, job_id=JOB, step=2,
                     train_loss=math.nan)  # fmt: skip
    body = message_verify(json.loads(json.dumps(message_sign(message, KEY))), KEY)
    assert math.isnan(body["train_loss"])


@pytest.mark.parametrize(
    "change",
    [
        lambda m: m.pop(SIGNATURE_FIELD),
        lambda m: m.update(step=3),
        lambda m: m.update(message_id="another-id"),  # the id is signed: no replay under a new id
        lambda m: m.update(host="h2"),
        lambda m: m.update(extra=1),
        lambda m: m.pop("train_loss"),
        lambda m: m.update(signature="v1." + "0" * 64),
        lambda m: m.update(signature="v2." + m["signature"][3:]),
        lambda m: m.update(signature=m["signature"][:-1]),
        lambda m: m.update(signature=None),
    ],
)
def test_an_altered_or_unsigned_message_is_refused(change: Any) -> None:
    signed = message_sign(report("job_progress", "h1", placement_id=3, job_id=JOB, step=2,
                                 train_loss=0.1), KEY)  # fmt: skip
    change(signed)
    with pytest.raises(MessageAuthError):
        message_verify(signed, KEY)


def test_keys_are_per_host_and_per_fleet_and_apart_from_grant_keys() -> None:
    message = message_sign({"command": "drain", "command_id": "c1"}, KEY)
    for other in (message_key(host_key("fleet-secret", "h2")),
                  message_key(host_key("other-secret", "h1"))):  # fmt: skip
        with pytest.raises(MessageAuthError):
            message_verify(message, other)
    assert KEY != bytes.fromhex(host_key("fleet-secret", "h1"))
    with pytest.raises(MessageAuthError):
        message_verify(["not", "a", "dict"], KEY)
    with pytest.raises(ValueError):
        message_key("")


GOOD = [checkpoint_key(JOB, 4), f"{checkpoint_key(JOB, 4)}/adapter_model.safetensors"]
BAD = [
    "", "/" + checkpoint_key(JOB, 4), f"{checkpoint_key(JOB, 4)}/../../x",
    f"checkpoints/{JOB}/../other/step-000004", f"{checkpoint_key(JOB, 4)}//x",
    f"{checkpoint_key(JOB, 4)}/.", f"checkpoints\\{JOB}\\step-000004",
    f"{checkpoint_key(JOB, 4)}\x00", f"{checkpoint_key(JOB, 4)}\n", checkpoint_key(JOB, 5),
    checkpoint_key("ftjob-other", 4), f"{checkpoint_key(JOB, 4)}0", "C:" + checkpoint_key(JOB, 4),
    7, None,
]  # fmt: skip


@pytest.mark.parametrize("key", GOOD)
def test_a_key_under_the_jobs_prefix_is_accepted(key: str) -> None:
    assert check_job_key(key, prefix=checkpoint_key(JOB, 4), field="k") == key


@pytest.mark.parametrize("key", BAD)
def test_a_key_outside_the_jobs_prefix_is_refused(key: Any) -> None:
    with pytest.raises(ProtocolError):
        check_job_key(key, prefix=checkpoint_key(JOB, 4), field="k")


def test_the_agent_cannot_build_a_report_with_another_jobs_key() -> None:
    ids = {"placement_id": 1, "job_id": JOB}
    report("checkpoint", "h1", step=4, storage_key=checkpoint_key(JOB, 4), metrics={}, **ids)
    report("job_succeeded", "h1", trained_tokens=1, adapter_key=adapter_key(JOB), **ids)
    with pytest.raises(ProtocolError, match="storage_key"):
        report("checkpoint", "h1", step=4, storage_key=checkpoint_key(JOB, 3), metrics={}, **ids)
    with pytest.raises(ProtocolError, match="adapter_key"):
        report("job_succeeded", "h1", trained_tokens=1, adapter_key="adapters/../x", **ids)
    with pytest.raises(ProtocolError, match="step"):
        report("checkpoint", "h1", step="4", storage_key=checkpoint_key(JOB, 4), metrics={},
               **ids)  # fmt: skip


def _placement(resume: Any) -> dict[str, Any]:
    job = {"id": JOB, "base_model": "tiny", "training_file": "file-1", "training_file_key": "f",
           "max_seq_len": 64, "hyperparameters": {}, "lora": {}, "seed": 1,
           "fine_tuned_model": "ft:tiny:acme::ftjob-abc", "resume_from": resume}  # fmt: skip
    return {"command": "apply_placement", "command_id": "c", "placement_id": 1, "job": job}


def test_the_agent_refuses_commands_naming_keys_outside_their_prefix() -> None:
    check_command(_placement(None))
    check_command(_placement({"step": 4, "storage_key": checkpoint_key(JOB, 4)}))
    for resume in ({"step": 4, "storage_key": checkpoint_key("ftjob-other", 4)},
                   {"step": 3, "storage_key": checkpoint_key(JOB, 4)},
                   {"step": 4, "storage_key": "/etc"}, {"storage_key": checkpoint_key(JOB, 4)},
                   "checkpoints/x"):  # fmt: skip
        with pytest.raises(ProtocolError):
            check_command(_placement(resume))
    load = {"command": "load_adapter", "command_id": "c", "name": "ft:x"}
    check_command({**load, "storage_key": adapter_key(JOB)})
    check_command({**load, "storage_key": checkpoint_key(JOB, 4)})
    for key in ("tokenizers/tiny", "adapters", "../adapters/x", "adapters/x/../../etc", "/a/b"):
        with pytest.raises(ProtocolError):
            check_command({**load, "storage_key": key})
