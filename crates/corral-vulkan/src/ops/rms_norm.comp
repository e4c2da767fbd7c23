// RMSNorm of each `dim`-wide row, one workgroup a row: out = x / sqrt(mean(x^2) + eps) * w,
// w = weight or, with `offset_one`, 1 + weight.
#version 450
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "reduce.glsl"

layout(push_constant) uniform Args {
    Floats x;
    Floats weight;
    Floats out_;
    uint dim;
    float eps;
    uint offset_one;
    uint rows;
} args;

void main() {
    if (flat_group() >= args.rows) {
        return;
    }
    uint base = flat_group() * args.dim;
    float sum = 0.0;
    for (uint i = gl_LocalInvocationID.x; i < args.dim; i += GROUP_SIZE) {
        float v = args.x.v[base + i];
        sum += v * v;
    }
    float inv = inversesqrt(workgroup_sum(sum) / float(args.dim) + args.eps);
    float one = args.offset_one != 0 ? 1.0 : 0.0;
    for (uint i = gl_LocalInvocationID.x; i < args.dim; i += GROUP_SIZE) {
        args.out_.v[base + i] = args.x.v[base + i] * inv * (one + args.weight.v[i]);
    }
}
