"""The suite reaches the shared Redis and RabbitMQ as its own users, with passwords, as
production does (`scripts/services.sh`); a wrong password is refused by both."""

from __future__ import annotations

import stat
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis
from kombu import Connection

from tests.services import AMQP_URL_ENV, REDIS_URL_ENV, service_url, services_env_path


def _with_password(url: str, password: str) -> str:
    parts = urlsplit(url)
    netloc = f"{parts.username}:{password}@{parts.hostname}:{parts.port}"
    return urlunsplit(parts._replace(netloc=netloc))


@pytest.mark.parametrize("name", [REDIS_URL_ENV, AMQP_URL_ENV])
def test_the_suites_urls_name_a_user_of_its_own_with_a_password(name: str) -> None:
    parts = urlsplit(service_url(name))
    assert parts.username == "harli-test"
    assert parts.password and len(parts.password) >= 16
    if services_env_path().exists():
        assert stat.S_IMODE(services_env_path().stat().st_mode) & 0o077 == 0


def test_redis_takes_the_suites_user_and_refuses_a_wrong_password() -> None:
    url = service_url(REDIS_URL_ENV)
    client = redis.Redis.from_url(url, socket_connect_timeout=2)
    try:
        assert client.acl_whoami() == "harli-test"
    finally:
        client.close()
    wrong = redis.Redis.from_url(_with_password(url, "not-the-password"), socket_connect_timeout=2)
    with pytest.raises(redis.AuthenticationError):
        wrong.ping()
    wrong.close()


def test_rabbitmq_takes_the_suites_user_and_refuses_a_wrong_password() -> None:
    url = service_url(AMQP_URL_ENV)
    with Connection(url, connect_timeout=5) as connection:
        connection.ensure_connection(max_retries=1)
        with connection.SimpleQueue("harli-test-services") as queue:
            queue.put({"ok": 1})
            message = queue.get(timeout=5)
            assert message.payload == {"ok": 1}
            message.ack()
    with Connection(_with_password(url, "not-the-password"), connect_timeout=5) as refused:
        with pytest.raises(Exception, match="ACCESS_REFUSED|403|auth"):
            refused.ensure_connection(max_retries=0)
