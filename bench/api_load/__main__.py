"""`python -m bench.api_load`: the tenant API under concurrent clients, on the production
setup and on the embedded default.

For each platform (`bench.api_load.platform`: `sqlite`, the run command's processes; `postgres`,
the production guide's), tenants and keys are made with `manage.py`, a short warm-up runs, then
each client count runs for `--duration-s`: `bench.api_load.load`'s mix of list files, create
file, create job, retrieve job and list jobs. A row per (platform, clients): rps, p50/p99
latency, errors by status and transport errors, the peak of open PostgreSQL connections, and
the audit of creates against the database read after the platform stopped (every acknowledged
create exactly once; none behind an error; transport errors counted apart).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import os
import platform as host_platform
import resource
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.api_load.load import (
    DEFAULT_MIX,
    OPS,
    Outcome,
    TenantObjects,
    audit,
    run_level,
    seed_tenants,
    summarize,
)
from bench.api_load.platform import Platform, Sizes
from bench.common.provenance import commit_hash, write_result

WARMUP_CLIENTS = 16
"""Clients of each platform's warm-up (its row is reported too, phase "warmup")."""


def client_counts(text: str) -> list[int]:
    counts = [int(part) for part in text.split(",") if part.strip()]
    if any(c < 1 for c in counts):
        raise argparse.ArgumentTypeError(f"client counts must be >= 1, got {text!r}")
    return counts


def mix_arg(text: str) -> dict[str, int]:
    mix = {}
    for part in text.split(","):
        op, _, weight = part.partition("=")
        if op not in OPS or not weight.isdigit():
            raise argparse.ArgumentTypeError(f"{part!r}: use op=weight with op in {OPS}")
        mix[op] = int(weight)
    if not any(mix.values()):
        raise argparse.ArgumentTypeError("the mix has no operation with a weight > 0")
    return mix


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.api_load", description=__doc__)
    p.add_argument("--postgres-clients", type=client_counts, default=[32, 128, 512],
                   help="client counts on the production setup ('' skips it)")  # fmt: skip
    p.add_argument("--sqlite-clients", type=client_counts, default=[32],
                   help="client counts on the embedded default ('' skips it)")  # fmt: skip
    p.add_argument("--duration-s", type=float, default=25.0, help="per client count")
    p.add_argument("--warmup-s", type=float, default=3.0,
                   help=f"per platform, {WARMUP_CLIENTS} clients (0: none)")  # fmt: skip
    p.add_argument("--tenants", type=int, default=4)
    p.add_argument("--timeout-s", type=float, default=60.0, help="a client's wait for an answer")
    p.add_argument("--mix", type=mix_arg, default=DEFAULT_MIX,
                   help="op=weight,... (ops: " + ", ".join(OPS) + ")")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--web-workers", type=int, help="default: deploy/harli.env.example")
    p.add_argument("--limit-concurrency", type=int, help="default: deploy/harli.env.example")
    p.add_argument("--requests-in-flight", type=int, help="default: deploy/harli.env.example")
    p.add_argument("--keep-alive-s", type=int, help="default: deploy/harli.env.example")
    p.add_argument("--worker-concurrency", type=int, help="default: deploy/harli.env.example")
    p.add_argument("--keep-work", action="store_true", help="keep the logs and files")
    p.add_argument("--out", default="bench/results")
    return p.parse_args()


class ConnectionSampler:
    """The peak of the platform's open database connections, sampled every `interval_s`."""

    def __init__(self, platform: Platform, interval_s: float = 0.5) -> None:
        self.platform = platform
        self.interval_s = interval_s
        self.peak: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            count = self.platform.connections()
            if count is not None:
                self.peak = max(self.peak or 0, count)
            self._stop.wait(self.interval_s)

    def __enter__(self) -> ConnectionSampler:
        if self.platform.database:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


def client_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_platform(
    kind: str, counts: list[int], args: argparse.Namespace, sizes: Sizes | None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    work = Path(tempfile.mkdtemp(prefix=f"harli-bench-api-{kind}-"))
    platform = Platform(kind, work, args.tenants, sizes=sizes)
    rows: list[dict[str, Any]] = []
    outcomes: list[Outcome] = []
    try:
        t0 = time.monotonic()
        platform.start()
        print(f"{kind}: started in {time.monotonic() - t0:.1f} s ({work})", flush=True)
        tenants = [TenantObjects(key) for _, key in platform.tenants]
        headers = platform.client_headers
        outcomes += asyncio.run(seed_tenants(platform.web_url, tenants, headers))
        phases = [("warmup", WARMUP_CLIENTS, args.warmup_s)] if args.warmup_s > 0 else []
        phases += [("measure", clients, args.duration_s) for clients in counts]
        for phase, clients, duration_s in phases:
            level = f"{kind}-{clients}" if phase == "measure" else f"{kind}-warmup"
            load_before = os.getloadavg()
            cpu_before, web_before = client_cpu_s(), platform.web_cpu_s()
            with ConnectionSampler(platform) as sampler:
                level_out, wall, started = asyncio.run(run_level(
                    platform.web_url, tenants, headers, level=level, concurrency=clients,
                    duration_s=duration_s, seed=args.seed + clients, mix=args.mix,
                    timeout_s=args.timeout_s,
                ))  # fmt: skip
            outcomes += level_out
            row = {
                "platform": kind,
                "phase": phase,
                "clients": clients,
                "level": level,
                **summarize(level_out, wall, started),
                "db_connections_peak": sampler.peak,
                "client_cpu_s": client_cpu_s() - cpu_before,
                "web_cpu_s": platform.web_cpu_s() - web_before,
                "loadavg_1m_before": load_before[0],
            }
            rows.append(row)
            print(f"{level}: {row['requests']} requests, {row['rps']:.1f} rps, p50 "
                  f"{row['latency_ms_p50']:.0f} ms, p99 {row['latency_ms_p99']:.0f} ms, errors "
                  f"{row['errors_by_status']} {row['transport_errors']}, connections peak "
                  f"{row['db_connections_peak']}", flush=True)  # fmt: skip
        exited = platform.exited()
        platform.stop()
        found = audit(outcomes, platform.rows())
        for row in rows:
            row.update(found["levels"].get(row["level"], {}))
        facts = {
            "rows_without_request": found["rows_without_request"],
            "rows_in_db": found["rows_in_db"],
            "audit_by_level": found["levels"],
            "processes_exited_during_run": {k: v for k, v in exited.items() if v is not None},
            "max_connections": platform.max_connections(),
        }
        return rows, facts
    finally:
        platform.stop()
        platform.drop_database()
        if not args.keep_work:
            shutil.rmtree(work, ignore_errors=True)


def table(rows: list[dict[str, Any]]) -> str:
    head = f"{'platform':<9}{'phase':<8}{'clients':>8}{'rps':>8}{'p50 ms':>9}{'p99 ms':>9}"
    head += f"{'errors':>8}"
    head += f"{'conns':>7}{'acked':>7}{'lost':>6}{'dup':>5}{'behind':>8}{'transp':>8}"
    lines = [head]
    for r in rows:
        conns = "-" if r["db_connections_peak"] is None else str(r["db_connections_peak"])
        lines.append(
            f"{r['platform']:<9}{r['phase']:<8}{r['clients']:>8}{r['rps']:>8.1f}{r['latency_ms_p50']:>9.0f}"
            f"{r['latency_ms_p99']:>9.0f}{r['errors']:>8}{conns:>7}"
            f"{r.get('acknowledged_creates', 0):>7}{r.get('rows_lost', 0):>6}"
            f"{r.get('rows_duplicated', 0):>5}{r.get('rows_committed_behind_error', 0):>8}"
            f"{r.get('transport_errors_committed', 0):>8}"
        )
        if r["errors"]:
            lines.append(f"{'':25}errors by status {r['errors_by_status']}, transport "
                         f"{r['transport_errors']}")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    sizes = Sizes.from_example(
        web_workers=args.web_workers, limit_concurrency=args.limit_concurrency,
        requests_in_flight=args.requests_in_flight, keep_alive_s=args.keep_alive_s,
        worker_concurrency=args.worker_concurrency,
    )  # fmt: skip
    rows: list[dict[str, Any]] = []
    facts: dict[str, Any] = {}
    if args.sqlite_clients:
        found, facts["sqlite"] = run_platform("sqlite", args.sqlite_clients, args, None)
        rows += found
    if args.postgres_clients:
        found, facts["postgres"] = run_platform("postgres", args.postgres_clients, args, sizes)
        rows += found
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = "none"
    config = {
        **{k: v for k, v in vars(args).items() if k != "keep_work"},
        "postgres_sizes": vars(sizes),
        "server": "uvicorn config.asgi (httptools, uvloop)",
        "sqlite_processes": "web (uvicorn, 1 process), celery worker (solo), beat; local "
                            "settings; filesystem broker; no host agent (jobs stay queued)",
        "postgres_processes": "web (uvicorn, web_workers processes), celery worker (prefork, "
                              "worker_concurrency), beat; production settings; Redis broker "
                              "with a password; no host agent (jobs stay queued)",
        "client": f"httpx {importlib.metadata.version('httpx')} AsyncClient, one asyncio loop, "
                  "one keep-alive connection per client",
        "machine": host_platform.processor() or host_platform.machine(),
        "cpus": len(os.sched_getaffinity(0)),
    }  # fmt: skip
    path = write_result("api-load", args.out, "cpu", torch_version, commit_hash(),
                        config=config, rows=rows, platforms=facts)  # fmt: skip
    print(table(rows))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
