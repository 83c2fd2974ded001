// The kernels' element types and their conversions to and from float32, shared by the
// native CPU kernels (each built alone by native_build.py, which hashes this header too).

#pragma once

#include <cstdint>
#include <cstring>

namespace radixlang {

enum Dtype : int { F32 = 0, BF16 = 1, F16 = 2 };

inline float bf16_to_float(uint16_t x) {
    uint32_t bits = static_cast<uint32_t>(x) << 16;
    float out;
    std::memcpy(&out, &bits, sizeof(out));
    return out;
}

inline uint16_t float_to_bf16(float x) {
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof(bits));
    if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
    bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even, as torch does
    return static_cast<uint16_t>(bits >> 16);
}

// Element i of an array of `dtype`, as a float.
inline float load(const void* base, int64_t i, int dtype) {
    switch (dtype) {
        case BF16:
            return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
        case F16:
            return static_cast<float>(static_cast<const _Float16*>(base)[i]);
        default:
            return static_cast<const float*>(base)[i];
    }
}

// Element i of an array of `dtype` set to x (rounded to nearest even).
inline void store(void* base, int64_t i, int dtype, float x) {
    switch (dtype) {
        case BF16:
            static_cast<uint16_t*>(base)[i] = float_to_bf16(x);
            break;
        case F16:
            static_cast<_Float16*>(base)[i] = static_cast<_Float16>(x);
            break;
        default:
            static_cast<float*>(base)[i] = x;
    }
}

}  // namespace radixlang
