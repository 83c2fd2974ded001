// Batch-invariant linear layers on CPUs: y = x @ W^T (+ bias), where every output element is
// computed by the same sequence of floating-point operations whatever else is in the call.
//
// oneDNN and BLAS pick their blocking, their micro-kernels and even whether to split the sum
// over K by the shape of the call, so one row's result changes with the number of rows beside
// it (measured here: float32 rows differ between 1 and 2 rows of a 1536-wide input; bfloat16
// rows between batch sizes on AMX machines). Here the sum over K is never split and never
// reordered: each output lane accumulates its products in increasing k with one fused
// multiply-add each (two k at a time with AVX-512 BF16's dot product, a fixed pair), and a row
// is computed by the same code whether it sits in a tile of 1 row or of 12. Rows and output
// panels are the only things divided among threads, so the thread count does not matter either.
//
// W is packed once at load time into panels of PANEL output columns, k-major:
//   layout PLAIN: panel[k][PANEL] in W's dtype (float32, bfloat16 or float16), widened to
//                 float32 as it is loaded; x comes in as float32;
//   layout PAIRS: panel[k / 2][PANEL][2] bfloat16 (AVX-512 BF16 only): x comes in as
//                 bfloat16, its k pairs broadcast against the panel's.
// Columns past n (and with PAIRS an odd k's last) are zeros.
//
// Compiled without -fassociative-math (native_build.py): the plain loops may not be reordered.

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "floats.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define RADIXLANG_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define RADIXLANG_AVX2 1
#endif

namespace {

using namespace radixlang;

enum Layout : int { PLAIN = 0, PAIRS = 1 };

#if defined(RADIXLANG_AVX512)
constexpr int PANEL = 32;  // two 16-float vectors
constexpr int MR = 12;     // rows per register tile: 24 accumulators of 32 registers
#elif defined(RADIXLANG_AVX2)
constexpr int PANEL = 16;  // two 8-float vectors
constexpr int MR = 6;      // 12 accumulators of 16 registers
#else
constexpr int PANEL = 16;
constexpr int MR = 4;
#endif
// Rows per task: a thread takes (panel, row block) tasks, panel by panel, so a panel stays in
// its cache while the rows stream past it.
constexpr int64_t ROW_BLOCK = 8 * MR;
// K is walked in passes, so that the panel's slice and a row tile's stay in L1 while the tiles
// of a task's rows go by: 128 k pairs (PAIRS: 16 KB of panel), 128 k (PLAIN: 8-16 KB). The sums
// are stored and reloaded between passes, which changes no bit of them.
constexpr int64_t PASS_PAIRS = 128;
constexpr int64_t PASS_K = 128;

inline size_t dtype_size(int dtype) { return dtype == F32 ? 4 : 2; }

// ---- register tiles: ROWS rows of x against one panel, added to out[r][0..PANEL) ----------

#if defined(RADIXLANG_AVX512)

template <int WD>
inline void load_panel_row(const void* panel, int64_t k, __m512& lo, __m512& hi) {
    if constexpr (WD == F32) {
        const float* p = static_cast<const float*>(panel) + k * PANEL;
        lo = _mm512_loadu_ps(p);
        hi = _mm512_loadu_ps(p + 16);
    } else if constexpr (WD == BF16) {
        const uint16_t* p = static_cast<const uint16_t*>(panel) + k * PANEL;
        const __m512i a = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
        const __m512i b =
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16)));
        lo = _mm512_castsi512_ps(_mm512_slli_epi32(a, 16));
        hi = _mm512_castsi512_ps(_mm512_slli_epi32(b, 16));
    } else {
        const uint16_t* p = static_cast<const uint16_t*>(panel) + k * PANEL;
        lo = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
        hi = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16)));
    }
}

template <int ROWS, int WD>
void tile_plain(const float* x, int64_t ldx, int64_t k0, int64_t k1, const void* panel,
                float out[][PANEL]) {
    __m512 acc[ROWS][2];
    for (int r = 0; r < ROWS; ++r) {
        acc[r][0] = _mm512_loadu_ps(out[r]);
        acc[r][1] = _mm512_loadu_ps(out[r] + 16);
    }
    for (int64_t k = k0; k < k1; ++k) {
        __m512 lo, hi;
        load_panel_row<WD>(panel, k, lo, hi);
        for (int r = 0; r < ROWS; ++r) {
            const __m512 xv = _mm512_set1_ps(x[r * ldx + k]);
            acc[r][0] = _mm512_fmadd_ps(xv, lo, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(xv, hi, acc[r][1]);
        }
    }
    for (int r = 0; r < ROWS; ++r) {
        _mm512_storeu_ps(out[r], acc[r][0]);
        _mm512_storeu_ps(out[r] + 16, acc[r][1]);
    }
}

#if defined(__AVX512BF16__)
constexpr bool HAS_PAIRS = true;

// x rows of bfloat16 (ldx elements apart, k even-padded), panel in the PAIRS layout: adds k
// pairs [p0, p1) to out (the running sums).
template <int ROWS>
void tile_pairs(const uint16_t* x, int64_t ldx, int64_t p0, int64_t p1, const void* panel,
                float out[][PANEL]) {
    __m512 acc[ROWS][2];
    for (int r = 0; r < ROWS; ++r) {
        acc[r][0] = _mm512_loadu_ps(out[r]);
        acc[r][1] = _mm512_loadu_ps(out[r] + 16);
    }
    const uint16_t* w = static_cast<const uint16_t*>(panel);
    for (int64_t i = p0; i < p1; ++i) {
        const __m512bh lo = (__m512bh)_mm512_loadu_si512(w + i * 2 * PANEL);
        const __m512bh hi = (__m512bh)_mm512_loadu_si512(w + i * 2 * PANEL + 32);
        for (int r = 0; r < ROWS; ++r) {
            int32_t pair;
            std::memcpy(&pair, x + r * ldx + 2 * i, sizeof(pair));
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xv, lo);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xv, hi);
        }
    }
    for (int r = 0; r < ROWS; ++r) {
        _mm512_storeu_ps(out[r], acc[r][0]);
        _mm512_storeu_ps(out[r] + 16, acc[r][1]);
    }
}
#else
constexpr bool HAS_PAIRS = false;
#endif

#elif defined(RADIXLANG_AVX2)
constexpr bool HAS_PAIRS = false;

template <int WD>
inline void load_panel_row(const void* panel, int64_t k, __m256& lo, __m256& hi) {
    if constexpr (WD == F32) {
        const float* p = static_cast<const float*>(panel) + k * PANEL;
        lo = _mm256_loadu_ps(p);
        hi = _mm256_loadu_ps(p + 8);
    } else if constexpr (WD == BF16) {
        const uint16_t* p = static_cast<const uint16_t*>(panel) + k * PANEL;
        const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8));
        lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(a), 16));
        hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
    } else {
        const uint16_t* p = static_cast<const uint16_t*>(panel) + k * PANEL;
#if defined(__F16C__)
        lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
        hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
#else
        alignas(32) float tmp[PANEL];
        for (int j = 0; j < PANEL; ++j) tmp[j] = load(p, j, F16);
        lo = _mm256_load_ps(tmp);
        hi = _mm256_load_ps(tmp + 8);
#endif
    }
}

template <int ROWS, int WD>
void tile_plain(const float* x, int64_t ldx, int64_t k0, int64_t k1, const void* panel,
                float out[][PANEL]) {
    __m256 acc[ROWS][2];
    for (int r = 0; r < ROWS; ++r) {
        acc[r][0] = _mm256_loadu_ps(out[r]);
        acc[r][1] = _mm256_loadu_ps(out[r] + 8);
    }
    for (int64_t k = k0; k < k1; ++k) {
        __m256 lo, hi;
        load_panel_row<WD>(panel, k, lo, hi);
        for (int r = 0; r < ROWS; ++r) {
            const __m256 xv = _mm256_broadcast_ss(x + r * ldx + k);
            acc[r][0] = _mm256_fmadd_ps(xv, lo, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(xv, hi, acc[r][1]);
        }
    }
    for (int r = 0; r < ROWS; ++r) {
        _mm256_storeu_ps(out[r], acc[r][0]);
        _mm256_storeu_ps(out[r] + 8, acc[r][1]);
    }
}

#else
constexpr bool HAS_PAIRS = false;

// Portable: one multiply-add per k and lane, in increasing k (never reassociated: see top).
template <int ROWS, int WD>
void tile_plain(const float* x, int64_t ldx, int64_t k0, int64_t k1, const void* panel,
                float out[][PANEL]) {
    for (int r = 0; r < ROWS; ++r) {
        float acc[PANEL];
        std::memcpy(acc, out[r], sizeof(acc));
        for (int64_t k = k0; k < k1; ++k) {
            const float xv = x[r * ldx + k];
            for (int j = 0; j < PANEL; ++j) acc[j] += xv * load(panel, k * PANEL + j, WD);
        }
        std::memcpy(out[r], acc, sizeof(acc));
    }
}
#endif

template <int WD>
void tile_plain_rows(int rows, const float* x, int64_t ldx, int64_t k0, int64_t k1,
                     const void* panel, float out[][PANEL]) {
    switch (rows) {
#define RADIXLANG_ROWS(R) \
    case R:               \
        return tile_plain<R, WD>(x, ldx, k0, k1, panel, out);
        RADIXLANG_ROWS(1)
        RADIXLANG_ROWS(2)
        RADIXLANG_ROWS(3)
        RADIXLANG_ROWS(4)
#if defined(RADIXLANG_AVX2) || defined(RADIXLANG_AVX512)
        RADIXLANG_ROWS(5)
        RADIXLANG_ROWS(6)
#endif
#if defined(RADIXLANG_AVX512)
        RADIXLANG_ROWS(7)
        RADIXLANG_ROWS(8)
        RADIXLANG_ROWS(9)
        RADIXLANG_ROWS(10)
        RADIXLANG_ROWS(11)
        RADIXLANG_ROWS(12)
#endif
#undef RADIXLANG_ROWS
        default:
            return;
    }
}

#if defined(RADIXLANG_AVX512) && defined(__AVX512BF16__)
void tile_pairs_rows(int rows, const uint16_t* x, int64_t ldx, int64_t p0, int64_t p1,
                     const void* panel, float out[][PANEL]) {
    switch (rows) {
#define RADIXLANG_ROWS(R) \
    case R:               \
        return tile_pairs<R>(x, ldx, p0, p1, panel, out);
        RADIXLANG_ROWS(1)
        RADIXLANG_ROWS(2)
        RADIXLANG_ROWS(3)
        RADIXLANG_ROWS(4)
        RADIXLANG_ROWS(5)
        RADIXLANG_ROWS(6)
        RADIXLANG_ROWS(7)
        RADIXLANG_ROWS(8)
        RADIXLANG_ROWS(9)
        RADIXLANG_ROWS(10)
        RADIXLANG_ROWS(11)
        RADIXLANG_ROWS(12)
#undef RADIXLANG_ROWS
        default:
            return;
    }
}
#endif

struct Problem {
    const void* x;  // [m, ldx]: float32 for PLAIN, bfloat16 for PAIRS
    int64_t ldx;
    int64_t m, k, n;
    const void* packed;
    int layout;
    int w_dtype;
    const float* bias;  // [n] or null
    void* y;            // [m, n] in y_dtype
    int y_dtype;
};

void store_row(const Problem& p, int64_t row, int64_t n0, int width, const float* acc) {
    const float* bias = p.bias;
    switch (p.y_dtype) {
        case BF16: {
            uint16_t* y = static_cast<uint16_t*>(p.y) + row * p.n + n0;
            for (int j = 0; j < width; ++j) y[j] = float_to_bf16(bias ? acc[j] + bias[n0 + j] : acc[j]);
            break;
        }
        case F16: {
            _Float16* y = static_cast<_Float16*>(p.y) + row * p.n + n0;
            for (int j = 0; j < width; ++j)
                y[j] = static_cast<_Float16>(bias ? acc[j] + bias[n0 + j] : acc[j]);
            break;
        }
        default: {
            float* y = static_cast<float*>(p.y) + row * p.n + n0;
            for (int j = 0; j < width; ++j) y[j] = bias ? acc[j] + bias[n0 + j] : acc[j];
        }
    }
}

int64_t panel_elements(const Problem& p) {
    return p.layout == PAIRS ? (p.k + 1) / 2 * 2 * PANEL : p.k * PANEL;
}

void run_task(const Problem& p, int64_t panel_index, int64_t m_begin, int64_t m_end) {
    const char* panel = static_cast<const char*>(p.packed) +
                        panel_index * panel_elements(p) * dtype_size(p.w_dtype);
    const int64_t n0 = panel_index * PANEL;
    const int width = static_cast<int>(std::min<int64_t>(PANEL, p.n - n0));
    alignas(64) float sums[ROW_BLOCK][PANEL] = {};
    const bool pairs = p.layout == PAIRS;
    const int64_t steps = pairs ? (p.k + 1) / 2 : p.k;  // k pairs, or k
    const int64_t pass = pairs ? PASS_PAIRS : PASS_K;
    for (int64_t s0 = 0; s0 < steps; s0 += pass) {
        const int64_t s1 = std::min(steps, s0 + pass);
        for (int64_t m0 = m_begin; m0 < m_end; m0 += MR) {
            const int rows = static_cast<int>(std::min<int64_t>(MR, m_end - m0));
            float(*out)[PANEL] = sums + (m0 - m_begin);
            if (pairs) {
#if defined(RADIXLANG_AVX512) && defined(__AVX512BF16__)
                const uint16_t* x = static_cast<const uint16_t*>(p.x) + m0 * p.ldx;
                tile_pairs_rows(rows, x, p.ldx, s0, s1, panel, out);
#endif
                continue;
            }
            const float* x = static_cast<const float*>(p.x) + m0 * p.ldx;
            switch (p.w_dtype) {
                case BF16:
                    tile_plain_rows<BF16>(rows, x, p.ldx, s0, s1, panel, out);
                    break;
                case F16:
                    tile_plain_rows<F16>(rows, x, p.ldx, s0, s1, panel, out);
                    break;
                default:
                    tile_plain_rows<F32>(rows, x, p.ldx, s0, s1, panel, out);
            }
        }
    }
    for (int64_t row = m_begin; row < m_end; ++row) {
        store_row(p, row, n0, width, sums[row - m_begin]);
    }
}

}  // namespace

extern "C" {

int radixlang_invariant_panel() { return PANEL; }
int radixlang_invariant_has_pairs() { return HAS_PAIRS ? 1 : 0; }

// Pack W [n, k] (row-major, w_dtype) into `packed` in `layout` (PAIRS needs bfloat16):
// ceil(n / PANEL) panels of panel_elements() elements of w_dtype. Returns 0, or -1 when the
// layout is not supported here.
int radixlang_invariant_pack(const void* w, int w_dtype, int64_t n, int64_t k, int layout,
                             void* packed) {
    if (layout == PAIRS && (!HAS_PAIRS || w_dtype != BF16)) return -1;
    const int64_t panels = (n + PANEL - 1) / PANEL;
    const int64_t k_rows = layout == PAIRS ? (k + 1) / 2 * 2 : k;
    const size_t size = dtype_size(w_dtype);
    std::memset(packed, 0, panels * PANEL * k_rows * size);
    char* dst = static_cast<char*>(packed);
    const char* src = static_cast<const char*>(w);
    for (int64_t row = 0; row < n; ++row) {
        const int64_t panel = row / PANEL, col = row % PANEL;
        char* base = dst + panel * PANEL * k_rows * size;
        for (int64_t kk = 0; kk < k; ++kk) {
            const int64_t at = layout == PAIRS ? ((kk / 2) * PANEL + col) * 2 + kk % 2
                                               : kk * PANEL + col;
            std::memcpy(base + at * size, src + (row * k + kk) * size, size);
        }
    }
    return 0;
}

// y [m, n] (y_dtype) = x [m, k] @ W^T (+ bias [n] float32, may be null). x is float32 rows
// `ldx` apart for PLAIN, bfloat16 rows `ldx` apart (k padded to even with a zero) for PAIRS.
int radixlang_invariant_linear(const void* x, int64_t ldx, int64_t m, int64_t k,
                               const void* packed, int layout, int w_dtype, int64_t n,
                               const float* bias, void* y, int y_dtype, int threads) {
    if (layout == PAIRS && !HAS_PAIRS) return -1;
    const Problem p{x, ldx, m, k, n, packed, layout, w_dtype, bias, y, y_dtype};
    const int64_t panels = (n + PANEL - 1) / PANEL;
    const int64_t blocks = (m + ROW_BLOCK - 1) / ROW_BLOCK;
    const int64_t tasks = panels * blocks;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < tasks; ++t) {
        const int64_t panel = t / blocks, block = t % blocks;
        run_task(p, panel, block * ROW_BLOCK, std::min(m, (block + 1) * ROW_BLOCK));
    }
    return 0;
}

}  // extern "C"
