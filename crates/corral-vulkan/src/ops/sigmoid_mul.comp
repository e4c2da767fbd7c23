// out[i] = x[i] * sigmoid(gate[i]) for the first `len` elements.
#version 450
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(push_constant) uniform Args {
    Floats x;
    Floats gate;
    Floats out_;
    uint len;
} args;

void main() {
    uint i = flat_index();
    if (i < args.len) {
        args.out_.v[i] = args.x.v[i] * sigmoid(args.gate.v[i]);
    }
}
