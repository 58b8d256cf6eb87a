"""The test suite: real PostgreSQL, fast password hashing."""

import os

import dj_database_url

from config.env import env_str
from config.settings.base import *  # noqa: F403

SECRET_KEY = "harli-test-only"
DATABASES = {
    "default": dj_database_url.parse(
        env_str("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test"), conn_max_age=0
    )
}
# One test database per pytest process, so concurrent runs on one server do not collide.
DATABASES["default"]["TEST"] = {"NAME": env_str("HARLI_TEST_DATABASE", f"test_harli_{os.getpid()}")}
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]

# WhiteNoise warns when the collected-static directory is missing; tests never collect static.
WHITENOISE_AUTOREFRESH = True
