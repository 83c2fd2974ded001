// Activations quantized to int8 per 32-element block, and the integer dot products the block
// kernels (block32_linear.cpp, kquant_linear.cpp) build on. Each kernel is built alone, so
// these are inline and live in the kernels' own namespace.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define RADIXLANG_AVX2 1
#endif

namespace radixlang {

constexpr int QK = 32;  // elements per activation block

inline float half_at(const uint8_t* p) {
    _Float16 h;
    std::memcpy(&h, p, sizeof(h));
    return static_cast<float>(h);
}

// x quantized per row and block: values, scales and the sums of the values.
struct QuantizedRows {
    int64_t k, nb;
    std::vector<int8_t> q;
    std::vector<float> d;
    std::vector<int32_t> s;
};

inline void quantize_rows(const float* x, int64_t m, int64_t k, QuantizedRows& out) {
    const int64_t nb = k / QK;
    out.k = k;
    out.nb = nb;
    out.q.resize(m * k);
    out.d.resize(m * nb);
    out.s.resize(m * nb);
    for (int64_t i = 0; i < m * nb; ++i) {
        const float* src = x + i * QK;  // rows are contiguous, so block i of the whole array
        float amax = 0.0f;
        for (int j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(src[j]));
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        int32_t sum = 0;
        int8_t* dst = out.q.data() + i * QK;
        for (int j = 0; j < QK; ++j) {
            const int v = static_cast<int>(std::nearbyint(src[j] * id));
            dst[j] = static_cast<int8_t>(v);
            sum += v;
        }
        out.d[i] = d;
        out.s[i] = sum;
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

}  // namespace radixlang
