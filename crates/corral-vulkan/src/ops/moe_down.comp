// The down projection of routed pairs in sorted order, scaled by each pair's routing weight,
// one workgroup a (position, output): y[s, c] = w[p] * (down[e][c] . act[s]) for the pair p
// at position s, e = ids[p]; an expert id past `num_experts` is reported as a fault.
#version 450
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "reduce.glsl"

layout(push_constant) uniform Args {
    Floats act;
    Uints ids;
    Floats weights;
    Uints sorted_pairs;
    Uints down;
    Floats y;
    Fault fault;
    uint pairs;
    uint inter;
    uint hidden;
    uint num_experts;
    uint down_type;
} args;

void main() {
    uint g = flat_group();
    if (g >= args.pairs * args.hidden) {
        return;
    }
    uint s = g / args.hidden;
    uint c = g - s * args.hidden;
    uint p = args.sorted_pairs.v[s];
    uint e = args.ids.v[p];
    if (e >= args.num_experts) {
        if (gl_LocalInvocationID.x == 0) {
            report(args.fault, FAULT_EXPERT_ID);
        }
        return;
    }
    uint64_t down = expert_at(args.down, e);
    uint64_t row = uint64_t(c) * args.inter;
    float sum = 0.0;
    for (uint k = gl_LocalInvocationID.x; k < args.inter; k += GROUP_SIZE) {
        sum += args.act.v[s * args.inter + k] * weight_at(down, args.down_type, row + k);
    }
    sum = workgroup_sum(sum);
    if (gl_LocalInvocationID.x == 0) {
        args.y.v[s * args.hidden + c] = args.weights.v[p] * sum;
    }
}
