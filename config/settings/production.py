"""Production: every secret from the environment, a configured database and broker, HTTPS.

This is the default settings module: `manage.py`, `config/asgi.py`, `config/wsgi.py` and
`config/celery.py` choose it when DJANGO_SETTINGS_MODULE is unset, so a process started with
nothing set refuses to start and names every variable it lacks (all of them are in
`deploy/harli.env.example`). DEBUG is never on here; the embedded platform on one machine
(`scripts/run.sh`) chooses `config.settings.local` explicitly, and says so.

HTTPS is assumed: HSTS, secure cookies and a redirect of plain-HTTP requests to HTTPS (the
probes `/healthz` and `/readyz` and `/metrics` excepted, so a load balancer or Prometheus can call
the web process directly).
Behind a reverse proxy that terminates TLS, HARLI_TRUSTED_PROXY_HOPS > 0 makes Django take the
scheme from `X-Forwarded-Proto` (the proxy must set it, overwriting what a client sent).

Database connections: each is closed at the end of its request or task
(HARLI_DB_CONN_MAX_AGE_S, config/settings/base.py, says why), and checked before reuse where it
is kept. README, "Production guide", counts the connections N web workers and the worker's
concurrency use against PostgreSQL's max_connections.
"""

from config.env import EnvError, env_bool, env_int, env_str
from config.logging import control_plane_logging
from config.settings.base import *  # noqa: F403
from config.settings.base import (
    CELERY_BROKER_CONFIGURED,
    DATABASE_URL,
    GATEWAY_SECRET,
    HARLI_LOG_LEVEL,
    HARLI_TRUSTED_PROXY_HOPS,
    SECRET_KEY,
)

_missing = [
    message
    for unset, message in [
        (not SECRET_KEY, "DJANGO_SECRET_KEY must be set in production (a random string of 50+ "
                         "characters)"),
        (not DATABASE_URL, "DATABASE_URL must be set in production (postgres://USER:PASSWORD@"
                           "HOST:5432/NAME)"),
        (not GATEWAY_SECRET, "HARLI_GATEWAY_SECRET must be set in production (hosts' grant keys)"),
        (not CELERY_BROKER_CONFIGURED, "CELERY_BROKER_URL must be set in production (redis://"
                                       " or amqp:// with credentials)"),
    ]
    if unset
]  # fmt: skip
if _missing:
    raise EnvError(
        "config.settings.production (the default DJANGO_SETTINGS_MODULE) cannot start:\n  "
        + "\n  ".join(_missing)
        + "\nEvery variable is described in deploy/harli.env.example. For the embedded platform "
        "on one machine, run scripts/run.sh (it chooses config.settings.local)."
    )

DEBUG = False

# Logs: one JSON object per line on stdout (config.logging), for the journal or a collector.
HARLI_LOG_FORMAT = env_str("HARLI_LOG_FORMAT", "json")
LOGGING = control_plane_logging(
    log_format=HARLI_LOG_FORMAT, level=HARLI_LOG_LEVEL, stream="ext://sys.stdout"
)

# HTTPS: every request not already secure is redirected, except the probes.
SECURE_SSL_REDIRECT = env_bool("HARLI_SECURE_SSL_REDIRECT", True)
# /metrics too: Prometheus scrapes each web machine directly, inside the network.
SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^readyz$", r"^metrics$"]
if HARLI_TRUSTED_PROXY_HOPS > 0:
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
SECURE_HSTS_SECONDS = env_int("HARLI_HSTS_SECONDS", 31_536_000, minimum=0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("HARLI_HSTS_INCLUDE_SUBDOMAINS", True)
SECURE_HSTS_PRELOAD = env_bool("HARLI_HSTS_PRELOAD", False)
# Asking browsers' preload lists to include the domain is its owner's decision (hard to undo),
# not a default: HARLI_HSTS_PRELOAD=1 takes it, and the check that asks for it stays quiet.
SILENCED_SYSTEM_CHECKS = ["security.W021"]
SESSION_COOKIE_SECURE = True
SESSION_COOKIE_HTTPONLY = True
CSRF_COOKIE_SECURE = True
# Django's defaults, pinned: a change of default must not loosen them.
X_FRAME_OPTIONS = "DENY"
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_REFERRER_POLICY = "same-origin"
SECURE_CROSS_ORIGIN_OPENER_POLICY = "same-origin"
