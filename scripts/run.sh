#!/usr/bin/env bash
# Install and run the whole platform on this machine: web (control plane, console and the
# inference gateway, under uvicorn), a Celery worker, Celery beat and one local host agent,
# supervised by scripts/supervise.py (a process that dies is restarted after a short backoff and
# the restart logged; one that keeps dying stops the platform). With DATABASE_URL and
# CELERY_BROKER_URL unset it needs no service: SQLite under var/ and Celery's filesystem transport
# under var/broker (a broker made of files, which works across processes; `memory://` would not).
# Seeds a demo tenant, key, the `tiny` model, a deployment and an operator, registers the local
# host, prints how to reach them and a ready-to-paste openai snippet. Logs are appended to
# var/log/NAME.log. Ctrl-C (or SIGTERM) stops every process.
#
# It chooses the local settings (config.settings.local: DEBUG on, a development secret key);
# everything else (manage.py, uvicorn, celery) defaults to config.settings.production, which
# refuses to start without its environment (README, "Production guide").
#
# The agent runs the tiny built-in model on the CPU unless HARLI_MODEL_DIR names a HF model
# directory (then HARLI_DEVICE defaults to cuda when a GPU is present, and the base model is
# registered as HARLI_BASE_MODEL, default: the directory's name).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export DJANGO_SETTINGS_MODULE=config.settings.local
echo "Settings: config.settings.local (DEBUG on, a development secret key): one machine, not for production."
if [ -z "${CELERY_BROKER_URL:-}" ]; then
  export CELERY_BROKER_URL=filesystem://
  export HARLI_BROKER_DIR=${HARLI_BROKER_DIR:-var/broker}
fi
bind=${HARLI_BIND:-127.0.0.1:8000}
host=${bind%:*}
case "$host" in 0.0.0.0|"") host=127.0.0.1 ;; esac
url="http://${host}:${bind##*:}"
agent_name=${HARLI_AGENT_NAME:-local}
agent_listen=${HARLI_AGENT_LISTEN:-127.0.0.1:8100}

python manage.py migrate --no-input -v 0
mkdir -p var/log
# The seed's output holds the operator's password: readable by this user only.
(umask 077; python manage.py seed_demo --url "$url" > var/log/seed.txt)
chmod 600 var/log/seed.txt
cat var/log/seed.txt
key=$(awk '/demo tenant API key:/{print $NF}' var/log/seed.txt)

base_model=tiny
deployment=tiny-chat
agent_args=()
gpu_kind=cpu
gpu_gb=16
if [ -n "${HARLI_MODEL_DIR:-}" ]; then
  base_model=${HARLI_BASE_MODEL:-$(basename "$HARLI_MODEL_DIR")}
  deployment="${base_model}-chat"
  device=${HARLI_DEVICE:-$(command -v nvidia-smi >/dev/null && echo cuda || echo cpu)}
  agent_args+=(--model-dir "$HARLI_MODEL_DIR" --device "$device" --tpot-slo-ms 50 --ttft-slo-ms 1000)
  if [ "$device" != cpu ]; then
    gpu_kind=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n1 | tr ' ' '-')
    gpu_gb=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n1)
    gpu_gb=$((gpu_gb / 1024))
  fi
  python manage.py basemodels list | awk 'NR>1{print $1}' | grep -qx "$base_model" \
    || python manage.py basemodels register "$base_model" --checkpoint "$HARLI_MODEL_DIR"
  python manage.py deployments list | awk 'NR>1{print $1}' | grep -qx "$deployment" \
    || python manage.py deployments create "$deployment" --base-model "$base_model" \
         --tpot-slo-ms 50 --ttft-slo-ms 1000
fi
python manage.py hosts list | awk 'NR>1{print $1}' | grep -qx "$agent_name" \
  || python manage.py hosts register "$agent_name" --gpu-kind "$gpu_kind" \
       --gpu-memory-gb "$gpu_gb" --deployment "$deployment"

# web: the ASGI app (config/asgi.py), Django and the gateway's streaming inference routes, under
# uvicorn as in production (deploy/systemd/harli-web.service). The agent accepts only requests
# the gateway signed with the host's key. The committed latency predictors
# (predictor_models/artifacts/<gpu>/<model>/): an H200 serving llama3-8b loads one and reports
# its estimate; other hosts run without one. On Ctrl-C each process gets 30 s to stop (the agent
# took over 10 s on a loaded machine) before SIGKILL.
agent_log_start=$(stat -c %s var/log/agent.log 2>/dev/null || echo 0)
HARLI_HOST_KEY=$(python manage.py hosts key "$agent_name") \
python scripts/supervise.py --log-dir var/log --stop-timeout-s 30 \
  --proc web uvicorn config.asgi:application --host "${bind%:*}" --port "${bind##*:}" \
    --lifespan on --no-access-log \
  --proc worker celery -A config worker --pool solo -Q control \
    --hostname "harli-worker@%h" --without-gossip --without-mingle --without-heartbeat -l WARNING \
  --proc beat celery -A config beat -l WARNING --schedule var/celerybeat-schedule \
  --proc agent python -m gpu_runtime.agent --host "$agent_name" --base-model "$base_model" \
    --control-url "$url" --listen "$agent_listen" \
    --predictor "${HARLI_PREDICTOR:-predictor_models/artifacts}" "${agent_args[@]}" &
supervisor=$!
stopping=0
stop_all() {
  trap - INT TERM EXIT
  stopping=1
  if kill -0 "$supervisor" 2>/dev/null; then
    echo; echo "Stopping Harli..."
    kill -TERM "$supervisor" 2>/dev/null || true
    wait "$supervisor" 2>/dev/null || true
  fi
}
trap stop_all INT TERM EXIT

echo "Starting web, worker, beat and the host agent (logs appended to var/log/)..."
for _ in $(seq 1 600); do
  # Only this run's part of the agent's log: an earlier run's "ready:" must not count.
  tail -c +$((agent_log_start + 1)) var/log/agent.log 2>/dev/null | grep -q "ready:" && break
  if ! kill -0 "$supervisor" 2>/dev/null; then
    echo "Harli stopped before the agent was ready (the supervisor exited); see var/log/" >&2
    tail -n 20 var/log/{web,worker,beat,agent}.log >&2
    exit 1
  fi
  sleep 0.5
done
cat <<TXT

Harli is running (logs in var/log/; Ctrl-C stops everything):
  control plane, console and inference: $url/v1   (console: $url/console/)
  host agent $agent_name serving $base_model behind the gateway: http://$agent_listen
  broker:                               $CELERY_BROKER_URL ${HARLI_BROKER_DIR:-}

Fine-tune the $base_model model and chat with the result, all through one base URL (paste it
into a shell; it runs with the platform's Python, which has the openai package):

$PWD/.venv/bin/python - <<'PY'
import time
from openai import OpenAI
client = OpenAI(base_url="$url/v1", api_key="$key")
f = client.files.create(file=open("$PWD/var/demo/train.jsonl", "rb"), purpose="fine-tune")
job = client.fine_tuning.jobs.create(model="$base_model", training_file=f.id, suffix="demo")
while job.status not in ("succeeded", "failed", "cancelled"):
    time.sleep(2)
    job = client.fine_tuning.jobs.retrieve(job.id)
    print(job.status, flush=True)
assert job.status == "succeeded", job.error
print("fine-tuned model:", job.fine_tuned_model)
stream = client.chat.completions.create(
    model=job.fine_tuned_model, messages=[{"role": "user", "content": "Say hi"}],
    max_tokens=16, stream=True,
)
for chunk in stream:  # server-sent events, token by token
    print(chunk.choices[0].delta.content or "" if chunk.choices else "", end="", flush=True)
print()
PY
TXT
status=0
wait "$supervisor" || status=$?
if [ "$stopping" = 0 ] && [ "$status" != 0 ]; then
  echo "Harli stopped: a process kept exiting (the supervisor's status $status); see var/log/" >&2
  exit 1
fi
