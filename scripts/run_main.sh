#!/usr/bin/env bash
# Sets up .venv (see setup.sh) and runs the main job: prompts completed by the engine on the
# default model, with the cache statistics and the radix tree. Extra arguments go to
# `radixlang generate` (e.g. --dtype bfloat16, --max-new-tokens 32).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/radixlang generate --chat --file examples/prompts/questions.txt \
    --system "You are a concise assistant. Answer in at most two sentences." \
    --max-new-tokens 48 --show-tree "$@"
