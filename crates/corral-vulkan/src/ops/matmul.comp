// out[r, col0 + n] (rows of `out_cols`) = x[r, :] . w[n, :] for weights of any float type or
// block format, `cols` wide from element `offset`: the portable product of many rows, a
// workgroup a tile of 64 rows by 64 outputs (tiles.glsl), each weight decoded once a tile of
// rows.
#version 450
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "parts.glsl"
#include "tiles.glsl"

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

void main() {
    uint tiles_n = (args.n + TILE - 1) / TILE;
    uint g = flat_group();
    uint r0 = (g / tiles_n) * TILE;
    uint n0 = (g % tiles_n) * TILE;
    if (r0 >= args.rows) {
        return;
    }
    uint id = gl_LocalInvocationID.x;
    float acc[4][4];
    float unused[4][4];
    for (uint i = 0; i < 4; i++) {
        for (uint j = 0; j < 4; j++) {
            acc[i][j] = 0.0;
            unused[i][j] = 0.0;
        }
    }
    tile_begin();
    for (uint k0 = 0; k0 < args.cols; k0 += 16) {
        for (uint i = 0; i < 4; i++) {
            uvec2 slot = tile_x_slot(i);
            uint r = r0 + slot.x;
            uint k = k0 + slot.y;
            stage_x(slot.x, slot.y, r < args.rows && k < args.cols ? args.x.v[r * args.cols + k] : 0.0);
        }
        if (id < TILE) {
            float w[16];
            uint n = n0 + id;
            if (n < args.n) {
                weight_part(args.w, args.weight_type, uint64_t(args.offset) + uint64_t(n) * args.cols,
                            k0, args.cols, w);
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
        uint r = r0 + tile_row0() + i;
        for (uint j = 0; j < 4; j++) {
            uint n = n0 + tile_out0() + j;
            if (r < args.rows && n < args.n) {
                args.out_.v[r * args.out_cols + args.col0 + n] = acc[i][j];
            }
        }
    }
}
