// The per-token experts' second half, a team (teams.glsl) an output:
// out[t, c] = sum over j of w[t, j] * (down[e][c] . act[t * top_k + j]), e = ids[t, j];
// an expert id past `num_experts` is reported as a fault (its term left out).
#version 450
#extension GL_GOOGLE_include_directive : require
#define GROUP_SIZE 128
#include "common.glsl"
#include "parts.glsl"
#include "teams.glsl"

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
    uint item = team_item();
    bool live = item < args.tokens * args.hidden;
    uint t = item / args.hidden;
    uint c = item % args.hidden;
    float total = 0.0;
    for (uint j = 0; live && j < args.top_k; j++) {
        uint p = t * args.top_k + j;
        uint e = args.ids.v[p];
        if (e >= args.num_experts) {
            if (team_lane() == 0) {
                report(args.fault, FAULT_EXPERT_ID);
            }
            continue;
        }
        uint64_t row = uint64_t(c) * args.inter;
        total += args.weights.v[p]
            * lane_dot(expert_at(args.down, e), args.down_type, row, args.inter, args.act,
                       p * args.inter);
    }
    total = team_sum(total);
    if (live && team_lane() == 0) {
        args.out_.v[t * args.hidden + c] = total;
    }
}
