#!/usr/bin/env bash
# Train the three family checkpoints of training/train.py on a CPU, one after the other, one thread each, each
# within a wall-time budget (train.py --minutes: the cosine schedule follows the clock and the run ends on time).
#
#   nohup bash training/cpu_run.sh > /work/trained/cpu_run.log 2>&1 &
#
# Knobs: OUT (default /work/trained, outside the repository), PYTHON (default /tmp/devenv/bin/python),
# MIN_DREAM / MIN_FDV2 / MIN_TINY (minutes of training each; defaults 20 / 25 / 55, about 110 minutes in all with
# the evaluations), MIN_IDLM (70; FAMILIES=idlm trains the I-DLM twin), THREADS (default 1), FAMILIES (default
# "dream fast_dllm_v2 tiny": the small twins first),
# RESUME=1 (continue each model from OUT/<name>/train_state.pt: the wall-time schedule goes on where it stopped;
# a model whose budget is used up only gets its final evaluation and check).
# Each model gets OUT/<name>/ (HF checkpoint, README.md card, train.log, training_log.json, train_state.pt),
# checkpointed every 10 minutes so partial progress is usable, then `train.py --check` (transformers load +
# reference decode) into OUT/<name>.check.log.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT="${OUT:-/work/trained}"
PY="${PYTHON:-/tmp/devenv/bin/python}"
THREADS="${THREADS:-1}"
FAMILIES="${FAMILIES:-dream fast_dllm_v2 tiny}"
mkdir -p "$OUT"
echo "# cpu_run.sh start $(date -u +%FT%TZ)"
for fam in $FAMILIES; do
  case "$fam" in
    tiny)         name=mbd-tiny-v2;    min="${MIN_TINY:-55}" ;;
    dream)        name=mbd-dream-tiny; min="${MIN_DREAM:-20}" ;;
    fast_dllm_v2) name=mbd-fdv2-tiny;  min="${MIN_FDV2:-25}" ;;
    idlm)         name=mbd-idlm-tiny;  min="${MIN_IDLM:-70}" ;;
    *) echo "unknown family $fam" >&2; exit 2 ;;
  esac
  extra=()
  if [ "${RESUME:-0}" = 1 ]; then extra+=(--resume); fi
  echo "== $fam -> $OUT/$name ($min min) $(date -u +%T)"
  "$PY" training/train.py --family "$fam" --out "$OUT/$name" --steps 100000 --minutes "$min" --threads "$THREADS" \
    --save-every 500 --save-minutes 10 --eval-per-task 20 --log-every 25 ${extra[@]+"${extra[@]}"} 2>&1 \
    | grep -v -E "Writing model shards|Warning"
  "$PY" training/train.py --check "$OUT/$name" --eval-per-task 5 --threads "$THREADS" 2>&1 \
    | grep -v -E "Loading weights|Warning" > "$OUT/$name.check.log"
  echo "== $fam done $(date -u +%T)"
done
echo "# cpu_run.sh end $(date -u +%FT%TZ)"
