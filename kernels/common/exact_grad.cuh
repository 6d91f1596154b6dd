// exact_grad.cuh: order-independent accumulation of captured-tensor gradients, the deterministic
// mode's CapturedGrad (kernel_options={"DETERMINISTIC": True}; docs/backward.md, "Deterministic
// mode").
//
// Float atomics make a sum depend on the order its terms arrive. Here each fp32 term is added
// exactly, as an integer: x = m * 2^(p - 149) with m its 24-bit significand and p in [0, 253]
// (p = max(exponent field, 1) - 1), and each element of the gradient owns kExactGradWords
// unsigned 64-bit words. Word k < 12 counts units of 2^(24 k - 149): the term's m << (p % 24)
// (< 2^47) is split into its low 24 bits, added to word p / 24, and the rest (< 2^23), added to
// the next word; a negative term adds both negated (two's complement: a signed int64 sum). No
// carry is propagated here, so a word overflows only after 2^39 terms. Integer addition is
// associative, so the words, and the float Python reads back from them
// (runtime/flex/exact_grad.py), are the same bits whatever the order of the adds. The last word
// collects non-finite terms as flags, OR-ed: 1 NaN, 2 +inf, 4 -inf (their sum is NaN when it
// holds both infinities, as IEEE's is).
// Requires attncc_types.cuh (attncc::i64).
#ifndef ATTNCC_EXACT_GRAD_CUH
#define ATTNCC_EXACT_GRAD_CUH

namespace attncc {

typedef unsigned long long u64;

// words per gradient element: 12 of the sum, 1 of non-finite flags
// (attncc.codegen.constants.EXACT_GRAD_WORDS)
constexpr int kExactGradWords = 13;

// g[offset] += x exactly: g is the gradient's word buffer, offset the element's index in it.
__device__ __forceinline__ void exact_grad_add(u64* g, i64 offset, float x) {
    u64* w = g + offset * kExactGradWords;
    const unsigned bits = __float_as_uint(x);
    const unsigned e = (bits >> 23) & 0xffu;
    if (e == 0xffu) {  // inf or NaN
        atomicOr(w + kExactGradWords - 1, (bits & 0x7fffffu) ? 1ull : (bits >> 31) ? 4ull : 2ull);
        return;
    }
    const unsigned m = (bits & 0x7fffffu) | (e ? 0x800000u : 0u);
    if (m == 0u) return;  // +-0 adds nothing
    const int p = e ? int(e) - 1 : 0;
    const int k = p / 24;
    const u64 v = (u64)m << (p - 24 * k);
    u64 lo = v & 0xffffffull, hi = v >> 24;
    if (bits >> 31) {
        lo = 0ull - lo;
        hi = 0ull - hi;
    }
    atomicAdd(w + k, lo);
    atomicAdd(w + k + 1, hi);
}

}  // namespace attncc

#endif  // ATTNCC_EXACT_GRAD_CUH
