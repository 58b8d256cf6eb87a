"""`python -m bench.api_load.db_rows`: the benchmark's rows in the platform's database, as JSON
on stdout: `{"files": [[token, id], ...], "jobs": [[token, id], ...]}`. A file's token is its
filename without `.jsonl`, a job's is its metadata's `bench_token`; rows without one are not
the benchmark's. Run with the platform's environment (its settings and database)."""

from __future__ import annotations

import json
import os
import sys

FILENAME_PREFIX = "bench-"


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings.production")
    import django

    django.setup()
    from api.models import File, FinetuneJob

    files = [
        [name.removesuffix(".jsonl"), pk]
        for pk, name in File.objects.filter(filename__startswith=FILENAME_PREFIX)
        .values_list("pk", "filename")
        .iterator()
    ]
    jobs = [
        [metadata["bench_token"], pk]
        for pk, metadata in FinetuneJob.objects.values_list("pk", "metadata").iterator()
        if isinstance(metadata, dict) and "bench_token" in metadata
    ]
    json.dump({"files": files, "jobs": jobs}, sys.stdout)


if __name__ == "__main__":
    main()
