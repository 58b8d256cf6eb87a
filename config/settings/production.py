"""Production: every secret from the environment, PostgreSQL and a real broker required."""

from config.env import EnvError, env_str
from config.settings.base import *  # noqa: F403
from config.settings.base import (
    CELERY_BROKER_CONFIGURED,
    DATABASE_URL,
    GATEWAY_SECRET,
    SECRET_KEY,
)

if not SECRET_KEY:
    raise EnvError("DJANGO_SECRET_KEY must be set in production")
if not DATABASE_URL:
    raise EnvError("DATABASE_URL must be set in production")
if not GATEWAY_SECRET:
    raise EnvError("HARLI_GATEWAY_SECRET must be set in production (hosts' grant keys)")
if not CELERY_BROKER_CONFIGURED:
    raise EnvError("CELERY_BROKER_URL must be set in production")

SESSION_COOKIE_SECURE = True
CSRF_COOKIE_SECURE = True
SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
_ = env_str
