// y = x @ W^T for GGUF block weights repacked at load with G rows of W interleaved per block
// (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K; G = 16 on AVX-512, 8 elsewhere: one vector's int32 lanes), so that
// one integer dot instruction works on G rows at once.
//
// The file's layout puts a block's 32 values of one row together, so a kernel reading it
// finishes each (row, block) pair with a horizontal sum of eight int32 lanes and spends three
// float operations per pair (convert, scale, add) on one integer dot: the float work, not the
// dot, bounds it. Here a packed block holds G rows, 4-element groups of each row side by side,
// so lane r of a vpdpbusd against x's group broadcast to every lane is row r's dot. After a
// block's groups, lane r holds row r's whole integer dot, and one convert, one scale and one
// fused add finish G pairs. The packed bytes are as many as the file's (Q4_K's sub-block scales
// are unpacked: 148 bytes per super-block row instead of 144), so a model still takes its
// file's size in memory.
//
// Packed layouts, per group of G rows and per block; a chunk is 4G bytes, byte 4r + i holding
// element 4c + i (of the block or sub-block) of row r for chunk c:
//   Q4_0 (18G bytes): G f16 scales d[r]; 4 chunks of nibbles, the low nibble of chunk c for
//        elements 4c..4c+3, the high one for 16+4c..16+4c+3 (the file's own pairing).
//   Q4_1 (20G): G f16 scales d[r], G f16 mins m[r], 4 chunks of nibbles as Q4_0's.
//   Q8_0 (34G): G f16 scales; 8 chunks of int8 values.
//   Q4_K (148G, a super-block of 256): G f16 d, G f16 dmin, the 6-bit scales sc[j][r] and
//        mins m[j][r] as bytes (8G each), then for each pair of sub-blocks (2p, 2p+1) 8 chunks
//        of nibbles, the low nibble sub-block 2p's, the high one 2p+1's.
//   Q6_K (210G, a super-block of 256): G f16 d, the int8 scales s[h][r] of the 16 halves
//        (16G), then per half h (16 elements, 4 chunks) the unsigned 6-bit values q = value + 32
//        in 12G bytes: nibbles of chunks 0 and 2 (low, high), of chunks 1 and 3, and the top two
//        bits of chunk c at bits 2c of one more 4G bytes.
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
using radixlang::q4k_scale_min;
using radixlang::QK;
using radixlang::quantize_rows;
using radixlang::QuantizedRows;

enum Format : int { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q6_K = 14 };  // ggml's type ids
constexpr int SUB = 8;  // 32-element sub-blocks per super-block

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PACKED_ZMM 1
constexpr int G = 16;
#elif defined(RADIXLANG_AVX2) && defined(__F16C__)
#define PACKED_YMM 1
constexpr int G = 8;
#else
constexpr int G = 8;
#endif

constexpr int block_elems(int f) { return f == Q4_K || f == Q6_K ? 256 : 32; }
constexpr int file_bytes(int f) {
    return f == Q4_0 ? 18 : f == Q4_1 ? 20 : f == Q8_0 ? 34 : f == Q4_K ? 144 : f == Q6_K ? 210 : 0;
}
constexpr int row_bytes_packed(int f) { return f == Q4_K ? 148 : file_bytes(f); }
constexpr int packed_bytes(int f) { return G * row_bytes_packed(f); }

// Byte offsets inside a packed block.
constexpr int CHUNK = 4 * G;
constexpr int values_at(int f) { return f == Q4_1 ? 4 * G : 2 * G; }  // 32-element formats
constexpr int Q4K_SC = 4 * G, Q4K_M = 12 * G, Q4K_VALUES = 20 * G;
constexpr int Q6K_SCALES = 2 * G, Q6K_VALUES = 18 * G, Q6K_HALF = 12 * G;

// Q6_K's element e (0..255) of a file super-block as unsigned q (0..63), as ggml lays it out.
inline int q6k_unsigned(const uint8_t* src, int e) {
    const int half = e / 128, quarter = (e % 128) / 32, l = e % 32;
    const uint8_t low = src[64 * half + 32 * (quarter % 2) + l];
    const uint8_t high = src[128 + 32 * half + l];
    return ((quarter < 2 ? low : low >> 4) & 0x0f) | (((high >> (2 * quarter)) & 3) << 4);
}

// One block of up to G rows (rows[r] == nullptr: a padding row) into the packed layout.
template <int F>
void pack_block(const uint8_t* const* rows, uint8_t* out) {
    std::memset(out, 0, packed_bytes(F));
    for (int r = 0; r < G; ++r) {
        const uint8_t* src = rows[r];
        if (src == nullptr) continue;
        if (F == Q4_0 || F == Q4_1 || F == Q8_0) {
            const int head = F == Q4_1 ? 2 : 1;  // f16 fields before the values: d (and m)
            for (int h = 0; h < head; ++h) std::memcpy(out + 2 * G * h + 2 * r, src + 2 * h, 2);
            const int chunks = F == Q8_0 ? 8 : 4;
            for (int c = 0; c < chunks; ++c) {
                std::memcpy(out + 2 * G * head + CHUNK * c + 4 * r, src + 2 * head + 4 * c, 4);
            }
        } else if (F == Q4_K) {
            std::memcpy(out + 2 * r, src, 2);
            std::memcpy(out + 2 * G + 2 * r, src + 2, 2);
            for (int j = 0; j < SUB; ++j) {
                int sc, m;
                q4k_scale_min(src + 4, j, sc, m);
                out[Q4K_SC + G * j + r] = static_cast<uint8_t>(sc);
                out[Q4K_M + G * j + r] = static_cast<uint8_t>(m);
            }
            for (int p = 0; p < 4; ++p) {
                for (int c = 0; c < 8; ++c) {
                    std::memcpy(out + Q4K_VALUES + 8 * CHUNK * p + CHUNK * c + 4 * r,
                                src + 16 + 32 * p + 4 * c, 4);
                }
            }
        } else {  // Q6_K
            std::memcpy(out + 2 * r, src + 208, 2);
            for (int h = 0; h < 16; ++h) out[Q6K_SCALES + G * h + r] = src[192 + h];
            for (int h = 0; h < 16; ++h) {
                uint8_t* half = out + Q6K_VALUES + Q6K_HALF * h;
                for (int c = 0; c < 4; ++c) {
                    for (int i = 0; i < 4; ++i) {
                        const int q = q6k_unsigned(src, 16 * h + 4 * c + i);
                        half[CHUNK * (c % 2) + 4 * r + i] |= static_cast<uint8_t>((q & 0x0f) << (c / 2 * 4));
                        half[2 * CHUNK + 4 * r + i] |= static_cast<uint8_t>((q >> 4) << (2 * c));
                    }
                }
            }
        }
    }
}

// Row r's element e of a packed block as an integer (Q4_0: with its -8; Q6_K: unsigned q).
template <int F>
int packed_int(const uint8_t* blk, int r, int e) {
    if (F == Q4_0 || F == Q4_1) {
        const uint8_t byte = blk[values_at(F) + CHUNK * ((e % 16) / 4) + 4 * r + e % 4];
        return (e < 16 ? byte & 0x0f : byte >> 4);
    }
    if (F == Q8_0) return static_cast<int8_t>(blk[2 * G + CHUNK * (e / 4) + 4 * r + e % 4]);
    if (F == Q4_K) {
        const int j = e / 32, i = e % 32;
        const uint8_t byte = blk[Q4K_VALUES + 8 * CHUNK * (j / 2) + CHUNK * (i / 4) + 4 * r + i % 4];
        return j % 2 ? byte >> 4 : byte & 0x0f;
    }
    const int h = e / 16, c = (e % 16) / 4, i = e % 4;
    const uint8_t* half = blk + Q6K_VALUES + Q6K_HALF * h;
    const int low = (half[CHUNK * (c % 2) + 4 * r + i] >> (c / 2 * 4)) & 0x0f;
    return low | (((half[2 * CHUNK + 4 * r + i] >> (2 * c)) & 3) << 4);
}

// Row r's value e of a packed block (for dequantizing: the file's formulas and roundings).
template <int F>
float packed_value(const uint8_t* blk, int r, int e) {
    const int q = packed_int<F>(blk, r, e);
    if (F == Q4_0) return static_cast<float>(q - 8) * half_at(blk + 2 * r);
    if (F == Q4_1) return std::fma(static_cast<float>(q), half_at(blk + 2 * r), half_at(blk + 2 * G + 2 * r));
    if (F == Q8_0) return half_at(blk + 2 * r) * static_cast<float>(q);
    if (F == Q4_K) {
        const int j = e / 32;
        const float scale = half_at(blk + 2 * r) * static_cast<float>(blk[Q4K_SC + G * j + r]);
        const float min = half_at(blk + 2 * G + 2 * r) * static_cast<float>(blk[Q4K_M + G * j + r]);
        return scale * static_cast<float>(q) - min;
    }
    const int8_t s = static_cast<int8_t>(blk[Q6K_SCALES + G * (e / 16) + r]);
    return half_at(blk + 2 * r) * static_cast<float>(s) * static_cast<float>(q - 32);
}

// ---- the dot products: MT rows of x against one group over blocks [b0, b1) ----------------
//
// sums[t * G + r] is the running sum of x row m0 + t against row r of the group.

#if defined(PACKED_ZMM) || defined(PACKED_YMM)

// The vector operations on G lanes (G int32 or float lanes; bytes four per lane).
struct Lanes {
#ifdef PACKED_ZMM
    using I = __m512i;
    using F = __m512;
    static I load(const uint8_t* p) { return _mm512_loadu_si512(p); }
    static I set1(int32_t v) { return _mm512_set1_epi32(v); }
    static I zero() { return _mm512_setzero_si512(); }
    static I and_(I a, I b) { return _mm512_and_si512(a, b); }
    static I or_(I a, I b) { return _mm512_or_si512(a, b); }
    static I shr(I a, int n) { return _mm512_srli_epi16(a, n); }
    static I shl(I a, int n) { return _mm512_slli_epi16(a, n); }
    static I sub32(I a, I b) { return _mm512_sub_epi32(a, b); }
    static I dot(I acc, I u8, I s8) {
#ifdef __AVX512VNNI__
        return _mm512_dpbusd_epi32(acc, u8, s8);
#else
        const I pairs = _mm512_maddubs_epi16(u8, s8);
        return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
#endif
    }
    // |w| as u8 and x with w's sign (Q8_0: keeps the u8 x s8 dot exact).
    static I abs8(I w) { return _mm512_abs_epi8(w); }
    static I sign8(I x, I w) {
        return _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
    }
    static F halves(const uint8_t* p) {
        return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    }
    static F ubytes(const uint8_t* p) {
        return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    }
    static F sbytes(const uint8_t* p) {
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    }
    static F tofloat(I a) { return _mm512_cvtepi32_ps(a); }
    static F fset1(float v) { return _mm512_set1_ps(v); }
    static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
    static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
    static F fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
    static F fload(const float* p) { return _mm512_loadu_ps(p); }
    static void fstore(float* p, F v) { _mm512_storeu_ps(p, v); }
#else
    using I = __m256i;
    using F = __m256;
    static I load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
    static I set1(int32_t v) { return _mm256_set1_epi32(v); }
    static I zero() { return _mm256_setzero_si256(); }
    static I and_(I a, I b) { return _mm256_and_si256(a, b); }
    static I or_(I a, I b) { return _mm256_or_si256(a, b); }
    static I shr(I a, int n) { return _mm256_srli_epi16(a, n); }
    static I shl(I a, int n) { return _mm256_slli_epi16(a, n); }
    static I sub32(I a, I b) { return _mm256_sub_epi32(a, b); }
    static I dot(I acc, I u8, I s8) { return radixlang::dot_u8s8(acc, u8, s8); }
    static I abs8(I w) { return _mm256_sign_epi8(w, w); }
    static I sign8(I x, I w) { return _mm256_sign_epi8(x, w); }
    static F halves(const uint8_t* p) {
        return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    }
    static F ubytes(const uint8_t* p) {
        return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    }
    static F sbytes(const uint8_t* p) {
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    }
    static F tofloat(I a) { return _mm256_cvtepi32_ps(a); }
    static F fset1(float v) { return _mm256_set1_ps(v); }
    static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
    static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
    static F fnmadd(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
    static F fload(const float* p) { return _mm256_loadu_ps(p); }
    static void fstore(float* p, F v) { _mm256_storeu_ps(p, v); }
#endif
    // x's 4-byte group broadcast to every lane.
    static I group(const int8_t* p) {
        int32_t v;
        std::memcpy(&v, p, 4);
        return set1(v);
    }
};

template <int F, int MT>
void group_tile(const uint8_t* grp, const QuantizedRows& x, int64_t m0, int64_t b0, int64_t b1,
                float* sums) {
    using L = Lanes;
    const L::I low4 = L::set1(0x0f0f0f0f), low2 = L::set1(0x03030303);
    L::F acc[MT];
    for (int t = 0; t < MT; ++t) acc[t] = L::fload(sums + t * G);
    const int64_t nb = x.nb;
    if constexpr (F == Q4_0 || F == Q4_1) {
        for (int64_t b = b0; b < b1; ++b) {
            const uint8_t* blk = grp + b * packed_bytes(F);
            const L::F dw = L::halves(blk);
            const L::F mw = F == Q4_1 ? L::halves(blk + 2 * G) : dw;
            L::I lo[4], hi[4];
            for (int c = 0; c < 4; ++c) {
                const L::I v = L::load(blk + values_at(F) + CHUNK * c);
                lo[c] = L::and_(v, low4);
                hi[c] = L::and_(L::shr(v, 4), low4);
            }
            for (int t = 0; t < MT; ++t) {
                const int64_t i = (m0 + t) * nb + b;
                const int8_t* xq = x.q.data() + i * QK;
                L::I dot = L::set1(F == Q4_0 ? -8 * x.s[i] : 0);
                for (int c = 0; c < 4; ++c) {
                    dot = L::dot(dot, lo[c], L::group(xq + 4 * c));
                    dot = L::dot(dot, hi[c], L::group(xq + 16 + 4 * c));
                }
                acc[t] = L::fmadd(L::tofloat(dot), L::mul(dw, L::fset1(x.d[i])), acc[t]);
                if (F == Q4_1) acc[t] = L::fmadd(mw, L::fset1(x.d[i] * static_cast<float>(x.s[i])), acc[t]);
            }
        }
    } else if constexpr (F == Q8_0) {
        for (int64_t b = b0; b < b1; ++b) {
            const uint8_t* blk = grp + b * packed_bytes(F);
            const L::F dw = L::halves(blk);
            for (int t = 0; t < MT; ++t) {
                const int64_t i = (m0 + t) * nb + b;
                const int8_t* xq = x.q.data() + i * QK;
                L::I dot = L::zero();
                for (int c = 0; c < 8; ++c) {
                    const L::I w = L::load(blk + 2 * G + CHUNK * c);  // from L1 after the first row
                    dot = L::dot(dot, L::abs8(w), L::sign8(L::group(xq + 4 * c), w));
                }
                acc[t] = L::fmadd(L::tofloat(dot), L::mul(dw, L::fset1(x.d[i])), acc[t]);
            }
        }
    } else if constexpr (F == Q4_K) {  // b0, b1 are activation blocks, whole super-blocks
        for (int64_t sb = b0 / SUB; sb < b1 / SUB; ++sb) {
            const uint8_t* blk = grp + sb * packed_bytes(F);
            const L::F d = L::halves(blk), dmin = L::halves(blk + 2 * G);
            for (int p = 0; p < 4; ++p) {
                const int ja = 2 * p, jb = 2 * p + 1;
                const L::F sa = L::mul(d, L::ubytes(blk + Q4K_SC + G * ja));
                const L::F sb_ = L::mul(d, L::ubytes(blk + Q4K_SC + G * jb));
                const L::F ma = L::mul(dmin, L::ubytes(blk + Q4K_M + G * ja));
                const L::F mb = L::mul(dmin, L::ubytes(blk + Q4K_M + G * jb));
                const uint8_t* vals = blk + Q4K_VALUES + 8 * CHUNK * p;
                for (int t = 0; t < MT; ++t) {
                    const int64_t ia = (m0 + t) * nb + sb * SUB + ja, ib = ia + 1;
                    const int8_t* xa = x.q.data() + ia * QK;
                    const int8_t* xb = x.q.data() + ib * QK;
                    L::I dot_a = L::zero(), dot_b = L::zero();
                    for (int c = 0; c < 8; ++c) {
                        const L::I v = L::load(vals + CHUNK * c);
                        dot_a = L::dot(dot_a, L::and_(v, low4), L::group(xa + 4 * c));
                        dot_b = L::dot(dot_b, L::and_(L::shr(v, 4), low4), L::group(xb + 4 * c));
                    }
                    const float dxa = x.d[ia], dxb = x.d[ib];
                    acc[t] = L::fmadd(L::tofloat(dot_a), L::mul(sa, L::fset1(dxa)), acc[t]);
                    acc[t] = L::fnmadd(ma, L::fset1(dxa * static_cast<float>(x.s[ia])), acc[t]);
                    acc[t] = L::fmadd(L::tofloat(dot_b), L::mul(sb_, L::fset1(dxb)), acc[t]);
                    acc[t] = L::fnmadd(mb, L::fset1(dxb * static_cast<float>(x.s[ib])), acc[t]);
                }
            }
        }
    } else {  // Q6_K
        for (int64_t sb = b0 / SUB; sb < b1 / SUB; ++sb) {
            const uint8_t* blk = grp + sb * packed_bytes(F);
            const L::F d = L::halves(blk);
            for (int h = 0; h < 16; ++h) {
                const L::F scale = L::mul(d, L::sbytes(blk + Q6K_SCALES + G * h));
                const uint8_t* half = blk + Q6K_VALUES + Q6K_HALF * h;
                const L::I a = L::load(half), b = L::load(half + CHUNK), top = L::load(half + 2 * CHUNK);
                L::I q[4];
                q[0] = L::or_(L::and_(a, low4), L::shl(L::and_(top, low2), 4));
                q[1] = L::or_(L::and_(b, low4), L::shl(L::and_(L::shr(top, 2), low2), 4));
                q[2] = L::or_(L::and_(L::shr(a, 4), low4), L::shl(L::and_(L::shr(top, 4), low2), 4));
                q[3] = L::or_(L::and_(L::shr(b, 4), low4), L::shl(L::and_(L::shr(top, 6), low2), 4));
                for (int t = 0; t < MT; ++t) {
                    const int64_t i = (m0 + t) * nb + sb * SUB + h / 2;
                    const int8_t* xq = x.q.data() + i * QK + 16 * (h % 2);
                    L::I dot = L::set1(-32 * x.half_s[2 * i + h % 2]);
                    for (int c = 0; c < 4; ++c) dot = L::dot(dot, q[c], L::group(xq + 4 * c));
                    acc[t] = L::fmadd(L::tofloat(dot), L::mul(scale, L::fset1(x.d[i])), acc[t]);
                }
            }
        }
    }
    for (int t = 0; t < MT; ++t) L::fstore(sums + t * G, acc[t]);
}

#else  // scalar code: each lane's operations, in the same order

template <int F, int MT>
void group_tile(const uint8_t* grp, const QuantizedRows& x, int64_t m0, int64_t b0, int64_t b1,
                float* sums) {
    const int64_t nb = x.nb;
    for (int t = 0; t < MT; ++t) {
        for (int r = 0; r < G; ++r) {
            float acc = sums[t * G + r];
            if (F == Q4_0 || F == Q4_1 || F == Q8_0) {
                for (int64_t b = b0; b < b1; ++b) {
                    const uint8_t* blk = grp + b * packed_bytes(F);
                    const int64_t i = (m0 + t) * nb + b;
                    const int8_t* xq = x.q.data() + i * QK;
                    int32_t dot = F == Q4_0 ? -8 * x.s[i] : 0;
                    for (int e = 0; e < QK; ++e) dot += packed_int<F>(blk, r, e) * xq[e];
                    acc = std::fma(static_cast<float>(dot), half_at(blk + 2 * r) * x.d[i], acc);
                    if (F == Q4_1) {
                        acc = std::fma(half_at(blk + 2 * G + 2 * r), x.d[i] * static_cast<float>(x.s[i]), acc);
                    }
                }
            } else if (F == Q4_K) {
                for (int64_t sb = b0 / SUB; sb < b1 / SUB; ++sb) {
                    const uint8_t* blk = grp + sb * packed_bytes(F);
                    const float d = half_at(blk + 2 * r), dmin = half_at(blk + 2 * G + 2 * r);
                    for (int j = 0; j < SUB; ++j) {
                        const int64_t i = (m0 + t) * nb + sb * SUB + j;
                        const int8_t* xq = x.q.data() + i * QK;
                        const float scale = d * static_cast<float>(blk[Q4K_SC + G * j + r]);
                        const float min = dmin * static_cast<float>(blk[Q4K_M + G * j + r]);
                        int32_t dot = 0;
                        for (int e = 0; e < QK; ++e) dot += packed_int<F>(blk, r, 32 * j + e) * xq[e];
                        acc = std::fma(static_cast<float>(dot), scale * x.d[i], acc);
                        acc = std::fma(-min, x.d[i] * static_cast<float>(x.s[i]), acc);
                    }
                }
            } else {  // Q6_K
                for (int64_t sb = b0 / SUB; sb < b1 / SUB; ++sb) {
                    const uint8_t* blk = grp + sb * packed_bytes(F);
                    const float d = half_at(blk + 2 * r);
                    for (int h = 0; h < 16; ++h) {
                        const int64_t i = (m0 + t) * nb + sb * SUB + h / 2;
                        const int8_t* xq = x.q.data() + i * QK + 16 * (h % 2);
                        const int8_t s = static_cast<int8_t>(blk[Q6K_SCALES + G * h + r]);
                        const float scale = d * static_cast<float>(s);
                        int32_t dot = -32 * x.half_s[2 * i + h % 2];
                        for (int e = 0; e < 16; ++e) dot += packed_int<F>(blk, r, 16 * h + e) * xq[e];
                        acc = std::fma(static_cast<float>(dot), scale * x.d[i], acc);
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

// y's rows are float32 or bfloat16 (y_dtype), `ldy` elements apart.
template <int F>
void linear(const uint8_t* packed, int64_t n, int64_t k, const QuantizedRows& x, int64_t m,
            void* y, int y_dtype, int64_t ldy, int threads) {
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
                const int64_t at = t * ldy + g * G;
                if (y_dtype == radixlang::F32) {
                    std::memcpy(static_cast<float*>(y) + at, sums.data() + t * G, rows * sizeof(float));
                } else {
                    for (int r = 0; r < rows; ++r) radixlang::store(y, at + r, y_dtype, sums[t * G + r]);
                }
            }
        }
    }
}

template <typename Fn>
int dispatch(int format, Fn&& fn) {
    return radixlang::dispatch_format<Q4_0, Q4_1, Q8_0, Q4_K, Q6_K>(format, fn);
}

}  // namespace

extern "C" {

// Rows of W per packed group in this build.
int radixlang_packed_group_rows() { return G; }

// Bytes of one packed group of a [*, k] matrix of `format`; 0 for a format not packed, or a k
// that is not whole blocks.
int64_t radixlang_packed_group_bytes(int format, int64_t k) {
    const int bytes = file_bytes(format) ? packed_bytes(format) : 0;
    if (bytes == 0 || k % block_elems(format) != 0) return 0;
    return k / block_elems(format) * bytes;
}

// The file's rows (n rows of row_bytes bytes, k / block elements each) packed into ceil(n / G)
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
    quantize_rows(x, m, k, qx, threads);
    return dispatch(format, [&](auto tag) {
        linear<decltype(tag)::value>(packed, n, k, qx, m, y, radixlang::F32, ldy, threads);
    });
}

// The same for bfloat16 x [m, k] and y: x widened (exactly) and y rounded to nearest even here,
// as torch's conversions around the float32 call would, without their two tensor ops a call.
int radixlang_packed_linear_bf16(int format, const uint8_t* packed, int64_t n, int64_t k,
                                 const uint16_t* x, int64_t m, uint16_t* y, int64_t ldy,
                                 int threads) {
    if (radixlang_packed_group_bytes(format, k) == 0) return -1;
    thread_local std::vector<float> wide;
    wide.resize(m * k);
    float* into = wide.data();  // the calling thread's buffer (each thread has its own `wide`)
    const int use = m * k >= (1 << 16) ? threads : 1;
#pragma omp parallel for schedule(static) num_threads(use)
    for (int64_t i = 0; i < m * k; ++i) into[i] = radixlang::bf16_to_float(x[i]);
    QuantizedRows qx;
    quantize_rows(into, m, k, qx, threads);
    return dispatch(format, [&](auto tag) {
        linear<decltype(tag)::value>(packed, n, k, qx, m, y, radixlang::BF16, ldy, threads);
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
                    radixlang::store(out, row * k + b * E + e, out_dtype, packed_value<F>(blk, r, e));
                }
            }
        }
    });
}

}  // extern "C"
