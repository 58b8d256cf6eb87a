"""API-key checks against a live control plane: grants, tenant scoping, the revocation bound."""

from __future__ import annotations

import pytest

from api.services.apikeys import api_key_issue_for_tenant, api_key_revoke
from api.services.fleet import base_model_register
from api.services.tenants import tenant_create
from gpu_runtime.agent.auth import KeyRejected, KeyVerifier


class FakeClock:
    """A hand-moved monotonic clock, so the TTL bound is tested exactly, without sleeping."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.django_db(transaction=True)
def test_grant_cache_and_revocation_within_ttl(live_server: object) -> None:
    base_model_register(name="tiny", preset="tiny")
    issued = api_key_issue_for_tenant(tenant=tenant_create(name="acme"))
    clock = FakeClock()
    verifier = KeyVerifier(
        str(live_server), ttl_s=10.0, negative_ttl_s=2.0, timeout_s=30.0, clock=clock
    )
    assert verifier.check(issued.key).models == frozenset({"tiny"})
    assert verifier.check(issued.key).models == frozenset({"tiny"})
    assert verifier.lookups == 1  # cached
    api_key_revoke(prefix_or_id=issued.api_key.prefix)
    clock.now += 9.9
    assert verifier.check(issued.key).models == frozenset({"tiny"})  # still inside the TTL
    clock.now += 0.2
    with pytest.raises(KeyRejected):
        verifier.check(issued.key)  # the TTL ran out: asked again, and refused
    assert verifier.lookups == 2
    with pytest.raises(KeyRejected):
        verifier.check(issued.key)  # a refusal is cached too (negative TTL)
    assert verifier.lookups == 2
    with pytest.raises(KeyRejected):
        verifier.check("hk-" + "x" * 40)
    with pytest.raises(KeyRejected, match="missing"):
        verifier.check("")


def test_unreachable_control_plane_fails_closed() -> None:
    verifier = KeyVerifier("http://127.0.0.1:9", ttl_s=10.0, timeout_s=1.0)
    with pytest.raises(KeyRejected, match="cannot reach the control plane"):
        verifier.check("hk-" + "y" * 40)


@pytest.mark.django_db(transaction=True)
def test_unlisted_checkpoints_are_granted_per_name_for_their_owner_only(
    live_server: object,
) -> None:
    from api.models import JobCheckpoint
    from api.services.files import UploadSource, file_create
    from api.services.jobs import finetune_job_create, job_checkpoint_record
    from gpu_runtime.contract.protocol import checkpoint_model_name
    from tests.api.conftest import VALID_JSONL

    base_model_register(name="tiny", preset="tiny")
    acme = tenant_create(name="acme")
    key = api_key_issue_for_tenant(tenant=acme).key
    other = api_key_issue_for_tenant(tenant=tenant_create(name="globex")).key
    upload = UploadSource.from_bytes(filename="t.jsonl", data=VALID_JSONL)
    file = file_create(tenant=acme, purpose="fine-tune", upload=upload)
    job = finetune_job_create(tenant=acme, model="tiny", training_file=file.id)
    job_checkpoint_record(job=job, step=4, metrics={})
    name = checkpoint_model_name(f"ft:tiny:acme::{job.id}", 4)
    clock = FakeClock()
    verifier = KeyVerifier(str(live_server), ttl_s=10.0, negative_ttl_s=2.0, clock=clock)
    grant = verifier.check(key)
    assert not grant.allows(name)  # /v1/models lists no checkpoint
    assert grant.allows_unlisted(name) and grant.allows_unlisted(name)
    assert verifier.lookups == 2  # the list, then the name once (cached)
    assert not verifier.check(other).allows_unlisted(name)  # another tenant's: refused
    assert not grant.allows_unlisted(checkpoint_model_name(f"ft:tiny:acme::{job.id}", 5))
    JobCheckpoint.objects.filter(job=job).delete()  # pruned or deleted
    clock.now += 10.1
    assert not verifier.check(key).allows_unlisted(name)  # refused once the TTL ran out
