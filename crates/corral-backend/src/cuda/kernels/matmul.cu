// Dense projections out[rows, N] = x[rows, K] · Wᵀ with W [N, K] in its stored type.
// Few rows (decode): a warp per output feature reads its weight row once for every row of x.
// Many rows: 64x64 tensor-core tiles (mma_tile.cuh).

#define MATVEC_MAX_ROWS 8
#define MATVEC_WARPS 8

template <typename W>
__device__ void matvec_impl(const float* x, u32 rows, const W* w, u32 N, u32 K, u32 vec,
                            float* out, Diag* diag) {
    u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u32 n = blockIdx.x * MATVEC_WARPS + warp;
    if (threadIdx.x == 0) {
        u32 valid = min((u32)MATVEC_WARPS, N - blockIdx.x * MATVEC_WARPS);
        count_weight_bytes(diag, (u64)valid * K * sizeof(W));
    }
    if (n >= N) return;
    const W* wr = w + (size_t)n * K;
    float acc[MATVEC_MAX_ROWS];
#pragma unroll
    for (int r = 0; r < MATVEC_MAX_ROWS; r++) acc[r] = 0.f;
    if (vec) {
        for (u32 k = lane * 8; k < K; k += 256) {
            float wv[8];
            load_w8(wr + k, wv);
#pragma unroll
            for (int r = 0; r < MATVEC_MAX_ROWS; r++) {
                if (r < rows) {
                    const float* xr = x + (size_t)r * K + k;
                    float4 a = *reinterpret_cast<const float4*>(xr);
                    float4 b = *reinterpret_cast<const float4*>(xr + 4);
                    acc[r] += a.x * wv[0] + a.y * wv[1] + a.z * wv[2] + a.w * wv[3] +
                              b.x * wv[4] + b.y * wv[5] + b.z * wv[6] + b.w * wv[7];
                }
            }
        }
    } else {
        for (u32 k = lane; k < K; k += 32) {
            float wv = load_w(wr, k);
#pragma unroll
            for (int r = 0; r < MATVEC_MAX_ROWS; r++)
                if (r < rows) acc[r] += x[(size_t)r * K + k] * wv;
        }
    }
#pragma unroll
    for (int r = 0; r < MATVEC_MAX_ROWS; r++) {
        float s = warp_sum(acc[r]);
        if (lane == 0 && r < rows) out[(size_t)r * N + n] = s;
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
    tile_mma<W, 1>(a_rows, wt, n_valid, (int)K, vec != 0, vec != 0, acc);
    tile_for_each([&](int mi, int ni, int r0, int tile_row, int tile_col) {
        u32 m = m0 + tile_row, n = n0 + tile_col;
        if (m < rows) {
            if (n < N) out[(size_t)m * N + n] = acc[0][mi][ni][r0];
            if (n + 1 < N) out[(size_t)m * N + n + 1] = acc[0][mi][ni][r0 + 1];
        }
    });
}

#define MATMUL(SUFFIX, W)                                                                     \
    extern "C" __global__ void __launch_bounds__(MATVEC_WARPS * 32) matvec_##SUFFIX(          \
        const float* x, u32 rows, const W* w, u32 N, u32 K, u32 vec, float* out, Diag* diag) {\
        matvec_impl<W>(x, rows, w, N, K, vec, out, diag);                                     \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(TILE_THREADS) matmul_tiled_##SUFFIX(         \
        const float* x, u32 rows, const W* w, u32 N, u32 K, u32 vec, float* out, Diag* diag) {\
        matmul_tiled_impl<W>(x, rows, w, N, K, vec, out, diag);                               \
    }
MATMUL(bf16, bf16w)
MATMUL(f16, f16w)
MATMUL(f32, float)
