#!/usr/bin/env bash
# The whole test suite: set-up, services, lint, types, the import layer rules (`lint-imports`,
# the contracts in pyproject.toml), the dependency audit (scripts/audit.py: pip-audit on the
# lock; one visible SKIPPED line where no vulnerability database answers), then pytest twice:
# every test on PostgreSQL, and the tests that use the database (tests/api, cli, workers,
# console, e2e; the list is DATABASE_TEST_DIRS in tests/conftest.py) again on SQLite, the
# embedded default.
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
echo "== pytest on PostgreSQL (every test)"; HARLI_TEST_DB=postgres pytest "$@"
echo "== pytest on SQLite (the tests that use the database)"
# Exit status 5: none of the tests named in "$@" uses the database; nothing to run again.
HARLI_TEST_DB=sqlite pytest "$@" || [ $? -eq 5 ]
