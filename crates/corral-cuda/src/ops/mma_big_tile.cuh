// A 128-row output tile of C = A · Wᵀ on tensor cores for prefill-sized expert groups: bf16
// activation rows and bf16 weights [N, K] row-major, both streamed into shared memory by a
// cp.async pipeline of STAGES 64-wide k-tiles and read as operands by ldmatrix. 256
// threads: 4x2 warps of 32 rows. With NW = 2 the block computes 64 columns of two weights
// (gate and up) over one staged A, so SwiGLU is applied in registers. A warp whose 32 rows
// are all past the tile's end skips its products. With SPLIT the activations are split
// pairs (mma_tile.cuh's split_bf16): a plane of high halves and, `lo_offset` values on, one
// of low halves, both staged, each multiplied by the same weight fragments, so A keeps about
// 16 significant bits. Shared memory is dynamic (kernels.rs's big_tile_smem_bytes, set as the
// kernels' attribute).

#define BT_M 128
#define BT_K 64
#define BT_THREADS 256
#define BT_W_ROWS 128  // weight rows staged per k-tile, all weights together
#define BT_STRIDE 72   // u16 per staged row: 64 + 8, conflict-free ldmatrix rows

// u16 per stage: the activation planes' rows, then the weight rows.
__host__ __device__ constexpr int bt_stage(bool split) {
    return ((split ? 2 : 1) * BT_M + BT_W_ROWS) * BT_STRIDE;
}

// acc[x][mi][ni][4]: weight x, rows wm*32 + mi*16 + {g, g+8}, columns (of that weight's
// BT_W_ROWS / NW) wn*WC + ni*8 + 2*tq + {0,1}, WC = BT_W_ROWS / NW / 2.
// a_rows: shared [BT_M] bf16 row pointers (null past the tile's rows); a_any: any readable
// address (the source of zero-filled copies); with SPLIT a row's low halves lie lo_offset
// values after it. w[x]: row 0 of weight x's rows in this tile, n_valid of them exist. Rows
// are 16-byte aligned and K % 8 == 0. `rows`: live tile rows.
template <int NW, bool SPLIT, int STAGES>
__device__ void big_tile_mma(const u16* const* a_rows, const u16* a_any, size_t lo_offset,
                             const bf16w* const* w, int n_valid, int K, int rows,
                             float (*acc)[2][BT_W_ROWS / NW / 16][4]) {
    constexpr int STAGE = bt_stage(SPLIT);
    constexpr int PLANES = SPLIT ? 2 : 1;
    constexpr int WR = BT_W_ROWS / NW;  // rows of each weight in the tile
    constexpr int NT = WR / 16;         // n8 tiles per warp per weight
    extern __shared__ __align__(16) unsigned char bt_smem[];
    u16* smem = reinterpret_cast<u16*>(bt_smem);  // per stage: A rows, then weight rows
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int wm = warp & 3, wn = warp >> 2;
    bool live = wm * 32 < rows;
    int tiles = (K + BT_K - 1) / BT_K;
#pragma unroll
    for (int x = 0; x < NW; x++)
#pragma unroll
        for (int mi = 0; mi < 2; mi++)
#pragma unroll
            for (int ni = 0; ni < NT; ni++)
#pragma unroll
                for (int r = 0; r < 4; r++) acc[x][mi][ni][r] = 0.f;

    // k-tile kt into its stage: 128 rows of each activation plane and 128 weight rows, of 8
    // pieces each.
    auto issue = [&](int kt) {
        int k0 = kt * BT_K;
        u16* as = smem + (kt % STAGES) * STAGE;
        u16* ws = as + PLANES * BT_M * BT_STRIDE;
#pragma unroll
        for (int i = 0; i < PLANES * BT_M * 8 / BT_THREADS; i++) {
            int c = tid + i * BT_THREADS, row = (c >> 3) % BT_M, plane = c / (BT_M * 8);
            int k = k0 + (c & 7) * 8;
            const u16* src = a_rows[row];
            bool ok = src != nullptr && k < K;
            cp_async16(as + (plane * BT_M + row) * BT_STRIDE + (c & 7) * 8,
                       ok ? src + plane * lo_offset + k : a_any, ok ? 16u : 0u);
        }
#pragma unroll
        for (int i = 0; i < BT_W_ROWS * 8 / BT_THREADS; i++) {
            int c = tid + i * BT_THREADS, row = c >> 3, k = k0 + (c & 7) * 8;
            int x = row / WR, r = row % WR;
            bool ok = r < n_valid && k < K;
            const bf16w* src = ok ? w[x] + (size_t)r * K + k : w[0];
            cp_async16(ws + row * BT_STRIDE + (c & 7) * 8, src, ok ? 16u : 0u);
        }
    };

#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < tiles) issue(s);
        cp_async_commit();
    }
    for (int kt = 0; kt < tiles; kt++) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        if (kt + STAGES - 1 < tiles) issue(kt + STAGES - 1);
        cp_async_commit();
        if (!live) continue;
        const u16* as = smem + (kt % STAGES) * STAGE;
        const u16* ws = as + PLANES * BT_M * BT_STRIDE;
#pragma unroll
        for (int ks = 0; ks < BT_K; ks += 16) {
            u32 af[PLANES][2][4];
#pragma unroll
            for (int pl = 0; pl < PLANES; pl++)
#pragma unroll
                for (int mi = 0; mi < 2; mi++)
                    ldmatrix_x4(af[pl][mi], as + (pl * BT_M + wm * 32 + mi * 16 + (lane & 15)) *
                                                     BT_STRIDE +
                                                 ks + (lane >> 4) * 8);
#pragma unroll
            for (int x = 0; x < NW; x++) {
#pragma unroll
                for (int np = 0; np < NT / 2; np++) {
                    int wrow = x * WR + wn * (WR / 2) + np * 16 + (lane & 7) + ((lane >> 4) << 3);
                    u32 bf[4];
                    ldmatrix_x4(bf, ws + wrow * BT_STRIDE + ks + ((lane >> 3) & 1) * 8);
#pragma unroll
                    for (int pl = 0; pl < PLANES; pl++)
#pragma unroll
                        for (int mi = 0; mi < 2; mi++) {
                            mma16816<false>(acc[x][mi][2 * np], af[pl][mi], bf);
                            mma16816<false>(acc[x][mi][2 * np + 1], af[pl][mi], bf + 2);
                        }
                }
            }
        }
    }
    cp_async_wait<0>();
}

// Calls f(mi, ni, r, tile_row, col) for each pair of adjacent columns a thread holds:
// accumulator entries [x][mi][ni][r] and [r + 1] of every weight x belong to tile_row and
// that weight's columns col, col + 1.
template <int NW, typename F>
__device__ __forceinline__ void big_tile_for_each(F f) {
    constexpr int NT = BT_W_ROWS / NW / 16;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int wm = warp & 3, wn = warp >> 2, g = lane >> 2, tq = lane & 3;
#pragma unroll
    for (int mi = 0; mi < 2; mi++)
#pragma unroll
        for (int ni = 0; ni < NT; ni++)
#pragma unroll
            for (int hh = 0; hh < 2; hh++)
                f(mi, ni, hh * 2, wm * 32 + mi * 16 + g + hh * 8, wn * NT * 8 + ni * 8 + 2 * tq);
}
