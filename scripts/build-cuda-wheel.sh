#!/usr/bin/env bash
# Build the mbd-rs wheel with the `cuda` feature on a machine without a GPU (and without a system CUDA toolkit).
#
# - installs nvcc and the CUDA 13.0.x headers/libraries from PyPI wheels into $CU13_PREFIX (13.0.x exactly: the
#   GPU machines' R580 driver cannot JIT PTX from a newer nvcc; any other nvcc version is refused);
# - makes a libcuda.so link stub that defines the driver API symbols (an empty stub is dropped by --as-needed
#   and the import would fail later), with soname libcuda.so.1 so the real driver is used at run time;
# - builds for compute capability 9.0 (H100/H200; candle's kernels become sm_90a) as an abi3 wheel;
# - checks the result's NEEDED entries with readelf.
# The default CPU wheel and CI are unaffected. Usage: bash scripts/build-cuda-wheel.sh [outdir]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-dist/cuda}
CU13_PREFIX=${CU13_PREFIX:-$HOME/.cache/mbd-rs/cu13}
PY=${PYTHON:-python3}

if [ ! -x "$CU13_PREFIX/nvidia/cu13/bin/nvcc" ]; then
  "$PY" -m pip install -q --disable-pip-version-check --target "$CU13_PREFIX" \
    nvidia-cuda-nvcc==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 \
    nvidia-cuda-cccl==13.0.85 nvidia-cuda-nvrtc==13.0.88 nvidia-cublas==13.0.2.14 nvidia-curand==10.4.0.35
fi
R=$CU13_PREFIX/nvidia/cu13
chmod +x "$R"/bin/* "$R"/nvvm/bin/* 2>/dev/null || true
ver=$("$R/bin/nvcc" --version | sed -n 's/.*release \([0-9]*\.[0-9]*\).*/\1/p')
if [ "$ver" != "13.0" ]; then
  echo "nvcc at $R/bin/nvcc is CUDA $ver; exactly 13.0.x is required (the GPU driver cannot JIT newer PTX)" >&2
  exit 1
fi
# unversioned names for the linker
for lib in cudart cublas cublasLt curand nvrtc; do
  f=$(ls "$R"/lib/lib$lib.so.* 2>/dev/null | sort | head -n 1)
  [ -n "$f" ] || { echo "missing lib$lib.so.* in $R/lib" >&2; exit 1; }
  ln -sf "$(basename "$f")" "$R/lib/lib$lib.so"
done
# libcuda stub: every driver API function named in cuda.h (after macro expansion to the versioned names)
mkdir -p "$R/lib/stubs"
if [ ! -f "$R/lib/stubs/libcuda.so" ]; then
  gcc -E -P -I"$R/include" "$R/include/cuda.h" 2>/dev/null \
    | grep -oE '\bcu[A-Z][A-Za-z0-9_]*[[:space:]]*\(' | sed 's/[[:space:]]*($//' | sort -u \
    | awk '{print "void " $1 "(void) {}"}' > "$R/lib/stubs/cuda_stub.c"
  gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$R/lib/stubs/libcuda.so" "$R/lib/stubs/cuda_stub.c"
fi
export CUDA_HOME=$R CUDA_PATH=$R PATH=$R/bin:$PATH NVCC=$R/bin/nvcc CUDA_COMPUTE_CAP=90 CUDARC_CUDA_VERSION=13000
export LIBRARY_PATH=$R/lib:$R/lib/stubs${LIBRARY_PATH:+:$LIBRARY_PATH}
"$PY" -m pip install -q --disable-pip-version-check "maturin==1.16.0"
"$PY" -m maturin build --release --features cuda --auditwheel skip -o "$OUT"
whl=$(ls -t "$OUT"/mbd_rs-*.whl | head -n 1)
tmp=$(mktemp -d)
"$PY" -m zipfile -e "$whl" "$tmp"
so=$(find "$tmp" -name '_core*.so' | head -n 1)
need=$(readelf -d "$so" | sed -n 's/.*Shared library: \[\(.*\)\]/\1/p' | tr '\n' ' ')
echo "NEEDED: $need"
# libcudart is dropped by --as-needed when no runtime-API symbol is used; the driver API and cuBLAS must be there.
for lib in libcuda.so.1 libcublas.so.13 libcurand.so.10; do
  case " $need " in *" $lib "*) ;; *) echo "expected NEEDED $lib in $so" >&2; exit 1 ;; esac
done
rm -rf "$tmp"
echo "built $whl ($(du -h "$whl" | cut -f1))"
