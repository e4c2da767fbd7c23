// The per-token experts' second half, one workgroup a (token, output):
// out[t, c] = sum over j of w[t, j] * (down[e][c] . act[t * top_k + j]), e = ids[t, j], in
// slot order; an expert id past `num_experts` is reported as a fault.
#version 450
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "reduce.glsl"

layout(push_constant) uniform Args {
    Floats act;
    Uints ids;
    Floats weights;
    Uints down;
    Floats out_;
    Fault fault;
    uint tokens;
    uint top_k;
    uint inter;
    uint hidden;
    uint num_experts;
    uint down_type;
} args;

void main() {
    uint g = flat_group();
    if (g >= args.tokens * args.hidden) {
        return;
    }
    uint t = g / args.hidden;
    uint c = g - t * args.hidden;
    float total = 0.0;
    for (uint j = 0; j < args.top_k; j++) {
        uint p = t * args.top_k + j;
        uint e = args.ids.v[p];
        float sum = 0.0;
        if (e < args.num_experts) {
            uint64_t down = expert_at(args.down, e);
            uint64_t row = uint64_t(c) * args.inter;
            for (uint k = gl_LocalInvocationID.x; k < args.inter; k += GROUP_SIZE) {
                sum += args.act.v[p * args.inter + k] * weight_at(down, args.down_type, row + k);
            }
        } else if (gl_LocalInvocationID.x == 0) {
            report(args.fault, FAULT_EXPERT_ID);
        }
        total += args.weights.v[p] * workgroup_sum(sum);
    }
    if (gl_LocalInvocationID.x == 0) {
        args.out_.v[t * args.hidden + c] = total;
    }
}
