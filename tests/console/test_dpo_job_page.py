"""The console's job page says how a job trains: supervised, or DPO with its beta."""

from __future__ import annotations

import pytest
from django.test import Client

from api.models import FinetuneJob, JobMethod
from tests.console.seed import Seeded

pytestmark = pytest.mark.django_db


def test_job_page_shows_the_method(operator_client: Client, seeded: Seeded) -> None:
    job = seeded.queued_job
    page = operator_client.get(f"/console/jobs/{job.pk}/").content.decode()
    assert "<dt>Method</dt><dd>Supervised</dd>" in page
    FinetuneJob.objects.filter(pk=job.pk).update(method=JobMethod.DPO, dpo_beta=0.25)
    page = operator_client.get(f"/console/jobs/{job.pk}/").content.decode()
    assert "<dt>Method</dt><dd>DPO · beta 0.25</dd>" in page
