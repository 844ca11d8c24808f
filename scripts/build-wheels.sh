#!/usr/bin/env bash
# Release artifacts for `pip install mbd-rs` without a Rust toolchain:
# - CPU wheels, abi3 (CPython >= 3.10), manylinux2014 (glibc >= 2.17) for x86_64 and aarch64, cross-linked with
#   maturin's zig linker (ziglang from PyPI) so that the glibc symbols referenced are the old ones whatever this
#   machine's glibc is;
# - the sdist (`maturin sdist`), which builds on any machine with Rust and a C compiler.
# Each wheel is checked: `auditwheel show` must accept its platform tag, the extension may need only glibc's
# libraries, nothing may be built for the build machine's CPU (`target-cpu=native`), and its size is reported with
# what dominates it.
#
# Usage: bash scripts/build-wheels.sh [outdir]   (default dist/)
#   MBD_WHEEL_ARCHS="x86_64 aarch64"   which wheels (CI builds x86_64 only)
#   MBD_SDIST=0                        skip the sdist
#   CARGO_TARGET_DIR                   shared Rust build dir (default target-zig/ in the checkout)
# On a 2-core machine: ~3 minutes per wheel from a cold build dir.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=$(mkdir -p "${1:-dist}" && cd "${1:-dist}" && pwd)
ARCHS=${MBD_WHEEL_ARCHS:-"x86_64 aarch64"}
BUILD_VENV=${MBD_BUILD_VENV:-$PWD/.venv-build}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target-zig}
# The oldest glibc the dependencies allow: Rust's std itself needs 2.17, which is manylinux2014.
COMPAT=manylinux2014
# Only the C library may be linked dynamically (auditwheel's manylinux policy; libgcc_s is not needed either).
ALLOWED_NEEDED="libc.so.6 libm.so.6 libpthread.so.0 libdl.so.2 librt.so.1 ld-linux-x86-64.so.2 ld-linux-aarch64.so.1"

case " ${RUSTFLAGS:-} ${CARGO_ENCODED_RUSTFLAGS:-} " in
  *target-cpu=native*) echo "RUSTFLAGS asks for target-cpu=native: a release wheel must run on any CPU" >&2; exit 1 ;;
esac
if grep -rqs "target-cpu" .cargo/ "$HOME/.cargo/config.toml" "$HOME/.cargo/config" 2>/dev/null; then
  echo "a cargo config sets target-cpu: a release wheel must run on any CPU of its architecture" >&2; exit 1
fi

[ -x "$BUILD_VENV/bin/python" ] || python3 -m venv "$BUILD_VENV"
"$BUILD_VENV/bin/python" -m pip install -q --disable-pip-version-check maturin==1.16.0 ziglang==0.17.1 \
  auditwheel==6.8.2 wheel==0.48.0
export PATH="$BUILD_VENV/bin:$PATH"

report_size() {  # what a wheel holds, largest members first
  python - "$1" <<'EOF'
import sys, zipfile, os
z = zipfile.ZipFile(sys.argv[1])
infos = sorted(z.infolist(), key=lambda i: -i.compress_size)
total = os.path.getsize(sys.argv[1])
print(f"  size {total / 1e6:.1f} MB compressed, {sum(i.file_size for i in infos) / 1e6:.1f} MB installed; largest:")
for i in infos[:3]:
    print(f"    {i.compress_size / 1e6:5.1f} MB ({i.file_size / 1e6:.1f} MB installed)  {i.filename}")
EOF
}

for arch in $ARCHS; do
  triple=$arch-unknown-linux-gnu
  if ! rustup target list --installed 2>/dev/null | grep -qx "$triple"; then
    echo "== adding the Rust standard library for $triple"
    rustup target add "$triple" || { echo "cannot add the Rust target $triple (rustup target add failed)" >&2; exit 1; }
  fi
  echo "== wheel for $arch"
  start=$(date +%s)
  rm -f "$OUT"/mbd_rs-*-"${COMPAT}_${arch}".*.whl
  maturin build --release --zig --compatibility "$COMPAT" --target "$triple" -o "$OUT"
  whl=$(ls -t "$OUT"/mbd_rs-*"_${arch}.whl" | head -n 1)
  echo "  built in $(( $(date +%s) - start )) s: $(basename "$whl")"
  auditwheel show "$whl" > "$OUT/.auditwheel.txt" 2>&1 || { cat "$OUT/.auditwheel.txt"; exit 1; }
  grep -q "manylinux_2_17_$arch" "$OUT/.auditwheel.txt" \
    || { cat "$OUT/.auditwheel.txt"; echo "auditwheel does not accept $whl as manylinux_2_17_$arch" >&2; exit 1; }
  echo "  auditwheel: consistent with manylinux_2_17_$arch"
  tmp=$(mktemp -d)
  python -m zipfile -e "$whl" "$tmp"
  so=$(find "$tmp" -name '_core*.so')
  machine=$(readelf -h "$so" | sed -n 's/.*Machine: *//p')
  need=$(readelf -d "$so" | sed -n 's/.*Shared library: \[\(.*\)\]/\1/p' | tr '\n' ' ')
  echo "  extension: $machine; NEEDED: $need"
  for lib in $need; do
    case " $ALLOWED_NEEDED " in *" $lib "*) ;; *) echo "unexpected shared library $lib in $so" >&2; exit 1 ;; esac
  done
  case "$arch:$machine" in
    x86_64:*X86-64*|aarch64:*AArch64*) ;;
    *) echo "$so is built for '$machine', not $arch" >&2; exit 1 ;;
  esac
  rm -rf "$tmp" "$OUT/.auditwheel.txt"
  report_size "$whl"
done

if [ "${MBD_SDIST:-1}" != 0 ]; then
  echo "== sdist"
  rm -f "$OUT"/mbd_rs-*.tar.gz
  maturin sdist -o "$OUT"
  sdist=$(ls -t "$OUT"/mbd_rs-*.tar.gz | head -n 1)
  echo "  $(basename "$sdist"): $(du -h "$sdist" | cut -f1)"
fi
ls -l "$OUT"
