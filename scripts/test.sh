#!/usr/bin/env bash
# The whole test suite: set-up, services, lint, types, tests.
# Extra arguments go to pytest (e.g. scripts/test.sh tests/api -k files).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --browser
bash scripts/services.sh
. .venv/bin/activate
echo "== ruff"; ruff check .
echo "== mypy"; mypy .
echo "== pytest"; pytest "$@"
