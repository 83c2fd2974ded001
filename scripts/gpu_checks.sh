#!/usr/bin/env bash
# The GPU checks, as one script for a lent CUDA machine:
#   1. every test marked `gpu` (compiled Triton kernels; the model and the engine on CUDA);
#   2. the decode-attention bandwidth benchmark, then FlashInfer's paged attention against the
#      Triton kernels (decode and extend; where flashinfer is not installed it writes a
#      "skipped" JSON and exits 0; its status is reported but does not fail the checks, as it
#      compares with an optional library);
#   3. the engine benchmark on CUDA in bfloat16 (with overlapped scheduling and CUDA graphs,
#      then without), and the null-model host-overhead benchmark, on a random-weight model with
#      the default model's architecture and tokenizer (MODEL_CONFIG: a folder with its
#      config.json and tokenizer files; the real weights are not installed there). Skipped
#      without MODEL_CONFIG.
# It uses that machine's own Python (PYTHON, default python3, with torch, triton and
# transformers; no virtualenv) and writes its logs and JSON to $OUT (default benchmarks/results).
# STAGE=tests runs only 1, STAGE=bench only 2 and 3 (the device allows 10 minutes a command).
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
out=${OUT:-benchmarks/results}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
"$python" -c 'import torch, triton, transformers as t; print("torch", torch.__version__,
"triton", triton.__version__, "transformers", t.__version__, "cuda", torch.cuda.is_available())'
stage=${STAGE:-all}
tests=0 bench=0 backends=0 engine=0
if [[ $stage != bench ]]; then
timeout "${TEST_TIMEOUT:-300}" "$python" -m pytest -q -m gpu -p no:cacheprovider \
    tests/kernels tests/runtime/test_model_parity.py tests/runtime/test_engine.py \
    tests/runtime/test_sampling.py tests/runtime/test_cuda_graphs.py \
    tests/runtime/test_engine_overlap.py tests/runtime/test_deterministic.py \
    2>&1 | tee "$out/gpu_tests.log"
tests=${PIPESTATUS[0]}
fi
if [[ $stage != tests ]]; then
timeout 120 "$python" benchmarks/bench_decode_attention_gpu.py --out "$out" 2>&1 \
    | tee "$out/gpu_bench.log"
bench=${PIPESTATUS[0]}
timeout 120 "$python" benchmarks/bench_attention_backends.py --out "$out" 2>&1 \
    | tee "$out/gpu_bench_attention_backends.log"
backends=${PIPESTATUS[0]}
if [[ -n "${MODEL_CONFIG:-}" ]]; then
    model=/tmp/radixlang-random-model
    "$python" benchmarks/make_random_model.py "$MODEL_CONFIG" "$model" || engine=1
    # With overlap and CUDA graphs (the CUDA defaults), then without them (the "before").
    timeout "${ENGINE_TIMEOUT:-240}" "$python" benchmarks/bench_engine.py --model "$model" \
        --device cuda --dtypes bfloat16 --out "$out" 2>&1 | tee "$out/gpu_bench_engine.log"
    engine=$(( engine || PIPESTATUS[0] ))
    timeout "${ENGINE_TIMEOUT:-240}" "$python" benchmarks/bench_engine.py --model "$model" \
        --device cuda --dtypes bfloat16 --no-overlap --no-cuda-graphs --hf-batches 32 \
        --out "$out/eager" 2>&1 | tee "$out/gpu_bench_engine_eager.log"
    engine=$(( engine || PIPESTATUS[0] ))
    # The host-overhead floor on the GPU: a null forward, with and without overlap.
    timeout 240 "$python" benchmarks/bench_host_overhead.py --model "$model" --device cuda \
        --batches 64 256 --repeats 2 --out "$out" 2>&1 | tee "$out/gpu_bench_host_overhead.log"
    engine=$(( engine || PIPESTATUS[0] ))
fi
fi
echo "gpu tests exit $tests, bandwidth benchmark exit $bench, attention backends benchmark" \
    "exit $backends, engine benchmarks exit $engine"
exit $(( tests || bench || engine ))
