#!/usr/bin/env bash
# The whole test suite: set-up, services, lint, types, the import layer rules (`lint-imports`,
# the contracts in pyproject.toml), the dependency audit (scripts/audit.py: pip-audit on the
# lock; one visible SKIPPED line where no vulnerability database answers), then pytest twice:
# every test on PostgreSQL, and the tests that use the database (tests/api, cli, workers,
# console, e2e; the list is DATABASE_TEST_DIRS in tests/conftest.py) again on SQLite, the
# embedded default. The vLLM reference tier (tests/reference) runs against vLLM's server where
# scripts/vllm_env.sh could set up .venv-vllm: HARLI_TEST_VLLM=auto (default: set it up within
# HARLI_TEST_VLLM_SETUP_S seconds, default 900, when the disk has room), 1 (set-up required: its
# failure fails the run), 0 (skip). One "== vLLM reference tier:" line says which and why.
# Extra arguments go to both pytest runs (e.g. scripts/test.sh tests/api -k files).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --browser
bash scripts/services.sh
. .venv/bin/activate
echo "== ruff"; ruff check .
echo "== mypy"; mypy .
echo "== import layers and cycles"; lint-imports
echo "== dependency audit"; python scripts/audit.py
. scripts/vllm_tier.sh
echo "== pytest on PostgreSQL (every test)"; HARLI_TEST_DB=postgres pytest --durations=20 "$@"
echo "== pytest on SQLite (the tests that use the database)"
# Exit status 5: none of the tests named in "$@" uses the database; nothing to run again.
HARLI_TEST_DB=sqlite pytest "$@" || [ $? -eq 5 ]
