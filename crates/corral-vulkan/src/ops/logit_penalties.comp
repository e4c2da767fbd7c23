// Each of `n` penalty entries ([index, subtract bits, repetition bits, 0]) applied to its
// logit: l' = l - subtract, then l' / repetition if positive, else l' * repetition. An index
// past the `len` logits is reported as a fault.
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
    args.logits.v[index] = l > 0.0 ? l / repetition : l * repetition;
}
