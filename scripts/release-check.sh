#!/usr/bin/env bash
# Prove the release artifacts from scripts/build-wheels.sh install and run as a user would get them:
# - each CPU wheel for this machine's architecture goes into a fresh venv with NO cargo, rustc or C compiler on
#   PATH; `mbd-rs --version` must be the wheel's version, `mbd-rs generate --chat "sort 7 2 9 4 1"` must answer
#   "1 2 4 7 9", and the test suite runs from a copy of tests/ (with README.md, the trained twins in models/ and
#   training/'s task definitions) against the installed package, never the source tree (the few tests of the
#   repository's own files are deselected);
# - the sdist goes into another fresh venv, compiled by pip with Rust, and gets the same checks;
# - wheels for another architecture (aarch64 here) cannot run on this machine: their tags, ELF machine and linked
#   libraries were checked by build-wheels.sh, and this script says so.
# - the CUDA wheel (scripts/build-cuda-wheel.sh; `MBD_CHECK_SDIST=0 bash scripts/release-check.sh dist/cuda`) gets the
#   wheel checks with its nvidia-* dependencies installed; on a machine without a GPU driver it must run on its CPU
#   core and say why (tests/test_packaging.py).
# Install times are printed (a wheel in seconds; the sdist compiles for minutes).
#
# Usage: bash scripts/release-check.sh [dist]
#   MBD_CHECK_SDIST=0   skip the sdist (it compiles the whole engine)
#   MBD_CHECK_TESTS     what pytest runs (default: all of tests/ but the tests marked source_tree, ~2 minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DIST=$(cd "${1:-dist}" && pwd)
PY=${PYTHON:-python3}
TESTS=${MBD_CHECK_TESTS:-tests}
cargo_version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n 1)
arch=$(uname -m)
WORK=$(mktemp -d /tmp/mbd-release-check.XXXXXX)
trap 'rm -rf "$WORK"' EXIT

# A PATH without compilers: every program of the usual PATH but cargo, rustc, rustup, cc, gcc, g++, clang, zig, ld.
# A wheel that needs to compile anything fails loudly here.
mkdir -p "$WORK/bin"
IFS=: read -ra dirs <<< "$PATH"
for d in "${dirs[@]}"; do
  case "$d" in *cargo*|*rustup*|*/.venv*|*venv-build*) continue ;; esac
  [ -d "$d" ] || continue
  for f in "$d"/*; do
    n=$(basename "$f")
    case "$n" in
      cargo*|rustc*|rustup*|rustdoc*|rust-*|cc|c++|cpp|gcc*|g++*|*-gcc*|*-g++*|clang*|zig*|ld|ld.*|maturin*|x86_64-linux-gnu-*|aarch64-linux-gnu-*) continue ;;
    esac
    [ -x "$f" ] && [ ! -e "$WORK/bin/$n" ] && ln -s "$f" "$WORK/bin/$n"
  done
done
NOCC_PATH=$WORK/bin

# The checks on an installed package, run from a directory holding only copies of tests/, README.md and the
# held-out tasks' definitions (training/*.py, which test_tiny_model.py imports) and models/ (test_trained_twins.py).
check_installed() {  # venv label version
  local venv=$1 label=$2 version=$3 run=$WORK/run-$2
  mkdir -p "$run/training" && cp -r "$ROOT/tests" "$ROOT/README.md" "$ROOT/docs" "$ROOT/models" "$run/" && cp "$ROOT"/training/*.py "$run/training/"
  (
    cd "$run"
    export PATH="$venv/bin:$NOCC_PATH"
    unset VIRTUAL_ENV PYTHONPATH CARGO_HOME RUSTUP_HOME
    python - <<'EOF'
import os, sys, mbd_rs
where = os.path.realpath(mbd_rs.__file__)
assert where.startswith(os.path.realpath(sys.prefix)), f"mbd_rs imported from {where}, not from the venv"
print(f"  import mbd_rs from {where}; core {mbd_rs._core.__name__}")
if mbd_rs._cuda_libs.cuda_unavailable:
    print(f"  CUDA build, running on its CPU core: {mbd_rs._cuda_libs.cuda_unavailable}")
EOF
    got=$(mbd-rs --version)
    [ "$got" = "mbd-rs $version" ] || { echo "mbd-rs --version says '$got', expected 'mbd-rs $version'" >&2; exit 1; }
    echo "  $got"
    out=$(mbd-rs generate --chat "sort 7 2 9 4 1")
    echo "  mbd-rs generate --chat \"sort 7 2 9 4 1\" -> $out"
    case "$out" in *"1 2 4 7 9"*) ;; *) echo "expected '1 2 4 7 9' from the embedded model ($label)" >&2; exit 1 ;; esac
    if [ "$arch" = x86_64 ] && [ "$label" = wheel ] && [ "$version" = "$cargo_version" ] \
       && command -v qemu-x86_64 >/dev/null; then
      # No kernel may assume the build machine's CPU: under emulated CPUs without AVX (x86-64-v2, numpy's own floor)
      # and with AVX2 but no AVX-512, dense and quantized generation must give the same answer (qemu raises
      # SIGILL on an instruction the emulated CPU lacks).
      # numpy's bundled OpenBLAS picks its kernels for the host's CPU, not the emulated one (under qemu 7.2 on an
      # AVX-512 host it runs AVX at import, on either emulated CPU): OPENBLAS_CORETYPE names the emulated CPU.
      for cpu in Nehalem Haswell; do
        for q in none q8_0 q4_k; do
          got=$(OPENBLAS_CORETYPE=${cpu^^} qemu-x86_64 -cpu "$cpu" "$venv/bin/python" -c "import mbd_rs
q = None if '$q' == 'none' else '$q'
print(mbd_rs.Engine.load(quantize=q).chat([{'role': 'user', 'content': 'sort 7 2 9 4 1'}]).text)" 2>/dev/null) \
            || { echo "the wheel fails on an emulated $cpu CPU (quantize=$q)" >&2; exit 1; }
          [ "$got" = "1 2 4 7 9" ] || { echo "emulated $cpu CPU, quantize=$q: '$got'" >&2; exit 1; }
        done
      done
      echo "  emulated CPUs (qemu-x86_64 -cpu Nehalem: no AVX; -cpu Haswell: AVX2, no AVX-512): same answers"
    fi
    python -m pip install -q --disable-pip-version-check -r "$ROOT/scripts/test-requirements.txt"
    # shellcheck disable=SC2086
    python -m pytest -q -p no:cacheprovider -m "not source_tree" $TESTS
  )
}

# The aarch64 wheel on an emulated aarch64 (qemu-user): Debian's arm64 CPython 3.11 unpacked into a sysroot (no
# chroot, no binfmt), the wheel and the test requirements installed for aarch64 by this machine's pip. Runs the
# in-process tests (a test that starts a subprocess cannot: without binfmt_misc the child is not emulated);
# about 20 minutes under emulation. Needs root, apt-get and qemu-user.
check_aarch64_emulated() {  # wheel
  local whl=$1 root=${MBD_ARM64_ROOT:-$HOME/.cache/mbd-rs/arm64-root} site=$WORK/arm64-site run=$WORK/run-aarch64
  echo "== $(basename "$whl"): emulated aarch64 (qemu-aarch64, Debian's arm64 CPython 3.11)"
  command -v qemu-aarch64 >/dev/null || { echo "qemu-aarch64 not found (apt-get install qemu-user)" >&2; return 1; }
  if [ ! -x "$root/usr/bin/python3.11" ]; then
    dpkg --print-foreign-architectures | grep -qx arm64 || { dpkg --add-architecture arm64 && apt-get update -qq; }
    mkdir -p "$root" "$WORK/debs"
    ( cd "$WORK/debs" && apt-get download -q python3.11-minimal:arm64 libpython3.11-minimal:arm64 \
        libpython3.11-stdlib:arm64 libc6:arm64 zlib1g:arm64 libexpat1:arm64 libffi8:arm64 libssl3:arm64 \
        libbz2-1.0:arm64 liblzma5:arm64 libgcc-s1:arm64 libstdc++6:arm64 libuuid1:arm64 libcrypt1:arm64 \
        libsqlite3-0:arm64 >/dev/null && for d in *.deb; do dpkg-deb -x "$d" "$root"; done )
  fi
  python3 -m pip install -q --disable-pip-version-check --target "$site" --platform manylinux_2_28_aarch64 \
    --platform manylinux2014_aarch64 --platform linux_aarch64 --python-version 3.11 --implementation cp \
    --only-binary=:all: -r scripts/test-requirements.txt "$whl"
  mkdir -p "$run/training" && cp -r "$ROOT/tests" "$ROOT/README.md" "$ROOT/docs" "$ROOT/models" "$run/" && cp "$ROOT"/training/*.py "$run/training/"
  ( cd "$run" && qemu-aarch64 -L "$root" "$root/usr/bin/python3.11" - "$site" <<'EOF'
import platform, sys
sys.path.insert(0, sys.argv[1])
import mbd_rs, pytest
assert platform.machine() == "aarch64" and mbd_rs.__file__.startswith(sys.argv[1]), (platform.machine(), mbd_rs.__file__)
for q in (None, "q8_0", "q4_k"):
    text = mbd_rs.Engine.load(quantize=q).chat([{"role": "user", "content": "sort 7 2 9 4 1"}]).text
    print(f"  aarch64, quantize={q}: sort 7 2 9 4 1 -> {text}")
    assert text == "1 2 4 7 9", text
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-m", "not source_tree", "-k", "not subprocess and not cli",
                      "tests/test_parity.py", "tests/test_quantize.py", "tests/test_generate_api.py",
                      "tests/test_decode_parity.py", "tests/test_batching.py", "tests/test_speculative.py",
                      "tests/test_cache_modes.py", "tests/test_tiny_model.py", "tests/test_hostile_load.py",
                      "tests/test_errors.py", "tests/test_profiles.py"]))
EOF
  )
}

fresh_venv() {  # dir: a venv made by the base interpreter, with nothing but pip
  "$PY" -m venv "$1"
}

status=0
shopt -s nullglob
wheels=("$DIST"/mbd_rs-*.whl)
[ ${#wheels[@]} -gt 0 ] || { echo "no wheel in $DIST (run scripts/build-wheels.sh first)" >&2; exit 1; }
for whl in "${wheels[@]}"; do
  name=$(basename "$whl")
  case "$name" in
    *"_${arch}.whl"|*".${arch}.whl") ;;
    *aarch64.whl)
      if [ "${MBD_QEMU_AARCH64:-0}" = 1 ]; then check_aarch64_emulated "$whl" || status=1
      else echo "== $name: another architecture; its platform tag, ELF machine and NEEDED libraries were checked by" \
                "build-wheels.sh (MBD_QEMU_AARCH64=1 runs it under qemu-aarch64)"; fi
      continue ;;
    *) echo "== $name: another architecture; its platform tag, ELF machine and NEEDED libraries were checked by" \
            "build-wheels.sh, it is not run here (no such machine)"; continue ;;
  esac
  echo "== $name: fresh venv, no compiler on PATH"
  venv=$WORK/venv-wheel
  rm -rf "$venv"; fresh_venv "$venv"
  ( export PATH="$venv/bin:$NOCC_PATH"
    for tool in cargo rustc cc gcc; do
      if command -v "$tool" >/dev/null; then echo "$tool is still on PATH" >&2; exit 1; fi
    done
    start=$(date +%s.%N)
    python -m pip install -q --disable-pip-version-check "$whl"
    echo "  pip install $name: $(python -c "print(f'{$(date +%s.%N) - $start:.1f}')") s (numpy included)" )
  wheel_version=$(echo "$name" | cut -d- -f2)
  check_installed "$venv" wheel "$wheel_version" || status=1
done

if [ "${MBD_CHECK_SDIST:-1}" != 0 ]; then
  sdists=("$DIST"/mbd_rs-*.tar.gz)
  [ ${#sdists[@]} -gt 0 ] || { echo "no sdist in $DIST" >&2; exit 1; }
  sdist=${sdists[0]}
  echo "== $(basename "$sdist"): fresh venv, compiled by pip (Rust and a C compiler needed)"
  venv=$WORK/venv-sdist
  fresh_venv "$venv"
  start=$(date +%s)
  # --no-cache-dir: pip would reuse the wheel it built from an earlier sdist of the same name and path; and a
  # target dir of its own: the sdist's files carry fixed timestamps, so a shared CARGO_TARGET_DIR holding an older
  # build of the same crates looks up to date to cargo and would be linked instead of the sdist's code
  CARGO_TARGET_DIR="$WORK/target-sdist" "$venv/bin/python" -m pip install -q --disable-pip-version-check \
    --no-cache-dir "$sdist"
  echo "  pip install $(basename "$sdist"): $(( $(date +%s) - start )) s"
  check_installed "$venv" sdist "$cargo_version" || status=1
fi
[ $status = 0 ] && echo "release check: passed" || echo "release check: FAILED" >&2
exit $status
