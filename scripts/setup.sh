#!/usr/bin/env bash
# Idempotent set-up for a fresh Debian/Ubuntu machine with Python 3.11:
# the virtual environment at .venv/, Python packages from requirements.lock,
# the console's browser assets (npm), and, with --browser, Debian's Chromium.
set -euo pipefail
cd "$(dirname "$0")/.."

want_browser=0
for arg in "$@"; do
  case "$arg" in
    --browser) want_browser=1 ;;
    *) echo "setup.sh: unknown option $arg" >&2; exit 2 ;;
  esac
done

apt_install() {
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@"
  else
    sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@"
  fi
}

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if ! "$PY" -c 'import sys; assert sys.version_info[:2] == (3, 11)' 2>/dev/null; then
  echo "setup.sh: Python 3.11 is required (found $("$PY" --version 2>&1))" >&2
  exit 1
fi
if ! "$PY" -c 'import venv, ensurepip' 2>/dev/null; then
  apt_install python3.11-venv
fi

if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.requirements.sha
want=$(sha256sum requirements.lock | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -r requirements.lock
  echo "$want" > "$stamp"
fi

if [ -f frontend/package.json ]; then
  command -v npm >/dev/null || apt_install nodejs npm
  fstamp=frontend/node_modules/.lock.sha
  fwant=$(sha256sum frontend/package-lock.json | cut -d' ' -f1)
  if [ "$(cat "$fstamp" 2>/dev/null)" != "$fwant" ]; then
    (cd frontend && npm ci --no-audit --no-fund --loglevel=error)
    echo "$fwant" > "$fstamp"
  fi
  (cd frontend && npm run --silent build)
fi

if [ "$want_browser" = 1 ] && [ ! -x /usr/bin/chromium ]; then
  apt_install chromium
fi
