#!/usr/bin/env bash
# The lints (CI runs this before the tests; CONTRIBUTING.md has what each one holds):
# - the floor plan (imports only downward, no circles, every file in a wing: scripts/check_layers.py reads the
#   `layers` block of docs/dev/architecture.md);
# - the references (no numbered work items, no repository path that names nothing: scripts/check_refs.py);
# - rustfmt --check, clippy with warnings as errors, and rustdoc with warnings as errors (a doc link that does not
#   resolve fails);
# - ruff on the Python (settings in pyproject.toml) and shellcheck on the shell scripts, both from PyPI at the
#   versions in scripts/lint-requirements.txt, in a venv of their own (./.venv-lint).
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== floor plan (scripts/check_layers.py)"
python3 scripts/check_layers.py
echo "== references (scripts/check_refs.py)"
python3 scripts/check_refs.py
echo "== cargo fmt --check"
cargo fmt --all --check
echo "== cargo clippy -D warnings"
cargo clippy --workspace --all-targets -- -D warnings
echo "== cargo doc -D warnings (every intra-doc link resolves)"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --document-private-items --quiet
echo "== ruff and shellcheck (./.venv-lint)"
[ -x .venv-lint/bin/python ] || python3 -m venv .venv-lint
.venv-lint/bin/python -m pip install -q --disable-pip-version-check -r scripts/lint-requirements.txt
.venv-lint/bin/ruff check python tests benches scripts training examples
git ls-files -z '*.sh' | xargs -0 .venv-lint/bin/shellcheck --severity=warning
echo "== lint: all clean"
