#!/usr/bin/env bash
# Train the family checkpoints of training/train.py on a GPU machine (Python with PyTorch + CUDA and transformers
# already installed; no network, no Rust needed) and write checkpoints + logs to $OUT.
#
#   copy the repository to the machine (training/ is all it needs, models/ for INIT=1), then:   bash training/gpu_run.sh
#
# Each family trains for a wall-time budget (train.py --minutes: the cosine schedule follows the clock, so a run
# ends on time with a decayed learning rate; STEPS is only an upper bound). The defaults (2 + 2 + 4 minutes, plus
# about a minute of evaluation) train the three default families in under 10 minutes; for longer runs raise the
# minutes, or call it once per family, e.g.  FAMILIES=tiny MIN_TINY=8 bash training/gpu_run.sh
#   OUT           output folder (default ./gpu_out); one sub-folder per model, each a complete HF checkpoint
#                 with README.md (model card), train.log, training_log.json (not train_state.pt: too big to
#                 bring back; it stays in WORK_DIR, default /tmp/mbd_gpu_train, for RESUME=1 on the same machine)
#   FAMILIES      which to train, in order (default "dream fast_dllm_v2 tiny"; "qwen35": the Qwen3.5 hybrid twin,
#                 FAMILIES=qwen35 bash training/gpu_run.sh, MIN_QWEN35 default 7; "idlm": the I-DLM twin,
#                 MIN_IDLM default 3, INIT=1 continues models/mbd-idlm-tiny)
#   MIN_DREAM / MIN_FDV2 / MIN_TINY (minutes), STEPS, BATCH (256), LR (default: each family's), SEED,
#   WORKERS (8 batch-building processes), EVAL_PER_TASK
#   RESUME=1      continue from $OUT/<name>/train_state.pt
#   INIT=1        start each twin from its committed checkpoint (models/<name>: train.py --init, a warm restart
#                 whose card lists the earlier stages); the tiny family from python/mbd_rs/models/mbd-tiny
# The device is picked by train.py (cuda when torch sees one); nothing here downloads anything.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_out}"
FAMILIES="${FAMILIES:-dream fast_dllm_v2 tiny}"
BATCH="${BATCH:-256}"
STEPS="${STEPS:-200000}"
WORKERS="${WORKERS:-8}"
LR="${LR:-}"   # empty: each family's own (train.py FAMILIES: tiny 2e-3, the twins 5e-4)
SEED="${SEED:-0}"
EVAL_PER_TASK="${EVAL_PER_TASK:-40}"
PY="${PYTHON:-python3}"
WORK_DIR="${WORK_DIR:-/tmp/mbd_gpu_train}"
mkdir -p "$OUT" "$WORK_DIR"
{
  echo "# gpu_run.sh $(date -u +%FT%TZ)"
  "$PY" - <<'EOF'
import torch, transformers, sys
print("python", sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__)
print("cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
EOF
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || true
} | tee "$OUT/env.txt"

for fam in $FAMILIES; do
  case "$fam" in
    tiny)         name=mbd-tiny;       min="${MIN_TINY:-4}" ;;
    dream)        name=mbd-dream-tiny; min="${MIN_DREAM:-2}" ;;
    fast_dllm_v2) name=mbd-fdv2-tiny;  min="${MIN_FDV2:-2}" ;;
    qwen35)       name=mbd-qwen35-tiny; min="${MIN_QWEN35:-7}" ;;
    idlm)         name=mbd-idlm-tiny;  min="${MIN_IDLM:-3}" ;;
    *) echo "unknown family $fam" >&2; exit 2 ;;
  esac
  extra=()
  if [ "${RESUME:-0}" = 1 ]; then extra+=(--resume); fi
  if [ -n "$LR" ]; then extra+=(--lr "$LR"); fi
  if [ "${INIT:-0}" = 1 ]; then
    if [ "$fam" = tiny ]; then extra+=(--init python/mbd_rs/models/mbd-tiny); else extra+=(--init "models/$name"); fi
  fi
  echo "== $fam -> $OUT/$name ($min min, batch $BATCH)"
  "$PY" training/train.py --family "$fam" --out "$WORK_DIR/$name" --minutes "$min" --steps "$STEPS" --batch "$BATCH" \
    --seed "$SEED" --threads 4 --workers "$WORKERS" --save-every 2000 --save-minutes 3 \
    --eval-per-task "$EVAL_PER_TASK" --log-every 100 \
    ${extra[@]+"${extra[@]}"} 2>&1 | grep -v -E "Writing model shards|Warning" | tee "$OUT/$name.stdout.log"
  "$PY" training/train.py --check "$WORK_DIR/$name" --eval-per-task 5 --threads 4 2>&1 \
    | grep -v -E "Loading weights|Warning" | tee "$OUT/$name.check.log"
  mkdir -p "$OUT/$name"
  find "$WORK_DIR/$name" -maxdepth 1 -type f ! -name 'train_state.pt*' -exec cp {} "$OUT/$name/" \;
done
echo "all done: $OUT"
