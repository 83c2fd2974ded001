// y = x @ W^T for W stored in GGUF's k-quant super-blocks of 256 elements (Q4_K, Q6_K: the
// types of llama.cpp's Q4_K_M mix), read in place, as block32_linear.cpp reads Q4_0/Q8_0.
//
// Activations are quantized per 32-element block (int8_activations.h). A super-block holds
// eight 32-element sub-blocks, each lined up with one activation block:
//   Q4_K (144 bytes): f16 d, f16 dmin, 12 bytes of 6-bit scales and mins (sc[j], m[j]), 128
//        bytes of 4-bit values; value = d * sc[j] * q - dmin * m[j], so a sub-block adds
//        dx * (d * sc[j] * sum(q * qx) - dmin * m[j] * sum(qx));
//   Q6_K (210 bytes): 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8 scales (one per 16
//        elements), f16 d; value = d * scale[i / 16] * (q - 32). A sub-block's integer dot
//        leaves elements 0..15 in lanes 0..3 and 16..31 in lanes 4..7, so the two scales
//        multiply their own lanes.
// Like the 32-element kernel, every (row of x, row of W) pair is summed the same way at any
// batch size, tile and thread count: batch-invariant.

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

using radixlang::half_at;
using radixlang::q4k_scale_min;
using radixlang::QK;
using radixlang::quantize_rows;
using radixlang::PairSum;
using radixlang::QuantizedRows;
#ifdef RADIXLANG_AVX2
using radixlang::dot_u8s8;
using radixlang::hsum;
#endif

enum Format : int { Q4_K = 12, Q6_K = 14 };  // ggml's type ids
constexpr int QKK = 256;                    // elements per super-block
constexpr int SUB = QKK / QK;               // activation blocks per super-block

constexpr int super_bytes(int format) { return format == Q4_K ? 144 : format == Q6_K ? 210 : 0; }

// A super-block's per-sub-block float factors: Q4_K's d * sc[j] and dmin * m[j]; Q6_K's
// d * scale[i] for its sixteen 16-element halves.
struct SuperScales {
    float scale[2 * SUB];
    float min[SUB];
};

template <int F>
inline void super_scales(const uint8_t* blk, SuperScales& out) {
    if (F == Q4_K) {
        const float d = half_at(blk), dmin = half_at(blk + 2);
        for (int j = 0; j < SUB; ++j) {
            int sc, m;
            q4k_scale_min(blk + 4, j, sc, m);
            out.scale[j] = d * static_cast<float>(sc);
            out.min[j] = dmin * static_cast<float>(m);
        }
    } else {
        const float d = half_at(blk + 208);
        const int8_t* scales = reinterpret_cast<const int8_t*>(blk + 192);
        for (int i = 0; i < 2 * SUB; ++i) out.scale[i] = d * static_cast<float>(scales[i]);
    }
}

// Sub-block j's 32 values as integers: Q4_K's q (0..15), Q6_K's q - 32 (-32..31).
template <int F>
inline void sub_values(const uint8_t* blk, int j, int* v) {
    if (F == Q4_K) {
        const uint8_t* qs = blk + 16 + (j / 2) * 32;
        const int shift = 4 * (j % 2);
        for (int i = 0; i < QK; ++i) v[i] = (qs[i] >> shift) & 0x0f;
    } else {
        const int half = j / 4, quarter = j % 4;
        const uint8_t* ql = blk + half * 64 + (quarter % 2) * 32;
        const uint8_t* qh = blk + 128 + half * 32;
        const int shift = quarter < 2 ? 0 : 4;
        for (int i = 0; i < QK; ++i) {
            v[i] = (((ql[i] >> shift) & 0x0f) | (((qh[i] >> (2 * quarter)) & 3) << 4)) - 32;
        }
    }
}

#ifdef RADIXLANG_AVX2

// Sub-block j as the dot's byte operands: Q4_K's values (u8); Q6_K's magnitudes and signs
// (the sign goes onto x, so the u8 x s8 dot stays exact).
template <int F>
inline void sub_vectors(const uint8_t* blk, int j, __m256i& a, __m256i& sign) {
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    if (F == Q4_K) {
        const __m256i qs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + (j / 2) * 32));
        a = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(qs, 4) : qs, low4);
    } else {
        const int half = j / 4, quarter = j % 4;
        const __m256i ql = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(blk + half * 64 + (quarter % 2) * 32));
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + half * 32));
        const __m256i lo = _mm256_and_si256(quarter < 2 ? ql : _mm256_srli_epi16(ql, 4), low4);
        const __m128i count = _mm_cvtsi32_si128(2 * quarter);
        const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(qh, count), _mm256_set1_epi8(3));
        const __m256i q = _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)),
                                          _mm256_set1_epi8(32));
        sign = q;
        a = _mm256_sign_epi8(q, q);
    }
}

template <int F, int R, int MT>
void tile(const uint8_t* w, int64_t row_bytes, const QuantizedRows& x, int64_t m0, int64_t n0,
          int64_t b0, int64_t b1, PairSum* sums) {
    constexpr int BYTES = super_bytes(F);
    __m256 acc[R][MT];
    float min_acc[R][MT];
    for (int r = 0; r < R; ++r) {
        for (int t = 0; t < MT; ++t) {
            acc[r][t] = _mm256_loadu_ps(sums[t * R + r].lanes);
            min_acc[r][t] = sums[t * R + r].extra;
        }
    }
    const int64_t nb = x.nb;
    for (int64_t sb = b0 / SUB; sb < b1 / SUB; ++sb) {
        SuperScales scales[R];
        const uint8_t* blk[R];
        for (int r = 0; r < R; ++r) {
            blk[r] = w + (n0 + r) * row_bytes + sb * BYTES;
            super_scales<F>(blk[r], scales[r]);
        }
        for (int j = 0; j < SUB; ++j) {
            __m256i a[R], sign[R];
            __m256 factor[R];
            for (int r = 0; r < R; ++r) {
                sub_vectors<F>(blk[r], j, a[r], sign[r]);
                factor[r] = F == Q4_K ? _mm256_set1_ps(scales[r].scale[j])
                                      : _mm256_set_m128(_mm_set1_ps(scales[r].scale[2 * j + 1]),
                                                        _mm_set1_ps(scales[r].scale[2 * j]));
            }
            const int64_t b = sb * SUB + j;
            for (int t = 0; t < MT; ++t) {
                const int64_t i = (m0 + t) * nb + b;
                const __m256i xv =
                    _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q.data() + i * QK));
                const __m256 dxv = _mm256_set1_ps(x.d[i]);
                const float xsum = x.d[i] * static_cast<float>(x.s[i]);
                for (int r = 0; r < R; ++r) {
                    const __m256i dot =
                        F == Q4_K ? dot_u8s8(_mm256_setzero_si256(), a[r], xv)
                                  : dot_u8s8(_mm256_setzero_si256(), a[r], _mm256_sign_epi8(xv, sign[r]));
                    acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                                                _mm256_mul_ps(factor[r], dxv), acc[r][t]);
                    if (F == Q4_K) min_acc[r][t] = std::fma(-scales[r].min[j], xsum, min_acc[r][t]);
                }
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

#else  // scalar code: the same sums, lane by lane

template <int F, int R, int MT>
void tile(const uint8_t* w, int64_t row_bytes, const QuantizedRows& x, int64_t m0, int64_t n0,
          int64_t b0, int64_t b1, PairSum* sums) {
    constexpr int BYTES = super_bytes(F);
    for (int t = 0; t < MT; ++t) {
        for (int r = 0; r < R; ++r) {
            float acc = sums[t * R + r].lanes[0], min_acc = sums[t * R + r].extra;
            for (int64_t sb = b0 / SUB; sb < b1 / SUB; ++sb) {
                const uint8_t* blk = w + (n0 + r) * row_bytes + sb * BYTES;
                SuperScales scales;
                super_scales<F>(blk, scales);
                for (int j = 0; j < SUB; ++j) {
                    const int64_t i = (m0 + t) * x.nb + sb * SUB + j;
                    const int8_t* xq = x.q.data() + i * QK;
                    int v[QK];
                    sub_values<F>(blk, j, v);
                    int32_t lo = 0, hi = 0;
                    for (int e = 0; e < QK / 2; ++e) lo += v[e] * xq[e];
                    for (int e = QK / 2; e < QK; ++e) hi += v[e] * xq[e];
                    if (F == Q4_K) {
                        acc = std::fma(static_cast<float>(lo + hi), scales.scale[j] * x.d[i], acc);
                        min_acc = std::fma(-scales.min[j], x.d[i] * static_cast<float>(x.s[i]),
                                           min_acc);
                    } else {
                        acc = std::fma(static_cast<float>(lo), scales.scale[2 * j] * x.d[i], acc);
                        acc = std::fma(static_cast<float>(hi), scales.scale[2 * j + 1] * x.d[i], acc);
                    }
                }
            }
            sums[t * R + r].lanes[0] = acc;
            sums[t * R + r].extra = min_acc;
        }
    }
}

#endif

// Passes over K end on super-block boundaries.
static_assert(radixlang::PASS_BLOCKS % SUB == 0);

template <int F>
struct KQuant {
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
    radixlang::tiled_linear<KQuant<F>>(w, n, row_bytes, x, m, y, ldy, threads);
}

template <int F, typename Out>
void dequantize(const uint8_t* w, int64_t n, int64_t k, int64_t row_bytes, Out* out, int threads) {
    constexpr int BYTES = super_bytes(F);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t row = 0; row < n; ++row) {
        for (int64_t sb = 0; sb < k / QKK; ++sb) {
            const uint8_t* blk = w + row * row_bytes + sb * BYTES;
            SuperScales scales;
            super_scales<F>(blk, scales);
            for (int j = 0; j < SUB; ++j) {
                int v[QK];
                sub_values<F>(blk, j, v);
                Out* dst = out + row * k + sb * QKK + j * QK;
                for (int e = 0; e < QK; ++e) {
                    // As the gguf package computes it: (d * sc) * q - dmin * m, two roundings.
                    const float value = F == Q4_K
                                            ? scales.scale[j] * static_cast<float>(v[e]) - scales.min[j]
                                            : scales.scale[2 * j + e / 16] * static_cast<float>(v[e]);
                    if constexpr (sizeof(Out) == 2) {
                        dst[e] = radixlang::float_to_bf16(value);
                    } else {
                        dst[e] = value;
                    }
                }
            }
        }
    }
}

template <typename Fn>
int dispatch(int format, Fn&& fn) {
    return radixlang::dispatch_format<Q4_K, Q6_K>(format, fn);
}

}  // namespace

extern "C" {

// Bytes of one super-block of `format` (a ggml type id), 0 for a format this kernel does not
// take.
int radixlang_kquant_bytes(int format) { return super_bytes(format); }

// As radixlang_block32_linear, for k a multiple of 256.
int radixlang_kquant_linear(int format, const uint8_t* w, int64_t n, int64_t k, int64_t row_bytes,
                            const float* x, int64_t m, float* y, int64_t ldy, int threads) {
    if (super_bytes(format) == 0) return -1;
    QuantizedRows qx;
    quantize_rows(x, m, k, qx, threads);
    return dispatch(format, [&](auto tag) {
        linear<decltype(tag)::value>(w, n, row_bytes, qx, m, y, ldy, threads);
    });
}

// W as float32 (out_dtype 0) or bfloat16 (1), [n, k].
int radixlang_kquant_dequantize(int format, const uint8_t* w, int64_t n, int64_t k,
                                int64_t row_bytes, void* out, int out_dtype, int threads) {
    return dispatch(format, [&](auto tag) {
        constexpr int F = decltype(tag)::value;
        if (out_dtype == radixlang::BF16) {
            dequantize<F>(w, n, k, row_bytes, static_cast<uint16_t*>(out), threads);
        } else {
            dequantize<F>(w, n, k, row_bytes, static_cast<float*>(out), threads);
        }
    });
}

}  // extern "C"
