// acc[i] += x[i] for the first `len` elements.
#version 450
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(push_constant) uniform Args {
    Floats acc;
    Floats x;
    uint len;
} args;

void main() {
    uint i = flat_index();
    if (i < args.len) {
        args.acc.v[i] += args.x.v[i];
    }
}
