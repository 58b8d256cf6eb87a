"""`python -m bench.gateway`: the gateway's added latency and CPU, and a host killed mid-run.

Phase 1 (one host): at each concurrency, the same streams straight to the host (with a grant the
benchmark signs, as the gateway would) and through the gateway, alternating, `--rounds` times;
TTFT and the gap between chunks at the client, p50/p99, and the gateway process's CPU time per
1,000 streamed tokens. Phase 2 (two hosts): streams through the gateway while one host is
killed (SIGKILL) a third of the way in; requests are counted by how they ended.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform as host_platform
import tempfile
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.common.cli_types import positive_ints
from bench.common.processes import cpu_seconds
from bench.common.provenance import commit_hash, write_result
from bench.gateway.load import LoadSummary, run_load
from bench.gateway.platform import Platform
from gpu_runtime.contract.grants import GRANT_HEADER, GRANT_TTL_S, Grant, grant_sign


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.gateway", description=__doc__)
    p.add_argument("--concurrency", type=positive_ints("--concurrency"), default=[1, 16, 64, 256])
    p.add_argument("--requests-per-stream", type=int, default=3,
                   help="requests per concurrent stream in each timed run")  # fmt: skip
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--failover-requests", type=int, default=192)
    p.add_argument("--failover-concurrency", type=int, default=32)
    p.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                   help="the agents on the first CPU; the control plane and this client on "
                   "the others (the gateway never slows the engine both paths share)")  # fmt: skip
    p.add_argument("--out", default="bench/results")
    return p.parse_args()


def direct_headers(platform: Platform, host: str) -> dict[str, str]:
    rid = f"req_{uuid.uuid4().hex}"
    grant = Grant(host, "demo", ("tiny",), time.time() + GRANT_TTL_S, rid)
    return {GRANT_HEADER: grant_sign(grant, platform.host_key(host))}


def row(system: str, concurrency: int, summary: LoadSummary, cpu_s: float | None) -> dict[str, Any]:
    out = {"system": system, "concurrency": concurrency, **asdict(summary)}
    out["gateway_cpu_s_per_1k_tokens"] = (
        cpu_s / summary.tokens * 1000 if cpu_s is not None and summary.tokens else None
    )
    return out


async def latency_phase(platform: Platform, args: argparse.Namespace) -> list[dict[str, Any]]:
    body = {"model": "tiny", "prompt": "Q: once upon", "max_tokens": args.max_tokens,
            "stream": True, "temperature": 0}  # fmt: skip
    gateway_headers = {"authorization": f"Bearer {platform.api_key}"}
    web_pid = platform.pid("web")
    # warm both paths (the gateway's key and fleet caches, the host's first batches)
    await run_load(f"{platform.web_url}/v1/completions", lambda: gateway_headers, body,
                   concurrency=4, requests=16)  # fmt: skip
    rows = []
    for concurrency in args.concurrency:
        requests = concurrency * args.requests_per_stream
        for round_ in range(args.rounds):
            direct, _ = await run_load(
                f"{platform.agent_url('agent-a')}/completions",
                lambda: direct_headers(platform, "agent-a"), body,
                concurrency=concurrency, requests=requests,
            )  # fmt: skip
            rows.append({**row("direct", concurrency, direct, None), "round": round_})
            before = cpu_seconds(web_pid)
            through, _ = await run_load(
                f"{platform.web_url}/v1/completions", lambda: gateway_headers, body,
                concurrency=concurrency, requests=requests,
            )  # fmt: skip
            used = cpu_seconds(web_pid) - before
            rows.append({**row("gateway", concurrency, through, used), "round": round_})
            print(f"c={concurrency} round {round_}: direct ttft p50 {direct.ttft_ms_p50:.2f} "
                  f"gateway {through.ttft_ms_p50:.2f} ms", flush=True)  # fmt: skip
    return rows


async def failover_phase(platform: Platform, args: argparse.Namespace) -> dict[str, Any]:
    platform.start_agent("agent-b")
    body = {"model": "tiny", "prompt": "Q: numbers", "max_tokens": 64, "stream": True,
            "temperature": 0}  # fmt: skip
    headers = {"authorization": f"Bearer {platform.api_key}"}
    url = f"{platform.web_url}/v1/completions"

    def routed_to_b() -> bool:
        return "-> agent-b" in platform.log("web")

    deadline = time.monotonic() + 60
    while not routed_to_b():  # until the gateway's view has both hosts
        await run_load(url, lambda: headers, body, concurrency=8, requests=8)
        if time.monotonic() > deadline:
            raise TimeoutError("the gateway never routed to agent-b")
    kill_at = args.failover_requests // 3
    killed: list[float] = []

    def on_done(done: int) -> None:
        if done == kill_at and not killed:
            platform.kill("agent-b")
            killed.append(time.monotonic())

    summary, results = await run_load(url, lambda: headers, body,
                                      concurrency=args.failover_concurrency,
                                      requests=args.failover_requests, on_done=on_done)  # fmt: skip
    return {
        "system": "gateway_failover",
        "hosts": 2,
        "killed": "agent-b",
        "killed_after_requests": kill_at,
        "concurrency": args.failover_concurrency,
        "requests": summary.requests,
        "succeeded": sum(r.error is None for r in results),
        "failed_before_first_byte": summary.failed_before_first_byte,
        "failed_after_first_byte": summary.failed_after_first_byte,
        "ttft_ms_p50": summary.ttft_ms_p50,
        "ttft_ms_p99": summary.ttft_ms_p99,
    }


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "system    c    ttft p50   ttft p99  chunk p50  chunk p99 chunk mean  cpu s/1k tok  tokens"
    ]
    for r in rows:
        if r["system"] == "gateway_failover":
            continue
        cpu = r["gateway_cpu_s_per_1k_tokens"]
        lines.append(
            f"{r['system']:<8}{r['concurrency']:>4} {r['ttft_ms_p50']:>10.2f} "
            f"{r['ttft_ms_p99']:>10.2f} {r['chunk_ms_p50']:>10.2f} {r['chunk_ms_p99']:>10.2f} "
            f"{r['chunk_ms_mean']:>10.3f} "
            f"{(f'{cpu:.3f}' if cpu is not None else '-'):>13} {r['tokens']:>7}"
        )
    return "\n".join(lines)


def added(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Gateway minus direct, per concurrency and round (the same round's pair)."""
    pairs: dict[tuple[int, int], dict[str, dict[str, Any]]] = {}
    for r in rows:
        if r["system"] in ("direct", "gateway"):
            pairs.setdefault((r["concurrency"], r["round"]), {})[r["system"]] = r
    out = []
    for (concurrency, round_), pair in sorted(pairs.items()):
        d, g = pair["direct"], pair["gateway"]
        out.append({
            "concurrency": concurrency, "round": round_,
            "added_ttft_ms_p50": g["ttft_ms_p50"] - d["ttft_ms_p50"],
            "added_ttft_ms_p99": g["ttft_ms_p99"] - d["ttft_ms_p99"],
            "added_chunk_ms_p50": g["chunk_ms_p50"] - d["chunk_ms_p50"],
            "added_chunk_ms_p99": g["chunk_ms_p99"] - d["chunk_ms_p99"],
            "added_chunk_ms_mean": g["chunk_ms_mean"] - d["chunk_ms_mean"],
            "gateway_cpu_s_per_1k_tokens": g["gateway_cpu_s_per_1k_tokens"],
        })  # fmt: skip
    return out


def main() -> None:
    args = parse_args()
    work = Path(tempfile.mkdtemp(prefix="harli-bench-gateway-"))
    max_streams = max(args.concurrency)
    cpus = sorted(os.sched_getaffinity(0))
    host_cpus = {cpus[0]} if args.pin and len(cpus) > 1 else None
    platform = Platform(work, max_num_seqs=max_streams, num_kv_blocks=max_streams * 8,
                        host_cpus=host_cpus)  # fmt: skip
    if host_cpus is not None:
        os.sched_setaffinity(0, set(cpus) - host_cpus)  # the client, beside the gateway
    try:
        platform.start(("agent-a",), later=("agent-b",))
        rows = asyncio.run(latency_phase(platform, args))
        failover = asyncio.run(failover_phase(platform, args))
    finally:
        platform.stop()
    rows.append(failover)
    import torch

    path = write_result(
        "gateway", args.out, "cpu", torch.__version__, commit_hash(),
        config={**vars(args), "machine": host_platform.processor() or host_platform.machine(),
                "model": "tiny (built-in preset)", "database": "sqlite",
                "broker": "filesystem", "server": "uvicorn (uvloop, httptools), one process",
                "agent_cpus": sorted(host_cpus) if host_cpus else "any",
                "gateway_and_client_cpus": sorted(set(cpus) - host_cpus) if host_cpus else "any",
                "cpus": len(cpus)},
        rows=rows,
        comparison=added(rows),
    )  # fmt: skip
    print(table(rows))
    print(json.dumps(failover))
    for a in added(rows):
        ttft, chunk = a["added_ttft_ms_p50"], a["added_chunk_ms_p50"]
        print(f"c={a['concurrency']:>3} r{a['round']}: added ttft p50 {ttft:+.2f} ms, "
              f"chunk p50 {chunk:+.3f} ms, mean {a['added_chunk_ms_mean']:+.3f} ms")  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
