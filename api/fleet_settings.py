"""The fleet's tunables (placement, reconciliation, checkpoints), read from the environment
(parsed by `config.env`) at call time.

* `HARLI_HOST_LOST_AFTER_S` (default 30): a host whose last heartbeat is older is lost.
* `HARLI_RECONCILE_INTERVAL_S` (default 5): how often beat runs the reconciliation.
* `HARLI_REDISPATCH_AFTER_S` (default 15): a pending placement the host has not started after
  this long is sent again (the agent drops duplicates by placement id).
* `HARLI_PLACEMENT_ACK_TIMEOUT_S` (default 600): a pending placement its host has neither
  started nor listed in a heartbeat this long after it was made is given up (the agent dropped
  it, or its host drains and is not sent it again) and the job placed anew. Longer than a job's
  set-up on a host (reading and tokenizing its training file).
* `HARLI_CHECKPOINT_EVERY_STEPS` (default 10): optimizer steps between checkpoints of a job.
* `HARLI_JOB_STALL_AFTER_S` (default 300): a running job with no progress report from its host
  for this long is flagged as stalled (an event, and a badge in the console).
* `HARLI_KEEP_CHECKPOINTS` (default 3, as OpenAI keeps): checkpoints a job keeps, the latest;
  older ones are deleted from the list and from storage.
* `HARLI_PLACEMENTS_PER_PASS` (default 100): the most jobs one placement pass places (the
  oldest first); the rest wait for the next pass (`api.services.placement`).

Read at call time so tests and the run command can shorten them per process.
"""

from __future__ import annotations

from dataclasses import dataclass

from config.env import env_int


@dataclass(frozen=True)
class FleetSettings:
    host_lost_after_s: int
    reconcile_interval_s: int
    redispatch_after_s: int
    placement_ack_timeout_s: int
    checkpoint_every_steps: int
    job_stall_after_s: int
    keep_checkpoints: int
    placements_per_pass: int


def fleet_settings() -> FleetSettings:
    values = FleetSettings(
        host_lost_after_s=env_int("HARLI_HOST_LOST_AFTER_S", 30),
        reconcile_interval_s=env_int("HARLI_RECONCILE_INTERVAL_S", 5),
        redispatch_after_s=env_int("HARLI_REDISPATCH_AFTER_S", 15),
        placement_ack_timeout_s=env_int("HARLI_PLACEMENT_ACK_TIMEOUT_S", 600),
        checkpoint_every_steps=env_int("HARLI_CHECKPOINT_EVERY_STEPS", 10),
        job_stall_after_s=env_int("HARLI_JOB_STALL_AFTER_S", 300),
        keep_checkpoints=env_int("HARLI_KEEP_CHECKPOINTS", 3),
        placements_per_pass=env_int("HARLI_PLACEMENTS_PER_PASS", 100),
    )
    for name, value in vars(values).items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    return values
