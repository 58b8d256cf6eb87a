"""The console's login throttle: failed sign-ins lock a username, or a client address, out."""

from __future__ import annotations

import logging
import threading
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

import pytest
from django.contrib.auth.signals import user_login_failed
from django.db import connections
from django.test import Client, RequestFactory
from pytest_django.fixtures import Settings

from api.login_throttle import LoginThrottlePolicy, lockout_end
from api.models import LoginFailure
from api.services.tenants import operator_create
from console.client_ip import client_ip

if TYPE_CHECKING:
    from django.test.client import _MonkeyPatchedWSGIResponse as TestResponse

LOGIN = "/console/login/"
OPS = ("ops", "ops-password-1")
ALICE = ("alice", "alice-password-1")
WRONG = "not-the-password-7f3a"
LOCKED = "Too many failed sign-ins; try again in 15 minutes."


@pytest.fixture
def operators(db: None) -> None:
    operator_create(username=OPS[0], password=OPS[1])
    operator_create(username=ALICE[0], password=ALICE[1])


def sign_in(username: str, password: str, *, ip: str = "192.0.2.10") -> TestResponse:
    return Client(REMOTE_ADDR=ip).post(LOGIN, {"username": username, "password": password})


def signed_in(response: TestResponse) -> bool:
    return response.status_code == 302 and response["Location"] == "/console/"


def age_failures(by: timedelta) -> None:
    """Move every recorded failure `by` into the past (the clock moving on)."""
    for failure in LoginFailure.objects.all():
        failure.at -= by
        failure.save(update_fields=["at"])


def test_five_wrong_passwords_lock_the_username_before_the_password_is_checked(
    operators: None,
) -> None:
    for _ in range(4):
        response = sign_in(OPS[0], WRONG)
        assert response.status_code == 200
        assert "Please enter a correct username and password" in response.content.decode()
    fifth = sign_in(OPS[0], WRONG)
    assert fifth.status_code == 429 and LOCKED in fifth.content.decode()
    right = sign_in(OPS[0], OPS[1])
    assert right.status_code == 429
    page = right.content.decode()
    assert LOCKED in page and "Please enter a correct" not in page
    assert right["Retry-After"] == "900"
    assert 'value="ops"' in page  # the username stays filled in
    assert LoginFailure.objects.filter(username="ops").count() == 5  # refusals are not failures
    # the same username in other letter cases from the same address: still locked
    assert sign_in("OPS", OPS[1]).status_code == 429
    # from another address the failures above do not count: the operator still signs in
    assert signed_in(sign_in(OPS[0], OPS[1], ip="198.51.100.7"))


def test_another_username_from_another_address_still_signs_in(operators: None) -> None:
    for _ in range(5):
        sign_in(OPS[0], WRONG)
    assert signed_in(sign_in(ALICE[0], ALICE[1], ip="198.51.100.7"))
    # the attacker's address has 5 failures, far below its limit of 20: alice from it works too
    assert signed_in(sign_in(ALICE[0], ALICE[1]))


def test_the_lockout_expires(operators: None) -> None:
    for _ in range(5):
        sign_in(OPS[0], WRONG)
    age_failures(timedelta(minutes=10))
    response = sign_in(OPS[0], OPS[1])
    assert response.status_code == 429
    assert "try again in 5 minutes." in response.content.decode()
    age_failures(timedelta(minutes=4, seconds=30))
    assert "try again in 1 minute." in sign_in(OPS[0], OPS[1]).content.decode()
    age_failures(timedelta(seconds=31))
    assert signed_in(sign_in(OPS[0], OPS[1]))


def test_failures_spread_wider_than_the_window_do_not_lock(operators: None) -> None:
    for _ in range(4):
        sign_in(OPS[0], WRONG)
    age_failures(timedelta(minutes=16))
    assert sign_in(OPS[0], WRONG).status_code == 200  # the fifth, but the others are too old
    assert signed_in(sign_in(OPS[0], OPS[1]))


def test_a_success_clears_the_usernames_failures(operators: None) -> None:
    for _ in range(4):
        sign_in(OPS[0], WRONG)
    assert signed_in(sign_in(OPS[0], OPS[1]))
    assert not LoginFailure.objects.filter(username="ops").exists()
    for _ in range(4):
        assert sign_in(OPS[0], WRONG).status_code == 200
    assert signed_in(sign_in(OPS[0], OPS[1]))


def test_twenty_failures_from_one_address_lock_it_across_usernames(operators: None) -> None:
    attacker = "203.0.113.5"
    for n in range(19):
        assert sign_in(f"guess{n}", WRONG, ip=attacker).status_code == 200
    assert sign_in("guess19", WRONG, ip=attacker).status_code == 429
    # the right password of a username never tried, from that address: refused
    response = sign_in(ALICE[0], ALICE[1], ip=attacker)
    assert response.status_code == 429 and LOCKED in response.content.decode()
    # the same username from elsewhere: not locked
    assert signed_in(sign_in(ALICE[0], ALICE[1], ip="198.51.100.7"))


def test_limits_come_from_settings(operators: None, settings: Settings) -> None:
    settings.HARLI_LOGIN_MAX_FAILURES_PER_USER = 2
    settings.HARLI_LOGIN_LOCKOUT_S = 120
    assert sign_in(OPS[0], WRONG).status_code == 200
    response = sign_in(OPS[0], WRONG)
    assert response.status_code == 429
    assert "try again in 2 minutes." in response.content.decode()


def test_a_tenant_user_with_its_password_counts_as_a_failure(operators: None) -> None:
    from api.services.tenants import tenant_create, tenant_service_user

    user = tenant_service_user(tenant=tenant_create(name="acme"))
    user.set_password("tenant-password")
    user.save()
    for _ in range(4):
        assert sign_in(user.username, "tenant-password").status_code == 200
    assert sign_in(user.username, "tenant-password").status_code == 429


def test_refusals_are_logged_without_the_password(
    operators: None, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    for _ in range(5):
        sign_in(OPS[0], WRONG, ip="203.0.113.9")
    sign_in(OPS[0], OPS[1], ip="203.0.113.9")
    warnings = [
        r for r in caplog.records if r.name == "console.views.auth" and r.levelno == logging.WARNING
    ]
    assert len(warnings) == 2  # the fifth failure and the refused sixth
    for record in warnings:
        line = record.getMessage()
        assert "'ops'" in line and "203.0.113.9" in line
    logged = "\n".join(r.getMessage() for r in caplog.records) + caplog.text
    assert WRONG not in logged and OPS[1] not in logged


def test_the_client_address_is_remote_addr_unless_proxies_are_trusted() -> None:
    factory = RequestFactory()
    request = factory.get("/", REMOTE_ADDR="10.0.0.2", HTTP_X_FORWARDED_FOR="1.1.1.1, 198.51.100.4")
    assert client_ip(request, trusted_proxy_hops=0) == "10.0.0.2"
    assert client_ip(request, trusted_proxy_hops=1) == "198.51.100.4"
    assert client_ip(request, trusted_proxy_hops=2) == "1.1.1.1"
    assert client_ip(request, trusted_proxy_hops=3) == "10.0.0.2"  # too few entries
    spoofed = factory.get("/", REMOTE_ADDR="10.0.0.2", HTTP_X_FORWARDED_FOR="not-an-ip")
    assert client_ip(spoofed, trusted_proxy_hops=1) == "10.0.0.2"
    assert client_ip(factory.get("/", REMOTE_ADDR=""), trusted_proxy_hops=0) == ""


def test_the_trusted_hop_decides_the_counted_address(operators: None, settings: Settings) -> None:
    settings.HARLI_TRUSTED_PROXY_HOPS = 1
    client = Client(REMOTE_ADDR="10.0.0.2", HTTP_X_FORWARDED_FOR="6.6.6.6, 203.0.113.77")
    client.post(LOGIN, {"username": OPS[0], "password": WRONG})
    assert list(LoginFailure.objects.values_list("ip", flat=True)) == ["203.0.113.77"]


def test_old_failures_are_pruned_on_write(operators: None) -> None:
    sign_in(OPS[0], WRONG)
    # the lookback: the global window (60 min) and a lockout (15 min), then a minute
    assert LoginThrottlePolicy.from_settings().lookback == timedelta(minutes=75)
    age_failures(timedelta(minutes=76))
    sign_in(ALICE[0], WRONG)
    assert list(LoginFailure.objects.values_list("username", flat=True)) == ["alice"]


def test_lockout_end_is_the_latest_run_reaching_the_limit() -> None:
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    minute = timedelta(minutes=1)
    window, lockout = 15 * minute, 15 * minute
    at = [t0 + n * minute for n in (0, 1, 2)]
    assert lockout_end(failures=at, limit=3, window=window, lockout=lockout) == at[2] + lockout
    assert lockout_end(failures=at[:2], limit=3, window=window, lockout=lockout) is None
    spread = [t0, t0 + 10 * minute, t0 + 20 * minute]
    assert lockout_end(failures=spread, limit=3, window=window, lockout=lockout) is None
    later = [*at, t0 + 30 * minute, t0 + 31 * minute, t0 + 32 * minute]
    assert lockout_end(failures=later, limit=3, window=window, lockout=lockout) == (
        later[-1] + lockout
    )


def test_the_api_login_route_sends_to_the_throttled_console_login(operators: None) -> None:
    page = Client().get("/api/auth/login/?next=/api/ops/tenants")
    assert page.status_code == 302
    assert page["Location"] == "/console/login/?next=/api/ops/tenants"
    client = Client()
    posted = client.post("/api/auth/login/", {"username": OPS[0], "password": OPS[1]})
    assert posted.status_code == 302 and posted["Location"].startswith("/console/login/")
    assert "_auth_user_id" not in client.session  # no password is checked there


def test_a_burst_of_simultaneous_attempts_gets_only_the_limit_checked(
    transactional_db: None,
) -> None:
    operator_create(username=OPS[0], password=OPS[1])
    attempts = 12
    start = threading.Barrier(attempts)
    statuses: list[int] = []
    errors: list[BaseException] = []
    checked: list[str] = []

    def count_check(sender: object, credentials: dict[str, str], **_: object) -> None:
        checked.append(credentials.get("username", ""))

    def attempt() -> None:
        try:
            start.wait()
            statuses.append(sign_in(OPS[0], WRONG).status_code)
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    user_login_failed.connect(count_check)
    try:
        threads = [threading.Thread(target=attempt) for _ in range(attempts)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    finally:
        user_login_failed.disconnect(count_check)
    assert errors == []
    # Five passwords checked, five failures recorded; the other seven were refused before
    # their password was checked. (Which of the five see the lockout already depends on when
    # they look: at most four are answered with the form.)
    assert checked == ["ops"] * 5
    assert LoginFailure.objects.filter(username="ops").count() == 5
    assert len(statuses) == attempts and set(statuses) <= {200, 429}
    assert statuses.count(200) <= 4


def test_failures_from_many_addresses_reach_the_slower_global_limit(
    operators: None, settings: Settings
) -> None:
    settings.HARLI_LOGIN_MAX_FAILURES_PER_USER_GLOBAL = 8
    for n in range(7):
        assert sign_in(OPS[0], WRONG, ip=f"203.0.113.{n}").status_code == 200
    assert sign_in(OPS[0], WRONG, ip="203.0.113.50").status_code == 429
    # the username is locked everywhere, even with its password from a new address
    response = sign_in(OPS[0], OPS[1], ip="198.51.100.200")
    assert response.status_code == 429 and LOCKED in response.content.decode()
    # another username is not
    assert signed_in(sign_in(ALICE[0], ALICE[1], ip="198.51.100.200"))


def test_a_success_keeps_failures_from_other_addresses(operators: None) -> None:
    for _ in range(3):
        sign_in(OPS[0], WRONG, ip="203.0.113.9")
    sign_in(OPS[0], WRONG)
    assert signed_in(sign_in(OPS[0], OPS[1]))
    assert list(LoginFailure.objects.values_list("ip", flat=True)) == ["203.0.113.9"] * 3
