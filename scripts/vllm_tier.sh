# Sourced by scripts/test.sh: decides whether the vLLM reference tier (tests/reference) runs,
# sets it up when it does, prints one "== vLLM reference tier:" line, and exports
# HARLI_TEST_VLLM_SKIP (the reason, empty when the tier runs) for the tier's pytest skips.
# HARLI_TEST_VLLM: auto (default) | 1 (required) | 0 (off). HARLI_TEST_VLLM_SETUP_S bounds the
# set-up (default 900 s; a set-up already done costs nothing); auto also wants 8 GiB free disk
# (the environment takes about 3.5 GiB).
vllm_mode=${HARLI_TEST_VLLM:-auto}
vllm_budget=${HARLI_TEST_VLLM_SETUP_S:-900}
vllm_venv=${HARLI_VLLM_VENV:-.venv-vllm}
HARLI_TEST_VLLM_SKIP=
case "$vllm_mode" in
  0) HARLI_TEST_VLLM_SKIP="HARLI_TEST_VLLM=0" ;;
  1|auto)
    free_kib=$(df -Pk . | awk 'NR==2 {print $4}')
    if [ "$vllm_mode" = auto ] && [ ! -x "$vllm_venv/bin/python" ] && [ "$free_kib" -lt $((8 * 1024 * 1024)) ]; then
      HARLI_TEST_VLLM_SKIP="only $((free_kib / 1024 / 1024)) GiB free disk, 8 GiB wanted (HARLI_TEST_VLLM=1 forces it)"
    else
      vllm_start=$(date +%s)
      if timeout "$vllm_budget" bash scripts/vllm_env.sh "$vllm_venv" >"${TMPDIR:-/tmp}/vllm_env.log" 2>&1; then
        vllm_took=$(( $(date +%s) - vllm_start ))
      else
        vllm_rc=$?
        tail -5 "${TMPDIR:-/tmp}/vllm_env.log" >&2
        if [ "$vllm_mode" = 1 ]; then
          echo "== vLLM reference tier: set-up failed (exit $vllm_rc) and HARLI_TEST_VLLM=1" >&2
          exit 1
        fi
        HARLI_TEST_VLLM_SKIP="set-up failed or passed ${vllm_budget} s (exit $vllm_rc; log ${TMPDIR:-/tmp}/vllm_env.log)"
      fi
    fi ;;
  *) echo "HARLI_TEST_VLLM must be auto, 1 or 0 (got '$vllm_mode')" >&2; exit 2 ;;
esac
if [ -n "$HARLI_TEST_VLLM_SKIP" ]; then
  echo "== vLLM reference tier: skipped ($HARLI_TEST_VLLM_SKIP)"
else
  echo "== vLLM reference tier: on ($vllm_venv, set-up ${vllm_took} s)"
fi
export HARLI_TEST_VLLM_SKIP HARLI_VLLM_VENV="$vllm_venv"
