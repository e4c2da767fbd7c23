// out[r, col0 + n] (rows of `out_cols`) = x[r, :] . w[n, :] for weights of any float type,
// `cols` wide from element `offset`: one workgroup a (row, output) pair. The portable
// product, for correctness; the fast ones come per device.
#version 450
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "reduce.glsl"

layout(push_constant) uniform Args {
    Floats x;
    uint64_t w;
    Floats out_;
    uint n;
    uint cols;
    uint out_cols;
    uint col0;
    uint weight_type;
    uint offset;
    uint rows;
} args;

void main() {
    uint g = flat_group();
    if (g >= args.rows * args.n) {
        return;
    }
    uint r = g / args.n;
    uint n = g - r * args.n;
    uint64_t row = uint64_t(args.offset) + uint64_t(n) * args.cols;
    float sum = 0.0;
    for (uint k = gl_LocalInvocationID.x; k < args.cols; k += GROUP_SIZE) {
        sum += args.x.v[r * args.cols + k] * weight_at(args.w, args.weight_type, row + k);
    }
    sum = workgroup_sum(sum);
    if (gl_LocalInvocationID.x == 0) {
        args.out_.v[r * args.out_cols + args.col0 + n] = sum;
    }
}
