// The down projection of a few tokens' routed pairs sorted by expert (ROWS pairs an expert
// at once), each scaled by its pair's routing weight, a team (teams.glsl) an (expert hit,
// output): each expert's rows read once for all its pairs.
// y[s, c] = w[p] * (down[e][c] . act[s]) for every sorted position s of the h-th expert
// hit e, p = sorted_pairs[s].
#version 450
#extension GL_GOOGLE_include_directive : require
#define GROUP_SIZE 128
#include "common.glsl"
#include "parts.glsl"
#include "teams.glsl"

layout(push_constant) uniform Args {
    Floats act;
    Floats weights;
    Uints offsets;
    Uints hit;
    Uints sorted_pairs;
    Uints down;
    Floats y;
    uint inter;
    uint hidden;
    uint down_type;
} args;

// The most pairs of one expert (`TILED_FROM_TOKENS` in ops/moe.rs).
const uint ROWS = 8;

shared float sums[ROWS][GROUP_SIZE];

void main() {
    uint item = team_item();
    uint h = item / args.hidden;
    uint c = item % args.hidden;
    bool live = h < args.hit.v[0];
    uint e = live ? args.hit.v[1 + h] : 0;
    uint s0 = live ? args.offsets.v[e] : 0;
    uint count = live ? args.offsets.v[e + 1] - s0 : 0;
    uint n = min(count, ROWS);
    float acc[ROWS];
    for (uint j = 0; j < ROWS; j++) {
        acc[j] = 0.0;
    }
    if (n > 0) {
        uint64_t down = expert_at(args.down, e);
        uint64_t row = uint64_t(c) * args.inter;
        for (uint k0 = team_lane() * 16; k0 < args.inter; k0 += TEAM * 16) {
            float w[16];
            weight_part(down, args.down_type, row, k0, args.inter, w);
            for (uint j = 0; j < ROWS; j++) {
                if (j < n) {
                    uint at = (s0 + j) * args.inter;
                    for (uint i = 0; i < 16; i++) {
                        acc[j] += w[i] * args.act.v[at + min(k0 + i, args.inter - 1)];
                    }
                }
            }
        }
    }
    for (uint j = 0; j < ROWS; j++) {
        sums[j][gl_LocalInvocationID.x] = acc[j];
    }
    barrier();
    if (team_lane() == 0) {
        for (uint j = 0; j < n; j++) {
            float total = 0.0;
            for (uint l = 0; l < TEAM; l++) {
                total += sums[j][gl_LocalInvocationID.x + l];
            }
            uint s = s0 + j;
            args.y.v[s * args.hidden + c] = args.weights.v[args.sorted_pairs.v[s]] * total;
        }
        // Pairs past ROWS (an expert routed twice for one token: never by the router), by
        // this invocation alone.
        for (uint j = ROWS; j < count; j++) {
            uint s = s0 + j;
            uint64_t row = uint64_t(c) * args.inter;
            float total = 0.0;
            for (uint k0 = 0; k0 < args.inter; k0 += 16) {
                float w[16];
                weight_part(expert_at(args.down, e), args.down_type, row, k0, args.inter, w);
                for (uint i = 0; i < 16; i++) {
                    total += w[i] * args.act.v[s * args.inter + min(k0 + i, args.inter - 1)];
                }
            }
            args.y.v[s * args.hidden + c] = args.weights.v[args.sorted_pairs.v[s]] * total;
        }
    }
}
