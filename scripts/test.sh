#!/usr/bin/env bash
# Build the extension once (debug) and run every test: Rust tests, mypy --strict on the package and the README's
# Python examples, then pytest. (The Rust lints, rustfmt and clippy, are scripts/lint.sh; CI runs both.)
# Always in its own ./.venv (a user's install, e.g. a release `pip install .`, is never replaced by this debug
# build). Set CARGO_TARGET_DIR to share a Rust build dir. On a 2-core machine the first run takes ~8 minutes,
# later runs ~1-2 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --disable-pip-version-check maturin==1.16.0 -r scripts/test-requirements.txt
echo "== build (debug extension into ./.venv)"
maturin develop
echo "== cargo test"
cargo test -q -p mbd-core
echo "== mypy --strict (package + README examples)"
bash scripts/check_types.sh
echo "== pytest"
python -m pytest -q tests "$@"
