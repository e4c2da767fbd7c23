// Gated DeltaNet: the short causal convolution with its rolling state, the gates, and the
// gated delta rule on each value head's fp32 state, as a token-by-token recurrence (decode)
// and in the chunked form (prefill, below). Runs come as U32 [runs, 4]: first token, token
// count, state slot, and 1 when the sequence starts there (state taken as 0). A run beyond
// the batch or a slot beyond the state pool raises ERR_STATE_SLOT and is skipped. The
// convolution and the recurrence may also keep each run's state after each of its tokens but
// the last: `kept` (null for none) is U32 [runs], the first of len - 1 consecutive slots
// (NO_KEPT: none), for a speculative verify to continue from any accepted position.

#define CONV_MAX_KERNEL 16
#define NO_KEPT 0xffffffffu

// The first slot keeping run r's states after its tokens, or NO_KEPT; a range beyond the
// pool raises ERR_STATE_SLOT and keeps nothing.
__device__ __forceinline__ u32 kept_of(const u32* kept, u32 r, u32 len, u32 slots, Diag* diag) {
    if (kept == nullptr || len < 2) return NO_KEPT;
    u32 k = kept[r];
    if (k == NO_KEPT) return NO_KEPT;
    if (k >= slots || len - 1 > slots - k) {
        if (threadIdx.x == 0) raise_error(diag, ERR_STATE_SLOT);
        return NO_KEPT;
    }
    return k;
}

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
#define CONV_TOKEN_LANES 8   // warps of a block
#define CONV_TILE 64         // tokens of a block
#define CONV_SPAN (CONV_TILE / CONV_TOKEN_LANES)  // consecutive tokens of a warp

// out[t, c] = silu(Σ_i w[c, i] · in[t - (kernel - 1) + i]) where `in` is channel c's stored
// history (the previous kernel - 1 inputs; zero for a fresh sequence) followed by the run's
// x[., c]. A block takes 32 channels of one run's tile of CONV_TILE tokens; each warp
// computes CONV_SPAN consecutive tokens from a window of inputs it loads once into registers.
// The first tile's block stages the old history in shared memory and alone writes the new one
// (the run's last kernel - 1 inputs), after its reads, so no block reads a history another has
// replaced. Grid: (ceil(channels / 32), tiles of the longest run, runs); block: 256 threads.
extern "C" __global__ void __launch_bounds__(CONV_CHANNELS * CONV_TOKEN_LANES) causal_conv1d(
    const float* x, const float* weight, u32 channels, u32 kernel, const u32* runs, u32 tokens,
    u32 slots, float* state, float* out, const u32* kept, Diag* diag) {
    begin_small_kernel();
    __shared__ float old_history[CONV_MAX_KERNEL][CONV_CHANNELS];
    u32 lane = threadIdx.x % CONV_CHANNELS, warp = threadIdx.x / CONV_CHANNELS;
    u32 c = blockIdx.x * CONV_CHANNELS + lane, tile = blockIdx.y, r = blockIdx.z;
    u32 start, len, slot;
    bool fresh;
    if (!run_of(runs, r, tokens, slots, &start, &len, &slot, &fresh, diag)) return;
    u32 t_begin = tile * CONV_TILE;
    if (tile + 1 == gridDim.y && len > t_begin + CONV_TILE && threadIdx.x == 0)
        raise_error(diag, ERR_RUN_LENGTH);
    if (tile > 0 && t_begin >= len) return;
    bool ok = c < channels, first = tile == 0;
    u32 hist = kernel - 1;
    float* history = state + ((size_t)slot * channels + (ok ? c : 0)) * hist;
    if (first)
        for (u32 i = warp; i < hist; i += CONV_TOKEN_LANES)
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
    u32 t0 = t_begin + warp * CONV_SPAN;
    if (ok && t0 < len) {
        // Inputs t0 .. t0 + CONV_SPAN - 1 + hist: token t0 + s reads win[s .. s + hist].
        float win[CONV_MAX_KERNEL - 1 + CONV_SPAN];
#pragma unroll
        for (u32 q = 0; q < CONV_MAX_KERNEL - 1 + CONV_SPAN; q++)
            win[q] = q < hist + CONV_SPAN && t0 + q < len + hist ? input(t0 + q) : 0.f;
#pragma unroll
        for (u32 s = 0; s < CONV_SPAN; s++) {
            if (t0 + s >= len) break;
            float y = 0.f;
            // Only the kernel's taps: the window's later inputs belong to later tokens (a
            // non-finite one times a zero weight would still reach this token).
#pragma unroll
            for (u32 i = 0; i < CONV_MAX_KERNEL; i++)
                if (i < kernel) y += w[i] * win[s + i];
            out[(size_t)(start + t0 + s) * channels + c] = silu(y);
        }
    }
    // The history after token t of this warp's span: inputs t + 1 .. t + hist.
    u32 keep = kept_of(kept, r, len, slots, diag);
    if (ok && keep != NO_KEPT)
        for (u32 s = 0; s < CONV_SPAN; s++) {
            u32 t = t0 + s;
            if (t + 1 >= len) break;
            float* after = state + ((size_t)(keep + t) * channels + c) * hist;
            for (u32 i = 0; i < hist; i++) after[i] = input(t + 1 + i);
        }
    __syncthreads();
    if (ok && first)
        for (u32 i = warp; i < hist; i += CONV_TOKEN_LANES) history[i] = input(len + i);
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
                                      const u32* kept, Diag* diag) {
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
    u32 keep = kept_of(kept, r, len, slots, diag);
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
        if (keep != NO_KEPT && t + 1 < start + len) {
            float* after = state + ((size_t)(keep + t - start) * nv + j) * dk * dv;
#pragma unroll
            for (int i = 0; i < DR_MAX_ROWS; i++) {
                u32 a = row0 + i;
                if (live && i < (int)rows && a < dk) after[(size_t)a * dv + e] = s[i];
            }
        }
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
        const u32* runs, u32 tokens, u32 slots, float* state, float* out, const u32* kept,     \
        Diag* diag) {                                                                         \
        begin_small_kernel();                                                                 \
        gated_delta_rule_impl(qkv, g, beta, nk, nv, dk, dv, runs, tokens, slots, state, out,  \
                              kept, diag);                                                    \
    }
GATED_DELTA_RULE(gated_delta_rule_256, 256)
GATED_DELTA_RULE(gated_delta_rule, 1024)

// The chunked form of the gated delta rule for prefill (the math of the CPU's `chunked`), on
// tensor cores (mma.sync m16n8k16, f32 accumulation, the state f32 throughout). Per chunk of
// 64 tokens of a run and value head, with cumulative log-decay γ:
// A = diag(β) K Kᵀ ⊙ e^{γ_i − γ_l} (strictly lower), T = (I + A)⁻¹, W = T diag(β e^γ) K,
// U = T diag(β) V and M = (Q Kᵀ) ⊙ e^{γ_i − γ_l} (lower, diagonal included) depend only on
// the chunk's inputs and are made for every chunk at once (gdr_chunk_prepare); a run's state
// then goes through its chunks in order (gdr_chunk_scan): V' = U − W S,
// O = e^γ ⊙ (Q S) + M V' and S ← e^{γ_last} S + Kᵀ (e^{γ_last − γ} ⊙ V'), with the state's
// value columns split over blocks (they evolve independently). The runs' chunks are numbered
// in run order; a launch pair takes the chunks [first, first + per_wave) (the workspace holds
// that many chunks of every value head), carrying states in their slots between launches.
//
// Operands: q̂ and k̂ are unit-bounded, so Q Kᵀ and K Kᵀ take them as f16 (11 significant
// bits). T, V, V', M and S have no such bound; each is a split pair of bf16 values,
// hi = bf16(x) and lo = bf16(x − hi), about 16 significant bits together, and a product of
// two split operands is hi·hi + hi·lo + lo·hi (lo·lo is below f32's own rounding). So a
// chunk's own part of its output, M V' with V' = U for a fresh state, carries no bf16
// rounding. W, q̂ and k̂ meet S and V' in the scan as bf16 (one rounding each), the state as
// a split pair.

#define GDR_CHUNK 64
#define GDR_MAX_DK 128
#define GDR_SLICE 32     // state columns a scan block carries
#define GDR_THREADS 256
#define GDR_KS (GDR_MAX_DK + 8)  // u16 stride of staged [64][dk] rows: conflict-free fragments
#define GDR_LS (GDR_CHUNK + 8)   // u16 stride of staged [.][64] rows
#define GDR_TAIL 132             // floats of a chunk's e^γ, e^{γ_last − γ}, e^{γ_last}, padding
#define GDR_PIECE 128            // value columns of U made at a time

// Bytes of the prepare kernel's dynamic shared memory: q̂ and k̂ rows (f16, then bf16; then
// V's rows' high and low halves) [64][GDR_KS]; A and T (f32 [64][65]).
#define GDR_PREP_SMEM_BYTES (2 * GDR_CHUNK * GDR_KS * 2 + 2 * GDR_CHUNK * (GDR_CHUNK + 1) * 4)
// Bytes of one scan stage: −W, q̂ and k̂ rows (bf16 [64][GDR_KS]), M's halves (bf16
// [64][GDR_LS]) and the tail; then the state slice's halves (transposed, [32][GDR_KS]), and
// V''s and V' scaled by e^{γ_last − γ} (transposed, [32][GDR_LS]), each as two halves.
#define GDR_STAGE_BYTES (3 * GDR_CHUNK * GDR_KS * 2 + 2 * GDR_CHUNK * GDR_LS * 2 + GDR_TAIL * 4)
#define GDR_SCAN_SMEM_BYTES \
    (2 * GDR_STAGE_BYTES + 2 * GDR_SLICE * GDR_KS * 2 + 4 * GDR_SLICE * GDR_LS * 2)

// Key dims rounded up to a k16 step.
__device__ __forceinline__ u32 gdr_dkp(u32 dk) { return (dk + 15) & ~15u; }

// The workspace of one (chunk, value head), bf16 then f32: −W, q̂ and k̂ [64][dkp], M's high
// and low halves [64][64]; the tail (e^γ [64], e^{γ_last − γ} [64], e^{γ_last}, 3 of padding)
// and U [64][dv]. Rows past the chunk's tokens and key dims past dk are zero.
__device__ __forceinline__ size_t gdr_chunk_bytes(u32 dk, u32 dv) {
    return 2 * ((size_t)3 * GDR_CHUNK * gdr_dkp(dk) + 2 * GDR_CHUNK * GDR_CHUNK) +
           4 * ((size_t)GDR_TAIL + (size_t)GDR_CHUNK * dv);
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

// A fragment (16 rows from r0, k16 step from k0) of a row-major bf16 tile of stride `ld`.
__device__ __forceinline__ void gdr_a_frag(u32* a, const u16* x, u32 ld, u32 r0, u32 k0) {
    u32 lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const u16* p = x + (r0 + g) * ld + k0 + 2 * t;
    a[0] = *reinterpret_cast<const u32*>(p);
    a[1] = *reinterpret_cast<const u32*>(p + 8 * ld);
    a[2] = *reinterpret_cast<const u32*>(p + 8);
    a[3] = *reinterpret_cast<const u32*>(p + 8 * ld + 8);
}

// B fragment (k16 step from k0, 8 columns from n0) of B[k][n] = x[n][k], x row-major bf16.
__device__ __forceinline__ void gdr_b_frag(u32* b, const u16* x, u32 ld, u32 n0, u32 k0) {
    u32 lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const u16* p = x + (n0 + g) * ld + k0 + 2 * t;
    b[0] = *reinterpret_cast<const u32*>(p);
    b[1] = *reinterpret_cast<const u32*>(p + 8);
}

// B fragments of two n8 tiles (n0, n0 + 8) for the k16 step from k0 of B = x, x row-major bf16
// [k][n]: {b0, b1} of the first tile, then of the second.
__device__ __forceinline__ void gdr_b_frags_trans(u32* b, const u16* x, u32 ld, u32 k0, u32 n0) {
    u32 lane = threadIdx.x & 31;
    ldmatrix_x4_trans(b, x + (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * ld + n0 + (lane >> 4) * 8);
}

// A fragment (16 rows from r0, k16 step from k0) of A = xᵀ, x row-major bf16 [k][rows].
__device__ __forceinline__ void gdr_a_frag_trans(u32* a, const u16* x, u32 ld, u32 r0, u32 k0) {
    u32 lane = threadIdx.x & 31;
    ldmatrix_x4_trans(a, x + (k0 + (lane & 7) + (lane >> 4) * 8) * ld + r0 + ((lane >> 3) & 1) * 8);
}

// The A fragments (16 rows from r0, k16 step from k0) of sign · T diag(scale), split, from T
// (f32 [64][65], lower triangular: zero above the diagonal).
__device__ __forceinline__ void gdr_t_frags(u32* ah, u32* al, const float* ts, const float* scale,
                                            float sign, u32 r0, u32 k0) {
    u32 lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (u32 x = 0; x < 4; x++) {
        u32 r = r0 + g + 8 * (x & 1), c = k0 + 2 * t + 8 * (x >> 1);
        float v0 = c <= r ? sign * ts[r * (GDR_CHUNK + 1) + c] * scale[c] : 0.f;
        float v1 = c + 1 <= r ? sign * ts[r * (GDR_CHUNK + 1) + c + 1] * scale[c + 1] : 0.f;
        split_bf16x2(v0, v1, &ah[x], &al[x]);
    }
}

// acc = rows 16 mt .. + 15 of sign · T diag(scale) (split) times columns n0 .. n0 + 15 of x
// (rows [64][GDR_KS], bf16, a split pair with xl when SPLIT): k steps up to the diagonal,
// two n8 tiles.
template <bool SPLIT>
__device__ __forceinline__ void gdr_lower_times(float (*acc)[4], const float* ts, const float* scale,
                                                float sign, const u16* xh, const u16* xl, u32 mt,
                                                u32 n0) {
#pragma unroll
    for (u32 h = 0; h < 2; h++)
#pragma unroll
        for (u32 r = 0; r < 4; r++) acc[h][r] = 0.f;
    for (u32 k0 = 0; k0 <= 16 * mt; k0 += 16) {
        u32 ah[4], al[4], bh[4], bl[4];
        gdr_t_frags(ah, al, ts, scale, sign, 16 * mt, k0);
        gdr_b_frags_trans(bh, xh, GDR_KS, k0, n0);
        if (SPLIT) gdr_b_frags_trans(bl, xl, GDR_KS, k0, n0);
#pragma unroll
        for (u32 h = 0; h < 2; h++) {
            mma16816<false>(acc[h], al, bh + 2 * h);
            if (SPLIT) mma16816<false>(acc[h], ah, bl + 2 * h);
            mma16816<false>(acc[h], ah, bh + 2 * h);
        }
    }
}

// Calls f(row, col, v0, v1) for the two adjacent columns of each half of a 16x8 accumulator.
template <typename F>
__device__ __forceinline__ void gdr_acc_each(const float* c, u32 r0, u32 n0, F f) {
    u32 lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    f(r0 + g, n0 + 2 * t, c[0], c[1]);
    f(r0 + g + 8, n0 + 2 * t, c[2], c[3]);
}

// Calls f(row, qv, kv) for rows i = warp, warp + 8, ... of the chunk with this lane's q̂ and
// k̂ entries d = lane + 32 c (L2-normalised, q also by dk^-1/2; zero past dk and m).
template <typename F>
__device__ __forceinline__ void gdr_normalised_rows(const float* qkv, u32 t0, u32 m, u32 width,
                                                    u32 nk, u32 dk, u32 kh_j, F f) {
    u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (u32 i = warp; i < GDR_CHUNK; i += GDR_THREADS / 32) {
        const float* row = qkv + (size_t)(t0 + i) * width;
        float qv[GDR_MAX_DK / 32], kv[GDR_MAX_DK / 32];
        float sq = 0.f, sk = 0.f;
#pragma unroll
        for (u32 c = 0; c < GDR_MAX_DK / 32; c++) {
            u32 d = lane + 32 * c;
            bool live = i < m && d < dk;
            qv[c] = live ? row[kh_j * dk + d] : 0.f;
            kv[c] = live ? row[nk * dk + kh_j * dk + d] : 0.f;
            sq += qv[c] * qv[c];
            sk += kv[c] * kv[c];
        }
        float qinv = rsqrtf(warp_sum(sq) + 1e-6f) * rsqrtf((float)dk);
        float kinv = rsqrtf(warp_sum(sk) + 1e-6f);
#pragma unroll
        for (u32 c = 0; c < GDR_MAX_DK / 32; c++) {
            qv[c] *= qinv;
            kv[c] *= kinv;
        }
        f(i, qv, kv);
    }
}

// Grid: (per_wave, nv); block: GDR_THREADS; dynamic shared memory GDR_PREP_SMEM_BYTES.
// Warp w computes 16 rows (w / 2) of each 64-row product, half (w % 2) of its columns.
extern "C" __global__ void __launch_bounds__(GDR_THREADS) gdr_chunk_prepare(
    const float* qkv, const float* g, const float* beta, u32 nk, u32 nv, u32 dk, u32 dv,
    const u32* runs, u32 num_runs, u32 tokens, u32 slots, u32 first, unsigned char* ws,
    Diag* diag) {
    begin_kernel();
    extern __shared__ __align__(16) unsigned char gdr_prep[];
    u16* qh = reinterpret_cast<u16*>(gdr_prep);  // [64][GDR_KS]: q̂ (f16, bf16), V's his
    u16* kh = qh + GDR_CHUNK * GDR_KS;           // [64][GDR_KS]: k̂ (f16, bf16), V's los
    float* as = reinterpret_cast<float*>(kh + GDR_CHUNK * GDR_KS);  // [64][65]: A
    float* ts = as + GDR_CHUNK * (GDR_CHUNK + 1);                   // [64][65]: T
    __shared__ float gamma[GDR_CHUNK], bt[GDR_CHUNK], bg[GDR_CHUNK];
    __shared__ float xs[3][16][16];
    const u32 ast = GDR_CHUNK + 1;
    u32 run, chunk;
    if (!gdr_chunk_of(runs, num_runs, tokens, first + blockIdx.x, &run, &chunk)) return;
    u32 start, len, slot;
    bool fresh;
    if (!run_of(runs, run, tokens, slots, &start, &len, &slot, &fresh, diag)) return;
    u32 j = blockIdx.y, kh_j = j / (nv / nk), dkp = gdr_dkp(dk);
    u32 t0 = start + chunk * GDR_CHUNK, m = min(GDR_CHUNK, len - chunk * GDR_CHUNK);
    u32 width = 2 * nk * dk + nv * dv;
    u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, mt = warp >> 1, half = warp & 1;
    unsigned char* base = ws + ((size_t)blockIdx.x * nv + j) * gdr_chunk_bytes(dk, dv);
    u16* w_out = reinterpret_cast<u16*>(base);
    u16* q_out = w_out + GDR_CHUNK * dkp;
    u16* k_out = q_out + GDR_CHUNK * dkp;
    u16* mh_out = k_out + GDR_CHUNK * dkp;
    u16* ml_out = mh_out + GDR_CHUNK * GDR_CHUNK;
    float* tail = reinterpret_cast<float*>(ml_out + GDR_CHUNK * GDR_CHUNK);
    float* u_out = tail + GDR_TAIL;
    // γ: an inclusive scan of the gates, two tokens a lane (zero past the chunk's tokens).
    if (warp == 0) {
        float a = 2 * lane < m ? g[(size_t)(t0 + 2 * lane) * nv + j] : 0.f;
        float b = 2 * lane + 1 < m ? g[(size_t)(t0 + 2 * lane + 1) * nv + j] : 0.f;
        float s = a + b;
#pragma unroll
        for (u32 o = 1; o < 32; o <<= 1) {
            float y = __shfl_up_sync(0xffffffffu, s, o);
            if (lane >= o) s += y;
        }
        gamma[2 * lane] = s - b;
        gamma[2 * lane + 1] = s;
    }
    if (threadIdx.x < GDR_CHUNK)
        bt[threadIdx.x] = threadIdx.x < m ? beta[(size_t)(t0 + threadIdx.x) * nv + j] : 0.f;
    // q̂ and k̂ rows as f16 for Q Kᵀ and K Kᵀ.
    gdr_normalised_rows(qkv, t0, m, width, nk, dk, kh_j, [&](u32 i, float* qv, float* kv) {
#pragma unroll
        for (u32 c = 0; c < GDR_MAX_DK / 32; c++) {
            u32 d = lane + 32 * c;
            if (d < dkp) {
                qh[i * GDR_KS + d] = f32_to_f16(qv[c]);
                kh[i * GDR_KS + d] = f32_to_f16(kv[c]);
            }
        }
    });
    __syncthreads();
    float last = gamma[GDR_CHUNK - 1];
    if (threadIdx.x < GDR_CHUNK) {
        u32 i = threadIdx.x;
        bool live = i < m;
        bg[i] = bt[i] * expf(gamma[i]);
        tail[i] = live ? expf(gamma[i]) : 0.f;
        tail[GDR_CHUNK + i] = live ? expf(last - gamma[i]) : 0.f;
    }
    if (threadIdx.x == 0) {
        tail[2 * GDR_CHUNK] = expf(last);
        tail[2 * GDR_CHUNK + 1] = tail[2 * GDR_CHUNK + 2] = tail[2 * GDR_CHUNK + 3] = 0.f;
    }
    // K Kᵀ and Q Kᵀ: rows 16 mt, columns 32 half .. + 31 (tiles above the diagonal are zero).
    {
        float kk[4][4], qk[4][4];
#pragma unroll
        for (u32 n = 0; n < 4; n++)
#pragma unroll
            for (u32 r = 0; r < 4; r++) kk[n][r] = qk[n][r] = 0.f;
        for (u32 k0 = 0; k0 < dkp; k0 += 16) {
            u32 ak[4], aq[4];
            gdr_a_frag(ak, kh, GDR_KS, 16 * mt, k0);
            gdr_a_frag(aq, qh, GDR_KS, 16 * mt, k0);
#pragma unroll
            for (u32 n = 0; n < 4; n++) {
                u32 n0 = 32 * half + 8 * n;
                if (n0 > 16 * mt + 15) continue;
                u32 b[2];
                gdr_b_frag(b, kh, GDR_KS, n0, k0);
                mma16816<true>(kk[n], ak, b);
                mma16816<true>(qk[n], aq, b);
            }
        }
#pragma unroll
        for (u32 n = 0; n < 4; n++) {
            u32 n0 = 32 * half + 8 * n;
            auto put = [&](u32 i, u32 l, float* kkv, float* qkv_) {
                float d0 = l <= i && i < m ? expf(gamma[i] - gamma[l]) : 0.f;
                float d1 = l + 1 <= i && i < m ? expf(gamma[i] - gamma[l + 1]) : 0.f;
                as[i * ast + l] = l < i ? bt[i] * kkv[0] * d0 : 0.f;
                as[i * ast + l + 1] = l + 1 < i ? bt[i] * kkv[1] * d1 : 0.f;
                split_bf16x2(qkv_[0] * d0, qkv_[1] * d1,
                           reinterpret_cast<u32*>(mh_out + i * GDR_CHUNK + l),
                           reinterpret_cast<u32*>(ml_out + i * GDR_CHUNK + l));
            };
            u32 g8 = lane >> 2, t2 = 2 * (lane & 3);
            put(16 * mt + g8, n0 + t2, &kk[n][0], &qk[n][0]);
            put(16 * mt + g8 + 8, n0 + t2, &kk[n][2], &qk[n][2]);
        }
    }
    __syncthreads();
    // q̂ and k̂ again, as bf16 for W and the scan.
    gdr_normalised_rows(qkv, t0, m, width, nk, dk, kh_j, [&](u32 i, float* qv, float* kv) {
#pragma unroll
        for (u32 c = 0; c < GDR_MAX_DK / 32; c++) {
            u32 d = lane + 32 * c;
            if (d < dkp) {
                qh[i * GDR_KS + d] = f32_to_bf16(qv[c]);
                kh[i * GDR_KS + d] = f32_to_bf16(kv[c]);
            }
        }
    });
    // T = (I + A)⁻¹ in 16x16 blocks: the diagonal blocks by forward substitution, a column
    // per thread; then block row a: T_ab = −T_aa Σ_{b<=l<a} A_al T_lb.
    if (threadIdx.x < GDR_CHUNK) {
        u32 a = threadIdx.x / 16, c = threadIdx.x % 16, o = 16 * a;
        float v[16];
#pragma unroll
        for (u32 i = 0; i < 16; i++) {
            float x = i == c ? 1.f : 0.f;
#pragma unroll
            for (u32 l = 0; l < i; l++) x -= as[(o + i) * ast + o + l] * v[l];
            v[i] = i >= c ? x : 0.f;
            ts[(o + i) * ast + o + c] = v[i];
        }
    }
    for (u32 a = 1; a < 4; a++) {
        __syncthreads();
        for (u32 e = threadIdx.x; e < a * 256; e += GDR_THREADS) {
            u32 b = e / 256, i = (e / 16) % 16, c = e % 16;
            float x = 0.f;
            for (u32 l = b; l < a; l++)
#pragma unroll
                for (u32 k = 0; k < 16; k++)
                    x += as[(16 * a + i) * ast + 16 * l + k] * ts[(16 * l + k) * ast + 16 * b + c];
            xs[b][i][c] = x;
        }
        __syncthreads();
        for (u32 e = threadIdx.x; e < a * 256; e += GDR_THREADS) {
            u32 b = e / 256, i = (e / 16) % 16, c = e % 16;
            float x = 0.f;
#pragma unroll
            for (u32 k = 0; k < 16; k++) x += ts[(16 * a + i) * ast + 16 * a + k] * xs[b][k][c];
            ts[(16 * a + i) * ast + 16 * b + c] = -x;
        }
    }
    __syncthreads();
    // q̂ and k̂ to the workspace, 16 bytes at a time.
    for (u32 x = threadIdx.x; x < GDR_CHUNK * dkp / 8; x += GDR_THREADS) {
        u32 i = x / (dkp / 8), d = (x % (dkp / 8)) * 8;
        *reinterpret_cast<uint4*>(q_out + i * dkp + d) =
            *reinterpret_cast<const uint4*>(qh + i * GDR_KS + d);
        *reinterpret_cast<uint4*>(k_out + i * dkp + d) =
            *reinterpret_cast<const uint4*>(kh + i * GDR_KS + d);
    }
    // −W = −T diag(β e^γ) K̂, K̂ from its rows by ldmatrix; columns 16 b .. + 15 for
    // b = half, half + 2, ...
    for (u32 b16 = half; b16 < dkp / 16; b16 += 2) {
        float acc[2][4];
        u32 n0 = 16 * b16;
        gdr_lower_times<false>(acc, ts, bg, -1.f, kh, nullptr, mt, n0);
#pragma unroll
        for (u32 h = 0; h < 2; h++)
            gdr_acc_each(acc[h], 16 * mt, n0 + 8 * h, [&](u32 i, u32 d, float v0, float v1) {
                *reinterpret_cast<u32*>(w_out + i * dkp + d) = pack_bf16(v0, v1);
            });
    }
    // U = T diag(β) V, V's rows staged (split) where q̂ and k̂ were, GDR_PIECE columns at a
    // time.
    for (u32 e0 = 0; e0 < dv; e0 += GDR_PIECE) {
        u32 piece = min(GDR_PIECE, dv - e0), width16 = (piece + 15) & ~15u;
        __syncthreads();  // the previous reads of q̂, k̂ or V are done
        for (u32 x = threadIdx.x; x < GDR_CHUNK * width16; x += GDR_THREADS) {
            u32 l = x / width16, e = x % width16;
            float v = l < m && e < piece
                          ? qkv[(size_t)(t0 + l) * width + 2 * nk * dk + j * dv + e0 + e]
                          : 0.f;
            split_bf16(v, &qh[l * GDR_KS + e], &kh[l * GDR_KS + e]);
        }
        __syncthreads();
        for (u32 b16 = half; b16 < width16 / 16; b16 += 2) {
            float acc[2][4];
            u32 n0 = 16 * b16;
            gdr_lower_times<true>(acc, ts, bt, 1.f, qh, kh, mt, n0);
#pragma unroll
            for (u32 h = 0; h < 2; h++)
                gdr_acc_each(acc[h], 16 * mt, n0 + 8 * h, [&](u32 i, u32 e, float v0, float v1) {
                    if (e < piece) u_out[(size_t)i * dv + e0 + e] = v0;
                    if (e + 1 < piece) u_out[(size_t)i * dv + e0 + e + 1] = v1;
                });
        }
    }
}

// acc += rows 16 mt .. + 15 of x (bf16 [64][GDR_KS], dkp columns) times the state slice's
// columns 16 half .. + 15, the state transposed and split in sh and sl (bf16 [32][GDR_KS]).
__device__ __forceinline__ void gdr_times_state(float (*acc)[4], const u16* x, const u16* sh,
                                                const u16* sl, u32 dkp, u32 mt, u32 half) {
    for (u32 k0 = 0; k0 < dkp; k0 += 16) {
        u32 a[4];
        gdr_a_frag(a, x, GDR_KS, 16 * mt, k0);
#pragma unroll
        for (u32 n = 0; n < 2; n++) {
            u32 bh[2], bl[2];
            gdr_b_frag(bh, sh, GDR_KS, 16 * half + 8 * n, k0);
            gdr_b_frag(bl, sl, GDR_KS, 16 * half + 8 * n, k0);
            mma16816<false>(acc[n], a, bl);
            mma16816<false>(acc[n], a, bh);
        }
    }
}

// Grid: (runs, nv, ceil(dv / GDR_SLICE)); block: GDR_THREADS; dynamic shared memory
// GDR_SCAN_SMEM_BYTES. Takes the `wave` chunks from `first` that gdr_chunk_prepare made, each
// staged by cp.async while the one before computes. Warp w computes rows 16 (w / 2) ..
// + 15 and columns 16 (w % 2) .. + 15 of the slice's V' and O, and holds rows 16 w .. + 15
// of the state slice in its accumulators (a split copy in shared memory is the operand).
extern "C" __global__ void __launch_bounds__(GDR_THREADS) gdr_chunk_scan(
    u32 nv, u32 dk, u32 dv, const u32* runs, u32 num_runs, u32 tokens, u32 slots, u32 first,
    u32 wave, u32 total, const unsigned char* ws, float* state, float* out, Diag* diag) {
    begin_kernel();
    extern __shared__ __align__(16) unsigned char gdr_scan[];
    u16* sth = reinterpret_cast<u16*>(gdr_scan + 2 * GDR_STAGE_BYTES);  // [32][GDR_KS]: Sᵀ
    u16* stl = sth + GDR_SLICE * GDR_KS;
    u16* vth = stl + GDR_SLICE * GDR_KS;  // [32][GDR_LS]: V'ᵀ
    u16* vtl = vth + GDR_SLICE * GDR_LS;
    u16* vsh = vtl + GDR_SLICE * GDR_LS;  // [32][GDR_LS]: (e^{γ_last − γ} ⊙ V')ᵀ
    u16* vsl = vsh + GDR_SLICE * GDR_LS;
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
    u32 dkp = gdr_dkp(dk);
    size_t chunk_bytes = gdr_chunk_bytes(dk, dv);
    u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, mt = warp >> 1, half = warp & 1;
    u32 g8 = lane >> 2, t2 = 2 * (lane & 3);
    float* s_global = state + ((size_t)slot * nv + j) * dk * dv;
    bool zero = fresh && c_begin == 0, s_rows = 16 * warp < dkp;
    float sacc[4][4];
#pragma unroll
    for (u32 n = 0; n < 4; n++)
#pragma unroll
        for (u32 x = 0; x < 4; x++) {
            u32 d = 16 * warp + g8 + 8 * (x >> 1), e = e0 + 8 * n + t2 + (x & 1);
            sacc[n][x] = !zero && d < dk && e < dv ? s_global[(size_t)d * dv + e] : 0.f;
        }
    auto store_st = [&]() {
        if (!s_rows) return;
#pragma unroll
        for (u32 n = 0; n < 4; n++)
#pragma unroll
            for (u32 x = 0; x < 4; x++) {
                u32 at = (8 * n + t2 + (x & 1)) * GDR_KS + 16 * warp + g8 + 8 * (x >> 1);
                split_bf16(sacc[n][x], &sth[at], &stl[at]);
            }
    };
    store_st();
    auto chunk_src = [&](u32 c) { return ws + ((size_t)(g0 + c - first) * nv + j) * chunk_bytes; };
    // Chunk c's −W, q̂, k̂, M and tail into stage `s`, 16 bytes a copy.
    auto issue = [&](u32 c, u32 s) {
        const unsigned char* src = chunk_src(c);
        unsigned char* dst = gdr_scan + s * GDR_STAGE_BYTES;
        const u16* src16 = reinterpret_cast<const u16*>(src);
        u16* dst16 = reinterpret_cast<u16*>(dst);
        u32 per_row = dkp / 8, per_mat = GDR_CHUNK * per_row;
        for (u32 x = threadIdx.x; x < 3 * per_mat; x += GDR_THREADS) {
            u32 which = x / per_mat, i = (x % per_mat) / per_row, d = (x % per_row) * 8;
            cp_async16(dst16 + (which * GDR_CHUNK + i) * GDR_KS + d,
                       src16 + (which * GDR_CHUNK + i) * dkp + d, 16);
        }
        // M's two halves: 128 rows of 64.
        const u16* m_src = src16 + 3 * GDR_CHUNK * dkp;
        u16* m_dst = dst16 + 3 * GDR_CHUNK * GDR_KS;
        for (u32 x = threadIdx.x; x < 2 * GDR_CHUNK * 8; x += GDR_THREADS)
            cp_async16(m_dst + (x / 8) * GDR_LS + (x % 8) * 8, m_src + (x / 8) * GDR_CHUNK + (x % 8) * 8,
                       16);
        const float* t_src = reinterpret_cast<const float*>(m_src + 2 * GDR_CHUNK * GDR_CHUNK);
        float* t_dst = reinterpret_cast<float*>(m_dst + 2 * GDR_CHUNK * GDR_LS);
        for (u32 x = threadIdx.x; x < GDR_TAIL / 4; x += GDR_THREADS)
            cp_async16(t_dst + 4 * x, t_src + 4 * x, 16);
        cp_async_commit();
    };
    // This thread's entries of chunk c's U: rows 16 mt + g8 (+ 8), columns 16 half + 8 n + t2.
    auto load_u = [&](u32 c, float (*u)[4]) {
        const float* u_src = reinterpret_cast<const float*>(
                                 chunk_src(c) + 2 * ((size_t)3 * GDR_CHUNK * dkp + 2 * GDR_CHUNK * GDR_CHUNK)) +
                             GDR_TAIL;
#pragma unroll
        for (u32 n = 0; n < 2; n++)
#pragma unroll
            for (u32 x = 0; x < 4; x++) {
                u32 i = 16 * mt + g8 + 8 * (x >> 1), e = e0 + 16 * half + 8 * n + t2 + (x & 1);
                u[n][x] = e < dv ? u_src[(size_t)i * dv + e] : 0.f;
            }
    };
    float u_next[2][4];
    if (c_begin < c_end) {
        issue(c_begin, 0);
        load_u(c_begin, u_next);
    }
    for (u32 c = c_begin; c < c_end; c++) {
        u32 s = (c - c_begin) & 1;
        float v[2][4];
#pragma unroll
        for (u32 n = 0; n < 2; n++)
#pragma unroll
            for (u32 x = 0; x < 4; x++) v[n][x] = u_next[n][x];
        if (c + 1 < c_end) {
            issue(c + 1, s ^ 1);
            load_u(c + 1, u_next);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();  // chunk c's stage and the state's copy are in place
        const u16* wn = reinterpret_cast<const u16*>(gdr_scan + s * GDR_STAGE_BYTES);
        const u16* qs = wn + GDR_CHUNK * GDR_KS;
        const u16* ks = qs + GDR_CHUNK * GDR_KS;
        const u16* mh = ks + GDR_CHUNK * GDR_KS;
        const u16* ml = mh + GDR_CHUNK * GDR_LS;
        const float* tail = reinterpret_cast<const float*>(ml + GDR_CHUNK * GDR_LS);
        u32 t0 = start + c * GDR_CHUNK, m = min(GDR_CHUNK, len - c * GDR_CHUNK);
        // V' = U + (−W) S.
        gdr_times_state(v, wn, sth, stl, dkp, mt, half);
#pragma unroll
        for (u32 n = 0; n < 2; n++)
            gdr_acc_each(v[n], 16 * mt, 16 * half + 8 * n, [&](u32 i, u32 e, float v0, float v1) {
                float ek = tail[GDR_CHUNK + i];
                split_bf16(v0, &vth[e * GDR_LS + i], &vtl[e * GDR_LS + i]);
                split_bf16(v1, &vth[(e + 1) * GDR_LS + i], &vtl[(e + 1) * GDR_LS + i]);
                split_bf16(v0 * ek, &vsh[e * GDR_LS + i], &vsl[e * GDR_LS + i]);
                split_bf16(v1 * ek, &vsh[(e + 1) * GDR_LS + i], &vsl[(e + 1) * GDR_LS + i]);
            });
        __syncthreads();
        // O = e^γ ⊙ (Q̂ S) + M V' (M is lower triangular: k steps up to the diagonal).
        float o[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
        gdr_times_state(o, qs, sth, stl, dkp, mt, half);
        float eg_lo = tail[16 * mt + g8], eg_hi = tail[16 * mt + g8 + 8];
#pragma unroll
        for (u32 n = 0; n < 2; n++) {
            o[n][0] *= eg_lo;
            o[n][1] *= eg_lo;
            o[n][2] *= eg_hi;
            o[n][3] *= eg_hi;
        }
        for (u32 k0 = 0; k0 <= 16 * mt; k0 += 16) {
            u32 ah[4], al[4];
            gdr_a_frag(ah, mh, GDR_LS, 16 * mt, k0);
            gdr_a_frag(al, ml, GDR_LS, 16 * mt, k0);
#pragma unroll
            for (u32 n = 0; n < 2; n++) {
                u32 bh[2], bl[2];
                gdr_b_frag(bh, vth, GDR_LS, 16 * half + 8 * n, k0);
                gdr_b_frag(bl, vtl, GDR_LS, 16 * half + 8 * n, k0);
                mma16816<false>(o[n], al, bh);
                mma16816<false>(o[n], ah, bl);
                mma16816<false>(o[n], ah, bh);
            }
        }
#pragma unroll
        for (u32 n = 0; n < 2; n++)
            gdr_acc_each(o[n], 16 * mt, 16 * half + 8 * n, [&](u32 i, u32 e, float v0, float v1) {
                if (i >= m) return;
                float* row = out + ((size_t)(t0 + i) * nv + j) * dv + e0;
                if (e0 + e < dv) row[e] = v0;
                if (e0 + e + 1 < dv) row[e + 1] = v1;
            });
        // S ← e^{γ_last} S + K̂ᵀ (e^{γ_last − γ} ⊙ V'), K̂ᵀ by transposing ldmatrix.
        if (s_rows) {
            float decay = tail[2 * GDR_CHUNK];
#pragma unroll
            for (u32 n = 0; n < 4; n++)
#pragma unroll
                for (u32 x = 0; x < 4; x++) sacc[n][x] *= decay;
#pragma unroll
            for (u32 k0 = 0; k0 < GDR_CHUNK; k0 += 16) {
                u32 a[4];
                gdr_a_frag_trans(a, ks, GDR_KS, 16 * warp, k0);
#pragma unroll
                for (u32 n = 0; n < 4; n++) {
                    u32 bh[2], bl[2];
                    gdr_b_frag(bh, vsh, GDR_LS, 8 * n, k0);
                    gdr_b_frag(bl, vsl, GDR_LS, 8 * n, k0);
                    mma16816<false>(sacc[n], a, bl);
                    mma16816<false>(sacc[n], a, bh);
                }
            }
        }
        __syncthreads();  // every read of Sᵀ, V' and this stage is done
        store_st();
    }
#pragma unroll
    for (u32 n = 0; n < 4; n++)
#pragma unroll
        for (u32 x = 0; x < 4; x++) {
            u32 d = 16 * warp + g8 + 8 * (x >> 1), e = e0 + 8 * n + t2 + (x & 1);
            if (d < dk && e < dv) s_global[(size_t)d * dv + e] = sacc[n][x];
        }
}
