// The gate and up projections and SwiGLU of a few tokens' routed pairs sorted by expert
// (ROWS pairs an expert at once: one a token), a team (teams.glsl) an (expert hit, row):
// each expert's rows read once for all its pairs, each invocation 16 columns at a time.
// act[s, r] = silu(gate[e][r] . x[t]) * (up[e][r] . x[t]) for every sorted position s of
// the h-th expert hit e, t = sorted_pairs[s] / top_k.
#version 450
#extension GL_GOOGLE_include_directive : require
#define GROUP_SIZE 128
#include "common.glsl"
#include "parts.glsl"
#include "teams.glsl"

layout(push_constant) uniform Args {
    Floats x;
    Uints offsets;
    Uints hit;
    Uints sorted_pairs;
    Uints gate;
    Uints up;
    Floats act;
    uint top_k;
    uint inter;
    uint hidden;
    uint gate_type;
    uint up_type;
} args;

// The most pairs of one expert (`TILED_FROM_TOKENS` in ops/moe.rs).
const uint ROWS = 8;

shared float gate_sums[ROWS][GROUP_SIZE];
shared float up_sums[ROWS][GROUP_SIZE];

void main() {
    uint item = team_item();
    uint h = item / args.inter;
    uint r = item % args.inter;
    bool live = h < args.hit.v[0];
    uint e = live ? args.hit.v[1 + h] : 0;
    uint s0 = live ? args.offsets.v[e] : 0;
    uint count = live ? args.offsets.v[e + 1] - s0 : 0;
    uint n = min(count, ROWS);
    uint x_at[ROWS];
    float g[ROWS];
    float u[ROWS];
    for (uint j = 0; j < ROWS; j++) {
        x_at[j] = j < n ? (args.sorted_pairs.v[s0 + j] / args.top_k) * args.hidden : 0;
        g[j] = 0.0;
        u[j] = 0.0;
    }
    if (n > 0) {
        uint64_t gate = expert_at(args.gate, e);
        uint64_t up = expert_at(args.up, e);
        uint64_t row = uint64_t(r) * args.hidden;
        for (uint k0 = team_lane() * 16; k0 < args.hidden; k0 += TEAM * 16) {
            float wg[16];
            float wu[16];
            weight_part(gate, args.gate_type, row, k0, args.hidden, wg);
            weight_part(up, args.up_type, row, k0, args.hidden, wu);
            for (uint j = 0; j < ROWS; j++) {
                if (j < n) {
                    for (uint i = 0; i < 16; i++) {
                        float xv = args.x.v[x_at[j] + min(k0 + i, args.hidden - 1)];
                        g[j] += wg[i] * xv;
                        u[j] += wu[i] * xv;
                    }
                }
            }
        }
    }
    for (uint j = 0; j < ROWS; j++) {
        gate_sums[j][gl_LocalInvocationID.x] = g[j];
        up_sums[j][gl_LocalInvocationID.x] = u[j];
    }
    barrier();
    if (team_lane() == 0) {
        for (uint j = 0; j < n; j++) {
            float gs = 0.0;
            float us = 0.0;
            for (uint l = 0; l < TEAM; l++) {
                gs += gate_sums[j][gl_LocalInvocationID.x + l];
                us += up_sums[j][gl_LocalInvocationID.x + l];
            }
            args.act.v[(s0 + j) * args.inter + r] = gs * sigmoid(gs) * us;
        }
        // Pairs past ROWS (an expert routed twice for one token: never by the router), by
        // this invocation alone.
        for (uint j = ROWS; j < count; j++) {
            uint x_row = (args.sorted_pairs.v[s0 + j] / args.top_k) * args.hidden;
            uint64_t row = uint64_t(r) * args.hidden;
            float gs = 0.0;
            float us = 0.0;
            for (uint k0 = 0; k0 < args.hidden; k0 += 16) {
                float wg[16];
                float wu[16];
                weight_part(expert_at(args.gate, e), args.gate_type, row, k0, args.hidden, wg);
                weight_part(expert_at(args.up, e), args.up_type, row, k0, args.hidden, wu);
                for (uint i = 0; i < 16; i++) {
                    float xv = args.x.v[x_row + min(k0 + i, args.hidden - 1)];
                    gs += wg[i] * xv;
                    us += wu[i] * xv;
                }
            }
            args.act.v[(s0 + j) * args.inter + r] = gs * sigmoid(gs) * us;
        }
    }
}
