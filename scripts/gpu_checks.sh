#!/usr/bin/env bash
# The GPU checks, as one script for a lent CUDA machine: the kernel and model tests marked `gpu`
# (compiled Triton on CUDA) and the decode-attention bandwidth benchmark. It uses that machine's
# own Python (PYTHON, default python3, with torch, triton and transformers; no virtualenv) and
# writes its logs and JSON to $OUT (default benchmarks/results).
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
out=${OUT:-benchmarks/results}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
"$python" -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'
"$python" -m pytest -q -m gpu -p no:cacheprovider tests/kernels tests/runtime/test_model_parity.py \
    2>&1 | tee "$out/gpu_tests.log"
tests=${PIPESTATUS[0]}
"$python" benchmarks/bench_decode_attention_gpu.py --out "$out" 2>&1 | tee "$out/gpu_bench.log"
bench=${PIPESTATUS[0]}
echo "gpu tests exit $tests, bandwidth benchmark exit $bench"
exit $(( tests || bench ))
