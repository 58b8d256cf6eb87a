"""JobEvent.fleet_detail: host-level detail for operators, out of the tenant's message and data.

Existing events are rewritten: a message that names a host gets the tenant's wording, the old
message moves to `fleet_detail["text"]`, and the host (and a placement's candidate reasons,
which state every host's status and free memory) move from `data` to `fleet_detail`.
"""

from __future__ import annotations

import re
from typing import Any

from django.db import migrations, models

# (old message, tenant's wording); the first group of each pattern is the host name.
REWRITES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"^Fine-tuning started on host (\S+)$"), "Fine-tuning started"),
    (
        re.compile(r"^Fine-tuning resumed on host (\S+) from checkpoint step (\d+)$"),
        r"Fine-tuning resumed from checkpoint step \2",
    ),
    (re.compile(r"^Placed on host (\S+)((?:, resuming from step \d+)?)$"), r"Placed for training\2"),
    (
        re.compile(r"^Waiting for host (\S+) to stop placement \d+ (\(.*\))$"),
        r"Waiting for the previous run to stop \2",
    ),
    (
        re.compile(r"^Waiting for the checkpoint of step (\d+) that host (\S+) stopped at$"),
        r"Waiting for the checkpoint of step \1",
    ),
    (
        re.compile(
            r"^Host (\S+) lost \(no heartbeat for \d+ s\); the job resumes from checkpoint "
            r"step (\d+) on another host$"
        ),
        r"Training interrupted; the job resumes from checkpoint step \2",
    ),
    (re.compile(r"^No progress from host (\S+) since (.*)$"), r"No training progress since \2"),
    (
        re.compile(r"^Progress from host (\S+) again (\(stalled since .*\))$"),
        r"Training progress again \2",
    ),
    (
        re.compile(r"^Host (\S+) stopped training (\(.*\) at step .*)$"),
        r"Training stopped \2",
    ),
]
WAITING = re.compile(r"^Waiting for a host \(.*\)$")
WAITING_TEXT = "Waiting for a host with room for this job"
# The pattern whose host is its second group.
HOST_SECOND = {REWRITES[4][0]}
BATCH = 500


def _rewrite(event: Any) -> bool:
    """Rewrite one event in place; True when it changed."""
    data = dict(event.data) if isinstance(event.data, dict) else event.data
    detail: dict[str, Any] = {}
    message = event.message
    for pattern, wording in REWRITES:
        match = pattern.match(message)
        if match:
            detail["text"] = message
            detail["host"] = match.group(2 if pattern in HOST_SECOND else 1)
            message = match.expand(wording)
            break
    else:
        if WAITING.match(message):
            detail["text"] = message
            message = WAITING_TEXT
    if isinstance(data, dict):
        if "host" in data:
            detail["host"] = data.pop("host")
        if "reasons" in data:  # a placement's candidates: every host's status and free memory
            detail["reasons"] = data.pop("reasons")
            detail["placement_id"] = data.pop("placement_id", None)
        if not data and event.data:
            data = None
    if not detail:
        return False
    if "text" not in detail:  # a step event: the tenant's text, on the host
        detail["text"] = f"{message} on host {detail['host']}"
    event.message, event.data, event.fleet_detail = message, data, detail
    return True


def forward(apps: Any, schema_editor: Any) -> None:
    JobEvent = apps.get_model("api", "JobEvent")
    changed: list[Any] = []
    for event in JobEvent.objects.filter(fleet_detail__isnull=True).iterator(chunk_size=BATCH):
        if _rewrite(event):
            changed.append(event)
        if len(changed) >= BATCH:
            JobEvent.objects.bulk_update(changed, ["message", "data", "fleet_detail"])
            changed = []
    if changed:
        JobEvent.objects.bulk_update(changed, ["message", "data", "fleet_detail"])


def backward(apps: Any, schema_editor: Any) -> None:
    """The old messages back, and the host (and placement reasons) back in `data`."""
    JobEvent = apps.get_model("api", "JobEvent")
    changed: list[Any] = []
    for event in JobEvent.objects.filter(fleet_detail__isnull=False).iterator(chunk_size=BATCH):
        detail = event.fleet_detail
        if event.type != "metrics" and "text" in detail:
            event.message = detail["text"]
        if "reasons" in detail:
            event.data = {
                "placement_id": detail.get("placement_id"),
                "host": detail.get("host"),
                "reasons": detail["reasons"],
            }
        elif "host" in detail and (isinstance(event.data, dict) or event.type == "metrics"):
            event.data = {**(event.data or {}), "host": detail["host"]}
        changed.append(event)
        if len(changed) >= BATCH:
            JobEvent.objects.bulk_update(changed, ["message", "data"])
            changed = []
    if changed:
        JobEvent.objects.bulk_update(changed, ["message", "data"])


class Migration(migrations.Migration):
    dependencies = [
        ("api", "0012_tenant_quotas"),
    ]

    operations = [
        migrations.AddField(
            model_name="jobevent",
            name="fleet_detail",
            field=models.JSONField(blank=True, null=True),
        ),
        migrations.RunPython(forward, backward),
    ]
