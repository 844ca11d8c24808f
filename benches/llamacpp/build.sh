#!/usr/bin/env bash
# Build the llama.cpp vendored in the llama-cpp-python 0.3.36 source distribution (CPU only, this machine's ISA),
# only the targets the comparison needs (llama-quantize, llama-bench, libllama), then our driver against libllama.
#
#   benches/llamacpp/build.sh            # work dir /tmp/llamacpp (LLAMACPP_WORK=... to move it)
#   LLAMACPP_ISA=avx2 benches/llamacpp/build.sh   # AVX2 + FMA + F16C only (a Zen 3 / pre-AVX-512 CPU), in build-avx2/
#   LLAMACPP_SERVER=1 benches/llamacpp/build.sh   # also llama-server (cache_prompt; the multi-turn comparison)
#
# Outputs, under $LLAMACPP_WORK:
#   src/      the unpacked sdist (vendor/llama.cpp holds convert_hf_to_gguf.py and gguf-py)
#   build/bin llama-quantize, llama-bench, mbd-llama-driver (+ libllama / libggml*.so, found through the rpath),
#             llama-server with LLAMACPP_SERVER=1
# Re-running is cheap: the download, the unpacking and the configured build are kept.
set -euo pipefail

VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
WORK=${LLAMACPP_WORK:-/tmp/llamacpp}
CACHE=${LLAMACPP_CACHE:-$WORK/cache}
PYTHON=${PYTHON:-/tmp/devenv/bin/python}
JOBS=${JOBS:-2}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

need_apt=()
command -v cmake >/dev/null || need_apt+=(cmake)
command -v g++ >/dev/null || need_apt+=(g++)
command -v make >/dev/null || need_apt+=(make)
if [ ${#need_apt[@]} -gt 0 ]; then
    echo "installing ${need_apt[*]} with apt" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}"
fi

mkdir -p "$CACHE" "$WORK/src"
SDIST=$CACHE/llama_cpp_python-$VERSION.tar.gz
if [ ! -f "$SDIST" ]; then
    if command -v pip >/dev/null; then PIP=(pip); else PIP=("$PYTHON" -m pip); fi
    # the sdist only from source: its build requirements (scikit-build-core, cmake) as wheels, or pip compiles cmake
    "${PIP[@]}" download --no-binary llama-cpp-python --no-deps "llama-cpp-python==$VERSION" -d "$CACHE"
fi
SRC=$WORK/src/llama_cpp_python-$VERSION/vendor/llama.cpp
if [ ! -f "$SRC/include/llama.h" ]; then
    tar xzf "$SDIST" -C "$WORK/src"
fi

ISA=${LLAMACPP_ISA:-native}
case "$ISA" in
    native) BUILD=$WORK/build; ISA_FLAGS=(-DGGML_NATIVE=ON); MARCH=-march=native ;;
    avx2) BUILD=$WORK/build-avx2; MARCH="-march=haswell"
          ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
                     -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF) ;;
    *) echo "LLAMACPP_ISA must be native or avx2, got '$ISA'" >&2; exit 2 ;;
esac
TARGETS=(llama-quantize llama-bench)
SERVER=OFF
if [ "${LLAMACPP_SERVER:-0}" = 1 ]; then TARGETS+=(llama-server); SERVER=ON; fi
t0=$(date +%s)
cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release \
    "${ISA_FLAGS[@]}" -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=$SERVER -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_COMMON=ON >"$BUILD.configure.log" 2>&1 \
    || { tail -40 "$BUILD.configure.log"; exit 1; }
grep -iE "x86 detected|GGML_(AVX|FMA|F16C)|OpenMP found|Adding CPU backend" "$BUILD.configure.log" || true
cmake --build "$BUILD" --config Release -j "$JOBS" --target "${TARGETS[@]}"

# our driver: the public llama.h API only, linked against the shared libraries just built
LIBDIR=$(dirname "$(find "$BUILD" -name 'libllama.so*' | head -1)")
g++ -O2 -std=c++17 $MARCH -Wall -Wextra -o "$BUILD/bin/mbd-llama-driver" "$HERE/driver.cpp" \
    -I"$SRC/include" -I"$SRC/ggml/include" -L"$LIBDIR" -lllama -lggml -lggml-base -lpthread -Wl,-rpath,"$LIBDIR"
echo "built in $(( $(date +%s) - t0 )) s:"
ls -la "$BUILD/bin/llama-quantize" "$BUILD/bin/llama-bench" "$BUILD/bin/mbd-llama-driver"
