// Gated DeltaNet: the short causal convolution with its rolling state, the gates, and the
// gated delta rule on each value head's fp32 state, as a token-by-token recurrence (decode)
// and in the chunked form (prefill, below). Runs come as U32 [runs, 4]: first token, token
// count, state slot, and 1 when the sequence starts there (state taken as 0). A run beyond
// the batch or a slot beyond the state pool raises ERR_STATE_SLOT and is skipped.

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
#define CONV_TILE 64         // tokens of a block

// out[t, c] = silu(Σ_i w[c, i] · in[t - (kernel - 1) + i]) where `in` is channel c's stored
// history (the previous kernel - 1 inputs; zero for a fresh sequence) followed by the run's
// x[., c]. A block takes 32 channels of one run's tile of CONV_TILE tokens, its warps
// alternating tokens, every token independent of the others. The first tile's block stages
// the old history in shared memory and alone writes the new one (the run's last kernel - 1
// inputs), after its reads, so no block reads a history another has replaced. Grid:
// (ceil(channels / 32), tiles of the longest run, runs); block: 256 threads.
extern "C" __global__ void __launch_bounds__(CONV_CHANNELS * CONV_TOKEN_LANES) causal_conv1d(
    const float* x, const float* weight, u32 channels, u32 kernel, const u32* runs, u32 tokens,
    u32 slots, float* state, float* out, Diag* diag) {
    begin_small_kernel();
    __shared__ float old_history[CONV_MAX_KERNEL][CONV_CHANNELS];
    u32 lane = threadIdx.x % CONV_CHANNELS, tl = threadIdx.x / CONV_CHANNELS;
    u32 c = blockIdx.x * CONV_CHANNELS + lane, tile = blockIdx.y, r = blockIdx.z;
    u32 start, len, slot;
    bool fresh;
    if (!run_of(runs, r, tokens, slots, &start, &len, &slot, &fresh, diag)) return;
    u32 t_begin = tile * CONV_TILE;
    if (tile + 1 == gridDim.y && len > t_begin + CONV_TILE && threadIdx.x == 0)
        raise_error(diag, ERR_RUN_LENGTH);
    if (tile > 0 && t_begin >= len) return;
    u32 t_end = min(len, t_begin + CONV_TILE);
    bool ok = c < channels, first = tile == 0;
    u32 hist = kernel - 1;
    float* history = state + ((size_t)slot * channels + (ok ? c : 0)) * hist;
    if (first)
        for (u32 i = tl; i < hist; i += CONV_TOKEN_LANES)
            old_history[i][lane] = ok && !fresh ? history[i] : 0.f;
    float w[CONV_MAX_KERNEL];
#pragma unroll
    for (int i = 0; i < CONV_MAX_KERNEL; i++)
        w[i] = ok && i < (int)kernel ? weight[(size_t)c * kernel + i] : 0.f;
    __syncthreads();
    // Input `i` of the run's window sequence: history below hist, then x from the run start
    // (a later tile's window starts at t_begin >= CONV_TILE > hist, inside x).
    auto input = [&](u32 i) -> float {
        return i < hist ? old_history[i][lane] : x[(size_t)(start + i - hist) * channels + c];
    };
    if (ok)
        for (u32 t = t_begin + tl; t < t_end; t += CONV_TOKEN_LANES) {
            float y = 0.f;
#pragma unroll
            for (int i = 0; i < CONV_MAX_KERNEL; i++)
                if (i < (int)kernel) y += w[i] * input(t + i);
            out[(size_t)(start + t) * channels + c] = silu(y);
        }
    __syncthreads();
    if (ok && first)
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

// The chunked form of the gated delta rule for prefill (the math of the CPU's `chunked`):
// per chunk of 64 tokens of a run and value head, with cumulative log-decay γ,
// A = diag(β) K Kᵀ ⊙ e^{γ_i − γ_l} (strictly lower), T = (I + A)⁻¹, W = T diag(β e^γ) K,
// U = T diag(β) V and M = (Q Kᵀ) ⊙ e^{γ_i − γ_l} (lower, diagonal included) depend only on
// the chunk's inputs and are made for every chunk at once (gdr_chunk_prepare); a run's state
// then goes through its chunks in order (gdr_chunk_scan): V' = U − W S,
// O = (Q e^γ) S + M V' and S ← e^{γ_last} S + (K e^{γ_last − γ})ᵀ V', with the state's value
// columns split over blocks (they evolve independently). The runs' chunks are numbered in
// run order; a launch pair takes the chunks [first, first + per_wave) (the workspace holds
// that many chunks of every value head), carrying states in their slots between launches.

#define GDR_CHUNK 64
#define GDR_MAX_DK 128
#define GDR_SLICE 32     // state columns a scan block carries
#define GDR_THREADS 256
// Floats of the prepare kernel's dynamic shared memory: K and Q (or a V piece) rows of
// GDR_MAX_DK + 1, A and T rows of 65.
#define GDR_PREP_SMEM_FLOATS (2 * GDR_CHUNK * (GDR_MAX_DK + 1) + 2 * GDR_CHUNK * (GDR_CHUNK + 1))
// Floats of the scan kernel's: W, Q e^γ and K e^{γ_last − γ} (64 × dk each), M (64 × 64),
// V' (64 × 32) and the state slice (dk × 32).
#define GDR_SCAN_SMEM_FLOATS \
    (3 * GDR_CHUNK * GDR_MAX_DK + GDR_CHUNK * GDR_CHUNK + GDR_CHUNK * GDR_SLICE + GDR_MAX_DK * GDR_SLICE)

// The workspace of one (chunk, value head): W [64, dk], U [64, dv], M [64, 64], then per token
// γ, the query's scale (1 / |q| · dk^-1/2 · e^γ) and the key's (1 / |k| · e^{γ_last − γ}).
__device__ __forceinline__ size_t gdr_chunk_floats(u32 dk, u32 dv) {
    return (size_t)GDR_CHUNK * (dk + dv + GDR_CHUNK + 3);
}

__device__ __forceinline__ u32 gdr_chunks(u32 len) { return (len + GDR_CHUNK - 1) / GDR_CHUNK; }

// The run and chunk of run-ordered chunk `g`; false past the last. Lengths are clamped to the
// batch (a run beyond it is reported by run_of).
__device__ bool gdr_chunk_of(const u32* runs, u32 num_runs, u32 tokens, u32 g, u32* run,
                             u32* chunk) {
    u32 acc = 0;
    for (u32 r = 0; r < num_runs; r++) {
        u32 n = gdr_chunks(min(runs[r * 4 + 1], tokens));
        if (g < acc + n) {
            *run = r;
            *chunk = g - acc;
            return true;
        }
        acc += n;
    }
    return false;
}

// Grid: (per_wave, nv); block: GDR_THREADS; dynamic shared memory GDR_PREP_SMEM_FLOATS.
extern "C" __global__ void __launch_bounds__(GDR_THREADS) gdr_chunk_prepare(
    const float* qkv, const float* g, const float* beta, u32 nk, u32 nv, u32 dk, u32 dv,
    const u32* runs, u32 num_runs, u32 tokens, u32 slots, u32 first, float* ws, Diag* diag) {
    begin_kernel();
    extern __shared__ __align__(16) float gdr_prep[];
    __shared__ float gamma[GDR_CHUNK], bt[GDR_CHUNK], bg[GDR_CHUNK], qinv[GDR_CHUNK],
        kinv[GDR_CHUNK];
    const u32 kst = GDR_MAX_DK + 1, ast = GDR_CHUNK + 1;
    float* ks = gdr_prep;                     // [64][kst]: normalised keys
    float* qs = ks + GDR_CHUNK * kst;         // [64][kst]: normalised queries, then V pieces
    float* as = qs + GDR_CHUNK * kst;         // [64][ast]: A
    float* ts = as + GDR_CHUNK * ast;         // [64][ast]: T
    u32 run, chunk;
    if (!gdr_chunk_of(runs, num_runs, tokens, first + blockIdx.x, &run, &chunk)) return;
    u32 start, len, slot;
    bool fresh;
    if (!run_of(runs, run, tokens, slots, &start, &len, &slot, &fresh, diag)) return;
    u32 j = blockIdx.y, kh = j / (nv / nk);
    u32 t0 = start + chunk * GDR_CHUNK, m = min(GDR_CHUNK, len - chunk * GDR_CHUNK);
    u32 width = 2 * nk * dk + nv * dv;
    u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (u32 x = threadIdx.x; x < GDR_CHUNK * dk; x += GDR_THREADS) {
        u32 i = x / dk, d = x % dk;
        const float* row = qkv + (size_t)(t0 + i) * width;
        qs[i * kst + d] = i < m ? row[kh * dk + d] : 0.f;
        ks[i * kst + d] = i < m ? row[nk * dk + kh * dk + d] : 0.f;
    }
    if (threadIdx.x == 0) {
        float acc = 0.f;
        for (u32 i = 0; i < GDR_CHUNK; i++) {
            acc += i < m ? g[(size_t)(t0 + i) * nv + j] : 0.f;
            gamma[i] = acc;
        }
    }
    if (threadIdx.x < GDR_CHUNK)
        bt[threadIdx.x] = threadIdx.x < m ? beta[(size_t)(t0 + threadIdx.x) * nv + j] : 0.f;
    __syncthreads();
    if (threadIdx.x < GDR_CHUNK) bg[threadIdx.x] = bt[threadIdx.x] * expf(gamma[threadIdx.x]);
    for (u32 i = warp; i < GDR_CHUNK; i += GDR_THREADS / 32) {
        float sq = 0.f, sk = 0.f;
        for (u32 d = lane; d < dk; d += 32) {
            sq += qs[i * kst + d] * qs[i * kst + d];
            sk += ks[i * kst + d] * ks[i * kst + d];
        }
        sq = warp_sum(sq);
        sk = warp_sum(sk);
        if (lane == 0) {
            qinv[i] = rsqrtf(sq + 1e-6f) * rsqrtf((float)dk);
            kinv[i] = rsqrtf(sk + 1e-6f);
        }
    }
    __syncthreads();
    for (u32 x = threadIdx.x; x < GDR_CHUNK * dk; x += GDR_THREADS) {
        u32 i = x / dk, d = x % dk;
        qs[i * kst + d] *= qinv[i];
        ks[i * kst + d] *= kinv[i];
    }
    __syncthreads();
    float* w_out = ws + ((size_t)blockIdx.x * nv + j) * gdr_chunk_floats(dk, dv);
    float* u_out = w_out + (size_t)GDR_CHUNK * dk;
    float* m_out = u_out + (size_t)GDR_CHUNK * dv;
    float* tail = m_out + GDR_CHUNK * GDR_CHUNK;
    // A and M, a (row, column) pair per thread and step: a warp shares its row.
    for (u32 x = threadIdx.x; x < GDR_CHUNK * GDR_CHUNK; x += GDR_THREADS) {
        u32 i = x / GDR_CHUNK, l = x % GDR_CHUNK;
        float kk = 0.f, qk = 0.f;
        if (l <= i && i < m)
            for (u32 d = 0; d < dk; d++) {
                float kl = ks[l * kst + d];
                kk += ks[i * kst + d] * kl;
                qk += qs[i * kst + d] * kl;
            }
        float decay = l <= i && i < m ? expf(gamma[i] - gamma[l]) : 0.f;
        as[i * ast + l] = l < i ? bt[i] * kk * decay : 0.f;
        m_out[i * GDR_CHUNK + l] = qk * decay;
    }
    __syncthreads();
    // T = (I + A)⁻¹ by forward substitution, a column per thread: T[i][c] = δ_ic − Σ_l A[i][l]
    // T[l][c] over c <= l < i.
    if (threadIdx.x < GDR_CHUNK) {
        u32 c = threadIdx.x;
        for (u32 i = 0; i < GDR_CHUNK; i++) {
            float v = i == c ? 1.f : 0.f;
            for (u32 l = 0; l < i; l++) v -= as[i * ast + l] * ts[l * ast + c];
            ts[i * ast + c] = i >= c ? v : 0.f;
        }
    }
    __syncthreads();
    // W = T diag(β e^γ) K.
    for (u32 x = threadIdx.x; x < m * dk; x += GDR_THREADS) {
        u32 i = x / dk, d = x % dk;
        float acc = 0.f;
        for (u32 l = 0; l <= i; l++) acc += ts[i * ast + l] * bg[l] * ks[l * kst + d];
        w_out[(size_t)i * dk + d] = acc;
    }
    // U = T diag(β) V, V staged in pieces of up to kst columns where the queries were.
    for (u32 e0 = 0; e0 < dv; e0 += kst) {
        u32 piece = min(kst, dv - e0);
        __syncthreads();
        for (u32 x = threadIdx.x; x < m * piece; x += GDR_THREADS) {
            u32 l = x / piece, e = x % piece;
            qs[l * kst + e] = qkv[(size_t)(t0 + l) * width + 2 * nk * dk + j * dv + e0 + e];
        }
        __syncthreads();
        for (u32 x = threadIdx.x; x < m * piece; x += GDR_THREADS) {
            u32 i = x / piece, e = x % piece;
            float acc = 0.f;
            for (u32 l = 0; l <= i; l++) acc += ts[i * ast + l] * bt[l] * qs[l * kst + e];
            u_out[(size_t)i * dv + e0 + e] = acc;
        }
    }
    if (threadIdx.x < GDR_CHUNK) {
        u32 i = threadIdx.x;
        float last = gamma[m - 1];
        tail[i] = gamma[i];
        tail[GDR_CHUNK + i] = qinv[i] * expf(gamma[i]);
        tail[2 * GDR_CHUNK + i] = kinv[i] * expf(last - gamma[i]);
    }
}

// Grid: (runs, nv, ceil(dv / GDR_SLICE)); block: GDR_THREADS; dynamic shared memory
// GDR_SCAN_SMEM_FLOATS. Takes the `wave` chunks from `first` that gdr_chunk_prepare made. Thread (warp w, lane e) owns state column e of the block's slice:
// rows w, w + 8, ... of V' and O and rows w, w + 8, ... of S.
extern "C" __global__ void __launch_bounds__(GDR_THREADS) gdr_chunk_scan(
    const float* qkv, u32 nk, u32 nv, u32 dk, u32 dv, const u32* runs, u32 num_runs,
    u32 tokens, u32 slots, u32 first, u32 wave, u32 total, const float* ws, float* state,
    float* out, Diag* diag) {
    begin_kernel();
    extern __shared__ __align__(16) float gdr_scan[];
    float* wsh = gdr_scan;                        // [64][dk]: W
    float* qg = wsh + GDR_CHUNK * dk;             // [64][dk]: q e^γ (normalised, scaled)
    float* kd = qg + GDR_CHUNK * dk;              // [64][dk]: k e^{γ_last − γ} (normalised)
    float* msh = kd + GDR_CHUNK * dk;             // [64][64]: M
    float* vp = msh + GDR_CHUNK * GDR_CHUNK;      // [64][32]: U, then V'
    float* s = vp + GDR_CHUNK * GDR_SLICE;        // [dk][32]: the state slice
    __shared__ float tail[3 * GDR_CHUNK];
    u32 r = blockIdx.x, j = blockIdx.y, e0 = blockIdx.z * GDR_SLICE;
    u32 start, len, slot;
    bool fresh;
    if (!run_of(runs, r, tokens, slots, &start, &len, &slot, &fresh, diag)) return;
    u32 g0 = 0;
    for (u32 q = 0; q < r; q++) g0 += gdr_chunks(min(runs[q * 4 + 1], tokens));
    u32 chunks = gdr_chunks(len);
    // The host planned `total` chunks from the promised longest run; a longer run has
    // chunks no launch prepares.
    if (g0 + chunks > total && threadIdx.x == 0) raise_error(diag, ERR_RUN_LENGTH);
    u32 c_begin = first > g0 ? first - g0 : 0;
    u32 c_end = min(chunks, first + wave > g0 ? first + wave - g0 : 0);
    bool zero_run = chunks == 0 && first == 0 && fresh;
    if (c_begin >= c_end && !zero_run) return;
    u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u32 e = e0 + lane;
    bool live = e < dv;
    u32 kh = j / (nv / nk), width = 2 * nk * dk + nv * dv;
    float* s_global = state + ((size_t)slot * nv + j) * dk * dv;
    bool zero = fresh && c_begin == 0;
    for (u32 d = warp; d < dk; d += GDR_THREADS / 32)
        s[d * GDR_SLICE + lane] = live && !zero ? s_global[(size_t)d * dv + e] : 0.f;
    for (u32 c = c_begin; c < c_end; c++) {
        u32 t0 = start + c * GDR_CHUNK, m = min(GDR_CHUNK, len - c * GDR_CHUNK);
        const float* w_in = ws + ((size_t)(g0 + c - first) * nv + j) * gdr_chunk_floats(dk, dv);
        const float* u_in = w_in + (size_t)GDR_CHUNK * dk;
        const float* m_in = u_in + (size_t)GDR_CHUNK * dv;
        const float* t_in = m_in + GDR_CHUNK * GDR_CHUNK;
        __syncthreads();  // the previous chunk's reads are done
        for (u32 x = threadIdx.x; x < 3 * GDR_CHUNK; x += GDR_THREADS) tail[x] = t_in[x];
        __syncthreads();
        for (u32 x = threadIdx.x; x < m * dk; x += GDR_THREADS) {
            u32 i = x / dk, d = x % dk;
            const float* row = qkv + (size_t)(t0 + i) * width;
            wsh[x] = w_in[x];
            qg[x] = row[kh * dk + d] * tail[GDR_CHUNK + i];
            kd[x] = row[nk * dk + kh * dk + d] * tail[2 * GDR_CHUNK + i];
        }
        for (u32 x = threadIdx.x; x < m * GDR_CHUNK; x += GDR_THREADS) msh[x] = m_in[x];
        for (u32 i = warp; i < m; i += GDR_THREADS / 32)
            vp[i * GDR_SLICE + lane] = live ? u_in[(size_t)i * dv + e] : 0.f;
        __syncthreads();
        // V' = U − W S.
        for (u32 i = warp; i < m; i += GDR_THREADS / 32) {
            float acc = 0.f;
            for (u32 d = 0; d < dk; d++) acc += wsh[i * dk + d] * s[d * GDR_SLICE + lane];
            vp[i * GDR_SLICE + lane] -= acc;
        }
        __syncthreads();
        // O = (Q e^γ) S + M V'.
        for (u32 i = warp; i < m; i += GDR_THREADS / 32) {
            float acc = 0.f;
            for (u32 d = 0; d < dk; d++) acc += qg[i * dk + d] * s[d * GDR_SLICE + lane];
            for (u32 l = 0; l <= i; l++) acc += msh[i * GDR_CHUNK + l] * vp[l * GDR_SLICE + lane];
            if (live) out[((size_t)(t0 + i) * nv + j) * dv + e] = acc;
        }
        __syncthreads();
        // S ← e^{γ_last} S + (K e^{γ_last − γ})ᵀ V'.
        float decay = expf(tail[m - 1]);
        for (u32 d = warp; d < dk; d += GDR_THREADS / 32) {
            float acc = s[d * GDR_SLICE + lane] * decay;
            for (u32 l = 0; l < m; l++) acc += kd[l * dk + d] * vp[l * GDR_SLICE + lane];
            s[d * GDR_SLICE + lane] = acc;
        }
    }
    __syncthreads();
    for (u32 d = warp; d < dk; d += GDR_THREADS / 32)
        if (live) s_global[(size_t)d * dv + e] = s[d * GDR_SLICE + lane];
}
