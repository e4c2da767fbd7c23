// Products in tiles of TILE rows by TILE outputs, K taken 16 columns at a time through
// shared memory, for workgroups of 256 invocations: each invocation accumulates 4 rows by 4
// outputs; a weight row's 16 columns are decoded as one part (parts.glsl) by one invocation.
// Include after parts.glsl, with GROUP_SIZE 256.

const uint TILE = 64;

// The x tile and one or two weight tiles, K-major: [k][row or output].
shared float tile_x[16][TILE + 4];
shared float tile_w[16][TILE + 4];
shared float tile_w2[16][TILE + 4];

// The first row and output of this invocation's 4 by 4 within the tile.
uint tile_row0() {
    return (gl_LocalInvocationID.x / 16) * 4;
}

uint tile_out0() {
    return (gl_LocalInvocationID.x % 16) * 4;
}

// The x tile's (row, column) pairs this invocation loads, the i-th of 4: 64 rows by 16.
uvec2 tile_x_slot(uint i) {
    uint at = gl_LocalInvocationID.x + GROUP_SIZE * i;
    return uvec2(at / 16, at % 16);
}

// Column kk of tile row m.
void stage_x(uint m, uint kk, float v) {
    tile_x[kk][m] = v;
}

// Output n's 16 columns, into the first or the second weight tile.
void stage_w(uint n, float w[16], bool second) {
    for (uint kk = 0; kk < 16; kk++) {
        if (second) {
            tile_w2[kk][n] = w[kk];
        } else {
            tile_w[kk][n] = w[kk];
        }
    }
}

// This invocation's 4 by 4 products of the staged columns, added into `acc` (the first
// weight tile) and `acc2` (the second, if `both`).
void tile_accumulate(inout float acc[4][4], inout float acc2[4][4], bool both) {
    uint m0 = tile_row0();
    uint n0 = tile_out0();
    for (uint kk = 0; kk < 16; kk++) {
        float a[4];
        float b[4];
        for (uint i = 0; i < 4; i++) {
            a[i] = tile_x[kk][m0 + i];
            b[i] = tile_w[kk][n0 + i];
        }
        for (uint i = 0; i < 4; i++) {
            for (uint j = 0; j < 4; j++) {
                acc[i][j] += a[i] * b[j];
            }
        }
        if (both) {
            for (uint i = 0; i < 4; i++) {
                b[i] = tile_w2[kk][n0 + i];
            }
            for (uint i = 0; i < 4; i++) {
                for (uint j = 0; j < 4; j++) {
                    acc2[i][j] += a[i] * b[j];
                }
            }
        }
    }
}
