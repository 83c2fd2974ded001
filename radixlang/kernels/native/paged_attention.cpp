// Paged attention on CPUs, reading K/V blocks where they lie in the pool (no gather).
//
// One entry point serves decode and extend: every query token names its sequence (a row of
// the block tables) and how many of that sequence's cached tokens it sees (its position + 1;
// the new tokens' own K/V are stored before attention runs). Decode is one query per sequence;
// an extend is a run of consecutive queries of one sequence, causal by their lengths. A query
// may also name its first visible token (a sliding window): tokens before it are never read, so
// blocks a request has released may stand anywhere in the table before the window.
//
// Work is split into items of (tile of up to TILE queries of one sequence, KV head, token
// range). A KV head's block is read once for every query head of its GQA group and every query
// of the tile. Long single-query rows (decode at small batch) are split along their tokens so
// that both cores get work; the partial results are merged with their softmax statistics.
// Tiles of two or more queries (extends, drafts to verify) take `attend_tiled` outside uniform
// mode, where the head size is a whole number of vectors.
//
// `uniform` (deterministic inference) makes a query's result a function of its own inputs
// only: never split (a split depends on the batch). Where the all-heads path serves the head
// size (64, 128), every query is an item of its own, as a decoded query is, with chunks from
// its own first visible token. Elsewhere queries are tiled with chunks that start on block
// boundaries (not at the tile's first visible token, which depends on the tile's other
// queries), and one dot-product loop for every score (the four-token loop and its tail may
// round differently). A query then gets the same bits in any batch, tile or position, as
// decode or in an extend.
//
// Built by radixlang/kernels/native_build.py with the machine's C++ compiler, loaded with
// ctypes; OpenMP comes from the runtime torch already loaded (same soname), so this kernel and
// torch share one thread pool.

#include <omp.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "floats.h"

namespace {

using namespace radixlang;

constexpr int TILE = 8;        // queries of one sequence handled together
constexpr int MAX_ROWS = 128;  // TILE * (query heads per KV head), bounded
constexpr int MAX_DIM = 256;
constexpr int CHUNK = 64;      // tokens scored before their softmax update
int TILED_MIN_QUERIES = 2;     // tiles of this many queries take the tiled path (below)

// A K or V vector of `dim` elements as floats: the pointer itself for float32, else converted
// into `scratch`.
template <int KV_DTYPE>
inline const float* as_floats(const void* base, int64_t offset, int dim, float* scratch) {
    if constexpr (KV_DTYPE == F32) {
        return static_cast<const float*>(base) + offset;
    } else if constexpr (KV_DTYPE == BF16) {
        const uint16_t* src = static_cast<const uint16_t*>(base) + offset;
#pragma omp simd
        for (int d = 0; d < dim; ++d) {
            uint32_t bits = static_cast<uint32_t>(src[d]) << 16;
            float value;
            std::memcpy(&value, &bits, sizeof(value));
            scratch[d] = value;
        }
        return scratch;
    } else {
        const _Float16* src = static_cast<const _Float16*>(base) + offset;
#pragma omp simd
        for (int d = 0; d < dim; ++d) scratch[d] = static_cast<float>(src[d]);
        return scratch;
    }
}

struct Problem {
    const void* q;
    int q_dtype;
    const void* k_cache;
    const void* v_cache;
    const int32_t* block_tables;
    int64_t table_stride;
    const int32_t* q_seq;
    const int32_t* q_len;
    const int32_t* q_start;  // null: every query sees its tokens from 0
    void* out;
    int heads, kv_heads, dim, block_size;
    float scale;
};

// An item's kv_head when it covers every head of one query (attend_all_heads: decode).
constexpr int ALL_HEADS = -1;

struct Item {
    int first_query, num_queries;  // the tile
    int kv_head;                   // or ALL_HEADS
    int token_begin, token_end;  // the range of cached tokens this item reads
    int split;                   // index of the partial result, -1 when the item is whole
};

// Softmax statistics and unnormalised output of one item's rows over its token range, in a
// caller's buffer of `partial_floats(dim)` floats.
struct Partial {
    float* max;  // [MAX_ROWS]
    float* sum;  // [MAX_ROWS]
    float* acc;  // [MAX_ROWS * dim]
};

inline int64_t partial_floats(int dim) { return static_cast<int64_t>(MAX_ROWS) * (dim + 2); }

inline Partial partial_at(float* buffer, int dim) {
    return {buffer, buffer + MAX_ROWS, buffer + 2 * MAX_ROWS};
}

// The opening of both paths: the item's query rows (each query's heads of the KV head's group)
// scaled into `q`, the tokens each row sees and its first, and its softmax statistics reset.
inline void start_rows(const Problem& p, const Item& item, int dim, float* q, int* limit,
                       int* first, Partial& r) {
    const int group = p.heads / p.kv_heads;
    for (int t = 0; t < item.num_queries; ++t) {
        const int query = item.first_query + t;
        for (int g = 0; g < group; ++g) {
            const int row = t * group + g;
            const int64_t base = (static_cast<int64_t>(query) * p.heads +
                                  item.kv_head * group + g) * dim;
            for (int d = 0; d < dim; ++d) q[row * dim + d] = load(p.q, base + d, p.q_dtype) * p.scale;
            limit[row] = std::min(p.q_len[query], item.token_end);
            first[row] = p.q_start ? p.q_start[query] : 0;
            r.max[row] = -FLT_MAX;
            r.sum[row] = 0.0f;
        }
    }
}

template <int KV_DTYPE, int DIM, bool UNIFORM>
void attend(const Problem& p, const Item& item, Partial& r) {
    const int dim = DIM > 0 ? DIM : p.dim;
    const int group = p.heads / p.kv_heads;
    const int rows = item.num_queries * group;
    float q[MAX_ROWS * MAX_DIM];
    int limit[MAX_ROWS];  // tokens row i sees
    int first[MAX_ROWS];  // row i's first visible token (its window's start)
    start_rows(p, item, dim, q, limit, first, r);
    std::fill(r.acc, r.acc + rows * dim, 0.0f);
    const int32_t* table = p.block_tables + p.q_seq[item.first_query] * p.table_stride;
    const int64_t token_stride = static_cast<int64_t>(p.kv_heads) * dim;
    // The chunk's K and V rows as float pointers: into the pool for float32, else into
    // buffers converted once per chunk (every row of the tile reads them).
    thread_local std::vector<float> k_buffer, v_buffer;
    if (KV_DTYPE != F32 && static_cast<int>(k_buffer.size()) < CHUNK * dim) {
        k_buffer.resize(CHUNK * dim);
        v_buffer.resize(CHUNK * dim);
    }
    const float* k_rows[CHUNK];
    const float* v_rows[CHUNK];
    float scores[MAX_ROWS][CHUNK];
    const int bs = p.block_size;
    // Uniform: chunks on block boundaries; a row skips what it does not see (j0 below).
    int start = UNIFORM ? item.token_begin / bs * bs : item.token_begin;
    while (start < item.token_end) {
        const int block = start / bs;
        const int end = std::min({(block + 1) * bs, item.token_end, start + CHUNK});
        const int n_tokens = end - start;
        const int64_t slot0 = static_cast<int64_t>(table[block]) * bs;
        for (int j = 0; j < n_tokens; ++j) {
            const int64_t offset = (slot0 + (start + j) % bs) * token_stride + item.kv_head * dim;
            k_rows[j] = as_floats<KV_DTYPE>(p.k_cache, offset, dim, k_buffer.data() + j * dim);
            v_rows[j] = as_floats<KV_DTYPE>(p.v_cache, offset, dim, v_buffer.data() + j * dim);
        }
        // Scores, four tokens at a time: four independent sums keep the FMA units busy.
        for (int row = 0; row < rows; ++row) {
            const float* __restrict qr = q + row * dim;
            int j = 0;
            for (; !UNIFORM && j + 4 <= n_tokens; j += 4) {
                const float* __restrict k0 = k_rows[j];
                const float* __restrict k1 = k_rows[j + 1];
                const float* __restrict k2 = k_rows[j + 2];
                const float* __restrict k3 = k_rows[j + 3];
                float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
                for (int d = 0; d < dim; ++d) {
                    const float x = qr[d];
                    s0 += x * k0[d];
                    s1 += x * k1[d];
                    s2 += x * k2[d];
                    s3 += x * k3[d];
                }
                scores[row][j] = s0;
                scores[row][j + 1] = s1;
                scores[row][j + 2] = s2;
                scores[row][j + 3] = s3;
            }
            for (; j < n_tokens; ++j) {
                const float* __restrict k = k_rows[j];
                float s = 0.0f;
#pragma omp simd reduction(+ : s)
                for (int d = 0; d < dim; ++d) s += qr[d] * k[d];
                scores[row][j] = s;
            }
        }
        // Online softmax: rescale what is accumulated when a row's maximum grows; then add
        // the chunk's weighted V rows, two at a time.
        for (int row = 0; row < rows; ++row) {
            float* __restrict w = scores[row];
            const int n = std::min(end, limit[row]) - start;
            const int j0 = std::max(0, first[row] - start);
            if (n <= j0) continue;  // the row sees none of these tokens (causal or windowed)
            float* __restrict acc = r.acc + row * dim;
            float chunk_max = r.max[row];
            for (int j = j0; j < n; ++j) chunk_max = std::max(chunk_max, w[j]);
            if (chunk_max > r.max[row]) {
                const float factor = std::exp(r.max[row] - chunk_max);
                r.sum[row] *= factor;
#pragma omp simd
                for (int d = 0; d < dim; ++d) acc[d] *= factor;
                r.max[row] = chunk_max;
            }
            float total = 0.0f;
#pragma omp simd reduction(+ : total)
            for (int j = j0; j < n; ++j) {
                const float e = std::exp(w[j] - chunk_max);
                w[j] = e;
                total += e;
            }
            r.sum[row] += total;
            int j = j0;
            for (; j + 2 <= n; j += 2) {
                const float* __restrict v0 = v_rows[j];
                const float* __restrict v1 = v_rows[j + 1];
                const float w0 = w[j], w1 = w[j + 1];
#pragma omp simd
                for (int d = 0; d < dim; ++d) acc[d] += w0 * v0[d] + w1 * v1[d];
            }
            if (j < n) {
                const float* __restrict v0 = v_rows[j];
                const float w0 = w[j];
#pragma omp simd
                for (int d = 0; d < dim; ++d) acc[d] += w0 * v0[d];
            }
        }
        start = end;
    }
}

// The tiled path: for tiles of several queries (verifying drafts, short extends) outside
// uniform mode. The loops above spend most of their time on horizontal sums (a 64-float dot
// product is four multiply-adds and a reduction across the vector); here a chunk's K is
// transposed as it is converted, so that one vector of multiply-adds yields a row's scores for
// VW tokens at once, and the rows' outputs stay in registers while the chunk's V rows stream
// past. Scores, softmax and outputs are the same sums, grouped otherwise (so not bitwise those
// of `attend`, which is why uniform mode never comes here).
#if defined(__AVX512F__)
constexpr int VW = 16;          // floats per vector register
constexpr int VREGS = 32;       // vector registers
#else
constexpr int VW = 8;
constexpr int VREGS = 16;
#endif
typedef float Vec __attribute__((vector_size(VW * sizeof(float))));
typedef float UnalignedVec __attribute__((vector_size(VW * sizeof(float)), aligned(4)));
constexpr int TILED_CHUNK = 32;                 // tokens per chunk
constexpr int CHUNK_VECS = TILED_CHUNK / VW;    // vectors of scores per row and chunk
constexpr int SCORE_ROWS = VW == 16 ? 6 : 2;  // rows per pass: their scores fill the registers
constexpr int PAD_ROWS = 8;                     // rows past the last, read but never stored

inline Vec load_vec(const float* at) { return *reinterpret_cast<const UnalignedVec*>(at); }
inline void store_vec(float* at, Vec v) { *reinterpret_cast<UnalignedVec*>(at) = v; }

// e^x for x <= 0 (-inf included, giving 0), within about 2 ulp of float's: x = n ln2 + t with
// |t| <= ln2/2, e^t by its Taylor polynomial to t^6 (error < 2e-7), 2^n put in the exponent.
// The compiler's own exp would be a call per element here (no vector math library is linked).
inline Vec exp_nonpositive(Vec x) {
    typedef int32_t IntVec __attribute__((vector_size(VW * sizeof(int32_t))));
    const Vec lowest = Vec{} - 87.0f;  // below: 0 (2^-126 is the smallest normal float)
    const Vec clamped = x < lowest ? lowest : x;
    const IntVec n = __builtin_convertvector(clamped * 1.44269504f - 0.5f, IntVec);  // rounded
    const Vec nf = __builtin_convertvector(n, Vec);
    const Vec t = clamped - nf * 0.693145752f - nf * 1.42860677e-6f;  // ln2 in two parts
    Vec poly = t * (1.0f / 720) + 1.0f / 120;
    poly = poly * t + 1.0f / 24;
    poly = poly * t + 1.0f / 6;
    poly = poly * t + 0.5f;
    poly = poly * t + 1.0f;
    poly = poly * t + 1.0f;
    const IntVec bits = (n + 127) << 23;
    Vec scale;
    std::memcpy(&scale, &bits, sizeof(scale));
    const Vec e = poly * scale;
    return x < lowest ? Vec{} : e;
}

// One query (decode; in uniform mode, any query) against every head of its sequence: the
// item's rows are all `heads` query heads. A token's K (and V) rows of all KV heads lie side by
// side, so reading them head after head walks memory in order; an item per KV head instead
// steps a whole token row (often a page) from one token to the next, which the hardware
// prefetchers do not follow (nor do they when threads share each row by head ranges: each
// core's prefetcher then fetches the others' halves too). K and V are converted in registers;
// chunks of SINGLE_CHUNK tokens span blocks.
constexpr int SINGLE_CHUNK = 32;

// Uniform mode computes a query's tokens in pieces on fixed boundaries (multiples of PIECE),
// each from fresh softmax statistics, merged left to right by `merge_partial`: the same bits
// whether one item takes every piece (a batch with work for every thread) or each piece is an
// item of its own, run on any thread and merged after (a batch too small for that).
constexpr int PIECE = 4 * SINGLE_CHUNK;

// `into` := `into` merged with `part` over rows [begin, end): both rescaled to the larger
// maximum and added. Out of line, so that the item loop and the merge after the parallel loop
// run the same instructions (uniform mode's bits depend on it).
__attribute__((noinline)) void merge_partial(Partial& into, const Partial& part, int begin,
                                             int end, int dim) {
    for (int row = begin; row < end; ++row) {
        const float top = std::max(into.max[row], part.max[row]);
        const float a = std::exp(into.max[row] - top);
        const float b = std::exp(part.max[row] - top);
        into.sum[row] = into.sum[row] * a + part.sum[row] * b;
        float* acc = into.acc + row * dim;
        const float* other = part.acc + row * dim;
        for (int d = 0; d < dim; ++d) acc[d] = acc[d] * a + other[d] * b;
        into.max[row] = top;
    }
}

template <int KV_DTYPE>
inline Vec kv_vec(const void* base, int64_t offset) {
    if constexpr (KV_DTYPE == F32) {
        return load_vec(static_cast<const float*>(base) + offset);
    } else if constexpr (KV_DTYPE == BF16) {
        typedef uint16_t Bits16 __attribute__((vector_size(VW * 2), aligned(2)));
        typedef uint32_t Bits32 __attribute__((vector_size(VW * 4)));
        const Bits16 h = *reinterpret_cast<const Bits16*>(static_cast<const uint16_t*>(base) + offset);
        const Bits32 bits = __builtin_convertvector(h, Bits32) << 16;
        Vec out;
        std::memcpy(&out, &bits, sizeof(out));
        return out;
    } else {
        typedef _Float16 Halves __attribute__((vector_size(VW * 2), aligned(2)));
        return __builtin_convertvector(
            *reinterpret_cast<const Halves*>(static_cast<const _Float16*>(base) + offset), Vec);
    }
}

inline float vec_sum(Vec v) {
    float total = 0.0f;
    for (int i = 0; i < VW; ++i) total += v[i];
    return total;
}

// Every head of `query` over its tokens [lo, hi), from fresh statistics.
template <int KV_DTYPE, int DIM>
void attend_heads(const Problem& p, int query, int lo, int hi, Partial& r) {
    static_assert(DIM % VW == 0 && DIM > 0, "whole vectors per head row");
    constexpr int DIM_VECS = DIM / VW;
    // Rows of one KV head's group whose outputs stay in registers (half of them), and tokens
    // added before they are stored.
    constexpr int V_ROWS = (VREGS / 2) / DIM_VECS > 0 ? (VREGS / 2) / DIM_VECS : 1;
    constexpr int V_TOKENS = 4;
    const int heads = p.heads, group = p.heads / p.kv_heads;
    alignas(64) float q[MAX_ROWS * DIM];
    for (int row = 0; row < heads; ++row) {
        const int64_t base = (static_cast<int64_t>(query) * heads + row) * DIM;
        for (int d = 0; d < DIM; ++d) q[row * DIM + d] = load(p.q, base + d, p.q_dtype) * p.scale;
        r.max[row] = -FLT_MAX;
        r.sum[row] = 0.0f;
    }
    std::fill(r.acc, r.acc + heads * DIM, 0.0f);
    const int32_t* table = p.block_tables + p.q_seq[query] * p.table_stride;
    const int64_t token_stride = static_cast<int64_t>(p.kv_heads) * DIM;
    const int bs = p.block_size;
    alignas(64) float scores[MAX_ROWS][SINGLE_CHUNK + VW];
    int64_t rows_at[SINGLE_CHUNK];
    for (int start = lo; start < hi; start += SINGLE_CHUNK) {
        const int n = std::min(hi - start, SINGLE_CHUNK);
        for (int j = 0; j < n; ++j) {
            const int token = start + j;
            rows_at[j] = (static_cast<int64_t>(table[token / bs]) * bs + token % bs) * token_stride;
        }
        for (int j = 0; j < n; ++j) {
            for (int h = 0; h < p.kv_heads; ++h) {
                Vec k[DIM_VECS];
                for (int v = 0; v < DIM_VECS; ++v) k[v] = kv_vec<KV_DTYPE>(p.k_cache, rows_at[j] + h * DIM + v * VW);
                for (int g = 0; g < group; ++g) {
                    const int row = h * group + g;
                    const float* qr = q + row * DIM;
                    Vec sum = load_vec(qr) * k[0];
                    for (int v = 1; v < DIM_VECS; ++v) sum += load_vec(qr + v * VW) * k[v];
                    scores[row][j] = vec_sum(sum);
                }
            }
        }
        for (int row = 0; row < heads; ++row) {
            float* w = scores[row];
            float chunk_max = r.max[row];
            for (int j = 0; j < n; ++j) chunk_max = std::max(chunk_max, w[j]);
            if (chunk_max > r.max[row]) {
                const float factor = std::exp(r.max[row] - chunk_max);
                r.sum[row] *= factor;
                float* acc = r.acc + row * DIM;
                for (int d = 0; d < DIM; ++d) acc[d] *= factor;
                r.max[row] = chunk_max;
            }
            Vec total = Vec{};
            for (int j = 0; j < n; j += VW) {
                Vec e = exp_nonpositive(load_vec(w + j) - chunk_max);
                for (int i = 0; i < VW; ++i) {
                    if (j + i >= n) e[i] = 0.0f;  // past the chunk: no weight
                }
                store_vec(w + j, e);
                total += e;
            }
            r.sum[row] += vec_sum(total);
        }
        // Outputs: V_TOKENS tokens at a time, each row's output held in registers across them
        // (stored once per V_TOKENS tokens, not once per token); a row still adds its tokens
        // one by one in order.
        for (int j0 = 0; j0 < n; j0 += V_TOKENS) {
            const int tokens = std::min(V_TOKENS, n - j0);
            for (int h = 0; h < p.kv_heads; ++h) {
                for (int g0 = 0; g0 < group; g0 += V_ROWS) {
                    const int rows = std::min(V_ROWS, group - g0);
                    const int row0 = h * group + g0;
                    Vec a[V_ROWS][DIM_VECS];
#pragma GCC unroll 16
                    for (int i = 0; i < V_ROWS; ++i)
#pragma GCC unroll 16
                        for (int v = 0; v < DIM_VECS; ++v)
                            a[i][v] = i < rows ? load_vec(r.acc + (row0 + i) * DIM + v * VW) : Vec{};
                    for (int t = 0; t < tokens; ++t) {
                        const int64_t at = rows_at[j0 + t] + h * DIM;
#pragma GCC unroll 16
                        for (int v = 0; v < DIM_VECS; ++v) {
                            const Vec v_row = kv_vec<KV_DTYPE>(p.v_cache, at + v * VW);
#pragma GCC unroll 16
                            for (int i = 0; i < V_ROWS; ++i)
                                if (i < rows) a[i][v] = a[i][v] + scores[row0 + i][j0 + t] * v_row;
                        }
                    }
#pragma GCC unroll 16
                    for (int i = 0; i < V_ROWS; ++i)
                        if (i < rows)
#pragma GCC unroll 16
                            for (int v = 0; v < DIM_VECS; ++v)
                                store_vec(r.acc + (row0 + i) * DIM + v * VW, a[i][v]);
                }
            }
        }
    }
}

template <int KV_DTYPE, int DIM, bool UNIFORM>
void attend_all_heads(const Problem& p, const Item& item, Partial& r) {
    const int query = item.first_query;
    const int lo = std::max(item.token_begin, p.q_start ? p.q_start[query] : 0);
    const int hi = std::min(item.token_end, p.q_len[query]);
    if constexpr (!UNIFORM) {
        attend_heads<KV_DTYPE, DIM>(p, query, lo, hi, r);
    } else {
        int end = std::min(hi, (lo / PIECE + 1) * PIECE);
        attend_heads<KV_DTYPE, DIM>(p, query, lo, end, r);
        if (end >= hi) return;
        thread_local std::vector<float> more;
        if (static_cast<int64_t>(more.size()) < partial_floats(DIM)) more.resize(partial_floats(DIM));
        Partial piece = partial_at(more.data(), DIM);
        for (int from = end; from < hi; from = end) {
            end = std::min(hi, from + PIECE);
            attend_heads<KV_DTYPE, DIM>(p, query, from, end, piece);
            merge_partial(r, piece, 0, p.heads, DIM);
        }
    }
}

template <int DIM>
constexpr int output_rows() {  // rows whose outputs fit the registers beside one V row
    constexpr int per_row = DIM / VW;
    constexpr int rows = (VREGS * 3 / 4) / per_row;
    return rows < 1 ? 1 : (rows > PAD_ROWS ? PAD_ROWS : rows);
}

template <int KV_DTYPE, int DIM>
void attend_tiled(const Problem& p, const Item& item, Partial& r) {
    static_assert(DIM % VW == 0 && DIM > 0, "the tiled path needs whole vectors per head row");
    static_assert(SCORE_ROWS >= 1 && SCORE_ROWS <= PAD_ROWS, "score rows per pass");
    constexpr int DIM_VECS = DIM / VW;
    constexpr int OUT_ROWS = output_rows<DIM>();
    const int group = p.heads / p.kv_heads;
    const int rows = item.num_queries * group;
    alignas(64) float q[(MAX_ROWS + PAD_ROWS) * DIM];
    alignas(64) float w[(MAX_ROWS + PAD_ROWS) * TILED_CHUNK];
    alignas(64) float kt[DIM * TILED_CHUNK];  // kt[d * TILED_CHUNK + j]: K transposed
    alignas(64) float vb[TILED_CHUNK * DIM];  // V rows as floats
    int limit[MAX_ROWS];
    int first[MAX_ROWS];
    start_rows(p, item, DIM, q, limit, first, r);
    // Rows past the last: zero queries, so their scores and weights are 0, never whatever the
    // stack held (the passes below read up to PAD_ROWS of them).
    std::fill(q + rows * DIM, q + (rows + PAD_ROWS) * DIM, 0.0f);
    std::fill(w + rows * TILED_CHUNK, w + (rows + PAD_ROWS) * TILED_CHUNK, 0.0f);
    std::fill(r.acc, r.acc + rows * DIM, 0.0f);
    const int32_t* table = p.block_tables + p.q_seq[item.first_query] * p.table_stride;
    const int64_t token_stride = static_cast<int64_t>(p.kv_heads) * DIM;
    const int bs = p.block_size;
    for (int start = item.token_begin; start < item.token_end; start += TILED_CHUNK) {
        const int n_tokens = std::min(TILED_CHUNK, item.token_end - start);
        for (int j = 0; j < n_tokens; ++j) {
            const int position = start + j;
            const int64_t offset =
                (static_cast<int64_t>(table[position / bs]) * bs + position % bs) * token_stride +
                item.kv_head * DIM;
            float k_row[DIM];
            const float* k = as_floats<KV_DTYPE>(p.k_cache, offset, DIM, k_row);
            for (int d = 0; d < DIM; ++d) kt[d * TILED_CHUNK + j] = k[d];
            const float* v = as_floats<KV_DTYPE>(p.v_cache, offset, DIM, vb + j * DIM);
            if (v != vb + j * DIM) std::memcpy(vb + j * DIM, v, DIM * sizeof(float));
        }
        for (int j = n_tokens; j < TILED_CHUNK; ++j)  // finite scores past the chunk's end
            for (int d = 0; d < DIM; ++d) kt[d * TILED_CHUNK + j] = 0.0f;
        // Scores: SCORE_ROWS rows a pass, a vector of VW tokens per multiply-add.
        for (int r0 = 0; r0 < rows; r0 += SCORE_ROWS) {
            Vec s[SCORE_ROWS][CHUNK_VECS] = {};
            for (int d = 0; d < DIM; ++d) {
                Vec k[CHUNK_VECS];
#pragma GCC unroll 8
                for (int c = 0; c < CHUNK_VECS; ++c) k[c] = load_vec(kt + d * TILED_CHUNK + c * VW);
#pragma GCC unroll 16
                for (int i = 0; i < SCORE_ROWS; ++i) {
                    const float x = q[(r0 + i) * DIM + d];
#pragma GCC unroll 8
                    for (int c = 0; c < CHUNK_VECS; ++c) s[i][c] += x * k[c];
                }
            }
#pragma GCC unroll 16
            for (int i = 0; i < SCORE_ROWS; ++i)
#pragma GCC unroll 8
                for (int c = 0; c < CHUNK_VECS; ++c)
                    store_vec(w + (r0 + i) * TILED_CHUNK + c * VW, s[i][c]);
        }
        // Online softmax per row over the tokens it sees: the others' scores set to -inf
        // first (their weights come out 0), so that every loop runs over whole vectors.
        for (int row = 0; row < rows; ++row) {
            float* __restrict wr = w + row * TILED_CHUNK;
            const int n = std::min(start + n_tokens, limit[row]) - start;
            const int j0 = std::max(0, first[row] - start);
            if (n <= j0) {
                std::fill(wr, wr + TILED_CHUNK, 0.0f);
                continue;
            }
            for (int j = 0; j < j0; ++j) wr[j] = -INFINITY;
            for (int j = n; j < TILED_CHUNK; ++j) wr[j] = -INFINITY;
            Vec top = load_vec(wr);
#pragma GCC unroll 8
            for (int c = 1; c < CHUNK_VECS; ++c) {
                const Vec x = load_vec(wr + c * VW);
                top = top > x ? top : x;
            }
            float chunk_max = r.max[row];
            for (int l = 0; l < VW; ++l) chunk_max = std::max(chunk_max, top[l]);
            if (chunk_max > r.max[row]) {
                const float factor = std::exp(r.max[row] - chunk_max);
                r.sum[row] *= factor;
                float* __restrict acc = r.acc + row * DIM;
#pragma omp simd
                for (int d = 0; d < DIM; ++d) acc[d] *= factor;
                r.max[row] = chunk_max;
            }
            Vec total{};
#pragma GCC unroll 8
            for (int c = 0; c < CHUNK_VECS; ++c) {
                const Vec e = exp_nonpositive(load_vec(wr + c * VW) - chunk_max);
                store_vec(wr + c * VW, e);
                total += e;
            }
            for (int l = 0; l < VW; ++l) r.sum[row] += total[l];
        }
        // Outputs: OUT_ROWS rows a pass kept in registers, each V row read once per pass.
        for (int r0 = 0; r0 < rows; r0 += OUT_ROWS) {
            Vec a[OUT_ROWS][DIM_VECS];
#pragma GCC unroll 16
            for (int i = 0; i < OUT_ROWS; ++i)
#pragma GCC unroll 16
                for (int c = 0; c < DIM_VECS; ++c)
                    a[i][c] = r0 + i < rows ? load_vec(r.acc + (r0 + i) * DIM + c * VW) : Vec{};
            for (int j = 0; j < n_tokens; ++j) {
                Vec v[DIM_VECS];
#pragma GCC unroll 16
                for (int c = 0; c < DIM_VECS; ++c) v[c] = load_vec(vb + j * DIM + c * VW);
#pragma GCC unroll 16
                for (int i = 0; i < OUT_ROWS; ++i) {
                    const float x = w[(r0 + i) * TILED_CHUNK + j];
#pragma GCC unroll 16
                    for (int c = 0; c < DIM_VECS; ++c) a[i][c] += x * v[c];
                }
            }
#pragma GCC unroll 16
            for (int i = 0; i < OUT_ROWS; ++i)
                if (r0 + i < rows)
#pragma GCC unroll 16
                    for (int c = 0; c < DIM_VECS; ++c)
                        store_vec(r.acc + (r0 + i) * DIM + c * VW, a[i][c]);
        }
    }
}

void write_rows(const Problem& p, const Item& item, const float* sum, const float* acc) {
    const int dim = p.dim;
    if (item.kv_head == ALL_HEADS) {  // rows are the query's heads in order
        const int64_t base = static_cast<int64_t>(item.first_query) * p.heads * dim;
        for (int row = 0; row < p.heads; ++row) {
            const float inv = sum[row] > 0.0f ? 1.0f / sum[row] : 0.0f;
            for (int d = 0; d < dim; ++d) {
                store(p.out, base + row * dim + d, p.q_dtype, acc[row * dim + d] * inv);
            }
        }
        return;
    }
    const int group = p.heads / p.kv_heads;
    for (int t = 0; t < item.num_queries; ++t) {
        const int query = item.first_query + t;
        for (int g = 0; g < group; ++g) {
            const int row = t * group + g;
            const float inv = sum[row] > 0.0f ? 1.0f / sum[row] : 0.0f;
            const int64_t base =
                (static_cast<int64_t>(query) * p.heads + item.kv_head * group + g) * dim;
            for (int d = 0; d < dim; ++d) store(p.out, base + d, p.q_dtype, acc[row * dim + d] * inv);
        }
    }
}

template <int KV_DTYPE, int DIM, bool UNIFORM>
void run_items(const Problem& p, const std::vector<Item>& items, float* partials, int threads) {
    const int64_t count = static_cast<int64_t>(items.size());
    const int64_t stride = partial_floats(p.dim);
#pragma omp parallel num_threads(threads)
    {
        // A whole item's result needs no keeping: one buffer per thread, kept between calls.
        thread_local std::vector<float> scratch;
        if (static_cast<int64_t>(scratch.size()) < stride) scratch.resize(stride);
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < count; ++i) {
            const Item& item = items[i];
            float* buffer = item.split < 0 ? scratch.data() : partials + item.split * stride;
            Partial r = partial_at(buffer, p.dim);
            if constexpr (DIM > 0 && DIM % VW == 0) {
                if (item.kv_head == ALL_HEADS)
                    attend_all_heads<KV_DTYPE, DIM, UNIFORM>(p, item, r);
                else if (!UNIFORM && item.num_queries >= TILED_MIN_QUERIES)
                    attend_tiled<KV_DTYPE, DIM>(p, item, r);
                else
                    attend<KV_DTYPE, DIM, UNIFORM>(p, item, r);
            } else {
                attend<KV_DTYPE, DIM, UNIFORM>(p, item, r);
            }
            if (item.split < 0) write_rows(p, item, r.sum, r.acc);
        }
    }
}

template <int KV_DTYPE, bool UNIFORM>
void dispatch_dim(const Problem& p, const std::vector<Item>& items, float* partials, int threads) {
    switch (p.dim) {
        case 64:
            return run_items<KV_DTYPE, 64, UNIFORM>(p, items, partials, threads);
        case 128:
            return run_items<KV_DTYPE, 128, UNIFORM>(p, items, partials, threads);
        default:
            return run_items<KV_DTYPE, 0, UNIFORM>(p, items, partials, threads);
    }
}

template <int KV_DTYPE>
void dispatch(const Problem& p, const std::vector<Item>& items, float* partials, int threads,
              bool uniform) {
    if (uniform) return dispatch_dim<KV_DTYPE, true>(p, items, partials, threads);
    dispatch_dim<KV_DTYPE, false>(p, items, partials, threads);
}

}  // namespace

extern "C" {

// Limits the Python side checks before calling.
int radixlang_max_rows() { return MAX_ROWS; }
int radixlang_max_dim() { return MAX_DIM; }
int radixlang_tile() { return TILE; }
// Tiles of at least this many queries take the tiled path (tests set it to compare paths).
void radixlang_set_tiled_min_queries(int n) { TILED_MIN_QUERIES = n; }

// q and out: [num_queries, heads, dim] contiguous (q_dtype); k_cache, v_cache:
// [num_blocks, block_size, kv_heads, dim] contiguous (kv_dtype); block_tables: int32 rows of
// `table_stride`; q_seq[i]: query i's row in the block tables; q_len[i]: how many cached tokens
// query i sees; q_start[i] (or null for 0): query i's first visible token, non-decreasing along
// a sequence's consecutive queries. Consecutive queries of one sequence are tiled together.
// `split_tokens` > 0
// splits single-query tiles whose length exceeds it (when the tiles alone would leave threads
// idle). `uniform` != 0: each query's result depends on its own inputs only (see the top;
// no splits then). Returns 0, or -1 on arguments outside the limits.
int radixlang_paged_attention(const void* q, int q_dtype, const void* k_cache,
                              const void* v_cache, int kv_dtype, const int32_t* block_tables,
                              int64_t table_stride, const int32_t* q_seq, const int32_t* q_len,
                              const int32_t* q_start, int num_queries, void* out, int heads, int kv_heads, int dim,
                              int block_size, float scale, int threads, int split_tokens,
                              int uniform) {
    if (heads % kv_heads != 0 || dim > MAX_DIM || dim <= 0 || block_size <= 0) return -1;
    const int group = heads / kv_heads;
    if (group > MAX_ROWS) return -1;
    // Single queries (decode, and in uniform mode every query) take one item for all their
    // heads, where the head size is whole vectors of a size the kernels are built for.
    const bool all_heads = (dim == 64 || dim == 128) && dim % VW == 0 && heads <= MAX_ROWS;
    // Uniform mode with all-heads items: every query alone, so that an extend's query is
    // computed exactly as the same query decoded (chunks from its own first visible token).
    const int tile = uniform && all_heads ? 1 : std::max(1, std::min(TILE, MAX_ROWS / group));
    Problem p{q,       q_dtype, k_cache, v_cache,  block_tables, table_stride,
              q_seq,   q_len,   q_start, out,      heads,        kv_heads,
              dim,     block_size, scale};

    // Tiles: runs of consecutive queries of one sequence.
    std::vector<Item> items;
    std::vector<std::pair<int, int>> tiles;
    for (int i = 0; i < num_queries;) {
        int j = i + 1;
        while (j < num_queries && j - i < tile && q_seq[j] == q_seq[i]) ++j;
        tiles.emplace_back(i, j - i);
        i = j;
    }
    const int64_t items_per_tile = all_heads ? 1 : kv_heads;
    const bool few = static_cast<int64_t>(tiles.size()) * items_per_tile < 4LL * threads;
    const bool split = !uniform && split_tokens > 0 && few;
    struct Merge {
        int first_query, num_queries, kv_head, first_split, num_splits;
    };
    std::vector<Merge> merges;
    int num_partials = 0;
    for (const auto& [first, n] : tiles) {
        int length = 0;
        int begin = q_start ? q_start[first] : 0;  // the tile's first visible token
        for (int t = first; t < first + n; ++t) {
            length = std::max(length, q_len[t]);
            if (q_start) begin = std::min(begin, q_start[t]);
        }
        begin = std::max(0, std::min(begin, length));
        int parts = 1;
        if (split && n == 1 && length - begin > split_tokens)
            parts = (length - begin + split_tokens - 1) / split_tokens;
        const bool whole_query = all_heads && n == 1;
        if (uniform && whole_query && few && length - begin > PIECE) {
            // An item per piece (see PIECE), merged in order below.
            int made = 0;
            for (int from = begin; from < length; from = (from / PIECE + 1) * PIECE) {
                const int end = std::min(length, (from / PIECE + 1) * PIECE);
                items.push_back({first, 1, ALL_HEADS, from, end, num_partials + made});
                ++made;
            }
            merges.push_back({first, 1, ALL_HEADS, num_partials, made});
            num_partials += made;
            continue;
        }
        for (int h = 0; h < (whole_query ? 1 : kv_heads); ++h) {
            const int kv_head = whole_query ? ALL_HEADS : h;
            if (parts == 1) {
                items.push_back({first, n, kv_head, begin, length, -1});
                continue;
            }
            // Ranges of whole blocks, so that each item after the first starts on a block
            // boundary; the first starts at the window.
            const int first_block = begin / block_size;
            const int blocks = (length + block_size - 1) / block_size - first_block;
            const int per = (blocks + parts - 1) / parts;
            int made = 0;
            for (int b = 0; b < blocks; b += per) {
                const int from = std::max(begin, (first_block + b) * block_size);
                const int end = std::min(length, (first_block + b + per) * block_size);
                items.push_back({first, n, kv_head, from, end, num_partials + made});
                ++made;
            }
            merges.push_back({first, n, kv_head, num_partials, made});
            num_partials += made;
        }
    }
    std::vector<float> partial_buffer(num_partials * partial_floats(dim));
    float* partials = partial_buffer.data();
    switch (kv_dtype) {
        case BF16:
            dispatch<BF16>(p, items, partials, threads, uniform != 0);
            break;
        case F16:
            dispatch<F16>(p, items, partials, threads, uniform != 0);
            break;
        default:
            dispatch<F32>(p, items, partials, threads, uniform != 0);
    }
    // Merge the split items: rescale each part to the common maximum and add.
    for (const Merge& m : merges) {
        const int rows = m.kv_head == ALL_HEADS ? heads : m.num_queries * group;
        Partial first = partial_at(partials + m.first_split * partial_floats(dim), dim);
        for (int s = 1; s < m.num_splits; ++s) {
            Partial part = partial_at(partials + (m.first_split + s) * partial_floats(dim), dim);
            merge_partial(first, part, 0, rows, dim);
        }
        Item whole{m.first_query, m.num_queries, m.kv_head, 0, 0, -1};
        write_rows(p, whole, first.sum, first.acc);
    }
    return 0;
}

}  // extern "C"
