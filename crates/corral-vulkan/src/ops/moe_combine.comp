// Back to token order: out[t, c] = sum over j of y[positions[t * top_k + j], c], summed in
// slot order, one invocation an output.
#version 450
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(push_constant) uniform Args {
    Floats y;
    Uints positions;
    Floats out_;
    uint len;
    uint top_k;
    uint hidden;
} args;

void main() {
    uint i = flat_index();
    if (i >= args.len) {
        return;
    }
    uint t = i / args.hidden;
    uint c = i - t * args.hidden;
    float sum = 0.0;
    for (uint j = 0; j < args.top_k; j++) {
        sum += args.y.v[args.positions.v[t * args.top_k + j] * args.hidden + c];
    }
    args.out_.v[i] = sum;
}
