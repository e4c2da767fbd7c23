// Tensor-core products of few rows with 16-bit weights, read straight from global memory
// (needs mma_tile.cuh for the mma and operand packing).

#define MVM_WARPS 8   // warps of a block, splitting K between them
#define MVM_UNROLL 4  // 32-element spans of K in flight per warp

// Few rows on tensor cores, for 16-bit weights (the dense projections here, the grouped
// experts of few tokens in moe.cu): a block computes 16 output features of NW weights for up
// to 8 NT rows of x, its warps taking alternate 32-element spans of K. The weights are the
// mma's A operand, loaded straight from global memory: lane (g, t) reads 8 consecutive
// elements of rows g and g + 8 with one 16-byte load each. A dot product does not care in
// which order K is summed, so the mma's k index is mapped onto memory such that those 8
// elements are exactly what the lane holds for two k16 steps; x (row g + 8j, the B operand,
// at xr[j], null past the last row) is read and rounded to the operand type through the same
// map. Each weight element is read once and meets every row. WAIT: the kernel began
// deferred, and each pass waits for the kernel before between its weight loads and x's.
template <bool F16, int NT, int NW, bool WAIT = false>
__device__ __forceinline__ void mvm_accumulate(const float* const (&xr)[NT],
                                               const u16* const (&w_lo)[NW],
                                               const u16* const (&w_hi)[NW], bool lo_ok,
                                               bool hi_ok, u32 K, float (&acc)[NW][NT][4],
                                               Diag* diag) {
    u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, t = lane & 3;
#pragma unroll
    for (int v = 0; v < NW; v++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int i = 0; i < 4; i++) acc[v][j][i] = 0.f;
    u32 spans = (K + 31) / 32;
    bool range_error = false;
    for (u32 s0 = warp; s0 < spans; s0 += MVM_WARPS * MVM_UNROLL) {
        uint4 wl[MVM_UNROLL][NW], wh[MVM_UNROLL][NW];
#pragma unroll
        for (int u = 0; u < MVM_UNROLL; u++) {
            u32 k = (s0 + u * MVM_WARPS) * 32 + t * 8;
            bool ok = k < K;
#pragma unroll
            for (int v = 0; v < NW; v++) {
                wl[u][v] = ok && lo_ok ? *reinterpret_cast<const uint4*>(w_lo[v] + k)
                                       : make_uint4(0, 0, 0, 0);
                wh[u][v] = ok && hi_ok ? *reinterpret_cast<const uint4*>(w_hi[v] + k)
                                       : make_uint4(0, 0, 0, 0);
            }
        }
        if constexpr (WAIT) wait_for_previous_kernel();
#pragma unroll
        for (int u = 0; u < MVM_UNROLL; u++) {
            // mma.sync needs the whole warp: only whole spans are skipped (warp-uniform); a
            // lane whose 8 elements lie beyond K (K % 8 == 0) feeds zeros.
            if (s0 + u * MVM_WARPS >= spans) break;
            u32 k = (s0 + u * MVM_WARPS) * 32 + t * 8;
            bool k_ok = k < K;
#pragma unroll
            for (int j = 0; j < NT; j++) {
                u32 b[4];
                x_operands8<F16>(xr[j] + k, xr[j] && k_ok, b, range_error);
#pragma unroll
                for (int v = 0; v < NW; v++) {
                    u32 a0[4] = {wl[u][v].x, wh[u][v].x, wl[u][v].y, wh[u][v].y};
                    u32 a1[4] = {wl[u][v].z, wh[u][v].z, wl[u][v].w, wh[u][v].w};
                    mma16816<F16>(acc[v][j], a0, &b[0]);
                    mma16816<F16>(acc[v][j], a1, &b[2]);
                }
            }
        }
    }
    if (range_error) raise_error(diag, ERR_F16_RANGE);
}

// Sums the N accumulators of every warp into warp 0's (true there); `red` is shared memory
// of (WARPS - 1) * N * 32 floats. Block-wide: every thread calls it.
template <int N, int WARPS = MVM_WARPS>
__device__ __forceinline__ bool mvm_reduce(float* acc, float* red) {
    u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (warp > 0) {
#pragma unroll
        for (int i = 0; i < N; i++) red[((warp - 1) * N + i) * 32 + lane] = acc[i];
    }
    __syncthreads();
    if (warp != 0) return false;
#pragma unroll
    for (int i = 0; i < N; i++)
#pragma unroll
        for (int w = 0; w < WARPS - 1; w++) acc[i] += red[(w * N + i) * 32 + lane];
    return true;
}

// Where accumulator i of n-tile j lands: feature g (+ 8 for i >= 2), row 8 j + 2 t + (i & 1).
__device__ __forceinline__ u32 mvm_feature(int i) { return ((threadIdx.x & 31) >> 2) + (i >= 2 ? 8 : 0); }
__device__ __forceinline__ u32 mvm_row(int j, int i) { return j * 8 + 2 * (threadIdx.x & 3) + (i & 1); }
