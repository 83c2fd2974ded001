// y = x @ W^T for GGUF block weights repacked at load, eight rows of W interleaved per block
// (Q4_0, Q8_0, Q4_K), so that one integer dot instruction works on eight rows at once.
//
// The file's layout puts a block's 32 values of one row together, so a kernel reading it
// finishes each (row, block) pair with a horizontal sum of eight int32 lanes and spends three
// float operations per pair (convert, scale, add) on one integer dot: the float work, not the
// dot, bounds it. Here a packed block holds eight rows: 4-element groups of each row side by
// side, so lane r of a vpdpbusd against x's group broadcast to every lane is row r's dot. After
// a block's eight groups, lane r holds row r's whole integer dot, and one convert, one scale
// and one fused add finish eight pairs. The packed bytes are as many as the file's (Q4_K's
// sub-block scales are unpacked: 148 bytes per super-block row instead of 144), so a model
// still takes its file's size in memory.
//
// Packed layouts, per group of eight rows and per block (r: row in the group; a chunk is 32
// bytes, byte 4r + i holding element 4c + i of row r for its chunk c):
//   Q4_0 (144 bytes): 8 f16 scales d[r]; 4 chunks of nibbles: the low nibble of chunk c holds
//        elements 4c..4c+3, the high one 16+4c..16+4c+3 (the file's own pairing, so chunk c
//        is the file's bytes 4c..4c+3 of each row).
//   Q8_0 (272 bytes): 8 f16 scales; 8 chunks of int8 values.
//   Q4_K (1184 bytes a super-block of 256): 8 f16 d, 8 f16 dmin, the 6-bit scales sc[j][r]
//        and mins m[j][r] as bytes (64 each), then for each pair of sub-blocks (2p, 2p+1) 8
//        chunks of nibbles, the low nibble sub-block 2p's, the high one 2p+1's.
// Rows past n in the last group are zero (their scales 0) and never written out.
//
// Activations are quantized per 32-element block to int8 (int8_activations.h). Each pair's sum
// is one float lane, added block by block in order with the same operations at every batch
// size, tile and thread count, and the scalar build does lane by lane exactly what the vector
// builds do in each lane: batch-invariant, and the same bits on every build.
//
// Built without reassociation or contraction (native_build.py SOURCE_FLAGS), like the other
// block kernels.

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
using radixlang::QK;
using radixlang::quantize_rows;
using radixlang::QuantizedRows;

enum Format : int { Q4_0 = 2, Q8_0 = 8, Q4_K = 12 };  // ggml's type ids
constexpr int G = 8;                                   // rows per packed group
constexpr int SUB = 8;                                 // 32-element sub-blocks per super-block

// Elements and packed bytes of one block of a group; the file's bytes per row and block.
constexpr int block_elems(int f) { return f == Q4_K ? 256 : 32; }
constexpr int packed_bytes(int f) { return f == Q4_0 ? 144 : f == Q8_0 ? 272 : f == Q4_K ? 1184 : 0; }
constexpr int file_bytes(int f) { return f == Q4_0 ? 18 : f == Q8_0 ? 34 : f == Q4_K ? 144 : 0; }

inline void put_half(uint8_t* dst, const uint8_t* src) { std::memcpy(dst, src, 2); }

inline void q4k_scale_min(const uint8_t* s, int j, int& sc, int& m) {
    if (j < 4) {
        sc = s[j] & 63;
        m = s[j + 4] & 63;
    } else {
        sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
        m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

// One block of up to eight rows (rows[r] == nullptr: a padding row) into the packed layout.
template <int F>
void pack_block(const uint8_t* const* rows, uint8_t* out) {
    std::memset(out, 0, packed_bytes(F));
    for (int r = 0; r < G; ++r) {
        const uint8_t* src = rows[r];
        if (src == nullptr) continue;
        if (F == Q4_0 || F == Q8_0) {
            put_half(out + 2 * r, src);
            const int chunks = F == Q4_0 ? 4 : 8;
            for (int c = 0; c < chunks; ++c) std::memcpy(out + 16 + 32 * c + 4 * r, src + 2 + 4 * c, 4);
        } else {  // Q4_K
            put_half(out + 2 * r, src);
            put_half(out + 16 + 2 * r, src + 2);
            for (int j = 0; j < SUB; ++j) {
                int sc, m;
                q4k_scale_min(src + 4, j, sc, m);
                out[32 + 8 * j + r] = static_cast<uint8_t>(sc);
                out[96 + 8 * j + r] = static_cast<uint8_t>(m);
            }
            for (int p = 0; p < 4; ++p) {
                for (int c = 0; c < 8; ++c) {
                    std::memcpy(out + 160 + 256 * p + 32 * c + 4 * r, src + 16 + 32 * p + 4 * c, 4);
                }
            }
        }
    }
}

// Row r's value e of a packed block (for dequantizing; the file's formulas and roundings).
template <int F>
float packed_value(const uint8_t* blk, int r, int e) {
    if (F == Q4_0) {
        const int c = (e % 16) / 4, i = e % 4;
        const uint8_t byte = blk[16 + 32 * c + 4 * r + i];
        const int q = (e < 16 ? byte & 0x0f : byte >> 4) - 8;
        return static_cast<float>(q) * half_at(blk + 2 * r);
    }
    if (F == Q8_0) {
        const int8_t q = static_cast<int8_t>(blk[16 + 32 * (e / 4) + 4 * r + e % 4]);
        return half_at(blk + 2 * r) * static_cast<float>(q);
    }
    const int j = e / 32, i = e % 32, p = j / 2;
    const uint8_t byte = blk[160 + 256 * p + 32 * (i / 4) + 4 * r + i % 4];
    const int q = j % 2 ? byte >> 4 : byte & 0x0f;
    const float scale = half_at(blk + 2 * r) * static_cast<float>(blk[32 + 8 * j + r]);
    const float min = half_at(blk + 16 + 2 * r) * static_cast<float>(blk[96 + 8 * j + r]);
    return scale * static_cast<float>(q) - min;
}

// ---- the dot products: MT rows of x against one group over blocks [b0, b1) ----------------
//
// acc[t * G + r] is the running sum of x row m0 + t against row r of the group. The vector code
// keeps one __m256 per x row; the scalar code repeats each lane's operations.

#if defined(RADIXLANG_AVX2) && defined(__F16C__)

inline __m256i bcast4(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

inline __m256 scales8(const uint8_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline __m256 bytes8(const uint8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

inline __m256i chunk(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

template <int F, int MT>
void group_tile(const uint8_t* grp, const QuantizedRows& x, int64_t m0, int64_t b0, int64_t b1,
                float* sums) {
    using radixlang::dot_u8s8;
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    __m256 acc[MT];
    for (int t = 0; t < MT; ++t) acc[t] = _mm256_loadu_ps(sums + t * G);
    const int64_t nb = x.nb;
    if constexpr (F == Q4_0) {
        for (int64_t b = b0; b < b1; ++b) {
            const uint8_t* blk = grp + b * packed_bytes(F);
            const __m256 dw = scales8(blk);
            __m256i lo[4], hi[4];
            for (int c = 0; c < 4; ++c) {
                const __m256i v = chunk(blk + 16 + 32 * c);
                lo[c] = _mm256_and_si256(v, low4);
                hi[c] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
            }
            for (int t = 0; t < MT; ++t) {
                const int64_t i = (m0 + t) * nb + b;
                const int8_t* xq = x.q.data() + i * QK;
                __m256i dot = _mm256_set1_epi32(-8 * x.s[i]);
                for (int c = 0; c < 4; ++c) {
                    dot = dot_u8s8(dot, lo[c], bcast4(xq + 4 * c));
                    dot = dot_u8s8(dot, hi[c], bcast4(xq + 16 + 4 * c));
                }
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dw, _mm256_set1_ps(x.d[i])),
                                         acc[t]);
            }
        }
    } else if constexpr (F == Q8_0) {
        for (int64_t b = b0; b < b1; ++b) {
            const uint8_t* blk = grp + b * packed_bytes(F);
            const __m256 dw = scales8(blk);
            for (int t = 0; t < MT; ++t) {
                const int64_t i = (m0 + t) * nb + b;
                const int8_t* xq = x.q.data() + i * QK;
                __m256i dot = _mm256_setzero_si256();
                for (int c = 0; c < 8; ++c) {
                    const __m256i w = chunk(blk + 16 + 32 * c);  // from L1 after the first row
                    // |w| (u8, 128 for -128) against x carrying w's sign: exact in every build.
                    dot = dot_u8s8(dot, _mm256_sign_epi8(w, w), _mm256_sign_epi8(bcast4(xq + 4 * c), w));
                }
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dw, _mm256_set1_ps(x.d[i])),
                                         acc[t]);
            }
        }
    } else {  // Q4_K: b0, b1 are activation blocks, whole super-blocks
        for (int64_t sb = b0 / SUB; sb < b1 / SUB; ++sb) {
            const uint8_t* blk = grp + sb * packed_bytes(F);
            const __m256 d = scales8(blk), dmin = scales8(blk + 16);
            for (int p = 0; p < 4; ++p) {
                const int ja = 2 * p, jb = 2 * p + 1;
                const __m256 sa = _mm256_mul_ps(d, bytes8(blk + 32 + 8 * ja));
                const __m256 sb_ = _mm256_mul_ps(d, bytes8(blk + 32 + 8 * jb));
                const __m256 ma = _mm256_mul_ps(dmin, bytes8(blk + 96 + 8 * ja));
                const __m256 mb = _mm256_mul_ps(dmin, bytes8(blk + 96 + 8 * jb));
                const uint8_t* vals = blk + 160 + 256 * p;
                for (int t = 0; t < MT; ++t) {
                    const int64_t ia = (m0 + t) * nb + sb * SUB + ja, ib = ia + 1;
                    const int8_t* xa = x.q.data() + ia * QK;
                    const int8_t* xb = x.q.data() + ib * QK;
                    __m256i dot_a = _mm256_setzero_si256(), dot_b = _mm256_setzero_si256();
                    for (int c = 0; c < 8; ++c) {
                        const __m256i v = chunk(vals + 32 * c);
                        dot_a = dot_u8s8(dot_a, _mm256_and_si256(v, low4), bcast4(xa + 4 * c));
                        dot_b = dot_u8s8(dot_b, _mm256_and_si256(_mm256_srli_epi16(v, 4), low4),
                                         bcast4(xb + 4 * c));
                    }
                    const float dxa = x.d[ia], dxb = x.d[ib];
                    acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_a), _mm256_mul_ps(sa, _mm256_set1_ps(dxa)),
                                             acc[t]);
                    acc[t] = _mm256_fnmadd_ps(ma, _mm256_set1_ps(dxa * static_cast<float>(x.s[ia])), acc[t]);
                    acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_b), _mm256_mul_ps(sb_, _mm256_set1_ps(dxb)),
                                             acc[t]);
                    acc[t] = _mm256_fnmadd_ps(mb, _mm256_set1_ps(dxb * static_cast<float>(x.s[ib])), acc[t]);
                }
            }
        }
    }
    for (int t = 0; t < MT; ++t) _mm256_storeu_ps(sums + t * G, acc[t]);
}

#else  // scalar code: each lane's operations, in the same order

// Row r's integer dot over a 32-element block (Q4_0: including the -8 offset) or sub-block.
template <int F>
int32_t lane_dot(const uint8_t* blk, int r, int j, const int8_t* xq, int32_t xsum) {
    int32_t dot = 0;
    if (F == Q4_0) {
        dot = -8 * xsum;
        for (int e = 0; e < 16; ++e) {
            const uint8_t byte = blk[16 + 32 * (e / 4) + 4 * r + e % 4];
            dot += (byte & 0x0f) * xq[e] + (byte >> 4) * xq[16 + e];
        }
    } else if (F == Q8_0) {
        for (int e = 0; e < 32; ++e) dot += static_cast<int8_t>(blk[16 + 32 * (e / 4) + 4 * r + e % 4]) * xq[e];
    } else {
        const uint8_t* vals = blk + 160 + 256 * (j / 2);
        for (int e = 0; e < 32; ++e) {
            const uint8_t byte = vals[32 * (e / 4) + 4 * r + e % 4];
            dot += (j % 2 ? byte >> 4 : byte & 0x0f) * xq[e];
        }
    }
    return dot;
}

template <int F, int MT>
void group_tile(const uint8_t* grp, const QuantizedRows& x, int64_t m0, int64_t b0, int64_t b1,
                float* sums) {
    const int64_t nb = x.nb;
    for (int t = 0; t < MT; ++t) {
        for (int r = 0; r < G; ++r) {
            float acc = sums[t * G + r];
            if (F != Q4_K) {
                for (int64_t b = b0; b < b1; ++b) {
                    const uint8_t* blk = grp + b * packed_bytes(F);
                    const int64_t i = (m0 + t) * nb + b;
                    const int32_t dot = lane_dot<F>(blk, r, 0, x.q.data() + i * QK, x.s[i]);
                    acc = std::fma(static_cast<float>(dot), half_at(blk + 2 * r) * x.d[i], acc);
                }
            } else {
                for (int64_t sb = b0 / SUB; sb < b1 / SUB; ++sb) {
                    const uint8_t* blk = grp + sb * packed_bytes(F);
                    const float d = half_at(blk + 2 * r), dmin = half_at(blk + 16 + 2 * r);
                    for (int j = 0; j < SUB; ++j) {
                        const int64_t i = (m0 + t) * nb + sb * SUB + j;
                        const float scale = d * static_cast<float>(blk[32 + 8 * j + r]);
                        const float min = dmin * static_cast<float>(blk[96 + 8 * j + r]);
                        const int32_t dot = lane_dot<F>(blk, r, j, x.q.data() + i * QK, 0);
                        acc = std::fma(static_cast<float>(dot), scale * x.d[i], acc);
                        acc = std::fma(-min, x.d[i] * static_cast<float>(x.s[i]), acc);
                    }
                }
            }
            sums[t * G + r] = acc;
        }
    }
}

#endif

// A group's running sums for every row of x, pass by pass over K (radixlang::PASS_BLOCKS
// activation blocks: a group's pass is a few KB, in L1 while every row of x goes by).
template <int F>
void group_against_all(const uint8_t* grp, const QuantizedRows& x, int64_t m, float* sums) {
    constexpr int MT = radixlang::X_ROWS_PER_TILE;
    std::fill(sums, sums + m * G, 0.0f);
    for (int64_t b0 = 0; b0 < x.nb; b0 += radixlang::PASS_BLOCKS) {
        const int64_t b1 = std::min(x.nb, b0 + radixlang::PASS_BLOCKS);
        int64_t m0 = 0;
        for (; m0 + MT <= m; m0 += MT) group_tile<F, MT>(grp, x, m0, b0, b1, sums + m0 * G);
        for (; m0 < m; ++m0) group_tile<F, 1>(grp, x, m0, b0, b1, sums + m0 * G);
    }
}

static_assert(radixlang::PASS_BLOCKS % SUB == 0, "passes end on super-block boundaries");

template <int F>
void linear(const uint8_t* packed, int64_t n, int64_t k, const QuantizedRows& x, int64_t m,
            float* y, int64_t ldy, int threads) {
    const int64_t groups = (n + G - 1) / G;
    const int64_t group_bytes = k / block_elems(F) * packed_bytes(F);
#pragma omp parallel num_threads(threads)
    {
        std::vector<float> sums(m * G);
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; ++g) {
            group_against_all<F>(packed + g * group_bytes, x, m, sums.data());
            const int rows = static_cast<int>(std::min<int64_t>(G, n - g * G));
            for (int64_t t = 0; t < m; ++t) {
                std::memcpy(y + t * ldy + g * G, sums.data() + t * G, rows * sizeof(float));
            }
        }
    }
}

template <typename Fn>
int dispatch(int format, Fn&& fn) {
    switch (format) {
        case Q4_0:
            fn(std::integral_constant<int, Q4_0>{});
            return 0;
        case Q8_0:
            fn(std::integral_constant<int, Q8_0>{});
            return 0;
        case Q4_K:
            fn(std::integral_constant<int, Q4_K>{});
            return 0;
        default:
            return -1;
    }
}

}  // namespace

extern "C" {

// Bytes of one packed group (eight rows) of a [*, k] matrix of `format`; 0 for a format not
// packed, or a k that is not whole blocks.
int64_t radixlang_packed_group_bytes(int format, int64_t k) {
    const int bytes = packed_bytes(format);
    if (bytes == 0 || k % block_elems(format) != 0) return 0;
    return k / block_elems(format) * bytes;
}

// The file's rows (n rows of row_bytes bytes, k / block elements each) packed into ceil(n / 8)
// groups at out.
int radixlang_packed_pack(int format, const uint8_t* raw, int64_t n, int64_t k, int64_t row_bytes,
                          uint8_t* out, int threads) {
    if (radixlang_packed_group_bytes(format, k) == 0) return -1;
    return dispatch(format, [&](auto tag) {
        constexpr int F = decltype(tag)::value;
        const int64_t blocks = k / block_elems(F), groups = (n + G - 1) / G;
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t g = 0; g < groups; ++g) {
            for (int64_t b = 0; b < blocks; ++b) {
                const uint8_t* rows[G];
                for (int r = 0; r < G; ++r) {
                    const int64_t row = g * G + r;
                    rows[r] = row < n ? raw + row * row_bytes + b * file_bytes(F) : nullptr;
                }
                pack_block<F>(rows, out + (g * blocks + b) * packed_bytes(F));
            }
        }
    });
}

// y[i * ldy + j] = sum_k x[i, k] * W[j, k] for i < m, j < n, W packed; x float32 [m, k].
int radixlang_packed_linear(int format, const uint8_t* packed, int64_t n, int64_t k,
                            const float* x, int64_t m, float* y, int64_t ldy, int threads) {
    if (radixlang_packed_group_bytes(format, k) == 0) return -1;
    QuantizedRows qx;
    quantize_rows(x, m, k, qx);
    return dispatch(format, [&](auto tag) {
        linear<decltype(tag)::value>(packed, n, k, qx, m, y, ldy, threads);
    });
}

// W as float32 (out_dtype 0) or bfloat16 (1), [n, k], from its packed groups.
int radixlang_packed_dequantize(int format, const uint8_t* packed, int64_t n, int64_t k, void* out,
                                int out_dtype, int threads) {
    if (radixlang_packed_group_bytes(format, k) == 0) return -1;
    return dispatch(format, [&](auto tag) {
        constexpr int F = decltype(tag)::value;
        constexpr int E = block_elems(F);
        const int64_t blocks = k / E;
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t row = 0; row < n; ++row) {
            const int64_t g = row / G;
            const int r = static_cast<int>(row % G);
            for (int64_t b = 0; b < blocks; ++b) {
                const uint8_t* blk = packed + (g * blocks + b) * packed_bytes(F);
                for (int e = 0; e < E; ++e) {
                    const float v = packed_value<F>(blk, r, e);
                    radixlang::store(out, row * k + b * E + e, out_dtype, v);
                }
            }
        }
    });
}

}  // extern "C"
