"""The messages between the control plane and the host agents (JSON, ids and plain data).

Both directions travel as Celery task messages (protocol 2, JSON body `[[payload], {}, {}]`),
so the control plane publishes with `app.send_task` and its workers execute reports as ordinary
tasks, while an agent consumes its queue with a plain kombu consumer and imports no Django.

Host queue `host.<NAME>`, task name :data:`HOST_COMMAND_TASK`, one payload dict:

* `{"command": "apply_placement", "command_id", "placement_id", "job": JobSpec,
  "engine_group" (the index of the engine group that trains it; absent: 0)}` — train a job;
  `job.resume_from` is `{"step", "storage_key"}` when it continues from a checkpoint.
* `{"command": "pause" | "cancel", "command_id", "placement_id", "job_id"}` — stop training and
  release the job. A pause finishes the optimizer batch in progress, then reports the
  checkpoint it writes there and `job_stopped`, before heartbeats stop naming the placement;
  a pause that meets the last batch stops there too (no `job_succeeded`). Sent when a pause or
  cancel commits, and again whenever a heartbeat names a placement that is no longer open; the
  agent ignores (and logs) one for a placement it does not train, and drops a placement whose
  stop came first. A placement whose `resume_from` is the final step succeeds at once.
* `{"command": "load_adapter", "command_id", "name", "storage_key"}` — serve an adapter by name
  (sent for a finished adapter of the host's base model its heartbeat lacks, and by an
  operator's order); one the host cannot apply is answered with `adapter_load_failed`.
* `{"command": "unload_adapter", "command_id", "name"}` — stop serving a model by name (a
  deleted fine-tuned model, or a checkpoint deleted or pruned): new requests for it are
  refused (404) at once, requests already decoding with it finish, then its slot is freed.
  Sent to every host that may serve it when the deletion commits, and again whenever a
  heartbeat names it; a name the host does not serve is a no-op.
* `{"command": "load_base_model", "command_id", "base_model", "model_dir" (or null),
  "preset" (or ""), "engine_group" (its index; absent: 0)}` — serve another base model in that
  engine group (only when idle; sent again until it is).
* `{"command": "drain", "command_id"}` — accept no new placement; finish what runs.
* `{"command": "undrain", "command_id"}` — back in service: report `draining` false again.

Every command may carry `request_id`: the id of the API request (or control-plane task) that
caused it (`gpu_runtime.contract.request_id`); the agent logs its handling of the command under
it. Every report about a job may carry `request_id` too: the id of the latest command the host
got for that job, so the control plane logs its intake under the request that caused it.

JobSpec: `{"id", "base_model", "training_file" (its file id), "training_file_key",
"validation_file" (or null), "validation_file_key" (or null), "max_seq_len",
"method" ("supervised" or "dpo"; absent: supervised),
"hyperparameters": {"n_epochs", "batch_size", "learning_rate_multiplier"} (numbers or "auto";
a DPO job's also "beta"),
"lora": {"rank", "alpha", "dropout", "target_modules"}, "seed", "checkpoint_every_steps",
"fine_tuned_model", "resume_from" (or null)}`. `max_seq_len` is the control plane's
`gpu_runtime.contract.training_data.training_max_seq_len` of the base model's context length, the
limit it checked the files against; the host trains with it and refuses a longer example.
Messages a host reports (`job_failed.message`) reach the tenant: they name files by their ids
and lines by number, never a storage key or a local path.

Tokenizers: a host that serves a base model publishes the files of its training tokenizer
(`gpu_runtime.contract.tokenizer.TOKENIZER_FILES`, plus `manifest.json`: `{"base_model",
"digest"}`) as a tree under :func:`tokenizer_key` before it trains; the control plane tokenizes
training files with them when it cannot read the model's directory itself.

Control queue `control`, task name :data:`HOST_REPORT_TASK`, one payload dict with
`{"message_id" (unique, the dedupe key), "kind", "host", "sent_at" (Unix s)}` plus, by kind:

* `heartbeat`: `base_model`, `server_url`, `draining`, `total_bytes`, `free_bytes`,
  `harvestable_tokens_per_s` (the host's estimate of the finetune tokens/s it can harvest),
  `harvest` (how: `source` "predictor" or "measured", and the estimate's inputs),
  `placements` (ids the host trains), `adapters` (names it serves), `predictor_version` and
  `predictor_mape` (the latency predictor artifact loaded, null without one), and `serving`
  (what the gateway routes by: `running` and `waiting` requests, `kv_free_pages` and
  `kv_total_pages`, `adapter_slots_used` and `adapter_slots_total`, `resident_adapters` (the
  names in GPU slots now), `tpot_p50_ms` and `slo_attainment` (the decode iterations of the
  last :data:`SERVING_WINDOW_S` seconds: median time per output token, and the fraction within
  the host's TPOT SLO; null when none ran); absent from hosts that do not serve), and
  `engine_groups` and `gpus` (per engine group and per GPU;
  `gpu_runtime.contract.engine_group_reports`; absent from an agent of the one-engine shape),
  and `engine`, `capabilities` and `engine_state` (what the host can do:
  `gpu_runtime.contract.host_capabilities`; absent: a Harli host that co-locates).
* `job_started`: `placement_id`, `job_id`, `resumed_from_step` (0 for a fresh start),
  `total_steps`, `hyperparameters` (`{"n_epochs", "batch_size", "learning_rate_multiplier"}`,
  what "auto" resolved to on the host).
* `job_progress`: `placement_id`, `job_id`, `step`, `total_steps`, `train_loss`,
  `train_accuracy` (mean token accuracy of the step's batch), `learning_rate`, `tokens_per_s`,
  `trained_tokens` (the job's total so far); a DPO job's also the :data:`PREFERENCE_METRICS` of
  that step (in checkpoint `metrics` too). (The validation loss of a checkpoint's step comes
  with the checkpoint; the control plane also accepts `valid_loss` here.)
* `checkpoint`: `placement_id`, `job_id`, `step`, `storage_key`, `metrics` (`train_loss`,
  `train_mean_token_accuracy`, `valid_loss`, `valid_mean_token_accuracy`, `full_valid_loss`,
  `full_valid_mean_token_accuracy`; null where not measured, see
  `gpu_runtime.finetune.validation`; a DPO job's also its step's :data:`PREFERENCE_METRICS` and
  `valid_preference_accuracy`, `full_valid_preference_accuracy`, its token accuracies being
  null), `total_steps`, `recent_steps` (`{"step", "train_loss",
  "learning_rate", "train_accuracy"}` of every step since the previous checkpoint report: the
  control plane records any whose `job_progress` was lost).
* `job_succeeded`: `placement_id`, `job_id`, `trained_tokens`, `adapter_key`, `train_loss`.
* `job_failed`: `placement_id`, `job_id`, `code`, `message`.
* `job_stopped`: `placement_id`, `job_id`, `reason` ("paused" | "cancelled"), `step`.
* `adapter_load_failed`: `name`, `storage_key`, `message` — a `load_adapter` the host could not
  apply (no complete tree at the key, files that are not a LoRA adapter for its base model);
  it serves nothing under `name` then, and the control plane records the failure for the
  operator (`message` is for operators only: it may name the host's paths).
* `metrics`: `window_s`, `host_metrics` (`weights_bytes`, `kv_used_bytes`,
  `finetune_lent_bytes`, `free_bytes`, `finetune_tokens_per_s`) and `deployment_metrics` (null
  or `tpot_p50_ms`, `tpot_p99_ms`, `ttft_p50_ms`, `ttft_p99_ms`, `slo_attainment`,
  `goodput_tokens_per_s`, `request_rate`, `predicted_iter_ms`, `observed_iter_ms`,
  `predictor_version`), plus `engine_groups` (each with its own `deployment_metrics`) and
  `gpus` (`gpu_runtime.contract.engine_group_reports`); the host-level figures stay the sums
  over the host, `deployment_metrics` that of group 0.

Storage keys (:func:`check_job_key`): a `checkpoint`'s `storage_key` is its job's checkpoint
of that step (`checkpoint_key(job_id, step)` or under it), a `job_succeeded`'s `adapter_key`
its job's adapter prefix (`adapter_key(job_id)` or under it); an `apply_placement`'s
`resume_from.storage_key` is the job's checkpoint of `resume_from.step`, a `load_adapter`'s key
lies under `adapters/` or `checkpoints/`. No key is absolute or holds `..`, `.`, an empty
segment, a backslash, NUL or a control character. A message breaking these is malformed
(:func:`check_report`, :func:`check_command`): the control plane stores and forwards nothing of
it, and the agent drops it.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from gpu_runtime.contract.engine_group_reports import (
    EngineGroupReportError,
    check_engine_group_fields,
)
from gpu_runtime.contract.host_capabilities import CapabilityReportError, check_capability_fields
from gpu_runtime.contract.request_id import valid_request_id

HOST_COMMAND_TASK = "harli.agent.command"
SERVING_WINDOW_S = 30.0
HOST_REPORT_TASK = "workers.host_report"
CONTROL_QUEUE = "control"

COMMANDS = frozenset(
    {
        "apply_placement",
        "pause",
        "cancel",
        "load_adapter",
        "unload_adapter",
        "load_base_model",
        "drain",
        "undrain",
    }
)
REPORT_KINDS = frozenset(
    {
        "heartbeat",
        "job_started",
        "job_progress",
        "checkpoint",
        "job_succeeded",
        "job_failed",
        "job_stopped",
        "adapter_load_failed",
        "metrics",
    }
)
_REQUIRED: dict[str, tuple[str, ...]] = {
    "heartbeat": ("free_bytes", "total_bytes", "placements"),
    "job_started": ("placement_id", "job_id", "resumed_from_step"),
    "job_progress": ("placement_id", "job_id", "step", "train_loss"),
    "checkpoint": ("placement_id", "job_id", "step", "storage_key", "metrics"),
    "job_succeeded": ("placement_id", "job_id", "trained_tokens", "adapter_key"),
    "job_failed": ("placement_id", "job_id", "code", "message"),
    "job_stopped": ("placement_id", "job_id", "reason"),
    "adapter_load_failed": ("name", "storage_key", "message"),
    "metrics": ("host_metrics",),
    "apply_placement": ("placement_id", "job"),
    "pause": ("placement_id", "job_id"),
    "cancel": ("placement_id", "job_id"),
    "load_adapter": ("name", "storage_key"),
    "unload_adapter": ("name",),
    "load_base_model": ("base_model",),
    "drain": (),
    "undrain": (),
}
JOB_METHODS = ("supervised", "dpo")
PREFERENCE_METRICS = (
    "train_preference_accuracy",
    "train_chosen_reward",
    "train_rejected_reward",
    "train_reward_margin",
)
"""A DPO step's metrics: the fraction of the batch's pairs whose preferred output got the
higher implicit reward, the mean rewards of both outputs, and their mean margin."""
JOB_SPEC_FIELDS = (
    "id",
    "base_model",
    "training_file",
    "training_file_key",
    "max_seq_len",
    "hyperparameters",
    "lora",
    "seed",
    "fine_tuned_model",
)


class ProtocolError(ValueError):
    """A message that does not follow this module's formats; the text names what is wrong."""


def host_queue(host: str) -> str:
    """The Celery queue an agent consumes."""
    return f"host.{host}"


def checkpoint_key(job_id: str, step: int) -> str:
    """Storage prefix of a job's checkpoint at `step`."""
    return f"checkpoints/{job_id}/step-{step:06d}"


def adapter_key(job_id: str) -> str:
    """Storage prefix of a job's finished adapter."""
    return f"adapters/{job_id}"


def tokenizer_key(base_model: str) -> str:
    """Storage prefix of the training tokenizer a host published for `base_model`."""
    return f"tokenizers/{base_model}"


CHECKPOINT_MODEL_MARKER = ":ckpt-step-"


def checkpoint_model_name(fine_tuned_model: str, step: int) -> str:
    """The model name of a job's checkpoint (OpenAI's `fine_tuned_model_checkpoint`):
    `<the job's fine-tuned model name>:ckpt-step-<step>`."""
    return f"{fine_tuned_model}{CHECKPOINT_MODEL_MARKER}{step}"


def parse_checkpoint_model(name: str) -> tuple[str, str, int] | None:
    """`(fine-tuned model name, job id, step)` of a checkpoint model name, else None.

    Fine-tuned model names end with `:<job id>` (`ft:<base>:<tenant>:<suffix>:<job id>`), and
    the checkpoint's storage prefix is `checkpoint_key(job id, step)`.
    """
    model, marker, step_text = name.rpartition(CHECKPOINT_MODEL_MARKER)
    if (
        not marker
        or not model.startswith("ft:")
        or not (step_text.isascii() and step_text.isdigit())
    ):
        return None
    if step_text != str(int(step_text)):  # one spelling per step: no leading zeros
        return None
    job_id = model.rsplit(":", 1)[-1]
    if not job_id or model.count(":") < 4:
        return None
    return model, job_id, int(step_text)


_KEY_FORBIDDEN = frozenset({"\\", "\x00"})


def check_storage_key(key: Any, *, field: str) -> str:
    """`key` when it is a plain relative storage key, else ProtocolError: a non-empty string of
    `/`-separated segments, none empty, `.` or `..`, no backslash, NUL or other control
    character, not absolute (no leading `/`, no drive letter)."""
    if not isinstance(key, str) or not key:
        raise ProtocolError(f"{field} must be a non-empty string, got {key!r:.80}")
    if any(ch in _KEY_FORBIDDEN or ord(ch) < 0x20 or ch == "\x7f" for ch in key):
        raise ProtocolError(f"{field} {key!r:.80} holds a backslash, NUL or control character")
    if key.startswith("/") or (len(key) > 1 and key[1] == ":"):
        raise ProtocolError(f"{field} {key!r:.80} is an absolute path")
    if any(segment in ("", ".", "..") for segment in key.split("/")):
        raise ProtocolError(f"{field} {key!r:.80} has an empty, '.' or '..' segment")
    return key


def check_job_key(key: Any, *, prefix: str, field: str) -> str:
    """`key` when it is a plain storage key (:func:`check_storage_key`) equal to `prefix` or
    under it (`prefix/...`), else ProtocolError. The control plane stores a host's keys and
    sends them to every host, so a host may name only its job's own prefix: a job's adapter
    (:func:`adapter_key`), a checkpoint of its own step (:func:`checkpoint_key`)."""
    check_storage_key(key, field=field)
    check_storage_key(prefix, field=f"the prefix of {field}")
    if key != prefix and not key.startswith(prefix + "/"):
        raise ProtocolError(f"{field} {key!r:.80} is not under {prefix!r}")
    return str(key)


def _job_id(message: dict[str, Any], name: str) -> str:
    job_id = message["job_id"]
    if not isinstance(job_id, str) or not job_id:
        raise ProtocolError(f"{name}.job_id must be a non-empty string, got {job_id!r:.80}")
    return job_id


def _step(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ProtocolError(f"{name} must be an integer >= 0, got {value!r:.80}")
    return value


def _check_report_keys(message: dict[str, Any]) -> None:
    """A checkpoint's `storage_key` is its job's checkpoint of that step; a finished job's
    `adapter_key` is under its job's adapter prefix."""
    kind = message["kind"]
    if kind == "checkpoint":
        job_id, step = _job_id(message, kind), _step(message["step"], "checkpoint.step")
        check_job_key(message["storage_key"], prefix=checkpoint_key(job_id, step),
                      field="checkpoint.storage_key")  # fmt: skip
    elif kind == "job_succeeded":
        job_id = _job_id(message, kind)
        check_job_key(message["adapter_key"], prefix=adapter_key(job_id),
                      field="job_succeeded.adapter_key")  # fmt: skip


ADAPTER_KEY_ROOTS = ("adapters", "checkpoints")
"""What `load_adapter` may name: a finished job's adapter or a checkpoint."""


def _check_command_keys(message: dict[str, Any]) -> None:
    """A placement resumes only from its own job's checkpoint of the step it names; an
    adapter is loaded only from an adapter or checkpoint prefix."""
    command = message["command"]
    if command == "apply_placement":
        job = message["job"]
        resume = job.get("resume_from")
        if resume is not None:
            if not isinstance(resume, dict) or "storage_key" not in resume or "step" not in resume:
                raise ProtocolError("apply_placement.job.resume_from is {step, storage_key}")
            job_id = job["id"]
            if not isinstance(job_id, str) or not job_id:
                raise ProtocolError("apply_placement.job.id must be a non-empty string")
            step = _step(resume["step"], "apply_placement.job.resume_from.step")
            check_job_key(resume["storage_key"], prefix=checkpoint_key(job_id, step),
                          field="apply_placement.job.resume_from.storage_key")  # fmt: skip
    elif command == "load_adapter":
        key = check_storage_key(message["storage_key"], field="load_adapter.storage_key")
        if key.split("/", 1)[0] not in ADAPTER_KEY_ROOTS or "/" not in key:
            raise ProtocolError(
                f"load_adapter.storage_key {key!r:.80} is not under {list(ADAPTER_KEY_ROOTS)}"
            )


def new_message_id() -> str:
    return uuid.uuid4().hex


def report(kind: str, host: str, **fields: Any) -> dict[str, Any]:
    """A control-queue report with a fresh message id (checked with :func:`check_report`)."""
    message = {
        "message_id": new_message_id(),
        "kind": kind,
        "host": host,
        "sent_at": time.time(),
        **fields,
    }
    check_report(message)
    return message


def _check_fields(message: dict[str, Any], name: str) -> None:
    missing = [f for f in _REQUIRED[name] if f not in message]
    if missing:
        raise ProtocolError(f"{name} message lacks {missing}: {sorted(message)}")
    if "request_id" in message and valid_request_id(message["request_id"]) is None:
        raise ProtocolError(
            f"{name} message has an invalid request_id: {message['request_id']!r:.80}"
        )


def check_report(message: Any) -> dict[str, Any]:
    """Return `message` when it is a well-formed report, else raise ProtocolError."""
    if not isinstance(message, dict):
        raise ProtocolError(f"a report is a JSON object, got {type(message).__name__}")
    for field in ("message_id", "kind", "host"):
        if not isinstance(message.get(field), str) or not message[field]:
            raise ProtocolError(f"report field {field!r} must be a non-empty string")
    if message["kind"] not in REPORT_KINDS:
        raise ProtocolError(
            f"unknown report kind {message['kind']!r}; known: {sorted(REPORT_KINDS)}"
        )
    _check_fields(message, message["kind"])
    _check_report_keys(message)
    if message["kind"] in ("heartbeat", "metrics"):
        try:
            check_engine_group_fields(message["kind"], message)
        except EngineGroupReportError as exc:
            raise ProtocolError(str(exc)) from None
    if message["kind"] == "heartbeat":
        try:
            check_capability_fields(message)
        except CapabilityReportError as exc:
            raise ProtocolError(str(exc)) from None
    return message


def check_command(message: Any) -> dict[str, Any]:
    """Return `message` when it is a well-formed host command, else raise ProtocolError."""
    if not isinstance(message, dict):
        raise ProtocolError(f"a command is a JSON object, got {type(message).__name__}")
    command = message.get("command")
    if command not in COMMANDS:
        raise ProtocolError(f"unknown command {command!r}; known: {sorted(COMMANDS)}")
    if not isinstance(message.get("command_id"), str):
        raise ProtocolError(f"{command} lacks a string command_id")
    _check_fields(message, command)
    if command == "apply_placement":
        job = message["job"]
        if not isinstance(job, dict):
            raise ProtocolError("apply_placement.job must be an object")
        missing = [f for f in JOB_SPEC_FIELDS if f not in job]
        if missing:
            raise ProtocolError(f"apply_placement.job lacks {missing}")
        if job.get("method", "supervised") not in JOB_METHODS:
            raise ProtocolError(
                f"apply_placement.job.method {job['method']!r} is not one of {list(JOB_METHODS)}"
            )
    _check_command_keys(message)
    return message
