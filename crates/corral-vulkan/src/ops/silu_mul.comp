// out[i] = silu(gate[i]) * up[i] for the first `len` elements.
#version 450
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(push_constant) uniform Args {
    Floats gate;
    Floats up;
    Floats out_;
    uint len;
} args;

void main() {
    uint i = flat_index();
    if (i < args.len) {
        float g = args.gate.v[i];
        args.out_.v[i] = g * sigmoid(g) * args.up.v[i];
    }
}
