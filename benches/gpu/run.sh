#!/usr/bin/env bash
# The CUDA checks in one script, for whoever has a machine with an NVIDIA GPU (compute capability 9.0 for the default
# wheel: H100, H200; the ptx80 stage covers others). That machine needs Python >= 3.10 with PyTorch for CUDA 13,
# transformers and pytest; no Rust, no compiler, no network.
#
# 1. Build the CUDA wheel on any Linux x86_64 machine (no GPU needed; the pinned nvcc comes from PyPI wheels):
#        bash scripts/build-cuda-wheel.sh dist/cuda        # ~17 min cold on 2 cores (nvcc for sm_90), 12 MB
# 2. Copy the repository checkout (its tracked files, ~32 MB) and dist/cuda/ to the GPU machine.
# 3. There, from the checkout:  bash benches/gpu/run.sh [STAGE...]   (no stage: `all` = install parity speed)
#    Each stage takes a few minutes; run them one at a time or several in one command.
# 4. Results land in $OUT (default gpu_out/ in the checkout): a JSON per stage, its log, nvidia-smi.txt. The runs
#    recorded so far are in benches/results/cuda/, read in benches/results/cuda.md.
#
# Stages (what each one checks):
#   install  pip install the wheel from dist/cuda (no dependencies: torch brings cuBLAS/cuRAND) and check that the
#            CUDA core loaded (not the CPU fallback) and that a CUDA device answers; every stage but ptx80 runs it
#            first
#   parity   benches/gpu/parity.py: fixtures f32/bf16 vs transformers f32, through the cache, vs transformers bf16
#            live on the GPU, greedy tokens GPU f32 == CPU f32; plus tests/test_packaging.py
#   speed    benches/gpu/speed.py --shape sdar-1.7b --e2e --ab candle_ops: one forward vs the bandwidth floor,
#            PyTorch eager and candle's ops in place of mbd-rs's CUDA kernels, end-to-end tokens/s, 1/8/32 streams
#   speed8b  the Qwen3-8B shape (SDAR-8B / TraDo-8B), one forward
#   profile  benches/gpu/kernels.py: kernels per forward, GPU busy time vs wall time, the costliest kernels, with
#            mbd-rs's CUDA kernels and with candle's ops
#   ncu      benches/gpu/ncu.py under Nsight Compute: the attention kernel at W 32, attention and add + norm at W 1
#            (grids, occupancy, throughput, stall reasons) on a 2-layer model of the SDAR-1.7B layer shape
#   quant    quantized weights on the GPU: benches/gpu/quant.py (logits of q8_0 / q6_k / q4_k / q4_0 models on CUDA
#            against the CPU's exact quantized path; GGUF blocks kept on the device), then speed.py on the SDAR-1.7B
#            shape with --ab q8_0,q6_k,q4_k (bf16 vs the quantized formats, each vs its floor)
#   segments benches/gpu/segments.py: K streams of the SDAR-1.7B attention shape batched with one launch per kernel
#            for all segments (_kernels cuda_segments) == a launch per segment == each stream alone, token for
#            token; then speed.py's 1/8/32 streams with the switch off and on
#   graphs   benches/gpu/graphs.py: the segments streams decoded with CUDA graphs (_kernels cuda_graphs) == without,
#            alone and batched, token for token, with graphs replayed and none refused; tokens/s off/on; then
#            speed.py's W x P forwards and 1/8/32 streams: default, cuda_segments, and cuda_segments + graphs
#   ptx80    the compute-8.0 PTX wheel (build it with MBD_CUDA_ARCH=80 bash scripts/build-cuda-wheel.sh dist/cuda80
#            and copy dist/cuda80/ too) under CUDA_FORCE_PTX_JIT=1, as a GPU other than 9.0 runs it: parity
#            (fixtures, greedy) and one-forward speed, then the same speed cases with the sm_90 wheel for the ratio
#            (installed by an earlier install stage on this machine; without it the stage says so and gives no ratio)
#   isd      benches/decoding/isd.py on the GPU: AR against ISD at strides 2/4/8 on the SDAR-1.7B shape (random
#            weights, made by speed.py's make_checkpoint), bf16, loaded causal + shifted: the cost side (no draft
#            accepted), then --agree (a zeroed final norm: every draft accepted), the most ISD gains per forward
#   qwen35   benches/gpu/qwen35.py: the Gated DeltaNet kernels at Qwen3.5's head shape (logits through the cache vs
#            transformers f32 on the GPU), the trained Qwen3.5 twin's reference-decoder cases on the GPU (cache on =
#            off, batched = alone), one window forward of the Qwen3.5-0.8B shape vs PyTorch and the floor
#   batching tests/test_batching.py on the GPU (device "auto" is CUDA there, bf16): do concurrent streams, batched
#            into shared forwards, still give their lone outputs token for token?
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_out}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
stages=${*:-all}
[ "$stages" = all ] && stages="install parity speed"

install() {
  whl=$(ls dist/cuda/mbd_rs-*+cu130-*.whl 2>/dev/null | head -n 1)
  [ -n "$whl" ] || { echo "no CUDA wheel in dist/cuda (build it with scripts/build-cuda-wheel.sh and copy it here)" >&2; exit 1; }
  "$PY" -m pip install -q --no-deps --no-index --force-reinstall "$whl"
  nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
  (cd /tmp && "$PY" - <<'PY')
import mbd_rs
print("mbd_rs", mbd_rs.__version__, "core", mbd_rs._core.__name__, "cuda_unavailable:", mbd_rs._cuda_libs.cuda_unavailable)
assert mbd_rs._core.__name__ == "mbd_rs._cuda._core", mbd_rs._cuda_libs.cuda_unavailable
eng = mbd_rs.Engine.load(device="auto")
print("device auto ->", eng.info.device, eng.info.dtype, eng.chat([{"role": "user", "content": "sort 7 2 9 4 1"}]).text)
assert eng.info.device.startswith("cuda"), eng.info.device
PY
}

for stage in $stages; do
  echo "== $stage"
  case $stage in
    install) install 2>&1 | tee "$OUT/install.log" ;;
    parity)
      install > /dev/null
      "$PY" benches/gpu/parity.py --out "$OUT/gpu_parity.json" 2>&1 | grep -v "Loading weights" | tee "$OUT/parity.log"
      (cd /tmp && "$PY" -m pytest -q -p no:cacheprovider "$OLDPWD/tests/test_packaging.py" 2>&1 | tail -3) | tee -a "$OUT/parity.log" ;;
    speed)
      install > /dev/null
      "$PY" benches/gpu/speed.py --shape sdar-1.7b --e2e --ab candle_ops --out "$OUT/gpu_speed_sdar-1.7b.json" 2>&1 \
        | grep -v "Loading weights" | tee "$OUT/speed.log" ;;
    quant)
      install > /dev/null
      "$PY" benches/gpu/quant.py --out "$OUT/gpu_quant.json" 2>&1 | tee "$OUT/quant.log"
      "$PY" benches/gpu/speed.py --shape sdar-1.7b --cases 512:1,512:4,512:16,512:32,2048:1,2048:32 --rounds 1 \
        --ab q8_0,q6_k,q4_k --out "$OUT/gpu_speed_quant.json" 2>&1 | grep -v "Loading weights" | tee -a "$OUT/quant.log" ;;
    isd)
      install > /dev/null
      ck=/tmp/mbd-gpu/sdar-1.7b
      "$PY" -c "import sys, torch; sys.path.insert(0, 'benches/gpu'); from speed import make_checkpoint; \
make_checkpoint('sdar-1.7b', '$ck', torch.device('cuda'), torch.bfloat16)" 2>&1 | grep -v "Loading weights" || true
      for agree in "" --agree; do
        "$PY" benches/decoding/isd.py "$ck" --device cuda --configs bf16 --strides 2,4,8 --rounds 3 --tokens 64 $agree \
          --agree-dir /tmp/mbd-gpu/isd-agree --out "$OUT/gpu_isd${agree:+_agree}.json" 2>&1 | tee -a "$OUT/isd.log"
      done ;;
    speed8b)
      install > /dev/null
      "$PY" benches/gpu/speed.py --shape qwen3-8b --cases 512:1,512:32,2048:1,2048:32 --rounds 1 --ab candle_ops \
        --out "$OUT/gpu_speed_qwen3-8b.json" 2>&1 | grep -v "Loading weights" | tee "$OUT/speed8b.log" ;;
    profile)
      install > /dev/null
      "$PY" benches/gpu/kernels.py --configs fused,candle --out "$OUT/gpu_profile.json" 2>&1 | grep -v "Loading weights" | tee "$OUT/profile.log" ;;
    ncu)
      install > /dev/null
      ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
      [ -n "$ncu" ] || { echo "no ncu on this machine" >&2; exit 1; }
      sections="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats"
      (cd benches/gpu && "$PY" ncu.py --window 1 > /dev/null 2>&1)  # writes the checkpoint once
      for spec in "mbd_attn_partial 32 6" "mbd_attn_partial|mbd_add_rms 1 10"; do
        set -- $spec
        (cd benches/gpu && "$ncu" -k "regex:$1" -c "$3" $sections "$PY" ncu.py --window "$2") 2>&1 \
          | grep -v "Loading weights\|^==PROF==" >> "$OUT/ncu.log"
      done
      grep -E "^  [a-z_A-Z].*\(|Duration|Achieved Occupancy|Registers Per|Memory Throughput|Compute \(SM\) Thr|Warp Cycles Per Issued" \
        "$OUT/ncu.log" | head -150 ;;
    segments)
      install > /dev/null
      "$PY" benches/gpu/segments.py --out "$OUT/gpu_segments.json" 2>&1 | grep -v "Loading weights" | tee "$OUT/segments.log"
      "$PY" benches/gpu/speed.py --shape sdar-1.7b --cases 512:1,512:32 --rounds 1 --e2e --e2e-engines mbd_rs,segments \
        --ab segments --out "$OUT/gpu_speed_segments.json" 2>&1 | grep -v "Loading weights" | tee -a "$OUT/segments.log" ;;
    graphs)
      install > /dev/null
      "$PY" benches/gpu/graphs.py --out "$OUT/gpu_graphs.json" 2>&1 | grep -v "Loading weights" | tee "$OUT/graphs.log"
      "$PY" benches/gpu/speed.py --shape sdar-1.7b --cases 512:1,512:4,512:32,2048:1,2048:32 --rounds 1 --e2e \
        --e2e-engines segments,graphs --ab segments,graphs --out "$OUT/gpu_speed_graphs.json" 2>&1 \
        | grep -v "Loading weights" | tee -a "$OUT/graphs.log" ;;
    ptx80)
      whl=$(ls dist/cuda80/mbd_rs-*+cu130.cc80-*.whl dist/cuda/mbd_rs-*+cu130.cc80-*.whl 2>/dev/null | head -n 1)
      [ -n "$whl" ] || { echo "no compute-8.0 wheel in dist/cuda80 (MBD_CUDA_ARCH=80 bash scripts/build-cuda-wheel.sh dist/cuda80)" >&2; exit 1; }
      rm -rf /tmp/mbd-cc80 && "$PY" -m pip install -q --no-deps --no-index --target /tmp/mbd-cc80 "$whl"
      cases=512:1,512:32,2048:1,2048:32
      (export CUDA_FORCE_PTX_JIT=1 PYTHONPATH=/tmp/mbd-cc80
       cd /tmp && "$PY" -c "import mbd_rs; assert mbd_rs._core.__name__ == 'mbd_rs._cuda._core', mbd_rs._cuda_libs.cuda_unavailable; print('cc80 wheel', mbd_rs.__version__)"
       cd "$OLDPWD" && "$PY" benches/gpu/parity.py --no-hf --out "$OUT/gpu_parity_cc80.json" 2>&1 | grep -v "Loading weights" | tail -30
       "$PY" benches/gpu/speed.py --shape sdar-1.7b --cases $cases --rounds 1 --out "$OUT/gpu_speed_cc80.json" 2>&1 \
         | grep -v "Loading weights") | tee "$OUT/ptx80.log"
      if (cd /tmp && "$PY" -c "import mbd_rs; assert mbd_rs._core.__name__ == 'mbd_rs._cuda._core'") 2>/dev/null; then
        "$PY" benches/gpu/speed.py --shape sdar-1.7b --cases $cases --rounds 1 --out "$OUT/gpu_speed_sm90.json" 2>&1 \
          | grep -v "Loading weights" | tee -a "$OUT/ptx80.log"
      else
        echo "no sm_90 wheel installed on this machine (run the install stage first): no ratio" | tee -a "$OUT/ptx80.log"
      fi ;;
    qwen35)
      install > /dev/null
      "$PY" benches/gpu/qwen35.py --out "$OUT/gpu_qwen35.json" 2>&1 | grep -v "Loading weights" | tee "$OUT/qwen35.log" ;;
    batching)
      install > /dev/null
      (cd /tmp && "$PY" -m pytest -q -p no:cacheprovider -rf --tb=line "$OLDPWD/tests/test_batching.py" 2>&1 | tail -25) \
        | tee "$OUT/batching.log" ;;
    *) echo "unknown stage $stage (install|parity|speed|speed8b|profile|ncu|quant|segments|graphs|ptx80|isd|qwen35|batching|all)" >&2; exit 2 ;;
  esac
done
