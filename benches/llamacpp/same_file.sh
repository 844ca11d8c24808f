#!/usr/bin/env bash
# GGUF files that both engines load: the f32 checkpoint written as GGUF by scripts/write_gguf.py (its byte-level
# BPE vocabulary is one mbd-rs reads, unlike convert.sh's SentencePiece stand-in), then llama-quantize's Q8_0,
# Q4_K_M and Q6_K of it. benches/llamacpp/quant_compare.py --same-file --gguf-dir OUT runs mbd-rs on these very files.
#
#   benches/llamacpp/same_file.sh /tmp/mbd-bench/qwen2.5-0.5b-shape /tmp/llamacpp/ours
#
# Needs benches/llamacpp/build.sh first (llama-quantize; same LLAMACPP_WORK) and a Python with mbd-rs's test
# dependencies (numpy, safetensors, gguf: PYTHON, default .venv/bin/python). ~40 s on 2 cores, 3.3 GB.
set -euo pipefail
SRC=${1:?usage: same_file.sh SRC_F32_HF_DIR OUT_DIR}
OUT=${2:?usage: same_file.sh SRC_F32_HF_DIR OUT_DIR}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
WORK=${LLAMACPP_WORK:-/tmp/llamacpp}
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
QUANTIZE=$WORK/build/bin/llama-quantize
[ -x "$QUANTIZE" ] || { echo "no $QUANTIZE: run benches/llamacpp/build.sh" >&2; exit 1; }
mkdir -p "$OUT"
"$PYTHON" "$ROOT/scripts/write_gguf.py" "$SRC" "$OUT/model-f32.gguf" --type f32
for t in ${TYPES:-Q8_0 Q4_K_M Q5_K_M Q6_K}; do
    lower=$(echo "$t" | tr 'A-Z' 'a-z')
    "$QUANTIZE" "$OUT/model-f32.gguf" "$OUT/model-$lower.gguf" "$t" "${QTHREADS:-2}" > "$OUT/quantize-$t.log" 2>&1
    echo "$OUT/model-$lower.gguf: $(grep -o 'quant size *= *[0-9.]* MiB.*' "$OUT/quantize-$t.log")"
done
