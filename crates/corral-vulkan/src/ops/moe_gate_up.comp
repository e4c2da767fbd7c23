// The gate and up projections and SwiGLU of routed pairs, a workgroup a (pair, GROUP_SIZE
// rows), an invocation a row: act[s, r] = silu(gate[e][r] . x[t]) * (up[e][r] . x[t]) for the
// pair p at position s (sorted_pairs[s] where given, else s itself: the per-token order),
// t = p / top_k and e = ids[p], x[t] taken through shared memory a chunk at a time. Experts'
// matrices through tables of their addresses; an expert id past `num_experts` is reported as
// a fault.
#version 450
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

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

const uint CHUNK = 1024;

shared float xs[CHUNK];

void main() {
    uint blocks = (args.inter + GROUP_SIZE - 1) / GROUP_SIZE;
    uint g = flat_group();
    uint s = g / blocks;
    if (s >= args.pairs) {
        return;
    }
    uint r = (g % blocks) * GROUP_SIZE + gl_LocalInvocationID.x;
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
    uint64_t row = uint64_t(min(r, args.inter - 1)) * args.hidden;
    float gs = 0.0;
    float us = 0.0;
    for (uint k0 = 0; k0 < args.hidden; k0 += CHUNK) {
        uint len = min(CHUNK, args.hidden - k0);
        for (uint k = gl_LocalInvocationID.x; k < len; k += GROUP_SIZE) {
            xs[k] = args.x.v[t * args.hidden + k0 + k];
        }
        barrier();
        for (uint k = 0; k < len; k++) {
            gs += xs[k] * weight_at(gate, args.gate_type, row + k0 + k);
            us += xs[k] * weight_at(up, args.up_type, row + k0 + k);
        }
        barrier();
    }
    if (r < args.inter) {
        args.act.v[s * args.inter + r] = gs * sigmoid(gs) * us;
    }
}
