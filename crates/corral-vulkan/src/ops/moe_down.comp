// The down projection of routed pairs in sorted order, scaled by each pair's routing weight,
// a team (teams.glsl) an output: y[s, c] = w[p] * (down[e][c] . act[s]) for the pair p at
// position s, e = ids[p]; an expert id past `num_experts` is reported as a fault.
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
    uint item = team_item();
    bool live = item < args.pairs * args.hidden;
    uint s = item / args.hidden;
    uint c = item % args.hidden;
    uint p = 0;
    uint e = 0;
    if (live) {
        p = args.sorted_pairs.v[s];
        e = args.ids.v[p];
        if (e >= args.num_experts) {
            if (team_lane() == 0) {
                report(args.fault, FAULT_EXPERT_ID);
            }
            live = false;
        }
    }
    float sum = 0.0;
    if (live) {
        uint64_t row = uint64_t(c) * args.inter;
        sum = lane_dot(expert_at(args.down, e), args.down_type, row, args.inter, args.act,
                       s * args.inter);
    }
    sum = team_sum(sum);
    if (live && team_lane() == 0) {
        args.y.v[s * args.hidden + c] = args.weights.v[p] * sum;
    }
}
