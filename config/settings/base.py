"""Settings shared by every environment. Environment values come from config.env."""

from __future__ import annotations

from config.database import SQLITE_ENGINE, database_settings
from config.env import BASE_DIR, env_int, env_list, env_redis_url, env_str
from config.logging import control_plane_logging
from gpu_runtime.contract.broker import broker_transport, broker_transport_options

SECRET_KEY = env_str("DJANGO_SECRET_KEY", "")
DEBUG = False
ALLOWED_HOSTS = env_list("DJANGO_ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]"])

INSTALLED_APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "api",
    "console",
    "workers",
]

MIDDLEWARE = [
    "api.metrics.RequestMetricsMiddleware",  # first: it times everything below it
    "api.request_ids.RequestIdMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "api.middleware.NulRefusalMiddleware",
    "api.middleware.RequestSizeLimitMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "api.middleware.ApiNotFoundMiddleware",
]

ROOT_URLCONF = "config.urls"
WSGI_APPLICATION = "config.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

# All migrations live under the top-level migrations/ package.
MIGRATION_MODULES = {
    "api": "migrations.api",
    "console": "migrations.console",
    "workers": "migrations.workers",
}

DATA_DIR = BASE_DIR / "var"
# DATABASE_URL unset: SQLite under var/, set up for concurrent writers (config.database).
DATABASE_URL = env_str("DATABASE_URL", "")
# How long a SQLite connection waits for another process's write to finish.
SQLITE_BUSY_TIMEOUT_MS = env_int("HARLI_SQLITE_BUSY_TIMEOUT_MS", 20_000)
# How long a connection to a database server stays open after the request that opened it. 0
# (the default) closes it at the end of each: under ASGI every Django request runs in a thread
# of its own, so a kept connection would stay open in a thread that never runs again (measured,
# 2 uvicorn workers: with 60 s, 40 sequential requests left 16 connections open and 48
# concurrent clients reached PostgreSQL's limit of 100; with 0 they peaked at 30 and all
# closed). The Celery worker closes its connections after every task whatever this says
# (celery.fixups.django), so each of its processes holds at most one.
DB_CONN_MAX_AGE_S = env_int("HARLI_DB_CONN_MAX_AGE_S", 0, minimum=0)
# Django requests one web process serves at once (api.request_slots); the others wait their
# turn. Each holds at most one database connection: README, "Database connections", counts them.
HARLI_WEB_REQUESTS_IN_FLIGHT = env_int("HARLI_WEB_REQUESTS_IN_FLIGHT", 16, minimum=1)
DATABASES = {
    "default": database_settings(
        url=DATABASE_URL,
        sqlite_path=DATA_DIR / "harli.sqlite3",
        conn_max_age=DB_CONN_MAX_AGE_S,
        busy_timeout_ms=SQLITE_BUSY_TIMEOUT_MS,
    )
}
if DATABASES["default"]["ENGINE"] != SQLITE_ENGINE:
    # A kept connection is checked before it is reused: a database restart costs no failed task.
    DATABASES["default"]["CONN_HEALTH_CHECKS"] = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
AUTH_USER_MODEL = "api.User"
LOGIN_URL = "rest_framework:login"
LOGIN_REDIRECT_URL = "/api/docs/"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = BASE_DIR / "staticfiles"
STATICFILES_DIRS = [d for d in [BASE_DIR / "frontend" / "dist"] if d.exists()]

# Celery: with no broker configured, kombu's in-memory transport (`memory://`), which reaches
# only consumers inside the same process; config.settings.local then runs tasks eagerly.
CELERY_BROKER_URL = env_str("CELERY_BROKER_URL", "") or "memory://"
CELERY_BROKER_CONFIGURED = bool(env_str("CELERY_BROKER_URL", ""))
CELERY_TASK_ALWAYS_EAGER = False
CELERY_TASK_DEFAULT_QUEUE = "control"
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
# `filesystem://` (the run command's service-free broker) keeps its folders under
# HARLI_BROKER_DIR, laid out as the host agents expect, and is served by the atomic transport
# the agents use too (both from the rule of gpu_runtime.contract.broker); on Redis an
# unacknowledged task is delivered again after HARLI_BROKER_VISIBILITY_TIMEOUT_S.
CELERY_BROKER_TRANSPORT = broker_transport(CELERY_BROKER_URL)
HARLI_BROKER_DIR = BASE_DIR / env_str("HARLI_BROKER_DIR", "var/broker")
CELERY_BROKER_TRANSPORT_OPTIONS: dict[str, object] = {
    "visibility_timeout": env_int("HARLI_BROKER_VISIBILITY_TIMEOUT_S", 3600),
    **broker_transport_options(CELERY_BROKER_URL, HARLI_BROKER_DIR),
}

# Logs (config.logging): readable text on stderr here, JSON on stdout in production; every line
# names its request id. HARLI_LOG_LEVEL for the platform's own loggers.
HARLI_LOG_FORMAT = env_str("HARLI_LOG_FORMAT", "text")
HARLI_LOG_LEVEL = env_str("HARLI_LOG_LEVEL", "INFO")
LOGGING = control_plane_logging(
    log_format=HARLI_LOG_FORMAT, level=HARLI_LOG_LEVEL, stream="ext://sys.stderr"
)

# The inference gateway (`api.gateway`): the fleet's secret from which each host's grant key is
# derived (`manage.py hosts key NAME` prints a host's), and how long it waits for a host.
GATEWAY_SECRET = env_str("HARLI_GATEWAY_SECRET", "")
GATEWAY_CONNECT_TIMEOUT_S = env_int("HARLI_GATEWAY_CONNECT_TIMEOUT_S", 2)
GATEWAY_READ_TIMEOUT_S = env_int("HARLI_GATEWAY_READ_TIMEOUT_S", 300)
"""Longest wait for a host's first byte, and between two chunks of a stream."""
GATEWAY_MAX_BODY_BYTES = env_int("HARLI_GATEWAY_MAX_BODY_BYTES", 32 * 1024 * 1024)
GATEWAY_KEY_CACHE_TTL_S = env_int("HARLI_GATEWAY_KEY_CACHE_TTL_S", 5)
"""How long the gateway trusts a key's (and a model name's) lookup: a revoked key, a deleted
model or a changed rate limit takes effect within this many seconds."""

# One `POST /v1/files` carries at most HARLI_MAX_UPLOAD_BYTES of file; larger files go through
# the Uploads API (`/v1/uploads`): parts of at most HARLI_UPLOAD_PART_MAX_BYTES (OpenAI: 64 MB),
# at most HARLI_UPLOAD_MAX_BYTES in all (OpenAI: 8 GB), completed within HARLI_UPLOAD_EXPIRES_S.
HARLI_MAX_UPLOAD_BYTES = env_int("HARLI_MAX_UPLOAD_BYTES", 512 * 1024 * 1024)
HARLI_UPLOAD_PART_MAX_BYTES = env_int("HARLI_UPLOAD_PART_MAX_BYTES", 64 * 1024 * 1024)
HARLI_UPLOAD_MAX_BYTES = env_int("HARLI_UPLOAD_MAX_BYTES", 8 * 1024 * 1024 * 1024)
HARLI_UPLOAD_EXPIRES_S = env_int("HARLI_UPLOAD_EXPIRES_S", 3600)
# Uploaded file bytes (api.storage.LocalStorage). Relative paths are taken from the repo root.
HARLI_STORAGE_DIR = BASE_DIR / env_str("HARLI_STORAGE_DIR", "var/storage")

# Where a request's uploaded file is spooled to disk while it is read (Django's
# FILE_UPLOAD_TEMP_DIR; uploads above 2.5 MB): a folder of its own, so that what a killed web
# process left there can be swept (`api.services.janitor`). Created at start-up.
HARLI_UPLOAD_SPOOL_DIR = BASE_DIR / env_str("HARLI_UPLOAD_SPOOL_DIR", "var/spool")
FILE_UPLOAD_TEMP_DIR = str(HARLI_UPLOAD_SPOOL_DIR)

# Idempotency keys of the tenant API (`api.idempotency`): kept this many hours after first use;
# a claim whose request has not finished after HARLI_IDEMPOTENCY_LOCK_S (longer than any request
# runs once its body arrived) is taken over by a retry.
HARLI_IDEMPOTENCY_KEY_RETENTION_H = env_int("HARLI_IDEMPOTENCY_KEY_RETENTION_H", 24, minimum=1)
HARLI_IDEMPOTENCY_LOCK_S = env_int("HARLI_IDEMPOTENCY_LOCK_S", 300, minimum=1)

# The janitor (`api.services.janitor`, beat every HARLI_JANITOR_INTERVAL_S; `manage.py janitor`
# runs it once): spool and partial storage files untouched for HARLI_JANITOR_STALE_FILE_AGE_S,
# stored files and upload parts without a row for HARLI_JANITOR_ORPHAN_GRACE_S, expired
# idempotency keys; raw host and deployment metric samples older than
# HARLI_METRICS_RAW_RETENTION_H (at least 24: the console charts up to 24 h of them), per-minute
# rollups older than HARLI_METRICS_ROLLUP_RETENTION_D, and the dedupe record of host reports
# older than HARLI_PROCESSED_REPORT_RETENTION_H (README, "Janitor", argues the defaults).
HARLI_JANITOR_INTERVAL_S = env_int("HARLI_JANITOR_INTERVAL_S", 600, minimum=1)
HARLI_JANITOR_STALE_FILE_AGE_S = env_int("HARLI_JANITOR_STALE_FILE_AGE_S", 3600, minimum=60)
HARLI_JANITOR_ORPHAN_GRACE_S = env_int("HARLI_JANITOR_ORPHAN_GRACE_S", 3600, minimum=60)
HARLI_METRICS_RAW_RETENTION_H = env_int("HARLI_METRICS_RAW_RETENTION_H", 48, minimum=24)
HARLI_METRICS_ROLLUP_RETENTION_D = env_int("HARLI_METRICS_ROLLUP_RETENTION_D", 90, minimum=1)
HARLI_PROCESSED_REPORT_RETENTION_H = env_int("HARLI_PROCESSED_REPORT_RETENTION_H", 168, minimum=24)

# The inference gateway's per-tenant rate limits (`api.rate_limits`): unset, each gateway
# process keeps its own buckets in memory; set, every process shares buckets in this Redis.
RATE_LIMIT_REDIS_URL = env_redis_url("HARLI_RATE_LIMIT_REDIS_URL")
# How often the gateway writes its aggregated usage (`api.usage_recorder`) to the database.
HARLI_USAGE_FLUSH_INTERVAL_S = env_int("HARLI_USAGE_FLUSH_INTERVAL_S", 10)

# Fleet-wide per-tenant quotas on fine-tuning (`api.quotas`); an operator overrides them per
# tenant (`manage.py tenants quotas`, PATCH /api/ops/tenants/<name>, the console).
HARLI_QUOTA_RUNNING_JOBS = env_int("HARLI_QUOTA_RUNNING_JOBS", 16, minimum=0)
HARLI_QUOTA_QUEUED_JOBS = env_int("HARLI_QUOTA_QUEUED_JOBS", 1000, minimum=0)
HARLI_QUOTA_STORED_BYTES = env_int("HARLI_QUOTA_STORED_BYTES", 100 * 1024**3, minimum=0)
HARLI_QUOTA_TRAINED_TOKENS_PER_MONTH = env_int(
    "HARLI_QUOTA_TRAINED_TOKENS_PER_MONTH", 100_000_000_000, minimum=0
)

# The console's login throttle (`api.login_throttle`): this many failed sign-ins for one
# username from one client address, or from one address, within the window lock that pair or
# that address out for the lockout period.
HARLI_LOGIN_MAX_FAILURES_PER_USER = env_int("HARLI_LOGIN_MAX_FAILURES_PER_USER", 5, minimum=1)
HARLI_LOGIN_MAX_FAILURES_PER_IP = env_int("HARLI_LOGIN_MAX_FAILURES_PER_IP", 20, minimum=1)
HARLI_LOGIN_WINDOW_S = env_int("HARLI_LOGIN_WINDOW_S", 900, minimum=1)
HARLI_LOGIN_LOCKOUT_S = env_int("HARLI_LOGIN_LOCKOUT_S", 900, minimum=1)
# The slower limit on one username from any addresses (a guesser spread over many addresses):
# this many failures within the global window lock the username everywhere for the lockout.
HARLI_LOGIN_MAX_FAILURES_PER_USER_GLOBAL = env_int(
    "HARLI_LOGIN_MAX_FAILURES_PER_USER_GLOBAL", 100, minimum=1
)
HARLI_LOGIN_GLOBAL_WINDOW_S = env_int("HARLI_LOGIN_GLOBAL_WINDOW_S", 3600, minimum=1)
# How many reverse proxies in front of the web process append to X-Forwarded-For: 0 (the
# default) trusts only REMOTE_ADDR; n takes the client address n entries from the header's end.
HARLI_TRUSTED_PROXY_HOPS = env_int("HARLI_TRUSTED_PROXY_HOPS", 0, minimum=0)

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "api.authentication.ApiKeyAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["api.permissions.IsOperator"],
    "DEFAULT_RENDERER_CLASSES": [
        "rest_framework.renderers.JSONRenderer",
        "rest_framework.renderers.BrowsableAPIRenderer",
    ],
    "DEFAULT_PARSER_CLASSES": [
        "api.parsers.JsonParser",
        "api.parsers.FormParser",
        "api.parsers.MultiPartParser",
    ],
    "DEFAULT_SCHEMA_CLASS": "api.schema.HarliAutoSchema",
    "EXCEPTION_HANDLER": "api.errors.exception_handler",
}

SPECTACULAR_SETTINGS = {
    "TITLE": "Harli control plane API",
    "DESCRIPTION": (
        "Tenant API at /v1 (OpenAI fine-tuning shape, bearer API key) and operator API at "
        "/api/ops/ (operator role: session or an operator's API key)."
    ),
    "VERSION": "0.1.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "COMPONENT_SPLIT_REQUEST": True,
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "api.schema.closed_request_bodies",
    ],
}

# Prometheus `/metrics` (api/metrics.py): the bearer token a scrape must carry; without one the
# route is off (404) unless METRICS_OPEN (local settings). With several web workers,
# PROMETHEUS_MULTIPROC_DIR (read by prometheus-client itself as well) is where each writes.
METRICS_TOKEN = env_str("HARLI_METRICS_TOKEN", "")
METRICS_OPEN = False
PROMETHEUS_MULTIPROC_DIR = env_str("PROMETHEUS_MULTIPROC_DIR", "")
# A Celery worker's metrics exporter (workers/metrics.py): its port (0: none) and address.
WORKER_METRICS_PORT = env_int("HARLI_WORKER_METRICS_PORT", 0, minimum=0)
WORKER_METRICS_HOST = env_str("HARLI_WORKER_METRICS_HOST", "127.0.0.1")
