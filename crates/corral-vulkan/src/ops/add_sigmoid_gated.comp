// acc[t, i] += sigmoid(gate[t]) * x[t, i] over `rows` rows of `dim`.
#version 450
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(push_constant) uniform Args {
    Floats acc;
    Floats x;
    Floats gate;
    uint len;
    uint dim;
} args;

void main() {
    uint i = flat_index();
    if (i < args.len) {
        args.acc.v[i] += sigmoid(args.gate.v[i / args.dim]) * args.x.v[i];
    }
}
