// y = x @ W^T for W stored in GGUF's 32-element blocks (Q4_0, Q4_1, Q8_0), read in place: the
// weights stay in the file's bytes (often a memory map), never dequantized to a copy.
//
// Activations are quantized per row and 32-element block to int8 with one float scale
// (dx = max|x| / 127, q = round-to-nearest-even(x / dx)), as llama.cpp's Q8 activations are, so
// each block's dot product is one integer dot of 32 bytes:
//   Q8_0: dw * dx * sum(qw * qx)
//   Q4_0: dw * dx * (sum(n * qx) - 8 * sum(qx))     (n the 4-bit value, 0..15)
//   Q4_1: dw * dx * sum(n * qx) + mw * dx * sum(qx)
// The integer dots run on AVX-512 VNNI / AVX-VNNI (vpdpbusd) where present, on AVX2 otherwise
// (vpmaddubsw + vpmaddwd), and in scalar code elsewhere.
//
// Every (row of x, row of W) pair is summed the same way whatever the batch size, the tile it
// falls in and the thread count (eight float lanes over the blocks in order, then one fixed
// horizontal sum): the kernel is batch-invariant, so deterministic mode uses it as it is.
// Threads split the output rows; K is walked in passes so that a batch reads each weight once
// (int8_activations.h's tiled_linear).
//
// Built and loaded like paged_attention.cpp (kernels/native_build.py), without reassociation or
// contraction, so that the quantizers (of activations, and of float weights at load) match their
// numpy references bit for bit.

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "floats.h"
#include "int8_activations.h"

namespace {

using radixlang::QK;
using radixlang::PairSum;
using radixlang::QuantizedRows;
using radixlang::half_at;
using radixlang::quantize_rows;
#ifdef RADIXLANG_AVX2
using radixlang::dot_u8s8;
using radixlang::hsum;
#endif

// ggml's type ids, as GGUF stores them.
enum Format : int { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };

int block_bytes(int format) {
    switch (format) {
        case Q4_0:
            return 18;
        case Q4_1:
            return 20;
        case Q8_0:
            return 34;
        default:
            return 0;
    }
}

// The weights of one block: the scale, the min (Q4_1), and the 32 values' bytes.
struct WeightBlock {
    float d, m;
    const uint8_t* qs;
};

inline WeightBlock weight_block(const uint8_t* blk, int format) {
    if (format == Q4_1) return {half_at(blk), half_at(blk + 2), blk + 4};
    return {half_at(blk), 0.0f, blk + 2};
}

// One pair's block as integers, in scalar code: sum(w * qx) with w = n (Q4) or qw (Q8_0).
inline int32_t scalar_dot(const uint8_t* qs, const int8_t* xq, int format) {
    int32_t sum = 0;
    if (format == Q8_0) {
        const int8_t* w = reinterpret_cast<const int8_t*>(qs);
        for (int j = 0; j < QK; ++j) sum += w[j] * xq[j];
    } else {
        for (int j = 0; j < QK / 2; ++j) {
            sum += (qs[j] & 0x0f) * xq[j] + (qs[j] >> 4) * xq[j + QK / 2];
        }
    }
    return sum;
}

#ifdef RADIXLANG_AVX2

// A Q4 block's 32 values as bytes 0..15, in element order (low nibbles first).
inline __m256i nibbles(const uint8_t* qs) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    const __m128i mask = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(bytes, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    return _mm256_set_m128i(hi, lo);
}

// R rows of W against MT rows of x over blocks [b0, b1), added to sums[t * R + r].
template <int F, int R, int MT>
void tile(const uint8_t* w, int64_t row_bytes, const QuantizedRows& x, int64_t m0, int64_t n0,
          int64_t b0, int64_t b1, PairSum* sums) {
    constexpr int BYTES = F == Q4_0 ? 18 : F == Q4_1 ? 20 : 34;
    __m256 acc[R][MT];
    float min_acc[R][MT];
    for (int r = 0; r < R; ++r) {
        for (int t = 0; t < MT; ++t) {
            acc[r][t] = _mm256_loadu_ps(sums[t * R + r].lanes);
            min_acc[r][t] = sums[t * R + r].extra;
        }
    }
    const int64_t nb = x.nb;
    for (int64_t b = b0; b < b1; ++b) {
        __m256i wv[R], wsign[R];
        __m256 dw[R];
        float mw[R];
        for (int r = 0; r < R; ++r) {
            const WeightBlock blk = weight_block(w + (n0 + r) * row_bytes + b * BYTES, F);
            dw[r] = _mm256_set1_ps(blk.d);
            mw[r] = blk.m;
            if (F == Q8_0) {
                wsign[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk.qs));
                wv[r] = _mm256_sign_epi8(wsign[r], wsign[r]);  // |w| as u8
            } else {
                wv[r] = nibbles(blk.qs);
            }
        }
        for (int t = 0; t < MT; ++t) {
            const int64_t i = (m0 + t) * nb + b;
            const __m256i xv =
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q.data() + i * QK));
            const float dx = x.d[i];
            const __m256 dxv = _mm256_set1_ps(dx);
            // Q4_0's -8 offset enters as the integer dot's starting value.
            const __m256i start =
                F == Q4_0 ? _mm256_setr_epi32(-8 * x.s[i], 0, 0, 0, 0, 0, 0, 0)
                          : _mm256_setzero_si256();
            const float xsum = dx * static_cast<float>(x.s[i]);
            for (int r = 0; r < R; ++r) {
                const __m256i dot = F == Q8_0
                                        ? dot_u8s8(start, wv[r], _mm256_sign_epi8(xv, wsign[r]))
                                        : dot_u8s8(start, wv[r], xv);
                acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dw[r], dxv),
                                            acc[r][t]);
                if (F == Q4_1) min_acc[r][t] = std::fma(mw[r], xsum, min_acc[r][t]);
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        for (int t = 0; t < MT; ++t) {
            _mm256_storeu_ps(sums[t * R + r].lanes, acc[r][t]);
            sums[t * R + r].extra = min_acc[r][t];
        }
    }
}

#else  // scalar code: the same sums, lane by lane, so results match the vector builds closely

template <int F, int R, int MT>
void tile(const uint8_t* w, int64_t row_bytes, const QuantizedRows& x, int64_t m0, int64_t n0,
          int64_t b0, int64_t b1, PairSum* sums) {
    const int bytes = block_bytes(F);
    for (int t = 0; t < MT; ++t) {
        for (int r = 0; r < R; ++r) {
            float acc = sums[t * R + r].lanes[0], min_acc = sums[t * R + r].extra;
            for (int64_t b = b0; b < b1; ++b) {
                const int64_t i = (m0 + t) * x.nb + b;
                const WeightBlock blk = weight_block(w + (n0 + r) * row_bytes + b * bytes, F);
                int32_t dot = scalar_dot(blk.qs, x.q.data() + i * QK, F);
                if (F == Q4_0) dot -= 8 * x.s[i];
                acc = std::fma(static_cast<float>(dot), blk.d * x.d[i], acc);
                if (F == Q4_1) min_acc = std::fma(blk.m, x.d[i] * static_cast<float>(x.s[i]), min_acc);
            }
            sums[t * R + r].lanes[0] = acc;
            sums[t * R + r].extra = min_acc;
        }
    }
}

#endif

template <int F>
struct Block32 {
    static constexpr int ROWS = 4;  // weight rows per tile
    static constexpr int X_ROWS = radixlang::X_ROWS_PER_TILE;
    template <int R, int MT>
    static void tile(const uint8_t* w, int64_t row_bytes, const QuantizedRows& x, int64_t m0,
                     int64_t n0, int64_t b0, int64_t b1, PairSum* sums) {
        ::tile<F, R, MT>(w, row_bytes, x, m0, n0, b0, b1, sums);
    }
};

template <int F>
void linear(const uint8_t* w, int64_t n, int64_t row_bytes, const QuantizedRows& x, int64_t m,
            float* y, int64_t ldy, int threads) {
    radixlang::tiled_linear<Block32<F>>(w, n, row_bytes, x, m, y, ldy, threads);
}

template <int F, typename Out>
void dequantize(const uint8_t* w, int64_t n, int64_t k, int64_t row_bytes, Out* out, int threads) {
    const int64_t nb = k / QK;
    constexpr int BYTES = F == Q4_0 ? 18 : F == Q4_1 ? 20 : 34;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t row = 0; row < n; ++row) {
        for (int64_t b = 0; b < nb; ++b) {
            const WeightBlock blk = weight_block(w + row * row_bytes + b * BYTES, F);
            float values[QK];
            if (F == Q8_0) {
                const int8_t* q = reinterpret_cast<const int8_t*>(blk.qs);
                for (int j = 0; j < QK; ++j) values[j] = blk.d * static_cast<float>(q[j]);
            } else {
                const float offset = F == Q4_0 ? -8.0f : 0.0f;
                for (int j = 0; j < QK / 2; ++j) {
                    const float lo = static_cast<float>(blk.qs[j] & 0x0f) + offset;
                    const float hi = static_cast<float>(blk.qs[j] >> 4) + offset;
                    values[j] = F == Q4_1 ? std::fma(lo, blk.d, blk.m) : lo * blk.d;
                    values[j + QK / 2] = F == Q4_1 ? std::fma(hi, blk.d, blk.m) : hi * blk.d;
                }
            }
            Out* dst = out + row * k + b * QK;
            for (int j = 0; j < QK; ++j) {
                if constexpr (sizeof(Out) == 2) {
                    dst[j] = radixlang::float_to_bf16(values[j]);
                } else {
                    dst[j] = values[j];
                }
            }
        }
    }
}

// One row of float weights as blocks, as llama.cpp's reference quantizers (and the gguf
// package's, bit for bit) make them: Q8_0 rounds half away from zero at d = max|x| / 127;
// Q4_0 scales by the value of largest magnitude over -8 and truncates x / d + 8.5.
void quantize_row(const float* x, int64_t k, int format, uint8_t* out) {
    const int bytes = block_bytes(format);
    for (int64_t b = 0; b < k / QK; ++b) {
        const float* src = x + b * QK;
        uint8_t* blk = out + b * bytes;
        if (format == Q8_0) {
            float amax = 0.0f;
            for (int j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(src[j]));
            const float d = amax / 127.0f;
            const float id = d != 0.0f ? 1.0f / d : 0.0f;
            const _Float16 h = static_cast<_Float16>(d);
            std::memcpy(blk, &h, 2);
            for (int j = 0; j < QK; ++j) {
                blk[2 + j] = static_cast<uint8_t>(static_cast<int8_t>(std::round(src[j] * id)));
            }
        } else {  // Q4_0
            float amax = 0.0f, max = 0.0f;
            for (int j = 0; j < QK; ++j) {
                if (std::fabs(src[j]) > amax) {
                    amax = std::fabs(src[j]);
                    max = src[j];
                }
            }
            const float d = max / -8.0f;
            const float id = d != 0.0f ? 1.0f / d : 0.0f;
            const _Float16 h = static_cast<_Float16>(d);
            std::memcpy(blk, &h, 2);
            for (int j = 0; j < QK / 2; ++j) {
                const float lo = std::trunc(src[j] * id + 8.5f);
                const float hi = std::trunc(src[j + QK / 2] * id + 8.5f);
                const int a = std::min(15, static_cast<int>(lo));
                const int c = std::min(15, static_cast<int>(hi));
                blk[2 + j] = static_cast<uint8_t>(a | (c << 4));
            }
        }
    }
}

}  // namespace

extern "C" {

// Float32 weights [n, k] quantized to `format` (Q8_0 or Q4_0) into out (n rows of k / 32
// blocks). Returns 0, or -1 for a format it does not make.
int radixlang_block32_quantize(int format, const float* w, int64_t n, int64_t k, uint8_t* out,
                               int threads) {
    if (format != Q8_0 && format != Q4_0) return -1;
    const int64_t row_bytes = k / QK * block_bytes(format);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t row = 0; row < n; ++row) quantize_row(w + row * k, k, format, out + row * row_bytes);
    return 0;
}

// Bytes of one block of `format` (a ggml type id), 0 for a format this kernel does not take.
int radixlang_block32_bytes(int format) { return block_bytes(format); }

// y[i * ldy + j] = sum_k x[i, k] * W[j, k] for i < m, j < n; W is n rows of row_bytes bytes of
// `format` blocks (k / 32 per row); x is float32 [m, k], k a multiple of 32. Returns 0, or -1
// for a format it does not take.
int radixlang_block32_linear(int format, const uint8_t* w, int64_t n, int64_t k, int64_t row_bytes,
                             const float* x, int64_t m, float* y, int64_t ldy, int threads) {
    QuantizedRows qx;
    quantize_rows(x, m, k, qx, threads);
    return radixlang::dispatch_format<Q4_0, Q4_1, Q8_0>(format, [&](auto tag) {
        linear<decltype(tag)::value>(w, n, row_bytes, qx, m, y, ldy, threads);
    });
}

// x quantized as the linear quantizes it (for tests): q [m, k] int8, d and s [m, k / 32].
void radixlang_block32_quantize_rows(const float* x, int64_t m, int64_t k, int8_t* q, float* d,
                                     int32_t* s) {
    QuantizedRows qx;
    quantize_rows(x, m, k, qx);
    std::memcpy(q, qx.q.data(), m * k);
    std::memcpy(d, qx.d.data(), qx.d.size() * sizeof(float));
    std::memcpy(s, qx.s.data(), qx.s.size() * sizeof(int32_t));
}

// W as float32 (out_dtype 0) or bfloat16 (1), [n, k]. Returns 0, or -1 for an unknown format.
int radixlang_block32_dequantize(int format, const uint8_t* w, int64_t n, int64_t k,
                                 int64_t row_bytes, void* out, int out_dtype, int threads) {
    const bool bf16 = out_dtype == radixlang::BF16;
    auto run = [&](auto tag) {
        constexpr int F = decltype(tag)::value;
        if (bf16) {
            dequantize<F>(w, n, k, row_bytes, static_cast<uint16_t*>(out), threads);
        } else {
            dequantize<F>(w, n, k, row_bytes, static_cast<float*>(out), threads);
        }
    };
    return radixlang::dispatch_format<Q4_0, Q4_1, Q8_0>(format, run);
}

}  // extern "C"
