#!/usr/bin/env bash
# Sets up .venv (see setup.sh) and runs the main job: the shipped example on the default model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/prefix_cache_demo.py "$@"
