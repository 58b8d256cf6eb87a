"""Concurrent tenant clients over `/v1`, each op timed at the client, each create tagged.

A client is one asyncio task with a connection of its own (keep-alive), acting for one tenant:
it draws an operation from the mix (seeded per client), sends it, waits for the whole response,
and draws the next, until the level's deadline. Operations: list files, create a file (a small
JSONL upload), create a fine-tuning job (from one of its tenant's acknowledged files), retrieve
a job (one of its tenant's acknowledged jobs), list jobs. Every create carries a token of its
own (the file's name, the job's `metadata.bench_token`), so the database can be compared with
what clients were told afterwards (`audit`).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.common.samples import sample_percentile

OPS = ("list_files", "create_file", "create_job", "retrieve_job", "list_jobs")
CREATES = {"create_file": "files", "create_job": "jobs"}
DEFAULT_MIX = {"list_files": 2, "create_file": 1, "create_job": 1, "retrieve_job": 3,
               "list_jobs": 2}  # fmt: skip
TRAINING_LINES = [
    {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
    for q, a in [("What is 2 + 2?", "4."), ("Name a colour.", "Red."), ("Peru's capital?", "Lima.")]
]
TRAINING_FILE = "".join(json.dumps(line) + "\n" for line in TRAINING_LINES).encode()


@dataclass(frozen=True)
class Outcome:
    """One request as its client saw it."""

    level: str
    op: str
    latency_s: float
    status: int | None
    """The HTTP status; None when the request failed in transport (see `transport_error`)."""
    transport_error: str | None = None
    token: str | None = None
    """A create's token; None for reads."""
    object_id: str | None = None
    """The id a 200 answer to a create acknowledged."""
    started_at: float = 0.0
    """`time.monotonic()` when it was sent."""
    detail: str = ""
    """A transport error's message."""

    @property
    def ok(self) -> bool:
        return self.status == 200


@dataclass
class TenantObjects:
    """A tenant's acknowledged files and jobs, shared by its clients."""

    api_key: str
    files: list[str] = field(default_factory=list)
    jobs: list[str] = field(default_factory=list)


class Client:
    def __init__(
        self, http: httpx.AsyncClient, tenant: TenantObjects, level: str, index: int,
        rng: random.Random, mix: Mapping[str, int], headers: Mapping[str, str],
    ) -> None:  # fmt: skip
        self.http = http
        self.tenant = tenant
        self.level = level
        self.index = index
        self.rng = rng
        self.ops = [op for op in OPS if mix.get(op, 0) > 0]
        self.weights = [mix[op] for op in self.ops]
        self.headers = {**headers, "authorization": f"Bearer {tenant.api_key}"}
        self.seq = 0

    def token(self) -> str:
        self.seq += 1
        return f"bench-{self.level}-{self.index}-{self.seq}"

    async def one(self, op: str) -> Outcome:
        token = self.token() if op in CREATES else None
        started = time.perf_counter()
        sent_at = time.monotonic()
        try:
            response = await self._send(op, token)
        except httpx.HTTPError as exc:
            return Outcome(self.level, op, time.perf_counter() - started, None,
                           transport_error=type(exc).__name__, token=token,
                           started_at=sent_at, detail=str(exc)[:200])  # fmt: skip
        latency = time.perf_counter() - started
        object_id = None
        if response.status_code == 200 and token is not None:
            object_id = str(response.json()["id"])
            (self.tenant.files if op == "create_file" else self.tenant.jobs).append(object_id)
        return Outcome(self.level, op, latency, response.status_code, token=token,
                       object_id=object_id, started_at=sent_at)  # fmt: skip

    async def _send(self, op: str, token: str | None) -> httpx.Response:
        h = self.headers
        if op == "list_files":
            return await self.http.get("/v1/files", headers=h, params={"limit": 20})
        if op == "list_jobs":
            return await self.http.get("/v1/fine_tuning/jobs", headers=h, params={"limit": 20})
        if op == "retrieve_job":
            job = self.rng.choice(self.tenant.jobs)
            return await self.http.get(f"/v1/fine_tuning/jobs/{job}", headers=h)
        if op == "create_file":
            return await self.http.post(
                "/v1/files", headers=h, data={"purpose": "fine-tune"},
                files={"file": (f"{token}.jsonl", TRAINING_FILE, "application/jsonl")},
            )  # fmt: skip
        if op == "create_job":
            body = {
                "model": "tiny",
                "training_file": self.rng.choice(self.tenant.files),
                "hyperparameters": {"n_epochs": 1},
                "metadata": {"bench_token": token},
            }
            return await self.http.post("/v1/fine_tuning/jobs", headers=h, json=body)
        raise ValueError(f"unknown op {op!r}")

    async def run(self, deadline: float, start_delay_s: float, out: list[Outcome]) -> None:
        await asyncio.sleep(start_delay_s)
        while time.monotonic() < deadline:
            out.append(await self.one(self.rng.choices(self.ops, self.weights)[0]))


def http_client(base_url: str, concurrency: int, timeout_s: float) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=base_url,
        limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency),
        timeout=httpx.Timeout(timeout_s),
    )


async def seed_tenants(
    base_url: str, tenants: Sequence[TenantObjects], headers: Mapping[str, str]
) -> list[Outcome]:
    """One file and one job per tenant, so every op of the mix has something to act on."""
    out = []
    async with http_client(base_url, 4, 60) as http:
        for i, tenant in enumerate(tenants):
            client = Client(http, tenant, "seed", i, random.Random(i), DEFAULT_MIX, headers)
            for op in ("create_file", "create_job"):
                outcome = await client.one(op)
                if not outcome.ok:
                    raise RuntimeError(f"seeding tenant {i}: {op} answered {outcome}")
                out.append(outcome)
    return out


async def run_level(
    base_url: str, tenants: Sequence[TenantObjects], headers: Mapping[str, str], *,
    level: str, concurrency: int, duration_s: float, seed: int, mix: Mapping[str, int],
    timeout_s: float,
) -> tuple[list[Outcome], float, float]:  # fmt: skip
    """`concurrency` clients (tenants round-robin) for `duration_s`; returns every outcome, the
    wall time from the first start to the last answer, and the start's `time.monotonic()`.
    Starts are spread over the first half second (a burst of connects is not what is measured)."""
    out: list[Outcome] = []
    rng = random.Random(seed)
    async with http_client(base_url, concurrency, timeout_s) as http:
        clients = [
            Client(
                http, tenants[i % len(tenants)], level, i, random.Random(rng.random()), mix, headers
            )  # fmt: skip
            for i in range(concurrency)
        ]
        started = time.monotonic()
        deadline = started + duration_s
        await asyncio.gather(
            *(c.run(deadline, 0.5 * i / concurrency, out) for i, c in enumerate(clients))
        )
        wall = time.monotonic() - started
    return out, wall, started


def summarize(outcomes: Sequence[Outcome], wall_s: float, started: float) -> dict[str, Any]:
    """Throughput, latency and errors of one level (`started`: its `time.monotonic()`)."""
    latencies = [o.latency_s * 1e3 for o in outcomes]
    by_op = {}
    for op in OPS:
        ms = [o.latency_s * 1e3 for o in outcomes if o.op == op]
        if ms:
            by_op[op] = {"requests": len(ms), "ms_p50": sample_percentile(ms, 50),
                         "ms_p99": sample_percentile(ms, 99)}  # fmt: skip
    statuses = Counter(str(o.status) for o in outcomes if o.status is not None and not o.ok)
    transport = Counter(o.transport_error for o in outcomes if o.transport_error is not None)
    return {
        "requests": len(outcomes),
        "wall_s": wall_s,
        "rps": len(outcomes) / wall_s if wall_s > 0 else 0.0,
        "latency_ms_p50": sample_percentile(latencies, 50) if latencies else None,
        "latency_ms_p99": sample_percentile(latencies, 99) if latencies else None,
        "latency_ms_max": max(latencies) if latencies else None,
        "errors": sum(statuses.values()) + sum(transport.values()),
        "errors_by_status": dict(sorted(statuses.items())),
        "transport_errors": dict(sorted(transport.items())),
        "server_errors_5xx": sum(n for s, n in statuses.items() if s.startswith("5")),
        "transport_error_samples": [
            {
                "op": o.op,
                "error": o.transport_error,
                "detail": o.detail,
                "sent_at_s": round(o.started_at - started, 3),
                "after_s": round(o.latency_s, 3),
            }
            for o in outcomes
            if o.transport_error is not None
        ][:10],  # fmt: skip
        "ops": by_op,
    }


def audit(
    outcomes: Sequence[Outcome], rows: Mapping[str, Sequence[Sequence[str]]]
) -> dict[str, Any]:
    """Each create as its client saw it against the database afterwards, per level.

    * `rows_lost`: acknowledged (200) but no row carries its token;
    * `rows_duplicated`: more than one row carries the token of one request;
    * `rows_mismatched`: the one row's id is not the acknowledged id;
    * `rows_committed_behind_error`: an HTTP error answered (4xx/5xx), yet a row exists;
    * `transport_errors_committed` / `_not_committed`: the client got no answer (timeout, reset):
      a row may or may not exist, both are legitimate, counted apart;
    * `rows_without_request` (whole run): rows whose token no request sent.
    """
    in_db: dict[tuple[str, str], list[str]] = {}
    for table in ("files", "jobs"):
        for token, pk in rows[table]:
            in_db.setdefault((table, token), []).append(pk)
    sent: set[tuple[str, str]] = set()
    per_level: dict[str, Counter[str]] = {}
    for o in outcomes:
        if o.token is None:
            continue
        key = (CREATES[o.op], o.token)
        sent.add(key)
        ids = in_db.get(key, [])
        c = per_level.setdefault(o.level, Counter())
        if o.ok:
            c["acknowledged_creates"] += 1
            if not ids:
                c["rows_lost"] += 1
            elif len(ids) > 1:
                c["rows_duplicated"] += 1
            elif ids[0] != o.object_id:
                c["rows_mismatched"] += 1
        elif o.status is None:
            c["transport_errors_committed" if ids else "transport_errors_not_committed"] += 1
            if len(ids) > 1:
                c["rows_duplicated"] += 1
        else:
            c["refused_creates"] += 1
            if ids:
                c["rows_committed_behind_error"] += 1
    keys = ("acknowledged_creates", "refused_creates", "rows_lost", "rows_duplicated",
            "rows_mismatched", "rows_committed_behind_error", "transport_errors_committed",
            "transport_errors_not_committed")  # fmt: skip
    return {
        "levels": {level: {k: c[k] for k in keys} for level, c in per_level.items()},
        "rows_without_request": sum(1 for key in in_db if key not in sent),
        "rows_in_db": {table: len(rows[table]) for table in ("files", "jobs")},
    }
