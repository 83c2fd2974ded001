#!/usr/bin/env bash
# Sets up .venv (see setup.sh) and Chromium where it can, then lints (ruff; the import-linter
# layering contracts) and runs the whole test suite. Any failure fails the script, including
# pytest's exit 5 (no tests collected). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The dashboard's browser test drives Debian's Chromium: install it where this user can (root
# with apt); elsewhere that one test is skipped, and says why.
if ! command -v chromium >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "tests: installing Debian's chromium for the dashboard's browser test"
    { apt-get install -y -q chromium || { apt-get update -q && apt-get install -y -q chromium; }; } \
        >/tmp/radixlang-chromium-install.log 2>&1 \
        || echo "tests: chromium could not be installed (see /tmp/radixlang-chromium-install.log)"
fi
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/lint-imports  # the layering contracts in pyproject.toml
export HF_HUB_OFFLINE=1  # nothing is fetched from a model hub at test time
# Two worker processes (pytest-xdist; both cores of CI): each test file on one worker, the Ray
# tests together (tests/conftest.py). "-n 0" among the arguments runs one process.
exec .venv/bin/python -m pytest -n 2 --dist loadgroup --durations=10 "$@"
