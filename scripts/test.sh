#!/usr/bin/env bash
# Build the extension and run every check: rustfmt, clippy (warnings are errors), Rust tests, mypy --strict on
# the package and the README's Python examples, then pytest.
# Uses the active virtualenv, or creates ./.venv. Set CARGO_TARGET_DIR to share a Rust build dir.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${VIRTUAL_ENV:-}" ]; then
  [ -x .venv/bin/python ] || python3 -m venv .venv
  . .venv/bin/activate
fi
# Versions the suite was last run with (pinned for reproducibility; the package itself needs only numpy).
python -m pip install -q --disable-pip-version-check maturin==1.16.0 pytest==9.2.0 numpy==2.4.6 safetensors==0.8.0 \
  starlette==1.10.0 uvicorn==0.54.0 openai==3.54.0 httpx==0.28.1 mypy==1.18.2
echo "== cargo fmt --check"
cargo fmt --all --check
echo "== cargo clippy -D warnings"
cargo clippy -q --workspace --all-targets -- -D warnings
echo "== build"
maturin develop -q
echo "== cargo test"
cargo test -q -p mbd-core
echo "== mypy --strict (package + README examples)"
bash scripts/check_types.sh
echo "== pytest"
python -m pytest -q tests "$@"
