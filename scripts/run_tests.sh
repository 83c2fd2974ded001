#!/usr/bin/env bash
# Sets up .venv (see setup.sh), then lints (ruff; the import-linter layering contracts) and runs
# the whole test suite. Any failure fails the script, including pytest's exit 5 (no tests
# collected). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/lint-imports  # the layering contracts in pyproject.toml
export HF_HUB_OFFLINE=1  # nothing is fetched from a model hub at test time
exec .venv/bin/python -m pytest --durations=10 "$@"
