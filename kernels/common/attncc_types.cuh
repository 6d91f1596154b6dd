// attncc_types.cuh: storage types, conversions and Python-semantics math helpers.
//
// Self-contained on purpose: no toolkit header is included, so NVRTC can compile generated code
// on a machine without a CUDA toolkit, and nvcc compiles the same text. The device math builtins
// used here (expf, floorf, __float_as_uint, ...) are provided by both compilers implicitly.
// Include guards rather than `#pragma once`: codegen inlines this text into one translation unit
// (and tests concatenate several units), where `#pragma once` would warn and not help.
#ifndef ATTNCC_TYPES_CUH
#define ATTNCC_TYPES_CUH

// offsetof as a constant expression, for the layout static_asserts of generated code. NVRTC has
// no <cstddef> and no __builtin_offsetof, but its EDG front end has __INTADDR__; nvcc's host and
// device compilers have __builtin_offsetof.
#if defined(__CUDACC_RTC__)
#define ATTNCC_OFFSETOF(T, m) ((unsigned long long)__INTADDR__(&(((T*)0)->m)))
#else
#define ATTNCC_OFFSETOF(T, m) __builtin_offsetof(T, m)
#endif

namespace attncc {

typedef long long i64;
typedef unsigned short u16;
typedef unsigned int u32;

// 16-bit storage types. Plain structs (not cuda_fp16's __half) so that no header is needed; all
// arithmetic happens in float after to_float().
struct bf16 {
    unsigned short bits;
};
struct f16 {
    unsigned short bits;
};

// ------------------------------------------------------------------------------ conversions
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(double x) { return (float)x; }
__device__ __forceinline__ float to_float(int x) { return (float)x; }
__device__ __forceinline__ float to_float(long long x) { return (float)x; }
__device__ __forceinline__ float to_float(bool x) { return x ? 1.0f : 0.0f; }
__device__ __forceinline__ float to_float(signed char x) { return (float)x; }
__device__ __forceinline__ float to_float(unsigned char x) { return (float)x; }
__device__ __forceinline__ float to_float(short x) { return (float)x; }
// bf16 is the upper half of a float32: widening is exact and needs only a shift.
__device__ __forceinline__ float to_float(bf16 x) { return __uint_as_float(((u32)x.bits) << 16); }
__device__ __forceinline__ float to_float(f16 x) {
    float r;
    asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(x.bits));
    return r;
}

// Integer loads: captured int64 tensors are read as int because IR integers are 32-bit (the
// frontend rejects constants that do not fit; index tensors fit in practice).
__device__ __forceinline__ int to_int(int x) { return x; }
__device__ __forceinline__ int to_int(long long x) { return (int)x; }
__device__ __forceinline__ int to_int(short x) { return (int)x; }
__device__ __forceinline__ int to_int(signed char x) { return (int)x; }
__device__ __forceinline__ int to_int(unsigned char x) { return (int)x; }
__device__ __forceinline__ int to_int(bool x) { return x ? 1 : 0; }

__device__ __forceinline__ bool to_bool(bool x) { return x; }
__device__ __forceinline__ bool to_bool(unsigned char x) { return x != 0; }
__device__ __forceinline__ bool to_bool(int x) { return x != 0; }

template <typename T>
__device__ __forceinline__ T from_float(float x);

template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }

// Round to nearest even by bit arithmetic (what torch does for float -> bfloat16). NaN is kept a
// quiet NaN: adding the rounding bias to a NaN payload could otherwise carry into infinity.
template <>
__device__ __forceinline__ bf16 from_float<bf16>(float x) {
    u32 u = __float_as_uint(x);
    bf16 r;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        r.bits = (unsigned short)((u >> 16) | 0x40u);
        return r;
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    r.bits = (unsigned short)(u >> 16);
    return r;
}

// The hardware conversion rounds to nearest even and handles subnormals, inf and NaN.
template <>
__device__ __forceinline__ f16 from_float<f16>(float x) {
    f16 r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));
    return r;
}

// ------------------------------------------------------------------------------ constants
__device__ __forceinline__ float pos_inf() { return __uint_as_float(0x7f800000u); }
__device__ __forceinline__ float neg_inf() { return __uint_as_float(0xff800000u); }

// ------------------------------------------------------------------------- Python / torch math
// Python's `//` floors (C truncates toward zero): step down when the signs differ and the
// division is inexact. Division by zero is undefined, as in C (the reference path raises).
__device__ __forceinline__ int floordiv(int a, int b) {
    int q = a / b;
    if ((a % b != 0) && ((a < 0) != (b < 0))) q -= 1;
    return q;
}
// Python's `%` takes the sign of the divisor (C's takes the sign of the dividend).
__device__ __forceinline__ int pymod(int a, int b) {
    int r = a % b;
    if (r != 0 && ((r < 0) != (b < 0))) r += b;
    return r;
}
// torch.floor_divide on floats (aten div_floor): from the quotient q of a - fmod(a, b), which is
// (nearly) an integer, so no rounding of a / b up to the next integer can leak into the floor;
// the sign fix, then floor. A zero result takes the sign of z = a / b. NaN / inf as torch.
__device__ __forceinline__ float floordiv_finish(float b, float mod, float q, float z) {
    if (mod != 0.0f && ((b < 0.0f) != (mod < 0.0f))) q = __fsub_rn(q, 1.0f);
    if (q == 0.0f) return copysignf(0.0f, z);
    const float f = floorf(q);
    return __fsub_rn(q, f) > 0.5f ? __fadd_rn(f, 1.0f) : f;
}
__device__ __forceinline__ float floordiv(float a, float b) {
    if (b == 0.0f) return __fdiv_rn(a, b);
    const float mod = fmodf(a, b);
    return floordiv_finish(b, mod, __fdiv_rn(__fsub_rn(a, mod), b), __fdiv_rn(a, b));
}
// The same by a Python scalar b: torch's CUDA kernel multiplies by the float32 reciprocal
// inv_b = 1.0f / b instead of dividing (and a zero b is a true division, a * inv_b).
__device__ __forceinline__ float floordiv_rcp(float a, float b, float inv_b) {
    if (b == 0.0f) return __fmul_rn(a, inv_b);
    const float mod = fmodf(a, b);
    return floordiv_finish(b, mod, __fmul_rn(__fsub_rn(a, mod), inv_b), __fmul_rn(a, inv_b));
}
// torch.remainder on floats: fmod (exact) moved to the divisor's sign.
__device__ __forceinline__ float pymod(float a, float b) {
    const float mod = fmodf(a, b);
    return (mod != 0.0f && ((b < 0.0f) != (mod < 0.0f))) ? __fadd_rn(mod, b) : mod;
}
// x ** e for a captured scalar e: torch's scalar-exponent kernels (aten pow_tensor_scalar).
__device__ __forceinline__ float pow_scalar(float x, float e) {
    if (e == 0.0f) return 1.0f;
    if (e == 1.0f) return x;
    if (e == 0.5f) return sqrtf(x);
    if (e == -0.5f) return rsqrtf(x);
    if (e == -1.0f) return __frcp_rn(x);
    if (e == 2.0f) return __fmul_rn(x, x);
    if (e == 3.0f) return __fmul_rn(__fmul_rn(x, x), x);
    if (e == -2.0f) return __frcp_rn(__fmul_rn(x, x));
    return powf(x, e);
}

// torch.sigmoid's CUDA kernel: 1 / (1 + exp(-x)), each step rounded once.
__device__ __forceinline__ float sigmoid(float x) {
    return __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-x)));
}

// Fast math (codegen's fast_math=True): one special-function-unit instruction each instead of the
// multi-instruction accurate libm versions, which would make the SFU -- not the tensor cores --
// the bound of an attention loop (softcap pays a tanh per logit on top of softmax's ex2). Errors
// (PTX ISA): ex2.approx ~2 ulp, lg2.approx ~2^-22 absolute, tanh.approx ~2^-11 relative,
// div.approx ~2 ulp for 2^-126 <= |divisor| <= 2^126 (0 beyond); all far below bf16/fp16
// output precision. They are spelled with CUDA's intrinsics (exp2f is ex2.approx, __log2f,
// __fdividef, __sinf, __cosf), not inline asm, where one exists: the compiler knows intrinsics
// have no side effects and hoists them out of loops -- RoPE's per-lane frequency
// exp(-2i log(base) / D) is then computed once per warp in the transform pre-pass, not per row
// (asm statements stayed in the loop; docs/fa2.md, "Transform pre-pass"). tanh.approx has no
// intrinsic.
__device__ __forceinline__ float fast_exp2(float x) { return exp2f(x); }
__device__ __forceinline__ float fast_exp(float x) { return fast_exp2(x * 1.4426950408889634f); }
__device__ __forceinline__ float fast_log2(float x) { return __log2f(x); }
__device__ __forceinline__ float fast_log(float x) { return fast_log2(x) * 0.6931471805599453f; }
__device__ __forceinline__ float fast_tanh(float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
#else
    return tanhf(x);
#endif
}
// sigmoid(x) = (1 + tanh(x/2)) / 2: one MUFU op, and no overflow for large |x|
__device__ __forceinline__ float fast_sigmoid(float x) { return 0.5f * fast_tanh(0.5f * x) + 0.5f; }
// a * (1/b): when b is loop-invariant (a captured scalar such as softcap's cap) the compiler
// hoists the reciprocal out of the kernel's loop, leaving one multiply per logit.
__device__ __forceinline__ float fast_rcp(float x) { return __fdividef(1.0f, x); }
__device__ __forceinline__ float fast_div(float a, float b) { return a * fast_rcp(b); }
// sin / cos: sin.approx and cos.approx are accurate (2^-21.4 absolute) only on [-pi, pi] and do
// no range reduction of their own, while RoPE angles reach thousands of radians. So reduce first:
// r = x - 2*pi*k, k = rint(x / 2pi), with 2*pi split into three floats (c1 has 8 significant
// bits, so k * c1 is exact for |k| < 2^16; each FMA rounds once): |error of r| < 6e-7. With the
// MUFU op the result is within 1e-6 of sin(x) for |x| <= 1e5 (a 100K-token RoPE); beyond that
// (and for NaN / inf) libm's sinf / cosf. Six instructions instead of libm's ~40 per call, and
// sin and cos of one angle share the reduction.
__device__ __forceinline__ float reduce_2pi(float x) {
    const float k = rintf(x * 0x1.45f306p-3f);  // x / (2 pi)
    float r = fmaf(-k, 6.28125f, x);
    r = fmaf(-k, 0x1.fb5444p-10f, r);
    return fmaf(-k, 0x1.68c234p-37f, r);
}
// libm's versions out of line: their rarely taken Payne-Hanek reduction (a local array) then does
// not cost the hot path registers or spills
__device__ __noinline__ float libm_sin(float x) { return sinf(x); }
__device__ __noinline__ float libm_cos(float x) { return cosf(x); }
__device__ __forceinline__ float fast_sin(float x) {
    return fabsf(x) <= 1.0e5f ? __sinf(reduce_2pi(x)) : libm_sin(x);
}
__device__ __forceinline__ float fast_cos(float x) {
    return fabsf(x) <= 1.0e5f ? __cosf(reduce_2pi(x)) : libm_cos(x);
}
__device__ __forceinline__ float rsqrt(float x) { return rsqrtf(x); }
__device__ __forceinline__ float exp2(float x) { return exp2f(x); }
__device__ __forceinline__ float log2(float x) { return log2f(x); }

// torch.minimum / torch.maximum propagate NaN; fminf / fmaxf would drop it.
__device__ __forceinline__ float minf(float a, float b) {
    return (a != a || b != b) ? a + b : fminf(a, b);
}
__device__ __forceinline__ float maxf(float a, float b) {
    return (a != a || b != b) ? a + b : fmaxf(a, b);
}
__device__ __forceinline__ int mini(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int maxi(int a, int b) { return a > b ? a : b; }
// |INT_MIN| is INT_MIN, as torch's int32 abs gives (negating in unsigned keeps C defined).
__device__ __forceinline__ int absi(int a) { return a < 0 ? (int)(0u - (unsigned)a) : a; }

// torch.sign: (0 < x) - (x < 0), so NaN and -0.0 give 0.0 (docs/ops.md).
__device__ __forceinline__ float signf(float x) { return (float)((0.0f < x) - (x < 0.0f)); }
__device__ __forceinline__ int signi(int a) { return (0 < a) - (a < 0); }
// torch.fmod on integers: C's remainder (the dividend's sign). INT_MIN % -1 is 0, which C
// leaves undefined; division by zero is undefined, as in C (the reference path raises).
__device__ __forceinline__ int fmodi(int a, int b) { return b == -1 ? 0 : a % b; }
// torch's int32 shifts: a count outside [0, 32) shifts every bit out (<< gives 0, >> the sign).
__device__ __forceinline__ int shl(int a, int b) {
    return (unsigned)b < 32u ? (int)((unsigned)a << b) : 0;
}
__device__ __forceinline__ int shr(int a, int b) { return a >> ((unsigned)b < 32u ? b : 31); }

}  // namespace attncc

#endif  // ATTNCC_TYPES_CUH
