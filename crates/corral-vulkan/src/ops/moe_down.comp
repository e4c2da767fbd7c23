// The down projection of routed pairs in sorted order, scaled by each pair's routing weight,
// a workgroup a (position, GROUP_SIZE outputs), an invocation an output:
// y[s, c] = w[p] * (down[e][c] . act[s]) for the pair p at position s, e = ids[p], act[s]
// taken through shared memory a chunk at a time; an expert id past `num_experts` is
// reported as a fault.
#version 450
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

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

const uint CHUNK = 1024;

shared float as_[CHUNK];

void main() {
    uint blocks = (args.hidden + GROUP_SIZE - 1) / GROUP_SIZE;
    uint g = flat_group();
    uint s = g / blocks;
    if (s >= args.pairs) {
        return;
    }
    uint c = (g % blocks) * GROUP_SIZE + gl_LocalInvocationID.x;
    uint p = args.sorted_pairs.v[s];
    uint e = args.ids.v[p];
    if (e >= args.num_experts) {
        if (gl_LocalInvocationID.x == 0) {
            report(args.fault, FAULT_EXPERT_ID);
        }
        return;
    }
    uint64_t down = expert_at(args.down, e);
    uint64_t row = uint64_t(min(c, args.hidden - 1)) * args.inter;
    float sum = 0.0;
    for (uint k0 = 0; k0 < args.inter; k0 += CHUNK) {
        uint len = min(CHUNK, args.inter - k0);
        for (uint k = gl_LocalInvocationID.x; k < len; k += GROUP_SIZE) {
            as_[k] = args.act.v[s * args.inter + k0 + k];
        }
        barrier();
        for (uint k = 0; k < len; k++) {
            sum += as_[k] * weight_at(down, args.down_type, row + k0 + k);
        }
        barrier();
    }
    if (c < args.hidden) {
        args.y.v[s * args.hidden + c] = args.weights.v[p] * sum;
    }
}
