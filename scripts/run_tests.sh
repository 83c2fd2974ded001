#!/usr/bin/env bash
# Sets up .venv (see setup.sh) and Chromium where it can, then lints (ruff; the import-linter
# layering contracts) and runs the whole test suite, then the tests that compare outputs once
# more in bfloat16 (below). Any failure fails the script, including pytest's exit 5 (no tests
# collected). Extra arguments go to both pytest runs.
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
main_status=0
.venv/bin/python -m pytest -n 2 --dist loadgroup --durations=10 "$@" || main_status=$?
# dtype="auto" is bfloat16 on a CPU that computes it natively (AMX, AVX-512 BF16) and float32
# elsewhere (CI's AVX2 machines). The tests that compare generated outputs across engines,
# processes, batches or the cache (marked compares_outputs; deterministic engines) run again
# with "auto" forced to bfloat16, as such a machine runs them. The other way round, on a
# machine with native bfloat16, RADIXLANG_AUTO_DTYPE=float32 bash scripts/run_tests.sh runs the
# main pass as CI does.
echo "tests: the compares_outputs tests again with RADIXLANG_AUTO_DTYPE=bfloat16"
bf16_status=0
RADIXLANG_AUTO_DTYPE=bfloat16 .venv/bin/python -m pytest -n 2 --dist loadgroup --durations=5 \
    "$@" -m compares_outputs || bf16_status=$?  # last: this -m wins over one in the arguments
if [ "$bf16_status" = 5 ] && [ $# -gt 0 ]; then
    # Arguments that select no marked test (a file, -k ...): nothing to run again.
    echo "tests: the arguments select no compares_outputs test; no bfloat16 pass"
    bf16_status=0
fi
if [ "$main_status" != 0 ] || [ "$bf16_status" != 0 ]; then
    echo "tests: failed (pytest exit $main_status; bfloat16 pass exit $bf16_status)" >&2
    exit 1
fi
