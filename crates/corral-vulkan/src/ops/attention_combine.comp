// The splits of attention_split.comp combined, a workgroup a (token, head): each split's
// unnormalised output and sum rescaled to the largest maximum among them, summed, divided.
#version 450
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(push_constant) uniform Args {
    Floats partial;
    Floats out_;
    uint rows;
    uint head_dim;
    uint splits;
} args;

void main() {
    uint row = flat_group();
    if (row >= args.rows) {
        return;
    }
    uint hd = args.head_dim;
    uint first = row * args.splits * (hd + 2);
    float m = uintBitsToFloat(0xff800000u);
    for (uint s = 0; s < args.splits; s++) {
        m = max(m, args.partial.v[first + s * (hd + 2)]);
    }
    for (uint d = gl_LocalInvocationID.x; d < hd; d += GROUP_SIZE) {
        float num = 0.0;
        float den = 0.0;
        for (uint s = 0; s < args.splits; s++) {
            uint at = first + s * (hd + 2);
            float ms = args.partial.v[at];
            float w = isinf(ms) ? 0.0 : exp(ms - m);
            num += w * args.partial.v[at + 2 + d];
            den += w * args.partial.v[at + 1];
        }
        args.out_.v[row * hd + d] = den > 0.0 ? num / den : 0.0;
    }
}
