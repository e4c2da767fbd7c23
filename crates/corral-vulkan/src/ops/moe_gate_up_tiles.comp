// The gate and up projections and SwiGLU of the routed pairs sorted by expert, in tiles
// (tiles.glsl): workgroup (h, nt, mt) takes the h-th expert hit, e, its sorted positions
// offsets[e] + 64 mt onwards (at most 64, within its own) and 64 of its intermediate rows
// from 64 nt: act[s, r] = silu(gate[e][r] . x[t]) * (up[e][r] . x[t]) for the pair p at
// position s, t = p / top_k; each expert's weights read once a tile of its pairs.
#version 450
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "parts.glsl"
#include "tiles.glsl"

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

shared uint row_token[TILE];

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
    if (id < rows) {
        row_token[id] = args.sorted_pairs.v[start + id] / args.top_k;
    }
    uint64_t gate = expert_at(args.gate, e);
    uint64_t up = expert_at(args.up, e);
    float g[4][4];
    float u[4][4];
    for (uint i = 0; i < 4; i++) {
        for (uint j = 0; j < 4; j++) {
            g[i][j] = 0.0;
            u[i][j] = 0.0;
        }
    }
    barrier();
    tile_begin();
    for (uint k0 = 0; k0 < args.hidden; k0 += 16) {
        for (uint i = 0; i < 4; i++) {
            uvec2 slot = tile_x_slot(i);
            uint k = k0 + slot.y;
            stage_x(slot.x, slot.y,
                    slot.x < rows && k < args.hidden ? args.x.v[row_token[slot.x] * args.hidden + k] : 0.0);
        }
        if (id < 2 * TILE) {
            bool second = id >= TILE;
            uint n = n0 + id % TILE;
            float w[16];
            if (n < args.inter) {
                weight_part(second ? up : gate, second ? args.up_type : args.gate_type,
                            uint64_t(n) * args.hidden, k0, args.hidden, w);
            } else {
                for (uint i = 0; i < 16; i++) {
                    w[i] = 0.0;
                }
            }
            stage_w(id % TILE, w, second);
        }
        barrier();
        tile_accumulate(g, u, true);
        barrier();
    }
    tile_finish(g, u, true);
    for (uint i = 0; i < 4; i++) {
        uint m = tile_row0() + i;
        for (uint j = 0; j < 4; j++) {
            uint n = n0 + tile_out0() + j;
            if (m < rows && n < args.inter) {
                args.act.v[(start + m) * args.inter + n] = g[i][j] * sigmoid(g[i][j]) * u[i][j];
            }
        }
    }
}
