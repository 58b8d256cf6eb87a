"""One measurement of `bench.control_plane` in a fresh PostgreSQL database, run as a script
inside the tree being measured (its `api` on PYTHONPATH), so the same script times the code of
two commits. Prints one JSON object (the last line of stdout).

Fixture: `--tenants` tenants, `--hosts` online hosts serving the tiny model with fresh
heartbeats whose free memory is one byte short of a job's estimate (every job must wait: the
pass evaluates them all), and `--jobs` queued jobs (bulk-inserted, two events each). Timed:
the placement step of a reconcile pass twice (the first records a waiting event per job, the
second finds them recorded), one whole reconcile pass, then, with room made on one host, one
new job created and placed by `job_place` (what its `place_job` task runs), and one reconcile
pass that places (the new code places at most its bound). Queries are counted with a cursor
wrapper.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

GIB = 2**30


@contextmanager
def counted() -> Iterator[list[int]]:
    from django.db import connection

    box = [0]

    def wrapper(execute: Callable[..., Any], sql: str, params: Any, many: bool, ctx: Any) -> Any:
        box[0] += 1
        return execute(sql, params, many, ctx)

    with connection.execute_wrapper(wrapper):
        yield box


def timed(fn: Callable[[], Any]) -> tuple[float, int, Any]:
    with counted() as box:
        start = time.perf_counter()
        out = fn()
        elapsed = time.perf_counter() - start
    return elapsed, box[0], out


def heartbeat(host: str, free_bytes: int) -> None:
    from api.services.reports import host_report_apply
    from gpu_runtime.contract.protocol import report

    host_report_apply(
        message=report(
            "heartbeat",
            host,
            base_model="tiny",
            server_url=f"http://{host}/v1",
            total_bytes=16 * GIB,
            free_bytes=free_bytes,
            harvestable_tokens_per_s=100.0,
            placements=[],
            adapters=[],
        )
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--jobs", type=int, required=True)
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--tenants", type=int, default=10)
    p.add_argument("--only-reconcile", action="store_true",
                   help="skip the two placement passes (reconcile runs the first)")  # fmt: skip
    args = p.parse_args()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings.test")
    import django

    django.setup()
    from django.db import connection
    from django.test.utils import setup_test_environment

    setup_test_environment()
    old_name = connection.settings_dict["NAME"]
    connection.creation.create_test_db(verbosity=0, autoclobber=True, serialize=False)
    try:
        result = run(args)
    finally:
        connection.creation.destroy_test_db(old_name, verbosity=0)
    print(json.dumps(result))


def run(args: argparse.Namespace) -> dict[str, Any]:
    from api.models import FinetuneJob, JobEvent, JobStatus, Placement
    from api.services import placement as placement_module
    from api.services.files import UploadSource, file_create
    from api.services.fleet import base_model_register, deployment_create, host_register
    from api.services.jobs import finetune_job_create
    from api.services.placement import finetune_memory_estimate, job_place
    from api.services.reconcile import fleet_reconcile
    from api.services.tenants import tenant_create

    tiny = base_model_register(name="tiny", preset="tiny")
    deployment = deployment_create(name="tiny-chat", base_model=tiny, tpot_slo_ms=50,
                                   ttft_slo_ms=500)  # fmt: skip
    line = b'{"prompt": "Q: hello", "completion": " A: world"}\n'
    tenants = [tenant_create(name=f"t{i}") for i in range(args.tenants)]
    files = [
        file_create(tenant=t, purpose="fine-tune",
                    upload=UploadSource.from_bytes(filename="t.jsonl", data=line * 4))
        for t in tenants
    ]  # fmt: skip
    templates = [
        finetune_job_create(tenant=t, model="tiny", training_file=f.id)
        for t, f in zip(tenants, files, strict=True)
    ]
    need = finetune_memory_estimate(job=templates[0])
    hosts = [f"h{i}" for i in range(args.hosts)]
    for name in hosts:
        host_register(name=name, gpu_kind="cpu", gpu_memory_bytes=16 * GIB, deployment=deployment)
        heartbeat(name, need - 1)
    rows = []
    for i in range(args.jobs - len(templates)):
        t = templates[i % len(templates)]
        rows.append(FinetuneJob(
            tenant_id=t.tenant_id, base_model=tiny, training_file_id=t.training_file_id,
            status=JobStatus.QUEUED, hyperparameters=t.hyperparameters, method=t.method,
            lora_rank=t.lora_rank, lora_alpha=t.lora_alpha, lora_dropout=t.lora_dropout,
            lora_target_modules=t.lora_target_modules, seed=i,
        ))  # fmt: skip
    FinetuneJob.objects.bulk_create(rows, batch_size=2000)
    events = [
        JobEvent(job=j, message=m)
        for j in rows
        for m in (f"Created fine-tuning job: {j.id}", "Files validated; job queued")
    ]
    JobEvent.objects.bulk_create(events, batch_size=4000)
    queued = FinetuneJob.objects.filter(status=JobStatus.QUEUED).count()

    if hasattr(placement_module, "placement_pass"):
        def place_all() -> Any:
            return placement_module.placement_pass()
    else:  # the loop the previous reconcile ran
        def place_all() -> Any:
            waiting = FinetuneJob.objects.filter(status=JobStatus.QUEUED).exclude(
                pk__in=Placement.objects.filter(state__in=("pending", "active")).values("job_id")
            )
            return [j for j in waiting.order_by("created_at").values_list("pk", flat=True)
                    if job_place(job_id=j) is not None]  # fmt: skip

    out: dict[str, Any] = {"queued_jobs": queued, "hosts": args.hosts, "tenants": args.tenants}
    if not args.only_reconcile:
        first_s, first_q, first = timed(place_all)
        steady_s, steady_q, steady = timed(place_all)
        out |= {
            "placement_first_s": first_s,
            "placement_first_queries": first_q,
            "placement_steady_s": steady_s,
            "placement_steady_queries": steady_q,
            "placed_when_full": len(first) + len(steady),
        }
    reconcile_s, reconcile_q, _ = timed(fleet_reconcile)
    # Room on one host: a new job is created and placed by its own task's function.
    heartbeat(hosts[0], 16 * GIB)
    new = finetune_job_create(tenant=tenants[0], model="tiny", training_file=files[0].id)
    new_s, new_q, placed = timed(lambda: job_place(job_id=new.id))
    out |= {
        "reconcile_s": reconcile_s,
        "reconcile_queries": reconcile_q,
        "new_job_place_s": new_s,
        "new_job_place_queries": new_q,
        "new_job_placed": placed is not None,
    }
    if hasattr(placement_module, "placement_pass"):
        # The previous code places every job that fits one host's reported free memory in one
        # pass (10,000 placements on one host): only the bounded pass is timed.
        heartbeat(hosts[1], 16 * GIB)
        placing_s, placing_q, result = timed(fleet_reconcile)
        out |= {"reconcile_placing_s": placing_s, "reconcile_placing_queries": placing_q,
                "reconcile_placing_placed": len(result.placed_jobs)}  # fmt: skip
    return out


if __name__ == "__main__":
    main()
