// MoE: top-k routing, the device-side sort of routed pairs by expert, grouped gate/up (with
// SwiGLU) and down (with the routing weight) over all experts on tensor cores, the combine
// back to token order, and the per-token matrix-vector path that reads only the selected
// experts' rows. Expert weights are reached through a per-projection table of device
// pointers (one per expert), so stacked and per-expert checkpoint layouts run alike.

#define ROUTE_THREADS 256
#define PT_DOWN_SLOTS 8  // routed slots whose down rows the per-token path reads at once
#define SORT_THREADS 1024
#define DOWN_MVM_GROUPS 4  // groups of 16 output features per block of the few-row grouped down
#define MAX_SORT_EXPERTS 4096

#define ROUTE_LANE_EXPERTS 16  // a lane's experts held in registers (tokens of up to 512)

// Softmax over each token's expert logits, then its top_k experts (ties to the lower id) and
// their probabilities, renormalised to sum 1 when asked. One warp per token. Up to 512
// experts, each lane holds its experts' logits (lane + 32 i) in registers, read once, and a
// bitmask of which are chosen; with more, the logits are re-read for each choice. With
// `shared`, a row holds one more logit (a shared expert's gate) and the token one more
// choice: expert num_experts, weighted sigmoid(that logit).
extern "C" __global__ void __launch_bounds__(ROUTE_THREADS) moe_route(
    const float* logits, u32 tokens, u32 num_experts, u32 top_k, u32 renormalize, u32 shared,
    u32* ids, float* weights) {
    begin_small_kernel();
    u32 lane = threadIdx.x & 31;
    u32 t = blockIdx.x * (ROUTE_THREADS / 32) + (threadIdx.x >> 5);
    if (t >= tokens) return;
    const float* l = logits + (size_t)t * (num_experts + shared);
    u32* out_ids = ids + (size_t)t * (top_k + shared);
    float* out_w = weights + (size_t)t * (top_k + shared);
    // The warp's best (value, id) pair, ties to the lower id; id 0xffffffff: none.
    auto warp_best = [&](float& bv, u32& bi) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            u32 oi = __shfl_xor_sync(0xffffffffu, bi, o);
            bool take = oi != 0xffffffffu &&
                        (bi == 0xffffffffu || ov > bv || (ov == bv && oi < bi));
            if (take) {
                bv = ov;
                bi = oi;
            }
        }
    };
    float total = 0.f;
    // Choice j is expert bi of logit bv: its probability out of the softmax's sum s.
    auto choose = [&](u32 j, float bv, u32 bi, float m, float s) {
        float w = expf(bv - m) / s;
        if (lane == 0) {
            out_ids[j] = bi;
            out_w[j] = w;
        }
        total += w;
    };
    if (num_experts <= 32 * ROUTE_LANE_EXPERTS) {
        float v[ROUTE_LANE_EXPERTS];
        float m = NEG_INF;
#pragma unroll
        for (int i = 0; i < ROUTE_LANE_EXPERTS; i++) {
            u32 e = lane + 32 * i;
            v[i] = e < num_experts ? l[e] : NEG_INF;
            m = fmaxf(m, v[i]);
        }
        m = warp_max(m);
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < ROUTE_LANE_EXPERTS; i++)
            if (lane + 32 * i < num_experts) s += expf(v[i] - m);
        s = warp_sum(s);
        u32 taken = 0;  // bit i: expert lane + 32 i is chosen already
        for (u32 j = 0; j < top_k; j++) {
            float bv = NEG_INF;
            u32 bi = 0xffffffffu;
#pragma unroll
            for (int i = 0; i < ROUTE_LANE_EXPERTS; i++) {
                u32 e = lane + 32 * i;
                if (e < num_experts && !((taken >> i) & 1u) && (bi == 0xffffffffu || v[i] > bv)) {
                    bv = v[i];
                    bi = e;
                }
            }
            warp_best(bv, bi);
            choose(j, bv, bi, m, s);
            if (lane == (bi & 31)) taken |= 1u << (bi >> 5);
        }
    } else {
        float m = NEG_INF;
        for (u32 e = lane; e < num_experts; e += 32) m = fmaxf(m, l[e]);
        m = warp_max(m);
        float s = 0.f;
        for (u32 e = lane; e < num_experts; e += 32) s += expf(l[e] - m);
        s = warp_sum(s);
        // Bit i of taken[i / 32]: this lane's expert lane + 32 i is chosen already.
        u32 taken[MAX_SORT_EXPERTS / 32 / 32] = {0};
        for (u32 j = 0; j < top_k; j++) {
            float bv = NEG_INF;
            u32 bi = 0xffffffffu;
            for (u32 e = lane, i = 0; e < num_experts; e += 32, i++) {
                bool is_taken = (taken[i >> 5] >> (i & 31)) & 1u;
                if (!is_taken && (bi == 0xffffffffu || l[e] > bv)) {
                    bv = l[e];
                    bi = e;
                }
            }
            warp_best(bv, bi);
            choose(j, bv, bi, m, s);
            if (lane == (bi & 31)) {
                u32 i = bi >> 5;
                taken[i >> 5] |= 1u << (i & 31);
            }
        }
    }
    if (renormalize && lane == 0)
        for (u32 j = 0; j < top_k; j++) out_w[j] /= total;
    if (shared && lane == 0) {
        out_ids[top_k] = num_experts;
        out_w[top_k] = sigmoid(l[num_experts]);
    }
}

#define RANKED_MAX_EXPERTS 1024  // experts of a token that moe_route_ranked holds
#define RANKED_MAX_CHOICES 64

// moe_route for up to RANKED_MAX_EXPERTS experts: a block per token, and each expert's place
// among the token's logits counted by one thread against all of them (ties to the lower id)
// rather than top_k rounds of warp-wide maxima, so the choices cost one pass, not top_k. Same
// outputs as moe_route (the renormalising sum may round differently).
extern "C" __global__ void __launch_bounds__(ROUTE_THREADS) moe_route_ranked(
    const float* logits, u32 tokens, u32 num_experts, u32 top_k, u32 renormalize, u32 shared,
    u32* ids, float* weights) {
    begin_small_kernel();
    __shared__ float v[RANKED_MAX_EXPERTS];
    __shared__ u32 chosen[RANKED_MAX_CHOICES];
    __shared__ float chosen_w[RANKED_MAX_CHOICES];
    __shared__ float scratch[32];
    u32 t = blockIdx.x;
    if (t >= tokens) return;
    const float* l = logits + (size_t)t * (num_experts + shared);
    float m = NEG_INF;
    for (u32 e = threadIdx.x; e < num_experts; e += blockDim.x) {
        v[e] = l[e];
        m = fmaxf(m, v[e]);
    }
    if (threadIdx.x < top_k) {
        chosen[threadIdx.x] = 0;
        chosen_w[threadIdx.x] = 0.f;
    }
    m = block_max(m, scratch);
    float s = 0.f;
    for (u32 e = threadIdx.x; e < num_experts; e += blockDim.x) s += expf(v[e] - m);
    s = block_sum(s, scratch);
    for (u32 e = threadIdx.x; e < num_experts; e += blockDim.x) {
        float x = v[e];
        u32 rank = 0;
        for (u32 o = 0; o < num_experts; o++) {
            float y = v[o];
            rank += (y > x) | ((y == x) & (o < e));
        }
        if (rank < top_k) {
            chosen[rank] = e;
            chosen_w[rank] = expf(x - m) / s;
        }
    }
    __syncthreads();
    float total = 0.f;
    if (threadIdx.x < 32) {
        for (u32 j = threadIdx.x; j < top_k; j += 32) total += chosen_w[j];
        total = warp_sum(total);
    }
    u32* out_ids = ids + (size_t)t * (top_k + shared);
    float* out_w = weights + (size_t)t * (top_k + shared);
    if (threadIdx.x < 32)
        for (u32 j = threadIdx.x; j < top_k; j += 32) {
            out_ids[j] = chosen[j];
            out_w[j] = renormalize ? chosen_w[j] / total : chosen_w[j];
        }
    if (shared && threadIdx.x == 0) {
        out_ids[top_k] = num_experts;
        out_w[top_k] = sigmoid(l[num_experts]);
    }
}

// Stable counting sort of the routed pairs by expert: counts, exclusive offsets [E + 1], the
// experts with pairs ([count, ids ascending]), the sorted order and its inverse. An id out of
// range raises the error flag and is sorted as expert 0, so that every later index stays in
// bounds. Block b places the pairs of its chunk [b * chunk, (b + 1) * chunk): each of its
// first `warps` warps owns a contiguous run of them and keeps its own count per expert
// in shared memory; __match_any_sync ranks equal ids within a step of 32 pairs, so a second
// walk over the same runs places every pair in pair order, with no atomics and no pass per
// expert. With more than one block, each also counts the pairs before and after its chunk
// (reading every id: no block waits for another), and block 0 writes the offsets.
#define SORT_COUNTERS 8192
#define SORT_BATCH 8  // steps of 32 pairs whose ids a warp loads at once
#define SORT_OUTSIDE_EXPERTS 1024  // experts of a sort of several blocks

// A lane's ids of SORT_BATCH steps from pair p (0xffffffff past `end`), all loads in flight
// together; an id out of range raises the flag (when `diag` is given) and reads as expert 0.
__device__ __forceinline__ void sort_load_ids(const u32* ids, u32 p, u32 end, u32 num_experts,
                                              u32* es, Diag* diag) {
#pragma unroll
    for (int i = 0; i < SORT_BATCH; i++) es[i] = p + 32 * i < end ? ids[p + 32 * i] : 0xffffffffu;
#pragma unroll
    for (int i = 0; i < SORT_BATCH; i++) {
        if (p + 32 * i < end && es[i] >= num_experts) {
            if (diag) raise_error(diag, ERR_EXPERT_ID);
            es[i] = 0;
        }
    }
}

// Adds the pairs of [begin, end) to count[e], the block's warps taking 32 pairs a step and
// each warp adding once per distinct expert of a step.
__device__ __forceinline__ void sort_count_range(const u32* ids, u32 begin, u32 end,
                                                 u32 num_experts, u32* count) {
    u32 lane = threadIdx.x & 31, lt_mask = (1u << lane) - 1u;
    for (u32 c0 = begin + (threadIdx.x & ~31u) * SORT_BATCH; c0 < end;
         c0 += blockDim.x * SORT_BATCH) {
        u32 es[SORT_BATCH];
        sort_load_ids(ids, c0 + lane, end, num_experts, es, nullptr);
#pragma unroll
        for (int i = 0; i < SORT_BATCH; i++) {
            u32 e = es[i];
            u32 peers = __match_any_sync(0xffffffffu, e);
            if (e != 0xffffffffu && (peers & lt_mask) == 0) atomicAdd(&count[e], __popc(peers));
        }
    }
}

template <bool CHUNKED>
__device__ void moe_sort_impl(const u32* ids, u32 pairs, u32 num_experts, u32 chunk,
                              u32* offsets, u32* hit_experts, u32* sorted_pairs,
                              u32* pair_positions, Diag* diag) {
    const u32 COUNTERS = CHUNKED ? SORT_COUNTERS / 2 : SORT_COUNTERS;
    __shared__ u32 counts[COUNTERS];  // [warp][expert]: count, then first position
    __shared__ u64 partial[SORT_THREADS];  // scanned: experts hit (high half), pairs (low)
    // Pairs of each expert before this block's chunk, and after it.
    __shared__ u32 before[CHUNKED ? SORT_OUTSIDE_EXPERTS : 1];
    __shared__ u32 after[CHUNKED ? SORT_OUTSIDE_EXPERTS : 1];
    u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    u32 c_begin = CHUNKED ? min(blockIdx.x * chunk, pairs) : 0;
    u32 c_end = CHUNKED ? min(c_begin + chunk, pairs) : pairs;
    u32 warps = min((u32)(SORT_THREADS / 32), COUNTERS / max(num_experts, 1u));
    u32 run = (c_end - c_begin + warps - 1) / warps;
    for (u32 i = tid; i < warps * num_experts; i += blockDim.x) counts[i] = 0;
    if (CHUNKED)
        for (u32 e = tid; e < num_experts; e += blockDim.x) before[e] = after[e] = 0;
    __syncthreads();
    u32 lt_mask = (1u << lane) - 1u;
    if (warp < warps) {
        u32 p_begin = min(c_begin + warp * run, c_end), p_end = min(p_begin + run, c_end);
        u32* mine = counts + warp * num_experts;
        for (u32 c0 = p_begin; c0 < p_end; c0 += 32 * SORT_BATCH) {
            u32 es[SORT_BATCH];
            sort_load_ids(ids, c0 + lane, p_end, num_experts, es, diag);
#pragma unroll
            for (int i = 0; i < SORT_BATCH; i++) {
                u32 e = es[i];
                u32 peers = __match_any_sync(0xffffffffu, e);
                if (e != 0xffffffffu && (peers & lt_mask) == 0) mine[e] += __popc(peers);
                __syncwarp();
            }
        }
    }
    if (CHUNKED) {
        sort_count_range(ids, 0, c_begin, num_experts, before);
        sort_count_range(ids, c_end, pairs, num_experts, after);
    }
    __syncthreads();
    // Exclusive scan over experts: each thread owns a contiguous run of experts.
    u32 per = (num_experts + blockDim.x - 1) / blockDim.x;
    u32 e0 = min(tid * per, num_experts), e1 = min(e0 + per, num_experts);
    u64 mine = 0;
    for (u32 e = e0; e < e1; e++) {
        u32 c = CHUNKED ? before[e] + after[e] : 0;
        for (u32 w = 0; w < warps; w++) c += counts[w * num_experts + e];
        mine += (c > 0 ? 1ull << 32 : 0ull) + c;
    }
    partial[tid] = mine;
    __syncthreads();
    for (u32 stride = 1; stride < blockDim.x; stride <<= 1) {
        u64 v = tid >= stride ? partial[tid - stride] : 0;
        __syncthreads();
        partial[tid] += v;
        __syncthreads();
    }
    u64 scanned = partial[tid] - mine;
    u32 running = (u32)scanned, hit_rank = (u32)(scanned >> 32);
    bool writes = !CHUNKED || blockIdx.x == 0;
    for (u32 e = e0; e < e1; e++) {
        if (writes) offsets[e] = running;
        u32 first = running;
        if (CHUNKED) running += before[e];
        for (u32 w = 0; w < warps; w++) {
            u32 c = counts[w * num_experts + e];
            counts[w * num_experts + e] = running;
            running += c;
        }
        if (CHUNKED) running += after[e];
        if (running > first && writes) hit_experts[1 + hit_rank++] = e;
    }
    if (tid == 0 && writes) offsets[num_experts] = pairs;
    if (tid == blockDim.x - 1 && writes) hit_experts[0] = (u32)(partial[tid] >> 32);
    __syncthreads();
    if (warp < warps) {
        u32 p_begin = min(c_begin + warp * run, c_end), p_end = min(p_begin + run, c_end);
        u32* next = counts + warp * num_experts;
        for (u32 c0 = p_begin; c0 < p_end; c0 += 32 * SORT_BATCH) {
            u32 es[SORT_BATCH];
            sort_load_ids(ids, c0 + lane, p_end, num_experts, es, nullptr);
#pragma unroll
            for (int i = 0; i < SORT_BATCH; i++) {
                u32 e = es[i], p = c0 + lane + 32 * i;
                u32 peers = __match_any_sync(0xffffffffu, e);
                if (e != 0xffffffffu) {
                    u32 s = next[e] + __popc(peers & lt_mask);
                    sorted_pairs[s] = p;
                    pair_positions[p] = s;
                }
                __syncwarp();
                if (e != 0xffffffffu && (peers & lt_mask) == 0) next[e] += __popc(peers);
                __syncwarp();
            }
        }
    }
}

// One block: every pair placed by it.
extern "C" __global__ void __launch_bounds__(SORT_THREADS) moe_sort(
    const u32* ids, u32 pairs, u32 num_experts, u32* offsets, u32* hit_experts,
    u32* sorted_pairs, u32* pair_positions, Diag* diag) {
    begin_small_kernel();
    moe_sort_impl<false>(ids, pairs, num_experts, pairs, offsets, hit_experts, sorted_pairs,
                         pair_positions, diag);
}

// A block per chunk of pairs (prefill), up to SORT_OUTSIDE_EXPERTS experts.
extern "C" __global__ void __launch_bounds__(SORT_THREADS) moe_sort_chunked(
    const u32* ids, u32 pairs, u32 num_experts, u32 chunk, u32* offsets, u32* hit_experts,
    u32* sorted_pairs, u32* pair_positions, Diag* diag) {
    begin_small_kernel();
    moe_sort_impl<true>(ids, pairs, num_experts, chunk, offsets, hit_experts, sorted_pairs,
                        pair_positions, diag);
}

// Finds which expert tile of tile_m sorted rows this block computes: expert e's rows
// offsets[e]..offsets[e+1] form ceil(count / tile_m) tiles, laid out expert after expert.
// Returns false for the spare blocks of a grid sized for the worst case.
__device__ bool find_expert_tile(const u32* offsets, u32 num_experts, u32 pairs, u32 tile_m,
                                 u32* expert, u32* row0, u32* rows) {
    __shared__ u32 s_expert, s_row0, s_rows;
    u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u32 tile = blockIdx.x;
    if (warp == 0) {
        if (lane == 0) s_expert = 0xffffffffu;
        __syncwarp();
        u32 before = 0;
        for (u32 c = 0; c < num_experts; c += 32) {
            u32 e = c + lane;
            u32 lo = e < num_experts ? offsets[e] : 0, hi = e < num_experts ? offsets[e + 1] : 0;
            hi = min(hi, pairs);
            u32 count = hi > lo ? hi - lo : 0;
            u32 tiles = (count + tile_m - 1) / tile_m;
            u32 inc = tiles;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                u32 n = __shfl_up_sync(0xffffffffu, inc, o);
                if (lane >= o) inc += n;
            }
            u32 first = before + inc - tiles;
            if (tiles && tile >= first && tile < first + tiles) {
                s_expert = e;
                s_row0 = lo + (tile - first) * tile_m;
                s_rows = min(tile_m, hi - s_row0);
            }
            before += __shfl_sync(0xffffffffu, inc, 31);
            if (before > tile) break;
        }
    }
    __syncthreads();
    *expert = s_expert;
    *row0 = s_row0;
    *rows = s_rows;
    return s_expert != 0xffffffffu;
}

// act[s] = silu(gate[e] x[t]) * up[e] x[t] for each sorted row s (pair p = sorted_pairs[s],
// token t = p / top_k, expert e). Grid: (worst-case tiles, ceil(I / TILE_N)).
template <typename W>
__device__ void grouped_gate_up_impl(const float* x, u32 hidden, u32 top_k, const u32* offsets,
                                     const u32* sorted_pairs, u32 pairs, u32 num_experts,
                                     const u64* gate_table, const u64* up_table, u32 inter,
                                     u32 vec, float* act, Diag* diag) {
    __shared__ const float* a_rows[TILE_M];
    u32 expert, row0, rows;
    if (!find_expert_tile(offsets, num_experts, pairs, TILE_M, &expert, &row0, &rows)) return;
    u32 n0 = blockIdx.y * TILE_N;
    if (threadIdx.x < TILE_M) {
        const float* ptr = nullptr;
        if (threadIdx.x < rows) ptr = x + (size_t)(sorted_pairs[row0 + threadIdx.x] / top_k) * hidden;
        a_rows[threadIdx.x] = ptr;
    }
    int n_valid = (int)min((u32)TILE_N, inter - n0);
    if (threadIdx.x == 0) count_weight_bytes(diag, 2ull * n_valid * hidden * sizeof(W));
    __syncthreads();
    const W* wt[2] = {reinterpret_cast<const W*>(gate_table[expert]) + (size_t)n0 * hidden,
                      reinterpret_cast<const W*>(up_table[expert]) + (size_t)n0 * hidden};
    float acc[2][2][4][4];
    tile_mma<W, 2>(a_rows, wt, n_valid, (int)hidden, vec != 0, vec != 0, acc, diag);
    tile_for_each([&](int mi, int ni, int r0, int tile_row, int tile_col) {
        u32 m = tile_row, n = n0 + tile_col;
        if (m < rows) {
            float* dst = act + (size_t)(row0 + m) * inter;
            if (n < inter) dst[n] = silu(acc[0][mi][ni][r0]) * acc[1][mi][ni][r0];
            if (n + 1 < inter) dst[n + 1] = silu(acc[0][mi][ni][r0 + 1]) * acc[1][mi][ni][r0 + 1];
        }
    });
}

// y[s] = w[p] * down[e] act[s] for each sorted row s. Grid: (worst-case tiles, ceil(H / TILE_N)).
template <typename W>
__device__ void grouped_down_impl(const float* act, u32 inter, const float* route_weights,
                                  const u32* offsets, const u32* sorted_pairs, u32 pairs,
                                  u32 num_experts, const u64* down_table, u32 hidden, u32 vec,
                                  float* y, Diag* diag) {
    __shared__ const float* a_rows[TILE_M];
    __shared__ float scale[TILE_M];
    u32 expert, row0, rows;
    if (!find_expert_tile(offsets, num_experts, pairs, TILE_M, &expert, &row0, &rows)) return;
    u32 n0 = blockIdx.y * TILE_N;
    if (threadIdx.x < TILE_M) {
        bool live = threadIdx.x < rows;
        a_rows[threadIdx.x] = live ? act + (size_t)(row0 + threadIdx.x) * inter : nullptr;
        scale[threadIdx.x] = live ? route_weights[sorted_pairs[row0 + threadIdx.x]] : 0.f;
    }
    int n_valid = (int)min((u32)TILE_N, hidden - n0);
    if (threadIdx.x == 0) count_weight_bytes(diag, (u64)n_valid * inter * sizeof(W));
    __syncthreads();
    const W* wt[1] = {reinterpret_cast<const W*>(down_table[expert]) + (size_t)n0 * inter};
    float acc[1][2][4][4];
    tile_mma<W, 1>(a_rows, wt, n_valid, (int)inter, vec != 0, vec != 0, acc, diag);
    tile_for_each([&](int mi, int ni, int r0, int tile_row, int tile_col) {
        u32 m = tile_row, n = n0 + tile_col;
        if (m < rows) {
            float* dst = y + (size_t)(row0 + m) * hidden;
            if (n < hidden) dst[n] = scale[m] * acc[0][mi][ni][r0];
            if (n + 1 < hidden) dst[n + 1] = scale[m] * acc[0][mi][ni][r0 + 1];
        }
    });
}

// The gate/up half for prefill-sized groups (bf16 weights; x given in bf16, as split pairs
// with SPLIT): 128 sorted rows by 64 columns of gate and up per block (mma_big_tile.cuh);
// act is written in bf16 (split: high halves, then the low halves pairs · I values on), rows
// of I values, for grouped_down_big. Grid: (worst-case tiles, ceil(I / 64)).
template <bool SPLIT, int STAGES>
__device__ void grouped_gate_up_big_impl(const u16* x, u32 hidden, u32 top_k, const u32* offsets,
                                         const u32* sorted_pairs, u32 pairs, u32 num_experts,
                                         const u64* gate_table, const u64* up_table, u32 inter,
                                         u16* act, Diag* diag) {
    __shared__ const u16* a_rows[BT_M];
    u32 expert, row0, rows;
    if (!find_expert_tile(offsets, num_experts, pairs, BT_M, &expert, &row0, &rows)) return;
    u32 n0 = blockIdx.y * (BT_W_ROWS / 2);
    if (threadIdx.x < BT_M) {
        const u16* ptr = nullptr;
        if (threadIdx.x < rows) ptr = x + (size_t)(sorted_pairs[row0 + threadIdx.x] / top_k) * hidden;
        a_rows[threadIdx.x] = ptr;
    }
    int n_valid = (int)min((u32)(BT_W_ROWS / 2), inter - n0);
    if (threadIdx.x == 0) count_weight_bytes(diag, 2ull * n_valid * hidden * sizeof(bf16w));
    __syncthreads();
    const bf16w* wt[2] = {reinterpret_cast<const bf16w*>(gate_table[expert]) + (size_t)n0 * hidden,
                          reinterpret_cast<const bf16w*>(up_table[expert]) + (size_t)n0 * hidden};
    float acc[2][2][BT_W_ROWS / 32][4];
    size_t x_lo = (size_t)(pairs / top_k) * hidden, act_lo = (size_t)pairs * inter;
    big_tile_mma<2, SPLIT, STAGES>(a_rows, x, x_lo, wt, n_valid, (int)hidden, (int)rows, acc);
    big_tile_for_each<2>([&](int mi, int ni, int r0, int tile_row, int tile_col) {
        u32 m = tile_row, n = n0 + tile_col;
        if (m < rows && n < inter) {
            float lo = silu(acc[0][mi][ni][r0]) * acc[1][mi][ni][r0];
            float hi = silu(acc[0][mi][ni][r0 + 1]) * acc[1][mi][ni][r0 + 1];
            size_t at = (size_t)(row0 + m) * inter + n;
            u32* dst = reinterpret_cast<u32*>(act + at);
            if (SPLIT) {
                split_bf16x2(lo, hi, dst, reinterpret_cast<u32*>(act + act_lo + at));
            } else {
                *dst = pack_bf16(lo, hi);
            }
        }
    });
}

// The down half for prefill-sized groups (bf16 weights, act in bf16 from
// grouped_gate_up_big, split pairs with SPLIT): 128 sorted rows by 128 features per block.
// Grid: (worst-case tiles, ceil(H / 128)).
// y in f32, or in bf16 (Y = u16) for a combine that reads it so (half the bytes each way).
__device__ __forceinline__ void store_y2(float* y, float a, float b) {
    *reinterpret_cast<float2*>(y) = make_float2(a, b);
}
__device__ __forceinline__ void store_y2(u16* y, float a, float b) {
    *reinterpret_cast<u32*>(y) = pack_bf16(a, b);
}

template <bool SPLIT, int STAGES, typename Y>
__device__ void grouped_down_big_impl(const u16* act, u32 inter, const float* route_weights,
                                      const u32* offsets, const u32* sorted_pairs, u32 pairs,
                                      u32 num_experts, const u64* down_table, u32 hidden,
                                      Y* y, Diag* diag) {
    __shared__ const u16* a_rows[BT_M];
    __shared__ float scale[BT_M];
    u32 expert, row0, rows;
    if (!find_expert_tile(offsets, num_experts, pairs, BT_M, &expert, &row0, &rows)) return;
    u32 n0 = blockIdx.y * BT_W_ROWS;
    if (threadIdx.x < BT_M) {
        bool live = threadIdx.x < rows;
        a_rows[threadIdx.x] = live ? act + (size_t)(row0 + threadIdx.x) * inter : nullptr;
        scale[threadIdx.x] = live ? route_weights[sorted_pairs[row0 + threadIdx.x]] : 0.f;
    }
    int n_valid = (int)min((u32)BT_W_ROWS, hidden - n0);
    if (threadIdx.x == 0) count_weight_bytes(diag, (u64)n_valid * inter * sizeof(bf16w));
    __syncthreads();
    const bf16w* wt[1] = {reinterpret_cast<const bf16w*>(down_table[expert]) + (size_t)n0 * inter};
    float acc[1][2][BT_W_ROWS / 16][4];
    big_tile_mma<1, SPLIT, STAGES>(a_rows, act, (size_t)pairs * inter, wt, n_valid, (int)inter,
                                   (int)rows, acc);
    big_tile_for_each<1>([&](int mi, int ni, int r0, int tile_row, int tile_col) {
        u32 m = tile_row, n = n0 + tile_col;
        if (m < rows && n < hidden)
            store_y2(y + (size_t)(row0 + m) * hidden + n, scale[m] * acc[0][mi][ni][r0],
                     scale[m] * acc[0][mi][ni][r0 + 1]);
    });
}

// Per-token path, first half: act[p, i] = silu(gate[e] x[t]) * up[e] x[t] for pair p and row
// i, a warp per (pair, row). Grid: ceil(I / 8) blocks per pair, pair-major.
template <typename W>
__device__ void per_token_gate_up_impl(const float* x, u32 hidden, const u32* ids, u32 top_k,
                                       u32 num_experts, const u64* gate_table,
                                       const u64* up_table, u32 inter, u32 vec, float* act,
                                       Diag* diag) {
    u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u32 chunks = (inter + 7) / 8;
    u32 p = blockIdx.x / chunks, chunk = blockIdx.x % chunks, i = chunk * 8 + warp;
    u32 e = ids[p];
    if (e >= num_experts) {
        if (threadIdx.x == 0) raise_error(diag, ERR_EXPERT_ID);
        return;
    }
    if (threadIdx.x == 0) {
        u32 valid = min(8u, inter - chunk * 8);
        count_weight_bytes(diag, 2ull * valid * hidden * sizeof(W));
    }
    if (i >= inter) return;
    const float* xt = x + (size_t)(p / top_k) * hidden;
    const W* g = reinterpret_cast<const W*>(gate_table[e]) + (size_t)i * hidden;
    const W* u = reinterpret_cast<const W*>(up_table[e]) + (size_t)i * hidden;
    float gv, uv;
    warp_dot2(xt, g, u, hidden, vec != 0, &gv, &uv);
    if (lane == 0) act[(size_t)p * inter + i] = silu(gv) * uv;
}

// Per-token path, second half: out[t, h] = sum_j w[t, j] * down[e_j][h] · act[t*k + j], a
// warp per (token, row), slots summed in order. Grid: ceil(H / 8) blocks per token.
template <typename W>
__device__ void per_token_down_impl(const float* act, u32 inter, const u32* ids,
                                    const float* route_weights, u32 top_k, u32 num_experts,
                                    const u64* down_table, u32 hidden, u32 vec, float* out,
                                    Diag* diag) {
    u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u32 chunks = (hidden + 7) / 8;
    u32 t = blockIdx.x / chunks, chunk = blockIdx.x % chunks, h = chunk * 8 + warp;
    if (threadIdx.x == 0) {
        u32 valid = min(8u, hidden - chunk * 8);
        count_weight_bytes(diag, (u64)valid * inter * top_k * sizeof(W));
    }
    if (h >= hidden) return;
    // PT_DOWN_SLOTS experts' rows at a time, their loads in flight together; slots summed in
    // order.
    float total = 0.f;
    for (u32 j0 = 0; j0 < top_k; j0 += PT_DOWN_SLOTS) {
        const W* rows[PT_DOWN_SLOTS];
        const float* acts[PT_DOWN_SLOTS];
#pragma unroll
        for (int u = 0; u < PT_DOWN_SLOTS; u++) {
            u32 j = min(j0 + u, top_k - 1);
            u32 p = t * top_k + j;
            u32 e = ids[p];
            if (e >= num_experts) {
                if (lane == 0) raise_error(diag, ERR_EXPERT_ID);
                e = 0;
            }
            rows[u] = reinterpret_cast<const W*>(down_table[e]) + (size_t)h * inter;
            acts[u] = act + (size_t)p * inter;
        }
        float dots[PT_DOWN_SLOTS];
        warp_dots<W, PT_DOWN_SLOTS, 2>(acts, rows, inter, vec != 0, dots);
#pragma unroll
        for (int u = 0; u < PT_DOWN_SLOTS; u++)
            if (j0 + u < top_k) total += route_weights[t * top_k + j0 + u] * dots[u];
    }
    if (lane == 0) out[(size_t)t * hidden + h] = total;
}

// The n-th expert (in id order) that has rows, and its sorted rows [lo, hi); false when
// fewer experts have rows. From the sort's list of hit experts: two loads, no scan.
__device__ __forceinline__ bool nth_hit_expert(const u32* offsets, const u32* hit_experts,
                                               u32 num_experts, u32 pairs, u32 n, u32* expert,
                                               u32* lo, u32* hi, Diag* diag) {
    if (n >= min(hit_experts[0], num_experts)) return false;
    u32 e = hit_experts[1 + n];
    if (e >= num_experts) {
        if (threadIdx.x == 0) raise_error(diag, ERR_EXPERT_ID);
        return false;
    }
    *expert = e;
    *lo = min(offsets[e], pairs);
    *hi = min(offsets[e + 1], pairs);
    return true;
}

// Grouped experts for few tokens (16-bit weights, rows 16-byte aligned): a block per
// (16 weight rows, hit expert) reads those rows once for the expert's sorted rows, 8 NT at a
// time (mma_vec.cuh), so each hit expert is read once per step however its rows are spread.
// The spare block rows of a grid sized for the worst case return at once.
//
// Gate/up: the 16 rows are 8 features of gate (A rows g) and the same 8 of up (A rows
// g + 8), so each thread holds both halves of its act values and a block reads one weight's
// worth of registers (measured on the H200 against 16 features of both, batch 8: 0.8% a
// step faster, Qwen3-30B-A3B and Qwen3.5-35B-A3B). Grid: (ceil(I / 8), min(E, pairs)).
template <typename W, int NT>
__device__ void grouped_gate_up_mvm_impl(const float* x, u32 hidden, u32 top_k,
                                            const u32* offsets, const u32* hit_experts,
                                            const u32* sorted_pairs, u32 pairs, u32 num_experts,
                                            const u64* gate_table, const u64* up_table,
                                            u32 inter, float* act, Diag* diag) {
    __shared__ float red[(MVM_WARPS - 1) * NT * 4 * 32];
    u32 n0 = blockIdx.x * 8, g = (threadIdx.x & 31) >> 2;
    u32 e, lo, hi;
    if (!nth_hit_expert(offsets, hit_experts, num_experts, pairs, blockIdx.y, &e, &lo, &hi, diag)) return;
    u32 chunks = (hi - lo + 8 * NT - 1) / (8 * NT);
    if (threadIdx.x == 0)
        count_weight_bytes(diag, 2ull * chunks * min(8u, inter - n0) * hidden * sizeof(W));
    bool ok = n0 + g < inter;
    size_t r = (size_t)(ok ? n0 + g : 0) * hidden;
    const u16* w_lo[1] = {reinterpret_cast<const u16*>(gate_table[e]) + r};
    const u16* w_hi[1] = {reinterpret_cast<const u16*>(up_table[e]) + r};
    for (u32 c0 = lo; c0 < hi; c0 += 8 * NT) {
        const float* xr[NT];
#pragma unroll
        for (int j = 0; j < NT; j++) {
            u32 s = c0 + j * 8 + g;
            xr[j] = s < hi ? x + (size_t)(sorted_pairs[s] / top_k) * hidden : nullptr;
        }
        float acc[1][NT][4];
        mvm_accumulate<F16Operands<W>::value, NT, 1>(xr, w_lo, w_hi, ok, ok, hidden, acc, diag);
        if (!mvm_reduce<NT * 4>(&acc[0][0][0], red)) continue;
        // acc[0][j][i]: gate (i < 2) or up (i >= 2) of feature n0 + g, row 8 j + 2 t + (i & 1).
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int i = 0; i < 2; i++) {
                u32 s = c0 + mvm_row(j, i);
                if (ok && s < hi) act[(size_t)s * inter + n0 + g] = silu(acc[0][j][i]) * acc[0][j][i + 2];
            }
    }
}

// Down: 16 features of H per mma, DOWN_MVM_GROUPS of them a block over the same rows of
// act. Grid: (ceil(H / (16 DOWN_MVM_GROUPS)), min(E, pairs)).
template <typename W, int NT>
__device__ void grouped_down_mvm_impl(const float* act, u32 inter, const float* route_weights,
                                      const u32* offsets, const u32* hit_experts,
                                      const u32* sorted_pairs, u32 pairs,
                                      u32 num_experts, const u64* down_table, u32 hidden,
                                      float* y, Diag* diag) {
    __shared__ float red[(MVM_WARPS - 1) * NT * 4 * 32];
    u32 base = blockIdx.x * 16 * DOWN_MVM_GROUPS, g = (threadIdx.x & 31) >> 2;
    u32 e, lo, hi;
    if (!nth_hit_expert(offsets, hit_experts, num_experts, pairs, blockIdx.y, &e, &lo, &hi, diag)) return;
    u32 chunks = (hi - lo + 8 * NT - 1) / (8 * NT);
    if (threadIdx.x == 0)
        count_weight_bytes(diag, (u64)chunks * min(16u * DOWN_MVM_GROUPS, hidden - base) * inter *
                                     sizeof(W));
    const u16* down = reinterpret_cast<const u16*>(down_table[e]);
    for (u32 c0 = lo; c0 < hi; c0 += 8 * NT) {
        const float* xr[NT];
#pragma unroll
        for (int j = 0; j < NT; j++) {
            u32 s = c0 + j * 8 + g;
            xr[j] = s < hi ? act + (size_t)s * inter : nullptr;
        }
        // The block's groups of 16 features in turn, each over the same rows of act.
        for (u32 n0 = base; n0 < min(hidden, base + 16 * DOWN_MVM_GROUPS); n0 += 16) {
            bool lo_ok = n0 + g < hidden, hi_ok = n0 + g + 8 < hidden;
            const u16* w_lo[1] = {down + (size_t)(lo_ok ? n0 + g : 0) * inter};
            const u16* w_hi[1] = {down + (size_t)(hi_ok ? n0 + g + 8 : 0) * inter};
            float acc[1][NT][4];
            mvm_accumulate<F16Operands<W>::value, NT, 1>(xr, w_lo, w_hi, lo_ok, hi_ok, inter, acc,
                                                         diag);
            if (!mvm_reduce<NT * 4>(&acc[0][0][0], red)) continue;
#pragma unroll
            for (int j = 0; j < NT; j++)
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    u32 n = n0 + mvm_feature(i), s = c0 + mvm_row(j, i);
                    if (n < hidden && s < hi)
                        y[(size_t)s * hidden + n] = route_weights[sorted_pairs[s]] * acc[0][j][i];
                }
        }
    }
}

#define MOE_MVM_KERNELS(SUFFIX, W, NT)                                                         \
    extern "C" __global__ void __launch_bounds__(MVM_WARPS * 32)                               \
        moe_grouped_gate_up_mvm_##SUFFIX##_n##NT(                                              \
            const float* x, u32 hidden, u32 top_k, const u32* offsets, const u32* hit_experts, \
            const u32* sorted_pairs, u32 pairs, u32 num_experts, const u64* gate_table,        \
            const u64* up_table, u32 inter, u32 vec, float* act, Diag* diag) {                 \
        begin_kernel();                                                                        \
        grouped_gate_up_mvm_impl<W, NT>(x, hidden, top_k, offsets, hit_experts, sorted_pairs,  \
                                        pairs, num_experts, gate_table, up_table, inter, act,  \
                                        diag);                                                 \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(MVM_WARPS * 32)                               \
        moe_grouped_down_mvm_##SUFFIX##_n##NT(                                                 \
            const float* act, u32 inter, const float* route_weights, const u32* offsets,       \
            const u32* hit_experts, const u32* sorted_pairs, u32 pairs, u32 num_experts,       \
            const u64* down_table, u32 hidden, u32 vec, float* y, Diag* diag) {                \
        begin_kernel();                                                                        \
        grouped_down_mvm_impl<W, NT>(act, inter, route_weights, offsets, hit_experts,          \
                                     sorted_pairs, pairs, num_experts, down_table, hidden, y,  \
                                     diag);                                                    \
    }
MOE_MVM_KERNELS(bf16, bf16w, 1)
MOE_MVM_KERNELS(bf16, bf16w, 4)
MOE_MVM_KERNELS(f16, f16w, 1)
MOE_MVM_KERNELS(f16, f16w, 4)

// Grouped experts for few tokens, streamed (sm_90+; streamed_mvm.cuh): each hit expert's
// weights read once, whatever rows it has. Same arguments as the few-row kernels. Gate/up
// lets down be scheduled at once: down's blocks take SMs as gate/up's leave them and stream
// their first weights while the last gate/up blocks finish.
#define MOE_STREAM_KERNELS(SUFFIX, W)                                                          \
    extern "C" __global__ void __launch_bounds__(STREAM_THREADS, 1)                            \
        moe_stream_gate_up_##SUFFIX(const float* x, u32 hidden, u32 top_k, const u32* offsets, \
                                    const u32* hit_experts, const u32* sorted_pairs, u32 pairs, \
                                    u32 num_experts, const u64* gate_table,                    \
                                    const u64* up_table, u32 inter, u32 vec, float* act,       \
                                    Diag* diag) {                                              \
        begin_small_kernel();                                                                  \
        StreamArgs p{x,          hidden,       inter,   top_k,       nullptr,    offsets,      \
                     hit_experts, sorted_pairs, pairs,  num_experts, gate_table, up_table,     \
                     nullptr,    0,            act,     diag};                                 \
        streamed_mvm_impl<W, STREAM_GATE_UP>(p);                                               \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(STREAM_THREADS, 1)                            \
        moe_stream_down_##SUFFIX(const float* act, u32 inter, const float* route_weights,      \
                                 const u32* offsets, const u32* hit_experts,                   \
                                 const u32* sorted_pairs, u32 pairs, u32 num_experts,          \
                                 const u64* down_table, u32 hidden, u32 vec, float* y,         \
                                 Diag* diag) {                                                 \
        begin_deferred_kernel();                                                               \
        StreamArgs p{act,         inter,        hidden, 0,           route_weights, offsets,   \
                     hit_experts, sorted_pairs, pairs,  num_experts, down_table,    nullptr,   \
                     nullptr,     0,            y,      diag};                                 \
        streamed_mvm_impl<W, STREAM_DOWN>(p);                                                  \
    }
MOE_STREAM_KERNELS(bf16, bf16w)
MOE_STREAM_KERNELS(f16, f16w)

#define MOE_KERNELS(SUFFIX, W)                                                                 \
    extern "C" __global__ void __launch_bounds__(TILE_THREADS) moe_grouped_gate_up_##SUFFIX(   \
        const float* x, u32 hidden, u32 top_k, const u32* offsets, const u32* /*hit_experts*/, \
        const u32* sorted_pairs, u32 pairs, u32 num_experts, const u64* gate_table,            \
        const u64* up_table, u32 inter, u32 vec, float* act, Diag* diag) {                     \
        begin_kernel();                                                                        \
        grouped_gate_up_impl<W>(x, hidden, top_k, offsets, sorted_pairs, pairs, num_experts,   \
                                gate_table, up_table, inter, vec, act, diag);                  \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(TILE_THREADS) moe_grouped_down_##SUFFIX(      \
        const float* act, u32 inter, const float* route_weights, const u32* offsets,           \
        const u32* /*hit_experts*/, const u32* sorted_pairs, u32 pairs, u32 num_experts,       \
        const u64* down_table, u32 hidden, u32 vec, float* y, Diag* diag) {                    \
        begin_kernel();                                                                        \
        grouped_down_impl<W>(act, inter, route_weights, offsets, sorted_pairs, pairs,          \
                             num_experts, down_table, hidden, vec, y, diag);                   \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(256) moe_per_token_gate_up_##SUFFIX(          \
        const float* x, u32 hidden, const u32* ids, u32 top_k, u32 num_experts,                \
        const u64* gate_table, const u64* up_table, u32 inter, u32 vec, float* act,            \
        Diag* diag) {                                                                          \
        begin_kernel();                                                                        \
        per_token_gate_up_impl<W>(x, hidden, ids, top_k, num_experts, gate_table, up_table,    \
                                  inter, vec, act, diag);                                      \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(256, 2) moe_per_token_down_##SUFFIX(          \
        const float* act, u32 inter, const u32* ids, const float* route_weights, u32 top_k,    \
        u32 num_experts, const u64* down_table, u32 hidden, u32 vec, float* out,               \
        Diag* diag) {                                                                          \
        begin_kernel();                                                                        \
        per_token_down_impl<W>(act, inter, ids, route_weights, top_k, num_experts, down_table, \
                               hidden, vec, out, diag);                                        \
    }
MOE_KERNELS(bf16, bf16w)
MOE_KERNELS(f16, f16w)
MOE_KERNELS(f32, float)

// x (bf16 here, or split pairs: a copy the host made), act (bf16 or split pairs) and y: see
// the impls above. The split kernels stage both planes in two stages (three for bf16: the same
// shared memory; three split stages measured no faster and fit one block an SM).
#define MOE_GATE_UP_BIG(NAME, SPLIT, STAGES)                                                   \
    extern "C" __global__ void __launch_bounds__(BT_THREADS, 2) NAME(                          \
        const u16* x, u32 hidden, u32 top_k, const u32* offsets, const u32* /*hit_experts*/,   \
        const u32* sorted_pairs, u32 pairs, u32 num_experts, const u64* gate_table,            \
        const u64* up_table, u32 inter, u32 /*vec*/, u16* act, Diag* diag) {                   \
        begin_kernel();                                                                        \
        grouped_gate_up_big_impl<SPLIT, STAGES>(x, hidden, top_k, offsets, sorted_pairs, pairs, \
                                                num_experts, gate_table, up_table, inter, act,  \
                                                diag);                                          \
    }
MOE_GATE_UP_BIG(moe_grouped_gate_up_big_bf16, false, 3)
MOE_GATE_UP_BIG(moe_grouped_gate_up_big_split, true, 2)
// y in f32 (Y = float) or bf16 (the prefill combine's input, `_y16`).
#define MOE_DOWN_BIG(NAME, SPLIT, STAGES, Y)                                                   \
    extern "C" __global__ void __launch_bounds__(BT_THREADS, 2) NAME(                          \
        const u16* act, u32 inter, const float* route_weights, const u32* offsets,             \
        const u32* /*hit_experts*/, const u32* sorted_pairs, u32 pairs, u32 num_experts,       \
        const u64* down_table, u32 hidden, u32 /*vec*/, Y* y, Diag* diag) {                    \
        begin_kernel();                                                                        \
        grouped_down_big_impl<SPLIT, STAGES, Y>(act, inter, route_weights, offsets,            \
                                                sorted_pairs, pairs, num_experts, down_table,  \
                                                hidden, y, diag);                              \
    }
MOE_DOWN_BIG(moe_grouped_down_big_bf16, false, 3, float)
MOE_DOWN_BIG(moe_grouped_down_big_bf16_y16, false, 3, u16)
MOE_DOWN_BIG(moe_grouped_down_big_split, true, 2, float)

// out = x as split pairs: the high halves at out, the low halves len values on; four values
// a thread (x 16-byte aligned, len % 4 == 0 for the vector path). The split tiles' operand.
extern "C" __global__ void to_bf16_split(const float* x, u64 len, u16* out) {
    begin_small_kernel();
    u64 i = ((u64)blockIdx.x * blockDim.x + threadIdx.x) * 4;
    if (i + 4 <= len && (len & 3) == 0) {
        float4 v = *reinterpret_cast<const float4*>(x + i);
        u32 h0, l0, h1, l1;
        split_bf16x2(v.x, v.y, &h0, &l0);
        split_bf16x2(v.z, v.w, &h1, &l1);
        *reinterpret_cast<uint2*>(out + i) = make_uint2(h0, h1);
        *reinterpret_cast<uint2*>(out + len + i) = make_uint2(l0, l1);
    } else {
        for (u64 e = i; e < min(i + 4, len); e++) split_bf16(x[e], out + e, out + len + e);
    }
}

__device__ __forceinline__ float4 load_y4(const float* p) {
    return *reinterpret_cast<const float4*>(p);
}
__device__ __forceinline__ float4 load_y4(const u16* p) {
    uint2 v = *reinterpret_cast<const uint2*>(p);
    return make_float4(__uint_as_float(v.x << 16), __uint_as_float(v.x & 0xffff0000u),
                       __uint_as_float(v.y << 16), __uint_as_float(v.y & 0xffff0000u));
}
__device__ __forceinline__ float load_y1(const float* p) { return *p; }
__device__ __forceinline__ float load_y1(const u16* p) { return bf16_to_f32(*p); }

// out[t] = sum_j y[pair_positions[t*k + j]], summed in slot order; four features a thread
// when hidden % 4 == 0 (one otherwise). y in f32, or bf16 (`_y16`).
template <typename Y>
__device__ void combine_impl(const Y* y, const u32* pair_positions, u32 tokens, u32 top_k,
                             u32 hidden, u32 pairs, float* out, Diag* diag) {
    u32 per = (hidden & 3u) == 0 ? 4u : 1u;
    u64 i = ((u64)blockIdx.x * blockDim.x + threadIdx.x) * per;
    if (i >= (u64)tokens * hidden) return;
    u32 t = (u32)(i / hidden), d = (u32)(i % hidden);
    float4 total = make_float4(0.f, 0.f, 0.f, 0.f);
    for (u32 j = 0; j < top_k; j++) {
        u32 s = pair_positions[t * top_k + j];
        if (s >= pairs) {
            raise_error(diag, ERR_ROW_INDEX);
            continue;
        }
        const Y* src = y + (size_t)s * hidden + d;
        if (per == 4) {
            float4 v = load_y4(src);
            total.x += v.x;
            total.y += v.y;
            total.z += v.z;
            total.w += v.w;
        } else {
            total.x += load_y1(src);
        }
    }
    if (per == 4) {
        *reinterpret_cast<float4*>(out + i) = total;
    } else {
        out[i] = total.x;
    }
}

#define MOE_COMBINE(NAME, Y)                                                                   \
    extern "C" __global__ void NAME(const Y* y, const u32* pair_positions, u32 tokens,         \
                                    u32 top_k, u32 hidden, u32 pairs, float* out, Diag* diag) { \
        begin_small_kernel();                                                                  \
        combine_impl<Y>(y, pair_positions, tokens, top_k, hidden, pairs, out, diag);           \
    }
MOE_COMBINE(moe_combine, float)
MOE_COMBINE(moe_combine_y16, u16)
