// The down projection of the routed pairs sorted by expert, in tiles (tiles.glsl), each
// scaled by its pair's routing weight: workgroup (h, nt, mt) takes the h-th expert hit, e,
// its sorted positions offsets[e] + 64 mt onwards (at most 64, within its own) and 64
// outputs from 64 nt: y[s, c] = w[p] * (down[e][c] . act[s]) for the pair p at position s;
// each expert's weights read once a tile of its pairs.
#version 450
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "parts.glsl"
#include "tiles.glsl"

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

void main() {
    uint h = gl_WorkGroupID.x;
    if (h >= args.hit.v[0]) {
        return;
    }
    uint e = args.hit.v[1 + h];
    uint start = args.offsets.v[e] + gl_WorkGroupID.z * TILE;
    uint end = args.offsets.v[e + 1];
    if (start >= end) {
        return;
    }
    uint rows = min(TILE, end - start);
    uint n0 = gl_WorkGroupID.y * TILE;
    uint id = gl_LocalInvocationID.x;
    uint64_t down = expert_at(args.down, e);
    float acc[4][4];
    float unused[4][4];
    for (uint i = 0; i < 4; i++) {
        for (uint j = 0; j < 4; j++) {
            acc[i][j] = 0.0;
            unused[i][j] = 0.0;
        }
    }
    tile_begin();
    for (uint k0 = 0; k0 < args.inter; k0 += 16) {
        for (uint i = 0; i < 4; i++) {
            uvec2 slot = tile_x_slot(i);
            uint k = k0 + slot.y;
            stage_x(slot.x, slot.y,
                    slot.x < rows && k < args.inter ? args.act.v[(start + slot.x) * args.inter + k] : 0.0);
        }
        if (id < TILE) {
            uint n = n0 + id;
            float w[16];
            if (n < args.hidden) {
                weight_part(down, args.down_type, uint64_t(n) * args.inter, k0, args.inter, w);
            } else {
                for (uint i = 0; i < 16; i++) {
                    w[i] = 0.0;
                }
            }
            stage_w(id, w, false);
        }
        barrier();
        tile_accumulate(acc, unused, false);
        barrier();
    }
    tile_finish(acc, unused, false);
    for (uint i = 0; i < 4; i++) {
        uint m = tile_row0() + i;
        if (m >= rows) {
            continue;
        }
        uint s = start + m;
        float scale = args.weights.v[args.sorted_pairs.v[s]];
        for (uint j = 0; j < 4; j++) {
            uint n = n0 + tile_out0() + j;
            if (n < args.hidden) {
                args.y.v[s * args.hidden + n] = scale * acc[i][j];
            }
        }
    }
}
