// Gated DeltaNet: the short causal convolution with its rolling state, the gates, and the
// gated delta rule as a token-by-token recurrence on each value head's fp32 state (decode,
// and prefill until the chunked tensor-core form lands). Runs come as U32 [runs, 4]: first
// token, token count, state slot, and 1 when the sequence starts there (state taken as 0).
// A run beyond the batch or a slot beyond the state pool raises ERR_STATE_SLOT and is
// skipped.

#define CONV_MAX_KERNEL 16

__device__ __forceinline__ bool run_of(const u32* runs, u32 r, u32 tokens, u32 slots, u32* start,
                                       u32* len, u32* slot, bool* fresh, Diag* diag) {
    *start = runs[r * 4];
    *len = runs[r * 4 + 1];
    *slot = runs[r * 4 + 2];
    *fresh = runs[r * 4 + 3] != 0;
    if (*slot >= slots || *start > tokens || *len > tokens - *start) {
        if (threadIdx.x == 0) raise_error(diag, ERR_STATE_SLOT);
        return false;
    }
    return true;
}

#define CONV_CHANNELS 32     // channels of a block (one per lane)
#define CONV_TOKEN_LANES 8   // tokens a block computes at once (one per warp)

// out[t, c] = silu(Σ_i w[c, i] · in[t - (kernel - 1) + i]) where `in` is channel c's stored
// history (the previous kernel - 1 inputs; zero for a fresh sequence) followed by the run's
// x[., c]. A block takes 32 channels of one run and its warps alternate tokens, every token
// independent of the others; the old history is staged in shared memory, and the run's last
// kernel - 1 inputs are written back once every token is done. Grid: (ceil(channels / 32),
// runs); block: 256 threads.
extern "C" __global__ void __launch_bounds__(CONV_CHANNELS * CONV_TOKEN_LANES) causal_conv1d(
    const float* x, const float* weight, u32 channels, u32 kernel, const u32* runs, u32 tokens,
    u32 slots, float* state, float* out, Diag* diag) {
    begin_small_kernel();
    __shared__ float old_history[CONV_MAX_KERNEL][CONV_CHANNELS];
    u32 lane = threadIdx.x % CONV_CHANNELS, tl = threadIdx.x / CONV_CHANNELS;
    u32 c = blockIdx.x * CONV_CHANNELS + lane, r = blockIdx.y;
    u32 start, len, slot;
    bool fresh;
    if (!run_of(runs, r, tokens, slots, &start, &len, &slot, &fresh, diag)) return;
    bool ok = c < channels;
    u32 hist = kernel - 1;
    float* history = state + ((size_t)slot * channels + (ok ? c : 0)) * hist;
    for (u32 i = tl; i < hist; i += CONV_TOKEN_LANES)
        old_history[i][lane] = ok && !fresh ? history[i] : 0.f;
    float w[CONV_MAX_KERNEL];
#pragma unroll
    for (int i = 0; i < CONV_MAX_KERNEL; i++)
        w[i] = ok && i < (int)kernel ? weight[(size_t)c * kernel + i] : 0.f;
    __syncthreads();
    // Input `i` of the run's window sequence: history below hist, then x from the run start.
    auto input = [&](u32 i) -> float {
        return i < hist ? old_history[i][lane] : x[(size_t)(start + i - hist) * channels + c];
    };
    if (ok)
        for (u32 t = tl; t < len; t += CONV_TOKEN_LANES) {
            float y = 0.f;
#pragma unroll
            for (int i = 0; i < CONV_MAX_KERNEL; i++)
                if (i < (int)kernel) y += w[i] * input(t + i);
            out[(size_t)(start + t) * channels + c] = silu(y);
        }
    __syncthreads();
    if (ok)
        for (u32 i = tl; i < hist; i += CONV_TOKEN_LANES) history[i] = input(len + i);
}

// g = -exp(a_log) · softplus(a + dt_bias) and beta = σ(b), per (token, head).
extern "C" __global__ void delta_net_gates(const float* a, const float* b, const float* a_log,
                                           const float* dt_bias, u32 tokens, u32 heads, float* g,
                                           float* beta) {
    begin_small_kernel();
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (u64)tokens * heads) return;
    u32 j = (u32)(i % heads);
    float x = a[i] + dt_bias[j];
    float softplus = x > 20.f ? x : log1pf(expf(x));
    g[i] = -expf(a_log[j]) * softplus;
    beta[i] = 1.f / (1.f + expf(-b[i]));
}

#define DR_MAX_ROWS 64  // state rows a thread keeps: key dims up to 128 over two threads

// Sums of a and of b over the block (blockDim.x a multiple of 32); every thread gets both.
// Begins with a barrier, so shared memory read before it may be rewritten after it.
__device__ __forceinline__ float2 block_sum2(float a, float b, float2* scratch32) {
    u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    a = warp_sum(a);
    b = warp_sum(b);
    __syncthreads();
    if (lane == 0) scratch32[warp] = make_float2(a, b);
    __syncthreads();
    float2 v = lane < warps ? scratch32[lane] : make_float2(0.f, 0.f);
    return make_float2(warp_sum(v.x), warp_sum(v.y));
}

// The gated delta rule for one (run, value head) per block, token by token. Thread 2e + h
// holds rows [h R, h R + R) of column e of the state S [dk, dv] in registers (R = dk / 2
// rounded up); the pair sums its halves with one shuffle. Per token: q and k L2-normalised
// (q also by dk^-1/2) into shared memory, S ← exp(g) S, p = β (v − Sᵀk), S += k pᵀ, and
// out = Sᵀq. Grid: (runs, nv); block: 2 dv threads rounded up to whole warps. Two entry
// points: up to 256 threads (dv <= 128), whose register budget keeps the state without
// spilling, and up to 1024.
__device__ __forceinline__ void gated_delta_rule_impl(const float* qkv, const float* g, const float* beta,
                                      u32 nk, u32 nv, u32 dk, u32 dv, const u32* runs,
                                      u32 tokens, u32 slots, float* state, float* out,
                                      Diag* diag) {
    __shared__ float q_s[2 * DR_MAX_ROWS], k_s[2 * DR_MAX_ROWS];
    __shared__ float2 scratch[32];
    u32 r = blockIdx.x, j = blockIdx.y;
    u32 start, len, slot;
    bool fresh;
    if (!run_of(runs, r, tokens, slots, &start, &len, &slot, &fresh, diag)) return;
    u32 e = threadIdx.x >> 1, h = threadIdx.x & 1;
    bool live = e < dv;
    u32 rows = (dk + 1) / 2, row0 = h * rows;
    u32 kh = j / (nv / nk);
    u32 width = 2 * nk * dk + nv * dv;
    float* s_global = state + ((size_t)slot * nv + j) * dk * dv;
    float s[DR_MAX_ROWS];
#pragma unroll
    for (int i = 0; i < DR_MAX_ROWS; i++) {
        u32 a = row0 + i;
        s[i] = live && i < (int)rows && a < dk && !fresh ? s_global[(size_t)a * dv + e] : 0.f;
    }
    float scale = rsqrtf((float)dk);
    // This thread's inputs of token t: q and k element threadIdx.x, v element e, the gates.
    struct TokenIn { float q, k, v, g, b; };
    auto load_token = [&](u32 t) {
        const float* row = qkv + (size_t)t * width;
        TokenIn in;
        in.q = threadIdx.x < dk ? row[kh * dk + threadIdx.x] : 0.f;
        in.k = threadIdx.x < dk ? row[nk * dk + kh * dk + threadIdx.x] : 0.f;
        in.v = live ? row[2 * nk * dk + j * dv + e] : 0.f;
        in.g = g[(size_t)t * nv + j];
        in.b = beta[(size_t)t * nv + j];
        return in;
    };
    // Each token's inputs are loaded while the previous token is computed.
    TokenIn next = len > 0 ? load_token(start) : TokenIn{0.f, 0.f, 0.f, 0.f, 0.f};
    for (u32 t = start; t < start + len; t++) {
        TokenIn cur = next;
        if (t + 1 < start + len) next = load_token(t + 1);
        float qv = cur.q, kv = cur.k;
        // Its barrier also ends the previous token's reads of q_s and k_s.
        float2 norms = block_sum2(qv * qv, kv * kv, scratch);
        if (threadIdx.x < dk) {
            q_s[threadIdx.x] = qv * rsqrtf(norms.x + 1e-6f) * scale;
            k_s[threadIdx.x] = kv * rsqrtf(norms.y + 1e-6f);
        }
        __syncthreads();
        float decay = expf(cur.g), b = cur.b;
        float p = 0.f;
#pragma unroll
        for (int i = 0; i < DR_MAX_ROWS; i++) {
            if (i < (int)rows && row0 + i < dk) {
                s[i] *= decay;
                p += k_s[row0 + i] * s[i];
            }
        }
        p += __shfl_xor_sync(0xffffffffu, p, 1);
        p = b * (cur.v - p);
        float o = 0.f;
#pragma unroll
        for (int i = 0; i < DR_MAX_ROWS; i++) {
            if (i < (int)rows && row0 + i < dk) {
                s[i] += k_s[row0 + i] * p;
                o += q_s[row0 + i] * s[i];
            }
        }
        o += __shfl_xor_sync(0xffffffffu, o, 1);
        if (live && h == 0) out[((size_t)t * nv + j) * dv + e] = o;
    }
#pragma unroll
    for (int i = 0; i < DR_MAX_ROWS; i++) {
        u32 a = row0 + i;
        if (live && i < (int)rows && a < dk) s_global[(size_t)a * dv + e] = s[i];
    }
}

#define GATED_DELTA_RULE(NAME, MAX_THREADS)                                                   \
    extern "C" __global__ void __launch_bounds__(MAX_THREADS) NAME(                           \
        const float* qkv, const float* g, const float* beta, u32 nk, u32 nv, u32 dk, u32 dv,  \
        const u32* runs, u32 tokens, u32 slots, float* state, float* out, Diag* diag) {       \
        begin_small_kernel();                                                                 \
        gated_delta_rule_impl(qkv, g, beta, nk, nv, dk, dv, runs, tokens, slots, state, out,  \
                              diag);                                                          \
    }
GATED_DELTA_RULE(gated_delta_rule_256, 256)
GATED_DELTA_RULE(gated_delta_rule, 1024)
