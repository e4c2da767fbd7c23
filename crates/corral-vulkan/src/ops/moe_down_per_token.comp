// The per-token experts' second half, a workgroup a (token, GROUP_SIZE outputs), an
// invocation an output: out[t, c] = sum over j of w[t, j] * (down[e][c] . act[t * top_k + j]),
// e = ids[t, j], in slot order, each act row taken through shared memory a chunk at a time;
// an expert id past `num_experts` is reported as a fault.
#version 450
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

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

const uint CHUNK = 1024;

shared float as_[CHUNK];

void main() {
    uint blocks = (args.hidden + GROUP_SIZE - 1) / GROUP_SIZE;
    uint g = flat_group();
    uint t = g / blocks;
    if (t >= args.tokens) {
        return;
    }
    uint c = (g % blocks) * GROUP_SIZE + gl_LocalInvocationID.x;
    float total = 0.0;
    for (uint j = 0; j < args.top_k; j++) {
        uint p = t * args.top_k + j;
        uint e = args.ids.v[p];
        if (e >= args.num_experts) {
            if (gl_LocalInvocationID.x == 0) {
                report(args.fault, FAULT_EXPERT_ID);
            }
            continue;
        }
        uint64_t down = expert_at(args.down, e);
        uint64_t row = uint64_t(min(c, args.hidden - 1)) * args.inter;
        float sum = 0.0;
        for (uint k0 = 0; k0 < args.inter; k0 += CHUNK) {
            uint len = min(CHUNK, args.inter - k0);
            for (uint k = gl_LocalInvocationID.x; k < len; k += GROUP_SIZE) {
                as_[k] = args.act.v[p * args.inter + k0 + k];
            }
            barrier();
            for (uint k = 0; k < len; k++) {
                sum += as_[k] * weight_at(down, args.down_type, row + k0 + k);
            }
            barrier();
        }
        total += args.weights.v[p] * sum;
    }
    if (c < args.hidden) {
        args.out_.v[t * args.hidden + c] = total;
    }
}
