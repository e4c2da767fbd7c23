// Each of `n` penalty entries ([index, subtract bits, repetition bits, 0]) applied to its
// logit: l' = l - subtract, then l' / repetition if positive (correctly rounded), else
// l' * repetition. An index past the `len` logits is reported as a fault.
#version 450
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(push_constant) uniform Args {
    Floats logits;
    Uints entries;
    Fault fault;
    uint n;
    uint len;
} args;

// l / r correctly rounded, as the CPU and CUDA divide: a driver's float division may be 2.5
// ulp off (NVIDIA's is). Of the floats within 3 ulp of the driver's quotient, the one whose
// exact remainder l - q r is least; the remainder is exact in double (q r has 48 significant
// bits, and l is within a factor of 2 of it). A quotient of two floats is never halfway
// between two floats, so the least is the nearest. Zeros, infinities, NaNs and subnormals
// keep the driver's quotient.
float divide_rounded(float l, float r) {
    precise float q = l / r;
    if (isinf(q) || isnan(q) || isinf(r) || abs(q) < 1e-37) {
        return q;
    }
    double dl = double(l);
    double dr = double(r);
    float best = q;
    double least = abs(dl - double(q) * dr);
    for (int k = -3; k <= 3; k++) {
        float c = uintBitsToFloat(uint(int(floatBitsToUint(q)) + k));
        double rem = abs(dl - double(c) * dr);
        if (rem < least) {
            least = rem;
            best = c;
        }
    }
    return best;
}

void main() {
    uint e = flat_index();
    if (e >= args.n) {
        return;
    }
    uint index = args.entries.v[4 * e];
    if (index >= args.len) {
        report(args.fault, FAULT_PENALTY_INDEX);
        return;
    }
    precise float l = args.logits.v[index] - uintBitsToFloat(args.entries.v[4 * e + 1]);
    float repetition = uintBitsToFloat(args.entries.v[4 * e + 2]);
    args.logits.v[index] = l > 0.0 ? divide_rounded(l, repetition) : l * repetition;
}
