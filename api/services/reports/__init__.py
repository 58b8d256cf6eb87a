"""Applying host reports (heartbeats, job progress, checkpoints, outcomes, metrics).

:func:`host_report_apply` is what the `workers.host_report` task calls. Each report is applied
at most once: its `message_id` is inserted into `ProcessedReport` in the same transaction as its
effect, so a redelivered copy (acks_late, broker restart) changes nothing. A report about a
placement that is no longer open (the job moved after its host was declared lost, or was paused
or cancelled) is stale, except the steps and checkpoint of a placement a pause released while
the job waits on it (`common.pausing`). A stale report is ignored, and the host is told to
stop that placement, by the report itself for a start or an outcome, and for the per-step
reports (progress, checkpoints) by the next heartbeat that names the placement: a worker a few
seconds behind would otherwise send one stop per step the host trained before its stop
arrived.

One module per role: `apply` (deduplication and dispatch by report kind), `heartbeat` (host
liveness, agent state and the commands it calls for), `jobs` (a placement's start, steps,
checkpoints and outcome), `adapters` (a host's failure to load an adapter), `metrics` (host
and deployment time series), `common` (the report's time stamp and the stop for a placement
that is no longer open). Each handler,
`<kind>_apply(*, host, message)`, runs inside :func:`host_report_apply`'s transaction with the
host's row locked; the commands a report calls for are sent once it commits (`api.dispatch`).
"""

from api.services.reports.apply import host_report_apply

__all__ = ["host_report_apply"]
