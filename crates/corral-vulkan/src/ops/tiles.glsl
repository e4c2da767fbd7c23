// Products in tiles of TILE rows by TILE outputs, K taken 16 columns at a time through
// shared memory, for workgroups of 256 invocations; a weight row's 16 columns are decoded as
// one part (parts.glsl) by one invocation. A kernel calls tile_begin() before its loop over
// K, stage_x and stage_w then tile_accumulate for each 16 columns (barriers around it), and
// tile_finish after, which leaves each invocation its 4 rows by 4 outputs (tile_row0,
// tile_out0) in `acc` (and `acc2`, the second weight tile's, if `both`).
//
// Portable: each invocation accumulates its 4 by 4 in f32 as it goes. With COOPMAT defined
// (the `_coopmat` variants, for devices with VK_KHR_cooperative_matrix): x and the weights
// are staged as f16 (x clamped to f16's range) and each subgroup multiplies CM by CM
// sub-tiles of the tile on the device's matrix units (f32 accumulators), which tile_finish
// hands back through shared memory in the same 4 by 4 shape.
// Include after parts.glsl, with GROUP_SIZE 256.

const uint TILE = 64;

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

#ifdef COOPMAT

// The side of the device's square f16 products (specialization constant 1: 16, or 8).
layout(constant_id = 1) const uint CM = 16;
// Sub-tiles a subgroup owns at most: the host uses these kernels only where the tile's
// (TILE / CM)^2 sub-tiles fit its subgroups so.
const uint MAX_OWN = 4;
// Halves between staged rows (16-byte aligned), and floats between rows of the results.
const uint STAGE_STRIDE = TILE + 8;
const uint OUT_STRIDE = TILE + 4;

// The x tile column-major (row m of column kk at kk * STAGE_STRIDE + m), the weight tiles
// row-major by k (output n of column kk at the same place): the A and B operands.
shared float16_t tile_x[16 * STAGE_STRIDE];
shared float16_t tile_w[16 * STAGE_STRIDE];
shared float16_t tile_w2[16 * STAGE_STRIDE];
// Where tile_finish lays the accumulators out for the invocations to read.
shared float tile_out[TILE * OUT_STRIDE];

coopmat<float, gl_ScopeSubgroup, CM, CM, gl_MatrixUseAccumulator> tile_acc[MAX_OWN];
coopmat<float, gl_ScopeSubgroup, CM, CM, gl_MatrixUseAccumulator> tile_acc2[MAX_OWN];

// The sub-tile this subgroup owns in its `o`-th accumulator, or one past the last.
uint tile_owned(uint o) {
    return gl_SubgroupID + o * gl_NumSubgroups;
}

const uint SUBTILES = (TILE / CM) * (TILE / CM);

void tile_begin() {
    for (uint o = 0; o < MAX_OWN; o++) {
        tile_acc[o] = coopmat<float, gl_ScopeSubgroup, CM, CM, gl_MatrixUseAccumulator>(0.0);
        tile_acc2[o] = coopmat<float, gl_ScopeSubgroup, CM, CM, gl_MatrixUseAccumulator>(0.0);
    }
}

// Column kk of tile row m.
void stage_x(uint m, uint kk, float v) {
    tile_x[kk * STAGE_STRIDE + m] = float16_t(clamp(v, -65504.0, 65504.0));
}

// Output n's 16 columns, into the first or the second weight tile.
void stage_w(uint n, float w[16], bool second) {
    for (uint kk = 0; kk < 16; kk++) {
        if (second) {
            tile_w2[kk * STAGE_STRIDE + n] = float16_t(w[kk]);
        } else {
            tile_w[kk * STAGE_STRIDE + n] = float16_t(w[kk]);
        }
    }
}

// The staged 16 columns' products, added into this subgroup's accumulators (`acc` and
// `acc2` are tile_finish's).
void tile_accumulate(inout float acc[4][4], inout float acc2[4][4], bool both) {
    for (uint o = 0; o < MAX_OWN; o++) {
        uint t = tile_owned(o);
        if (t >= SUBTILES) {
            continue;
        }
        uint m0 = (t / (TILE / CM)) * CM;
        uint n0 = (t % (TILE / CM)) * CM;
        for (uint k = 0; k < 16; k += CM) {
            coopmat<float16_t, gl_ScopeSubgroup, CM, CM, gl_MatrixUseA> a;
            coopmat<float16_t, gl_ScopeSubgroup, CM, CM, gl_MatrixUseB> b;
            coopMatLoad(a, tile_x, k * STAGE_STRIDE + m0, STAGE_STRIDE,
                        gl_CooperativeMatrixLayoutColumnMajor);
            coopMatLoad(b, tile_w, k * STAGE_STRIDE + n0, STAGE_STRIDE,
                        gl_CooperativeMatrixLayoutRowMajor);
            tile_acc[o] = coopMatMulAdd(a, b, tile_acc[o]);
            if (both) {
                coopMatLoad(b, tile_w2, k * STAGE_STRIDE + n0, STAGE_STRIDE,
                            gl_CooperativeMatrixLayoutRowMajor);
                tile_acc2[o] = coopMatMulAdd(a, b, tile_acc2[o]);
            }
        }
    }
}

// This invocation's 4 by 4 of the first (`second` false) or the second accumulators.
void tile_read_back(inout float acc[4][4], bool second) {
    for (uint o = 0; o < MAX_OWN; o++) {
        uint t = tile_owned(o);
        if (t < SUBTILES) {
            uint at = (t / (TILE / CM)) * CM * OUT_STRIDE + (t % (TILE / CM)) * CM;
            if (second) {
                coopMatStore(tile_acc2[o], tile_out, at, OUT_STRIDE,
                             gl_CooperativeMatrixLayoutRowMajor);
            } else {
                coopMatStore(tile_acc[o], tile_out, at, OUT_STRIDE,
                             gl_CooperativeMatrixLayoutRowMajor);
            }
        }
    }
    barrier();
    for (uint i = 0; i < 4; i++) {
        for (uint j = 0; j < 4; j++) {
            acc[i][j] = tile_out[(tile_row0() + i) * OUT_STRIDE + tile_out0() + j];
        }
    }
    barrier();
}

void tile_finish(inout float acc[4][4], inout float acc2[4][4], bool both) {
    tile_read_back(acc, false);
    if (both) {
        tile_read_back(acc2, true);
    }
}

#else

// The x tile and one or two weight tiles, K-major: [k][row or output].
shared float tile_x[16][TILE + 4];
shared float tile_w[16][TILE + 4];
shared float tile_w2[16][TILE + 4];

void tile_begin() {
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

void tile_finish(inout float acc[4][4], inout float acc2[4][4], bool both) {
}

#endif
