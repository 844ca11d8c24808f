#!/usr/bin/env bash
# Convert an HF checkpoint to the GGUF files benches/llamacpp/quant_compare.py runs llama.cpp on:
#   OUT_DIR/model-f32.gguf, model-bf16.gguf, model-f16.gguf   (vendored convert_hf_to_gguf.py)
#   OUT_DIR/model-q8_0.gguf, model-q4_k_m.gguf                (llama-quantize from the f32 GGUF)
#
#   benches/llamacpp/convert.sh /tmp/mbd-bench/qwen2.5-0.5b-shape-bf16 /tmp/llamacpp/gguf
#
# Needs benches/llamacpp/build.sh first (same LLAMACPP_WORK). PYTHON (default /tmp/devenv/bin/python) must have
# torch + transformers; numpy, pyyaml, tqdm, requests and sentencepiece are pip-installed into it when missing.
# TYPES="f32 bf16 f16 q8_0 q4_k_m" picks the outputs; files that exist are kept (FORCE=1 redoes them).
#
# The tokenizer: the random bench checkpoints carry a 316-token test BPE tokenizer.json, and convert_hf_to_gguf
# refuses any BPE tokenizer whose pre-tokenizer hash it does not know ("BPE pre-tokenizer was not recognized").
# The fix lives in a copy of the model directory, OUT_DIR/hf-src: config.json and model.safetensors are symlinks to
# the source, tokenizer.json is left out, and a tiny SentencePiece model takes its place (tokenizer.model: the
# characters of one sentence plus the 256 byte tokens, trained here, deterministic), with a tokenizer_config.json
# that names the special tokens config.json points at (<|endoftext|> = bos/eos 151643, <|mask|> = 151665). The
# converter then takes its SentencePiece path (no hash check) and pads the vocabulary to config.json's vocab_size
# with [PAD] tokens. The weights, and so the timings, are untouched: the benchmark feeds token ids, never text.
set -euo pipefail

SRC=${1:?usage: convert.sh SRC_HF_DIR OUT_DIR}
OUT=${2:?usage: convert.sh SRC_HF_DIR OUT_DIR}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
WORK=${LLAMACPP_WORK:-/tmp/llamacpp}
PYTHON=${PYTHON:-/tmp/devenv/bin/python}
TYPES=${TYPES:-f32 bf16 f16 q8_0 q4_k_m}
QTHREADS=${QTHREADS:-2}
LLAMA=$WORK/src/llama_cpp_python-$VERSION/vendor/llama.cpp
QUANTIZE=$WORK/build/bin/llama-quantize
if [ ! -f "$LLAMA/convert_hf_to_gguf.py" ]; then
    echo "no $LLAMA/convert_hf_to_gguf.py: run benches/llamacpp/build.sh" >&2
    exit 1
fi
SRC=$(cd "$SRC" && pwd)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

missing=()
for m in numpy:numpy yaml:pyyaml tqdm:tqdm requests:requests sentencepiece:sentencepiece torch:torch \
         transformers:transformers; do
    "$PYTHON" -c "import ${m%%:*}" 2>/dev/null || missing+=("${m#*:}")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "pip install ${missing[*]} into $PYTHON" >&2
    "$PYTHON" -m pip install -q "${missing[@]}"
fi

# the model directory copy with a SentencePiece tokenizer (see the header)
HF=$OUT/hf-src
mkdir -p "$HF"
for f in "$SRC"/*.safetensors "$SRC"/*.safetensors.index.json "$SRC"/config.json; do
    [ -e "$f" ] && ln -sfn "$f" "$HF/$(basename "$f")"
done
"$PYTHON" - "$HF/tokenizer.model" <<'EOF'
import io, sys
import sentencepiece as spm
buf = io.BytesIO()
spm.SentencePieceTrainer.train(sentence_iterator=iter(["the quick brown fox jumps over the lazy dog 0123456789"]),
                               model_writer=buf, model_type="char", vocab_size=320, hard_vocab_limit=False,
                               byte_fallback=True, character_coverage=1.0, normalization_rule_name="identity",
                               num_threads=1, minloglevel=2)
open(sys.argv[1], "wb").write(buf.getvalue())
EOF
cat >"$HF/tokenizer_config.json" <<'EOF'
{"added_tokens_decoder": {"151643": {"content": "<|endoftext|>", "special": true},
                          "151665": {"content": "<|mask|>", "special": true}}}
EOF

convert() {  # outtype
    local f=$OUT/model-$1.gguf
    if [ -f "$f" ] && [ "${FORCE:-0}" != 1 ]; then echo "keep $f"; return; fi
    local t0
    t0=$(date +%s)
    PYTHONPATH=$LLAMA/gguf-py "$PYTHON" "$LLAMA/convert_hf_to_gguf.py" "$HF" --outtype "$1" --outfile "$f.tmp" \
        >"$OUT/convert-$1.log" 2>&1 || { tail -30 "$OUT/convert-$1.log"; exit 1; }
    mv "$f.tmp" "$f"
    echo "$f: $(( $(date +%s) - t0 )) s, $(stat -c %s "$f") bytes"
}

quantize() {  # llama-quantize type name, file suffix
    local f=$OUT/model-$2.gguf
    if [ -f "$f" ] && [ "${FORCE:-0}" != 1 ]; then echo "keep $f"; return; fi
    [ -f "$OUT/model-f32.gguf" ] || convert f32
    local t0
    t0=$(date +%s)
    "$QUANTIZE" "$OUT/model-f32.gguf" "$f.tmp" "$1" "$QTHREADS" >"$OUT/quantize-$2.log" 2>&1 \
        || { tail -30 "$OUT/quantize-$2.log"; exit 1; }
    mv "$f.tmp" "$f"
    echo "$f: $(( $(date +%s) - t0 )) s, $(stat -c %s "$f") bytes"
    # what llama-quantize did per tensor type, and its fallbacks for rows its block size does not divide
    echo "    tensor types written (count):"
    grep -oE "converting to +[a-zA-Z0-9_]+" "$OUT/quantize-$2.log" | awk '{print $3}' | sort | uniq -c \
        | sed 's/^/    /' || true
    echo "    fallbacks (count, wanted -> got):"
    grep -oE "required for type +[a-zA-Z0-9_]+\) -> falling back to +[a-zA-Z0-9_]+" "$OUT/quantize-$2.log" \
        | awk '{print $4, "->", $9}' | sed 's/)//' | sort | uniq -c | sed 's/^/    /' || true
    grep -E "^llama_model_quantize_impl: (model|quant) size" "$OUT/quantize-$2.log" | sed 's/^/    /' || true
}

for t in $TYPES; do
    case $t in
        f32|bf16|f16) convert "$t" ;;
        q8_0) quantize Q8_0 q8_0 ;;
        q4_k_m) quantize Q4_K_M q4_k_m ;;
        *) echo "unknown type $t" >&2; exit 1 ;;
    esac
done
