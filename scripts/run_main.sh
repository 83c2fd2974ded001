#!/usr/bin/env bash
# Sets up .venv (see setup.sh) and runs the main job: examples/tree_of_thought.py on the default
# model — a tree of thoughts (branching 3, depth 3: 27 leaves) grown with fork, every leaf judged
# with select, a vote — then the prompt tokens computed against the token trie of all prompts
# sent, and the cache statistics. Extra arguments go to the example (e.g. --max-tokens 16).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/tree_of_thought.py "$@"
