// The gate and up projections and SwiGLU of routed pairs, one workgroup a (pair, row):
// act[s, r] = silu(gate[e][r] . x[t]) * (up[e][r] . x[t]) for the pair p at position s
// (sorted_pairs[s] where given, else s itself: the per-token order), t = p / top_k and
// e = ids[p]. Experts' matrices through tables of their addresses; an expert id past
// `num_experts` is reported as a fault.
#version 450
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "reduce.glsl"

layout(push_constant) uniform Args {
    Floats x;
    Uints ids;
    uint64_t sorted_pairs;
    Uints gate;
    Uints up;
    Floats act;
    Fault fault;
    uint pairs;
    uint top_k;
    uint inter;
    uint hidden;
    uint num_experts;
    uint gate_type;
    uint up_type;
} args;

void main() {
    uint g = flat_group();
    if (g >= args.pairs * args.inter) {
        return;
    }
    uint s = g / args.inter;
    uint r = g - s * args.inter;
    uint p = args.sorted_pairs != 0 ? Uints(args.sorted_pairs).v[s] : s;
    uint e = args.ids.v[p];
    if (e >= args.num_experts) {
        if (gl_LocalInvocationID.x == 0) {
            report(args.fault, FAULT_EXPERT_ID);
        }
        return;
    }
    uint t = p / args.top_k;
    uint64_t gate = expert_at(args.gate, e);
    uint64_t up = expert_at(args.up, e);
    uint64_t row = uint64_t(r) * args.hidden;
    float gs = 0.0;
    float us = 0.0;
    for (uint k = gl_LocalInvocationID.x; k < args.hidden; k += GROUP_SIZE) {
        float xv = args.x.v[t * args.hidden + k];
        gs += xv * weight_at(gate, args.gate_type, row + k);
        us += xv * weight_at(up, args.up_type, row + k);
    }
    gs = workgroup_sum(gs);
    us = workgroup_sum(us);
    if (gl_LocalInvocationID.x == 0) {
        args.act.v[s * args.inter + r] = gs * sigmoid(gs) * us;
    }
}
