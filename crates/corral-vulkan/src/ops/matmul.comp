// out[r, col0 + n] (rows of `out_cols`) = x[r, :] . w[n, :] for weights of any float type,
// `cols` wide from element `offset`: the portable product, a workgroup a tile of 16 rows by
// 16 outputs, x and w taken through shared memory 16 columns at a time (each weight read
// once a tile of rows). The fast products come per device.
#version 450
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

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

const uint TILE = 16;

shared float xs[TILE][TILE + 1];
shared float ws[TILE][TILE + 1];

void main() {
    uint tiles_n = (args.n + TILE - 1) / TILE;
    uint g = flat_group();
    uint r0 = (g / tiles_n) * TILE;
    uint n0 = (g % tiles_n) * TILE;
    if (r0 >= args.rows) {
        return;
    }
    uint ty = gl_LocalInvocationID.x / TILE;
    uint tx = gl_LocalInvocationID.x % TILE;
    uint r = r0 + ty;
    uint wn = n0 + ty;
    float acc = 0.0;
    for (uint k0 = 0; k0 < args.cols; k0 += TILE) {
        uint k = k0 + tx;
        xs[ty][tx] = r < args.rows && k < args.cols ? args.x.v[r * args.cols + k] : 0.0;
        ws[ty][tx] = wn < args.n && k < args.cols
            ? weight_at(args.w, args.weight_type, uint64_t(args.offset) + uint64_t(wn) * args.cols + k)
            : 0.0;
        barrier();
        for (uint kk = 0; kk < TILE; kk++) {
            acc += xs[ty][kk] * ws[tx][kk];
        }
        barrier();
    }
    uint n = n0 + tx;
    if (r < args.rows && n < args.n) {
        args.out_.v[r * args.out_cols + args.col0 + n] = acc;
    }
}
