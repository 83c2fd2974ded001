// RMSNorm over the rows of a matrix on CPUs, after adding a residual branch in place: one call
// where torch runs about ten ops (upcast, square, mean, add, rsqrt, multiply, downcast, multiply
// by the weight, and the residual add before), 15-20 us at decode's few rows.
//
// Rounding as torch's: the sum `residual + delta` rounded to the residual's dtype (as torch's
// add); the row normalized and multiplied by the weight in float32, rounded once (F.rms_norm).
// Only the sum of squares may round differently (its order is not torch's). Each row is computed alone by the same code, whatever the
// number of rows or threads (deterministic inference relies on it).
//
// Built by radixlang/kernels/native_build.py, loaded with ctypes (kernels/rms_norm.py).

#include <omp.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "floats.h"

namespace {

using namespace radixlang;

// Rows below this many elements in all run on the calling thread: a parallel region costs more
// than a decode step's few rows.
constexpr int64_t PARALLEL_ELEMENTS = 1 << 16;

template <int DTYPE>
void norm_rows(void* residual, const void* delta, const void* weight, void* out, int64_t rows,
               int64_t cols, float eps, int threads) {
    const int use = rows * cols >= PARALLEL_ELEMENTS ? threads : 1;
#pragma omp parallel num_threads(use)
    {
        thread_local std::vector<float> row;
        if (static_cast<int64_t>(row.size()) < cols) row.resize(cols);
        float* x = row.data();
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r) {
            const int64_t base = r * cols;
            if (delta != nullptr) {
                for (int64_t c = 0; c < cols; ++c) {
                    store(residual, base + c, DTYPE,
                          load(residual, base + c, DTYPE) + load(delta, base + c, DTYPE));
                }
            }
            float squares = 0.0f;
            for (int64_t c = 0; c < cols; ++c) {
                x[c] = load(residual, base + c, DTYPE);
                squares += x[c] * x[c];
            }
            const float inv = 1.0f / std::sqrt(squares / static_cast<float>(cols) + eps);
            for (int64_t c = 0; c < cols; ++c)
                store(out, base + c, DTYPE, x[c] * inv * load(weight, c, DTYPE));
        }
    }
}

}  // namespace

extern "C" {

// residual, delta (null: none), out: [rows, cols] contiguous of `dtype` (radixlang::Dtype);
// weight: [cols] of `dtype`. residual += delta, then out = rms_norm(residual) * weight.
// Returns 0, or -1 for an unknown dtype.
int radixlang_rms_norm(void* residual, const void* delta, const void* weight, void* out,
                       int dtype, int64_t rows, int64_t cols, float eps, int threads) {
    switch (dtype) {
        case F32:
            norm_rows<F32>(residual, delta, weight, out, rows, cols, eps, threads);
            return 0;
        case BF16:
            norm_rows<BF16>(residual, delta, weight, out, rows, cols, eps, threads);
            return 0;
        case F16:
            norm_rows<F16>(residual, delta, weight, out, rows, cols, eps, threads);
            return 0;
        default:
            return -1;
    }
}

}  // extern "C"
