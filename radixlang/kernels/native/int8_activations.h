// Activations quantized to int8 per 32-element block, the integer dot products the block
// kernels (block32_linear.cpp, kquant_linear.cpp) build on, and the loops that tile a linear
// for them. Each kernel is built alone, so these are inline and live in the kernels' own
// namespace.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define RADIXLANG_AVX2 1
#endif

namespace radixlang {

constexpr int QK = 32;  // elements per activation block

// Rows of x per tile: a tile keeps ROWS x X_ROWS vector accumulators in registers, and AVX-512
// has 32 vector registers where AVX2 has 16.
#ifdef __AVX512F__
constexpr int X_ROWS_PER_TILE = 4;
#else
constexpr int X_ROWS_PER_TILE = 2;
#endif

inline float half_at(const uint8_t* p) {
    _Float16 h;
    std::memcpy(&h, p, sizeof(h));
    return static_cast<float>(h);
}

// Q4_K's sub-block j (0..7) scale and min, from a super-block's 12 bytes of packed 6-bit
// values (llama.cpp's layout).
inline void q4k_scale_min(const uint8_t* s, int j, int& sc, int& m) {
    if (j < 4) {
        sc = s[j] & 63;
        m = s[j + 4] & 63;
    } else {
        sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
        m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

// x quantized per row and block: values, scales, the sums of the values, and the sums of each
// 16-element half (Q6_K's scales cover 16 elements).
struct QuantizedRows {
    int64_t k, nb;
    std::vector<int8_t> q;
    std::vector<float> d;
    std::vector<int32_t> s, half_s;
};

// One 32-element block: d = max|x| / 127, q = round-half-even(x * (1 / d)), and the sums of
// q's two 16-element halves. The vector code does the scalar code's operations lane by lane
// (the same roundings), so both match the numpy reference bit for bit.
inline void quantize_block(const float* src, int8_t* dst, float& d_out, int32_t* half_sums) {
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], amax8 = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
        v[j] = _mm256_loadu_ps(src + 8 * j);
        amax8 = _mm256_max_ps(amax8, _mm256_andnot_ps(sign, v[j]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float d = _mm_cvtss_f32(m4) / 127.0f;
    const __m256 id = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
    __m256i q[4];
    for (int j = 0; j < 4; ++j) {
        q[j] = _mm256_cvtps_epi32(
            _mm256_round_ps(_mm256_mul_ps(v[j], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
    for (int h = 0; h < 2; ++h) {
        const __m256i pair = _mm256_add_epi32(q[2 * h], q[2 * h + 1]);
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(pair), _mm256_extracti128_si256(pair, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
        half_sums[h] = _mm_cvtsi128_si32(s4);
    }
    // packs interleave 128-bit lanes; the permute puts the 4-byte groups back in order.
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    const __m256i ordered = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), ordered);
    d_out = d;
#else
    float amax = 0.0f;
    for (int j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(src[j]));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    half_sums[0] = half_sums[1] = 0;
    for (int j = 0; j < QK; ++j) {
        const int v = static_cast<int>(std::nearbyint(src[j] * id));
        dst[j] = static_cast<int8_t>(v);
        half_sums[j / 16] += v;
    }
    d_out = d;
#endif
}

inline void quantize_rows(const float* x, int64_t m, int64_t k, QuantizedRows& out, int threads = 1) {
    const int64_t nb = k / QK;
    out.k = k;
    out.nb = nb;
    out.q.resize(m * k);
    out.d.resize(m * nb);
    out.s.resize(m * nb);
    out.half_s.resize(2 * m * nb);
    // Rows are contiguous, so block i of the whole array; threads only where there is enough.
    const int use = m * nb >= 4096 ? threads : 1;
#pragma omp parallel for schedule(static) num_threads(use)
    for (int64_t i = 0; i < m * nb; ++i) {
        int32_t* half = out.half_s.data() + 2 * i;
        quantize_block(x + i * QK, out.q.data() + i * QK, out.d[i], half);
        out.s[i] = half[0] + half[1];
    }
}

#ifdef RADIXLANG_AVX2

// u8 a times s8 b, summed over groups of four bytes into acc's eight int32 lanes.
inline __m256i dot_u8s8(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, a, b);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, a, b);
#else
    // |a| <= 128 and |b| <= 127 here, so the pairs' int16 sums cannot saturate.
    const __m256i pairs = _mm256_maddubs_epi16(a, b);
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}

inline float hsum(__m256 v) {
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    const __m128 s1 = _mm_add_ss(s2, _mm_movehdup_ps(s2));
    return _mm_cvtss_f32(s1);
}

#endif

// fn(std::integral_constant<int, F>{}) for the F of Formats equal to format: 0, or -1 where
// none is (a format the kernel does not take).
template <int... Formats, typename Fn>
int dispatch_format(int format, Fn&& fn) {
    const bool found =
        ((format == Formats ? (fn(std::integral_constant<int, Formats>{}), true) : false) || ...);
    return found ? 0 : -1;
}

// The running sum of one (row of x, row of W) pair between passes over K: eight float lanes
// (the vector kernels' accumulator; scalar code uses lane 0) and a scalar for the terms that
// do not depend on W's values (Q4_1's and Q4_K's mins).
struct PairSum {
    float lanes[8];
    float extra;
};

inline float finish(const PairSum& s) {
#ifdef RADIXLANG_AVX2
    return hsum(_mm256_loadu_ps(s.lanes)) + s.extra;
#else
    return s.lanes[0] + s.extra;
#endif
}

// Activation blocks of K per pass. A tile's weights for one pass (ROWS rows x 64 blocks, a few
// KB) stay in L1 while every row of x goes past them, so a batch reads each weight from memory
// once, not once per group of rows. Fixed, so that a pair's sums never depend on the batch.
constexpr int64_t PASS_BLOCKS = 64;

// y = x @ W^T, threads splitting W's rows. Kernel supplies ROWS (W rows per tile), X_ROWS (x
// rows per tile) and
//   template <int R, int MT> static void tile(w, row_bytes, x, m0, n0, b0, b1, PairSum* sums)
// which adds blocks [b0, b1) of R rows of W (from n0) against MT rows of x (from m0) to
// sums[t * R + r]. Every pair is summed over the same passes in the same order whatever the
// batch, the tile it falls in and the thread count: batch-invariant.
template <typename Kernel, int R>
void rows_against_all(const uint8_t* w, int64_t row_bytes, const QuantizedRows& x, int64_t m,
                      int64_t n0, float* y, int64_t ldy, PairSum* sums) {
    constexpr int MT = Kernel::X_ROWS;
    std::memset(sums, 0, sizeof(PairSum) * m * R);
    for (int64_t b0 = 0; b0 < x.nb; b0 += PASS_BLOCKS) {
        const int64_t b1 = std::min(x.nb, b0 + PASS_BLOCKS);
        int64_t m0 = 0;
        for (; m0 + MT <= m; m0 += MT) {
            Kernel::template tile<R, MT>(w, row_bytes, x, m0, n0, b0, b1, sums + m0 * R);
        }
        for (; m0 < m; ++m0) {
            Kernel::template tile<R, 1>(w, row_bytes, x, m0, n0, b0, b1, sums + m0 * R);
        }
    }
    for (int64_t t = 0; t < m; ++t) {
        for (int r = 0; r < R; ++r) y[t * ldy + n0 + r] = finish(sums[t * R + r]);
    }
}

template <typename Kernel>
void tiled_linear(const uint8_t* w, int64_t n, int64_t row_bytes, const QuantizedRows& x,
                  int64_t m, float* y, int64_t ldy, int threads) {
    constexpr int R = Kernel::ROWS;
    const int64_t tiles = (n + R - 1) / R;
#pragma omp parallel num_threads(threads)
    {
        std::vector<PairSum> sums(m * R);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < tiles; ++i) {
            const int64_t n0 = i * R;
            if (n0 + R <= n) {
                rows_against_all<Kernel, R>(w, row_bytes, x, m, n0, y, ldy, sums.data());
            } else {
                for (int64_t row = n0; row < n; ++row) {
                    rows_against_all<Kernel, 1>(w, row_bytes, x, m, row, y, ldy, sums.data());
                }
            }
        }
    }
}

}  // namespace radixlang
