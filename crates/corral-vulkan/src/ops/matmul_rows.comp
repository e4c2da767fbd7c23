// out[r, col0 + n] = x[r, :] . w[n, :] for up to ROWS rows of x: the few-row product
// (decode), reading each weight once. A team (teams.glsl) an output, each invocation taking
// 16 columns at a time (a block's part, its scales decoded once) for every row of x, the
// team's partial sums added through shared memory.
#version 450
#extension GL_GOOGLE_include_directive : require
#define GROUP_SIZE 128
#include "common.glsl"
#include "parts.glsl"
#include "teams.glsl"

layout(push_constant) uniform Args {
    Floats x;
    uint64_t w;
    Floats out_;
    uint n;
    uint cols;
    uint out_cols;
    uint col0;
    uint weight_type;
    uint offset;
    uint rows;
} args;

// The most rows of x (`MATMUL_ROWS_MAX` in ops/matmul.rs).
const uint ROWS = 8;

shared float sums[ROWS][GROUP_SIZE];

void main() {
    uint lane = team_lane();
    uint n = team_item();
    float acc[ROWS];
    for (uint r = 0; r < ROWS; r++) {
        acc[r] = 0.0;
    }
    if (n < args.n) {
        uint64_t row = uint64_t(args.offset) + uint64_t(n) * args.cols;
        for (uint k0 = lane * 16; k0 < args.cols; k0 += TEAM * 16) {
            float w[16];
            weight_part(args.w, args.weight_type, row, k0, args.cols, w);
            for (uint r = 0; r < ROWS; r++) {
                if (r < args.rows) {
                    float s = 0.0;
                    for (uint i = 0; i < 16; i++) {
                        s += w[i] * args.x.v[r * args.cols + min(k0 + i, args.cols - 1)];
                    }
                    acc[r] += s;
                }
            }
        }
    }
    for (uint r = 0; r < ROWS; r++) {
        sums[r][gl_LocalInvocationID.x] = acc[r];
    }
    barrier();
    // A (team, row) pair an invocation: more pairs than invocations where teams are small.
    for (uint t = gl_LocalInvocationID.x; t < TEAMS * args.rows; t += GROUP_SIZE) {
        uint r = t % args.rows;
        uint tm = t / args.rows;
        uint out_n = flat_group() * TEAMS + tm;
        if (out_n < args.n) {
            float total = 0.0;
            for (uint l = 0; l < TEAM; l++) {
                total += sums[r][tm * TEAM + l];
            }
            args.out_.v[r * args.out_cols + args.col0 + out_n] = total;
        }
    }
}
