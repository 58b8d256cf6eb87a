#!/bin/bash
# Profile the latency predictor's data in the co-location deployment's engine mode, on the GPU.
#
# usage: OUTDIR=DIR [GIT_COMMIT=sha] bash predictor_models/profile_deployment.sh [END_S] [TAG]
#   from the repository root; END_S (default 318): seconds by which all has ended.
#   PROFILE_EXTRA: more profile flags, last wins (CPU dry run: "--device cpu --model tiny").
#
# The engine as bench.colocate and the host agent run it: mixed-step CUDA graphs, 512-token
# steps, block 16, decode buckets 1..64 incl. 24/48, green-context decode splits 48/64/96 + the
# whole device. Llama-3-8B stage 1 (half the steps carry prompt chunks of 16..512-B tokens, some
# after a cached prefix, some two chunks) and stage 2 (LoraTrainer quanta, 5 decode
# configurations per warmed quantum); then Qwen2.5-7B stages 1+2 in the time left. Writes
# profile-h200-<model>-<TAG>.csv + .meta.json per model (rows written as they are measured) and
# summary.json (rows, errors, median ms per stage / kind / token bucket). Next: copy the files to
# predictor_models/data/ as profile-h200-<model>-engine-<sha>-<TAG>.csv (+ .meta.json) and run
# python -m bench.predictor --data on each (README: "Re-running after an engine change").
set -u
T0=$(date +%s)
END=${1:-318}
TAG=${2:-mixed}
COMMON="--decode-source engine --finetune trainer --mixed-graphs --decode-groups 6,8,12
 --max-num-seqs 64 --max-batched-tokens 512 --graph-batch-sizes 1,2,4,8,16,24,32,48,64
 --max-model-len 2048 --context-max 2048 --chunk-share 0.5 --chunk-min 16 --prefix-share 0.3
 --two-chunk-share 0.2 --stage2-chunk-share 0 --decode-per-quantum 5 --max-kv-tokens 160000
 --iters 12 --commit ${GIT_COMMIT:-unknown} --out $OUTDIR"
EXTRA=${PROFILE_EXTRA:-}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>/dev/null || true
# Llama gets 55% of the budget (95 + 75 s of sampling at END=318), Qwen what is left.
S1=$(( (END - 148) * 95 / 170 )); S2=$(( (END - 148) * 75 / 170 ))
[ "$S1" -lt 5 ] && S1=5; [ "$S2" -lt 5 ] && S2=5
echo "=== llama3-8b $(date +%T): stage budgets ${S1}/${S2}s"
# shellcheck disable=SC2086
timeout $((END - 10)) python3 -m predictor_models.profile --model llama3-8b $COMMON \
  --stages 12 --stage1-s "$S1" --stage2-s "$S2" --seed 31 --tag "$TAG" $EXTRA
echo "llama rc=$? at $(( $(date +%s) - T0 ))s"
LEFT=$(( END - ($(date +%s) - T0) ))
if [ "$LEFT" -gt 90 ]; then
  S1=$(( (LEFT - 50) * 55 / 100 )); S2=$(( (LEFT - 50) * 45 / 100 ))
  echo "=== qwen2.5-7b $(date +%T): left ${LEFT}s, stage budgets ${S1}/${S2}s"
  # shellcheck disable=SC2086
  timeout $((LEFT - 3)) python3 -m predictor_models.profile --model qwen2.5-7b $COMMON \
    --stages 12 --stage1-s "$S1" --stage2-s "$S2" --seed 41 --tag "$TAG" $EXTRA
  echo "qwen rc=$? at $(( $(date +%s) - T0 ))s"
else
  echo "=== qwen2.5-7b skipped: ${LEFT}s left"
fi
python3 - "$OUTDIR" <<'EOF'
import csv, json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
summary = {}
for path in sorted(out.glob("profile-*.csv")):
    rows = list(csv.DictReader(path.open()))
    meta = json.loads(path.with_suffix(".meta.json").read_text())
    table: dict = {}
    for r in rows:
        chunk = float(r["prefill_chunk_tokens"]) > 0
        key = (r["stage"], "chunk" if chunk else "decode", r["padded_tokens"] if chunk else "-")
        table.setdefault(key, []).append(float(r["latency_ms"]))
    summary[path.name] = {
        "rows": len(rows), "errors": meta.get("errors"), "profile_s": meta.get("profile_s"),
        "groups": {"/".join(k): [len(v), round(statistics.median(v), 2)]
                   for k, v in sorted(table.items())},
    }
(out / "summary.json").write_text(json.dumps(summary, indent=1))
for name, s in summary.items():
    print(f"{name}: {s['rows']} rows in {s['profile_s']} s, errors {len(s['errors'] or [])}")
    for e in (s["errors"] or [])[:5]:
        print("  ERROR", e)
    print("  stage/kind/token bucket: [rows, median ms]")
    for k, v in s["groups"].items():
        print(f"  {k:24s} {v}")
EOF
echo "total $(( $(date +%s) - T0 ))s"
