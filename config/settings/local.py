"""One machine, no services: SQLite and a local Celery transport unless configured."""

from config.env import env_bool, env_str, local_secret
from config.settings.base import *  # noqa: F403
from config.settings.base import CELERY_BROKER_CONFIGURED, DATA_DIR, GATEWAY_SECRET

DEBUG = env_bool("DJANGO_DEBUG", True)
SECRET_KEY = env_str("DJANGO_SECRET_KEY", "harli-local-development-only")
DATA_DIR.mkdir(parents=True, exist_ok=True)
# Without HARLI_GATEWAY_SECRET, a random one kept under var/ (readable by this user only).
GATEWAY_SECRET = GATEWAY_SECRET or local_secret(DATA_DIR / "gateway-secret")

# No broker configured: the in-memory transport reaches no separate worker process, so tasks run
# inline in the caller. With CELERY_BROKER_URL set, tasks go to the broker as in production.
CELERY_TASK_ALWAYS_EAGER = not CELERY_BROKER_CONFIGURED

# The embedded platform listens on loopback: /metrics answers without a token unless
# HARLI_METRICS_TOKEN sets one.
METRICS_OPEN = True
