"""Fixtures for the messaging tests: those of the services' tests (a fleet of hosts, a queued
job, empty host queues), read back through the same in-memory broker."""

from tests.api.services.conftest import (  # noqa: F401 (fixtures)
    deployment,
    empty_host_queues,
    job,
    storage_dir,
    tenant,
    tiny,
)
