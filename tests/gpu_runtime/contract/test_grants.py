"""Gateway grants: what verifies, and each way one is refused."""

from __future__ import annotations

import pytest

from gpu_runtime.contract.grants import (
    CLOCK_LEEWAY_S,
    Grant,
    GrantError,
    grant_sign,
    grant_verify,
    host_key,
)

KEY = host_key("fleet-secret", "gpu-1")
GRANT = Grant("gpu-1", "acme", ("ft:tiny:acme::job-1",), 1000.0, "req_1")


def test_a_signed_grant_verifies_with_its_fields() -> None:
    assert grant_verify(grant_sign(GRANT, KEY), KEY, host="gpu-1", now=999.0) == GRANT
    assert GRANT.allows("ft:tiny:acme::job-1") and not GRANT.allows("tiny")


def test_keys_differ_per_host_and_per_secret() -> None:
    assert len({KEY, host_key("fleet-secret", "gpu-2"), host_key("other", "gpu-1")}) == 3
    with pytest.raises(ValueError):
        host_key("", "gpu-1")


@pytest.mark.parametrize(
    ("token", "key", "host", "now", "reason"),
    [
        (grant_sign(GRANT, KEY), host_key("fleet-secret", "gpu-2"), "gpu-1", 999.0, "signature"),
        (grant_sign(GRANT, KEY), KEY, "gpu-2", 999.0, "not 'gpu-2'"),
        (grant_sign(GRANT, KEY), KEY, "gpu-1", 1000.0 + CLOCK_LEEWAY_S + 0.1, "expired"),
        ("", KEY, "gpu-1", 0.0, "missing"),
        ("v2.a.b", KEY, "gpu-1", 0.0, "malformed"),
        ("v1.only-two", KEY, "gpu-1", 0.0, "malformed"),
        ("v1.é.x", KEY, "gpu-1", 0.0, "malformed"),
    ],
)
def test_refusals_say_why(token: str, key: str, host: str, now: float, reason: str) -> None:
    with pytest.raises(GrantError, match=reason):
        grant_verify(token, key, host=host, now=now)


def test_a_tampered_payload_fails_its_signature() -> None:
    version, payload, signature = grant_sign(GRANT, KEY).split(".")
    other = grant_sign(Grant("gpu-1", "globex", GRANT.models, 1000.0), KEY).split(".")[1]
    with pytest.raises(GrantError, match="signature"):
        grant_verify(f"{version}.{other}.{signature}", KEY, host="gpu-1", now=0.0)
    assert payload != other


def test_within_the_clock_leeway_an_expired_grant_still_verifies() -> None:
    assert grant_verify(grant_sign(GRANT, KEY), KEY, host="gpu-1", now=1000.0 + CLOCK_LEEWAY_S)
