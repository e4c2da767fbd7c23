// Dense projections out[rows, N] = x[rows, K] · Wᵀ with W [N, K] in its stored type.
// Few rows (decode): each weight row is read once for every row of x, on CUDA cores in f32
// (one row, or f32 weights) or on tensor cores (16-bit weights, 2 to 32 rows); those kernels
// begin deferred, their first weight loads in flight while the kernel before ends.
// Many rows: 64x64 tensor-core tiles (mma_tile.cuh).

#define MATVEC_WARPS 4

#define MATVEC_FEATURES 2  // output features per warp
#define MATVEC_PIECES 4    // 256-element pieces of each weight row in flight per lane

// A warp computes MATVEC_FEATURES output features for every row of x (ROWS at most, a
// compile-time bound): its lanes stream the features' weight rows in 16-byte pieces, and each
// piece of x, read once, meets all of them.
template <typename W, int ROWS>
__device__ void matvec_impl(const float* x, u32 rows, const W* w, u32 N, u32 K, u32 vec,
                            float* out, Diag* diag) {
    u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u32 per_block = MATVEC_WARPS * MATVEC_FEATURES;
    u32 n0 = blockIdx.x * per_block + warp * MATVEC_FEATURES;
    if (threadIdx.x == 0) {
        u32 valid = min(per_block, N - blockIdx.x * per_block);
        count_weight_bytes(diag, (u64)valid * K * sizeof(W));
    }
    if (n0 >= N) return;
    u32 nv = min((u32)MATVEC_FEATURES, N - n0);
    if constexpr (ROWS == 1 && sizeof(W) == 2) {
        if (vec) {
            // One row of x: each feature's whole weight row in flight at once.
            const float* xs[MATVEC_FEATURES];
            const W* ws[MATVEC_FEATURES];
#pragma unroll
            for (int j = 0; j < MATVEC_FEATURES; j++) {
                xs[j] = x;
                ws[j] = w + (size_t)(n0 + min((u32)j, nv - 1)) * K;
            }
            float dots[MATVEC_FEATURES];
            warp_dots16<W, MATVEC_FEATURES, 8, true>(xs, ws, K, dots);
            wait_for_previous_kernel();  // waited already unless K is 0
#pragma unroll
            for (int j = 0; j < MATVEC_FEATURES; j++)
                if (lane == 0 && rows > 0 && j < nv) out[n0 + j] = dots[j];
            return;
        }
    }
    wait_for_previous_kernel();
    float acc[ROWS][MATVEC_FEATURES];
#pragma unroll
    for (int r = 0; r < ROWS; r++)
#pragma unroll
        for (int j = 0; j < MATVEC_FEATURES; j++) acc[r][j] = 0.f;
    if (vec) {
        // MATVEC_PIECES pieces of 256 elements per pass: their 16-byte loads in flight at once.
        for (u32 k = lane * 8; k < K; k += MATVEC_PIECES * 256) {
            float wv[MATVEC_PIECES][MATVEC_FEATURES][8];
#pragma unroll
            for (int u = 0; u < MATVEC_PIECES; u++)
#pragma unroll
                for (int j = 0; j < MATVEC_FEATURES; j++) {
                    if (j < nv && k + u * 256 < K) {
                        load_w8(w + (size_t)(n0 + j) * K + k + u * 256, wv[u][j]);
                    } else {
#pragma unroll
                        for (int i = 0; i < 8; i++) wv[u][j][i] = 0.f;
                    }
                }
#pragma unroll
            for (int u = 0; u < MATVEC_PIECES; u++) {
                if (k + u * 256 >= K) break;
#pragma unroll
                for (int r = 0; r < ROWS; r++) {
                    if (r < rows) {
                        const float* xr = x + (size_t)r * K + k + u * 256;
                        float4 a = *reinterpret_cast<const float4*>(xr);
                        float4 b = *reinterpret_cast<const float4*>(xr + 4);
                        float xv[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
                        for (int j = 0; j < MATVEC_FEATURES; j++)
#pragma unroll
                            for (int i = 0; i < 8; i++) acc[r][j] += xv[i] * wv[u][j][i];
                    }
                }
            }
        }
    } else {
        for (u32 k = lane; k < K; k += 32) {
            float wv[MATVEC_FEATURES];
#pragma unroll
            for (int j = 0; j < MATVEC_FEATURES; j++)
                wv[j] = j < nv ? load_w(w, (size_t)(n0 + j) * K + k) : 0.f;
#pragma unroll
            for (int r = 0; r < ROWS; r++) {
                if (r < rows) {
                    float xv = x[(size_t)r * K + k];
#pragma unroll
                    for (int j = 0; j < MATVEC_FEATURES; j++) acc[r][j] += xv * wv[j];
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
#pragma unroll
        for (int j = 0; j < MATVEC_FEATURES; j++) {
            float s = warp_sum(acc[r][j]);
            if (lane == 0 && r < rows && j < nv) out[(size_t)r * N + n0 + j] = s;
        }
    }
}

template <typename W, int NT>
__device__ void matvec_mma_impl(const float* x, u32 rows, const W* w, u32 N, u32 K, float* out,
                                Diag* diag) {
    __shared__ float red[(MVM_WARPS - 1) * NT * 4 * 32];
    u32 g = (threadIdx.x & 31) >> 2;
    u32 n0 = blockIdx.x * 16;
    if (threadIdx.x == 0) count_weight_bytes(diag, (u64)min(16u, N - n0) * K * sizeof(W));
    bool lo_ok = n0 + g < N, hi_ok = n0 + g + 8 < N;
    const u16* w_lo[1] = {reinterpret_cast<const u16*>(w) + (size_t)(lo_ok ? n0 + g : 0) * K};
    const u16* w_hi[1] = {reinterpret_cast<const u16*>(w) + (size_t)(hi_ok ? n0 + g + 8 : 0) * K};
    const float* xr[NT];
#pragma unroll
    for (int j = 0; j < NT; j++) xr[j] = j * 8 + g < rows ? x + (size_t)(j * 8 + g) * K : nullptr;
    float acc[1][NT][4];
    mvm_accumulate<F16Operands<W>::value, NT, 1, true>(xr, w_lo, w_hi, lo_ok, hi_ok, K, acc,
                                                         diag);
    wait_for_previous_kernel();  // waited already unless the warp had no span of K
    if (!mvm_reduce<NT * 4>(&acc[0][0][0], red)) return;
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            u32 n = n0 + mvm_feature(i), r = mvm_row(j, i);
            if (n < N && r < rows) out[(size_t)r * N + n] = acc[0][j][i];
        }
}

// matvec_mma with K split over gridDim.y blocks, for projections of too few 16-feature tiles
// to fill the device: a block sums split_k elements of K (a multiple of 256) and writes its
// partial sums; the tile's last block to finish (a ticket in `counters`, zero between
// launches) adds the tile's partials in split order, so the result does not depend on which
// block finished last, and writes out.
template <typename W, int NT>
__device__ void matvec_mma_split_impl(const float* x, u32 rows, const W* w, u32 N, u32 K,
                                      u32 split_k, float* partial, u32* counters, float* out,
                                      Diag* diag) {
    const int ACC = NT * 4;
    __shared__ float red[(MVM_WARPS - 1) * ACC * 32];
    u32 lane = threadIdx.x & 31, g = lane >> 2;
    u32 tile = blockIdx.x, n0 = tile * 16, split = blockIdx.y, splits = gridDim.y;
    u32 k0 = min(split * split_k, K), klen = min(split_k, K - k0);
    if (threadIdx.x == 0) count_weight_bytes(diag, (u64)min(16u, N - n0) * klen * sizeof(W));
    bool lo_ok = n0 + g < N, hi_ok = n0 + g + 8 < N;
    const u16* w16 = reinterpret_cast<const u16*>(w);
    const u16* w_lo[1] = {w16 + (size_t)(lo_ok ? n0 + g : 0) * K + k0};
    const u16* w_hi[1] = {w16 + (size_t)(hi_ok ? n0 + g + 8 : 0) * K + k0};
    const float* xr[NT];
#pragma unroll
    for (int j = 0; j < NT; j++)
        xr[j] = j * 8 + g < rows ? x + (size_t)(j * 8 + g) * K + k0 : nullptr;
    float acc[1][NT][4];
    mvm_accumulate<F16Operands<W>::value, NT, 1, true>(xr, w_lo, w_hi, lo_ok, hi_ok, klen, acc,
                                                         diag);
    wait_for_previous_kernel();  // waited already unless the warp had no span of K
    if (!mvm_reduce<ACC>(&acc[0][0][0], red)) return;
    const float* sums = &acc[0][0][0];
    float* mine = partial + ((size_t)tile * splits + split) * (ACC * 32);
#pragma unroll
    for (int i = 0; i < ACC; i++) mine[i * 32 + lane] = sums[i];
    __threadfence();
    u32 ticket = 0;
    if (lane == 0) ticket = atomicAdd(&counters[tile], 1u);
    if (__shfl_sync(0xffffffffu, ticket, 0) != splits - 1) return;
    __threadfence();
    float total[ACC];
#pragma unroll
    for (int i = 0; i < ACC; i++) total[i] = 0.f;
    for (u32 s = 0; s < splits; s++) {
        const float* theirs = partial + ((size_t)tile * splits + s) * (ACC * 32);
#pragma unroll
        for (int i = 0; i < ACC; i++) total[i] += __ldcg(theirs + i * 32 + lane);
    }
    if (lane == 0) counters[tile] = 0;
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            u32 n = n0 + mvm_feature(i), r = mvm_row(j, i);
            if (n < N && r < rows) out[(size_t)r * N + n] = total[j * 4 + i];
        }
}

template <typename W>
__device__ void matmul_tiled_impl(const float* x, u32 rows, const W* w, u32 N, u32 K, u32 vec,
                                  float* out, Diag* diag) {
    __shared__ const float* a_rows[TILE_M];
    u32 m0 = blockIdx.x * TILE_M, n0 = blockIdx.y * TILE_N;
    if (threadIdx.x < TILE_M) {
        u32 m = m0 + threadIdx.x;
        a_rows[threadIdx.x] = m < rows ? x + (size_t)m * K : nullptr;
    }
    int n_valid = (int)min((u32)TILE_N, N - n0);
    if (threadIdx.x == 0) count_weight_bytes(diag, (u64)n_valid * K * sizeof(W));
    __syncthreads();
    const W* wt[1] = {w + (size_t)n0 * K};
    float acc[1][2][4][4];
    tile_mma<W, 1>(a_rows, wt, n_valid, (int)K, vec != 0, vec != 0, acc, diag);
    tile_for_each([&](int mi, int ni, int r0, int tile_row, int tile_col) {
        u32 m = m0 + tile_row, n = n0 + tile_col;
        if (m < rows) {
            if (n < N) out[(size_t)m * N + n] = acc[0][mi][ni][r0];
            if (n + 1 < N) out[(size_t)m * N + n + 1] = acc[0][mi][ni][r0 + 1];
        }
    });
}

#define MATVEC(SUFFIX, W, ROWS)                                                               \
    extern "C" __global__ void __launch_bounds__(MATVEC_WARPS * 32) matvec_##SUFFIX##_r##ROWS(   \
        const float* x, u32 rows, const W* w, u32 N, u32 K, u32 vec, float* out, Diag* diag) {   \
        begin_deferred_kernel();                                                                 \
        matvec_impl<W, ROWS>(x, rows, w, N, K, vec, out, diag);                                  \
    }
#define MATMUL(SUFFIX, W)                                                                     \
    MATVEC(SUFFIX, W, 1)                                                                      \
    MATVEC(SUFFIX, W, 2)                                                                      \
    MATVEC(SUFFIX, W, 4)                                                                      \
    MATVEC(SUFFIX, W, 8)                                                                      \
    MATVEC(SUFFIX, W, 16)                                                                     \
    MATVEC(SUFFIX, W, 32)                                                                     \
    extern "C" __global__ void __launch_bounds__(TILE_THREADS) matmul_tiled_##SUFFIX(         \
        const float* x, u32 rows, const W* w, u32 N, u32 K, u32 vec, float* out, Diag* diag) {\
        begin_kernel();                                                                       \
        matmul_tiled_impl<W>(x, rows, w, N, K, vec, out, diag);                               \
    }
MATMUL(bf16, bf16w)
MATMUL(f16, f16w)
MATMUL(f32, float)

#define MATVEC_MMA(SUFFIX, W, NT)                                                             \
    extern "C" __global__ void __launch_bounds__(MVM_WARPS * 32) matvec_mma_##SUFFIX##_n##NT( \
        const float* x, u32 rows, const W* w, u32 N, u32 K, float* out, Diag* diag) {          \
        begin_deferred_kernel();                                                               \
        matvec_mma_impl<W, NT>(x, rows, w, N, K, out, diag);                                   \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(MVM_WARPS * 32)                               \
        matvec_mma_split_##SUFFIX##_n##NT(const float* x, u32 rows, const W* w, u32 N, u32 K,  \
                                          u32 split_k, float* partial, u32* counters,          \
                                          float* out, Diag* diag) {                            \
        begin_deferred_kernel();                                                               \
        matvec_mma_split_impl<W, NT>(x, rows, w, N, K, split_k, partial, counters, out, diag); \
    }
MATVEC_MMA(bf16, bf16w, 1)
MATVEC_MMA(bf16, bf16w, 2)
MATVEC_MMA(bf16, bf16w, 4)
MATVEC_MMA(f16, f16w, 1)
MATVEC_MMA(f16, f16w, 2)
MATVEC_MMA(f16, f16w, 4)

// Few-row dense projections streamed (sm_90+; streamed_mvm.cuh): a block per SM, the
// weights' first stages copied while the kernel before ends.
#define MATVEC_STREAM(SUFFIX, W)                                                              \
    extern "C" __global__ void __launch_bounds__(STREAM_THREADS, 1) matvec_stream_##SUFFIX(   \
        const float* x, u32 rows, const W* w, u32 N, u32 K, float* out, Diag* diag) {         \
        begin_deferred_kernel();                                                              \
        StreamArgs p{x,       K,       N,       0,       nullptr,                             \
                     nullptr, nullptr, nullptr, 0,       0,                                   \
                     nullptr, nullptr, reinterpret_cast<const u16*>(w), rows, out, diag};     \
        streamed_mvm_impl<W, STREAM_DENSE>(p);                                                \
    }
MATVEC_STREAM(bf16, bf16w)
MATVEC_STREAM(f16, f16w)
