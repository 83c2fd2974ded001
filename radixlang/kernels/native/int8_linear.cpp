// y = (x @ W^T) * scale + bias with W held in int8 (one float scale per output row): weight-only
// quantization for CPUs, where a decode step's matmuls are bound by reading the weights.
//
// W is packed once at load time into panels of PANEL output rows, each stored k-major:
// panel[p][k][0..PANEL) int8, so that one 16-byte load gives a k's weights for the whole panel.
// Small batches multiply straight from the int8 panel (the weights are read once, four times
// fewer bytes than float32); larger ones first widen the panel to float32 in a per-thread
// buffer and run a 6 x 16 register-tiled float microkernel over it.
//
// Built and loaded like paged_attention.cpp (kernels/native_build.py).

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define RADIXLANG_AVX2 1
#endif

namespace {

constexpr int PANEL = 16;  // output rows per panel
constexpr int TILE_M = 6;  // batch rows per float microkernel tile
constexpr int DIRECT_MAX_M = 4;

void epilogue(float* y, int n0, int width, const float* acc, const float* scale,
              const float* bias) {
    for (int j = 0; j < width; ++j) {
        float v = acc[j] * scale[n0 + j];
        if (bias) v += bias[n0 + j];
        y[n0 + j] = v;
    }
}

#ifdef RADIXLANG_AVX2

inline void widen16(const int8_t* src, __m256& lo, __m256& hi) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
    hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)));
}

// A k's 16 panel weights as two float vectors: widened from int8, or loaded as they are.
inline void load16(const int8_t* src, __m256& lo, __m256& hi) { widen16(src, lo, hi); }

inline void load16(const float* src, __m256& lo, __m256& hi) {
    lo = _mm256_loadu_ps(src);
    hi = _mm256_loadu_ps(src + 8);
}

// ROWS rows of x against one panel (int8 straight from the packed weights, or float from a
// widened copy): ROWS x 16 accumulators, one broadcast and two FMAs per row and k.
template <int ROWS, typename Weight>
void tile(const float* x, int64_t k_total, const Weight* panel, float out[][PANEL]) {
    __m256 acc[ROWS][2];
    for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < k_total; ++k) {
        __m256 lo, hi;
        load16(panel + k * PANEL, lo, hi);
        for (int r = 0; r < ROWS; ++r) {
            const __m256 xv = _mm256_broadcast_ss(x + r * k_total + k);
            acc[r][0] = _mm256_fmadd_ps(xv, lo, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(xv, hi, acc[r][1]);
        }
    }
    for (int r = 0; r < ROWS; ++r) {
        _mm256_storeu_ps(out[r], acc[r][0]);
        _mm256_storeu_ps(out[r] + 8, acc[r][1]);
    }
}

template <typename Weight>
void tile_rows(int rows, const float* x, int64_t k_total, const Weight* panel,
               float out[][PANEL]) {
    switch (rows) {
        case 1: tile<1>(x, k_total, panel, out); break;
        case 2: tile<2>(x, k_total, panel, out); break;
        case 3: tile<3>(x, k_total, panel, out); break;
        case 4: tile<4>(x, k_total, panel, out); break;
        case 5: tile<5>(x, k_total, panel, out); break;
        default: tile<6>(x, k_total, panel, out);
    }
}

void widen_panel(const int8_t* panel, int64_t k_total, float* dst) {
    for (int64_t k = 0; k < k_total; ++k) {
        __m256 lo, hi;
        widen16(panel + k * PANEL, lo, hi);
        _mm256_storeu_ps(dst + k * PANEL, lo);
        _mm256_storeu_ps(dst + k * PANEL + 8, hi);
    }
}

#endif

// Portable fallback: the same panels, plain loops.
template <typename Panel>
void generic_tile(int rows, const float* x, int64_t k_total, const Panel* panel,
                  float out[][PANEL]) {
    for (int r = 0; r < rows; ++r) {
        float acc[PANEL] = {0};
        for (int64_t k = 0; k < k_total; ++k) {
            const float xv = x[r * k_total + k];
            for (int j = 0; j < PANEL; ++j) acc[j] += xv * static_cast<float>(panel[k * PANEL + j]);
        }
        std::memcpy(out[r], acc, sizeof(acc));
    }
}

void run_panel(const float* x, int64_t m_total, int64_t k_total, const int8_t* panel,
               float* widened, float* y, int64_t n_total, int n0, const float* scale,
               const float* bias) {
    const int width = static_cast<int>(std::min<int64_t>(PANEL, n_total - n0));
    float out[TILE_M][PANEL];
    const bool direct = m_total <= DIRECT_MAX_M;
#ifdef RADIXLANG_AVX2
    if (!direct) widen_panel(panel, k_total, widened);
    for (int64_t m0 = 0; m0 < m_total; m0 += (direct ? DIRECT_MAX_M : TILE_M)) {
        const int rows = static_cast<int>(std::min<int64_t>(direct ? DIRECT_MAX_M : TILE_M,
                                                            m_total - m0));
        const float* xm = x + m0 * k_total;
        if (direct) {
            tile_rows(rows, xm, k_total, panel, out);
        } else {
            tile_rows(rows, xm, k_total, static_cast<const float*>(widened), out);
        }
        for (int r = 0; r < rows; ++r)
            epilogue(y + (m0 + r) * n_total, n0, width, out[r], scale, bias);
    }
#else
    (void)widened;
    (void)direct;
    for (int64_t m0 = 0; m0 < m_total; m0 += TILE_M) {
        const int rows = static_cast<int>(std::min<int64_t>(TILE_M, m_total - m0));
        generic_tile(rows, x + m0 * k_total, k_total, panel, out);
        for (int r = 0; r < rows; ++r)
            epilogue(y + (m0 + r) * n_total, n0, width, out[r], scale, bias);
    }
#endif
}

}  // namespace

extern "C" {

int radixlang_int8_panel() { return PANEL; }

// Pack W [n, k] int8 row-major into panels: packed[(n / PANEL) * k * PANEL + kk * PANEL + n % PANEL].
// `packed` holds ceil(n / PANEL) * PANEL * k bytes; rows past n are zero.
void radixlang_int8_pack(const int8_t* w, int64_t n, int64_t k, int8_t* packed) {
    const int64_t panels = (n + PANEL - 1) / PANEL;
    std::memset(packed, 0, panels * PANEL * k);
    for (int64_t row = 0; row < n; ++row) {
        int8_t* dst = packed + (row / PANEL) * k * PANEL + row % PANEL;
        const int8_t* src = w + row * k;
        for (int64_t kk = 0; kk < k; ++kk) dst[kk * PANEL] = src[kk];
    }
}

// y [m, n] float32 = x [m, k] float32 @ W^T * scale [n] (+ bias [n], may be null).
void radixlang_int8_linear(const float* x, int64_t m, int64_t k, const int8_t* packed, int64_t n,
                           const float* scale, const float* bias, float* y, int threads) {
    const int64_t panels = (n + PANEL - 1) / PANEL;
#pragma omp parallel num_threads(threads)
    {
        thread_local std::vector<float> widened;
        if (m > DIRECT_MAX_M && static_cast<int64_t>(widened.size()) < k * PANEL)
            widened.resize(k * PANEL);
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; ++p) {
            run_panel(x, m, k, packed + p * k * PANEL, widened.data(), y, n,
                      static_cast<int>(p * PANEL), scale, bias);
        }
    }
}

}  // extern "C"
