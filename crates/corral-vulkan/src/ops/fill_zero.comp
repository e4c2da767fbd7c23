// The first `len` words of a buffer set to zero.
#version 450
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(push_constant) uniform Args {
    Uints x;
    uint len;
} args;

void main() {
    uint i = flat_index();
    if (i < args.len) {
        args.x.v[i] = 0;
    }
}
