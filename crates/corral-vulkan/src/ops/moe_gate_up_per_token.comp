// The per-token experts' first half, a team (teams.glsl) an output:
// act[p, r] = silu(gate[e][r] . x[t]) * (up[e][r] . x[t]) for each routed pair p,
// t = p / top_k and e = ids[p]. Experts' matrices through tables of their addresses; an
// expert id past `num_experts` is reported as a fault.
#version 450
#extension GL_GOOGLE_include_directive : require
#define GROUP_SIZE 128
#include "common.glsl"
#include "parts.glsl"
#include "teams.glsl"

layout(push_constant) uniform Args {
    Floats x;
    Uints ids;
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
    uint item = team_item();
    bool live = item < args.pairs * args.inter;
    uint p = item / args.inter;
    uint r = item % args.inter;
    uint e = 0;
    if (live) {
        e = args.ids.v[p];
        if (e >= args.num_experts) {
            if (team_lane() == 0) {
                report(args.fault, FAULT_EXPERT_ID);
            }
            live = false;
        }
    }
    float gs = 0.0;
    float us = 0.0;
    if (live) {
        uint x_at = (p / args.top_k) * args.hidden;
        uint64_t row = uint64_t(r) * args.hidden;
        gs = lane_dot(expert_at(args.gate, e), args.gate_type, row, args.hidden, args.x, x_at);
        us = lane_dot(expert_at(args.up, e), args.up_type, row, args.hidden, args.x, x_at);
    }
    gs = team_sum(gs);
    us = team_sum(us);
    if (live && team_lane() == 0) {
        args.act.v[p * args.inter + r] = gs * sigmoid(gs) * us;
    }
}
