// Paged KV cache: storing this batch's K and V, and causal GQA attention over the cache.
// The cache holds K/V as bf16 (default), f32, or fp8 e4m3 (u8) with an f32 scale per (slot,
// KV head): a slot's row of fp8_row_bytes holds its heads' values, then their scales.
// Scores, softmax and accumulation in f32.

__device__ __forceinline__ void store_kv(u16* p, size_t i, float v) { p[i] = f32_to_bf16(v); }
__device__ __forceinline__ void store_kv(float* p, size_t i, float v) { p[i] = v; }

// One warp stores head `kvh` of a slot's fp8 row at `row` from lane-strided values `get(d)`
// (d < head_dim): the head's largest magnitude maps to 448.
template <typename Get>
__device__ __forceinline__ void store_fp8_head(u8* row, u32 kvh, u32 head_dim, u32 kv_dim,
                                               Get get) {
    u32 lane = threadIdx.x & 31;
    float amax = 0.f;
    for (u32 d = lane; d < head_dim; d += 32) amax = fmaxf(amax, fabsf(get(d)));
    amax = warp_max(amax);
    // Finite, so that no reader multiplies a zero by it into NaN.
    float scale = amax > 0.f && amax < 1e30f ? amax / 448.f : 1.f, inv = 1.f / scale;
    for (u32 d = lane; d < head_dim; d += 32) row[kvh * head_dim + d] = (u8)f32_to_e4m3(get(d) * inv);
    if (lane == 0) *reinterpret_cast<float*>(row + kv_dim + 4 * kvh) = scale;
}

// fp8: a warp per (token, KV head) of K and of V.
__device__ void kv_store_fp8_impl(const float* k, const float* v, const u32* slots, u32 tokens,
                                  u32 kv_heads, u32 head_dim, u64 cache_slots, u8* cache_k,
                                  u8* cache_v, Diag* diag) {
    u32 t = blockIdx.x;
    if (t >= tokens) return;
    u32 slot = slots[t];
    if (slot >= cache_slots) {
        if (threadIdx.x == 0) raise_error(diag, ERR_KV_SLOT);
        return;
    }
    u32 kv_dim = kv_heads * head_dim, warps = blockDim.x >> 5;
    size_t row = (size_t)slot * fp8_row_bytes(kv_heads, head_dim);
    for (u32 i = threadIdx.x >> 5; i < 2 * kv_heads; i += warps) {
        u32 kvh = i % kv_heads;
        const float* src = (i < kv_heads ? k : v) + (size_t)t * kv_dim + kvh * head_dim;
        store_fp8_head(i < kv_heads ? cache_k + row : cache_v + row, kvh, head_dim, kv_dim,
                       [&](u32 d) { return src[d]; });
    }
}

template <typename C>
__device__ void kv_store_impl(const float* k, const float* v, const u32* slots, u32 tokens,
                              u32 kv_dim, u64 cache_slots, C* cache_k, C* cache_v, Diag* diag) {
    u32 t = blockIdx.x;
    if (t >= tokens) return;
    u32 slot = slots[t];
    if (slot >= cache_slots) {
        if (threadIdx.x == 0) raise_error(diag, ERR_KV_SLOT);
        return;
    }
    for (u32 d = threadIdx.x; d < kv_dim; d += blockDim.x) {
        size_t src = (size_t)t * kv_dim + d, dst = (size_t)slot * kv_dim + d;
        store_kv(cache_k, dst, k[src]);
        store_kv(cache_v, dst, v[src]);
    }
}

#define KV_STORE(SUFFIX, C)                                                                   \
    extern "C" __global__ void kv_store_##SUFFIX(const float* k, const float* v,              \
                                                 const u32* slots, u32 tokens, u32 kv_dim,    \
                                                 u64 cache_slots, C* cache_k, C* cache_v,     \
                                                 Diag* diag) {                                \
        begin_small_kernel();                                                                 \
        kv_store_impl<C>(k, v, slots, tokens, kv_dim, cache_slots, cache_k, cache_v, diag);   \
    }
KV_STORE(bf16, u16)
KV_STORE(f32, float)

extern "C" __global__ void kv_store_fp8(const float* k, const float* v, const u32* slots,
                                        u32 tokens, u32 kv_heads, u32 head_dim,
                                        u64 cache_slots, u8* cache_k, u8* cache_v, Diag* diag) {
    begin_small_kernel();
    kv_store_fp8_impl(k, v, slots, tokens, kv_heads, head_dim, cache_slots, cache_k, cache_v,
                      diag);
}

// From a fused q/k/v projection ([tokens, (heads + 2 kv_heads) * head_dim]): a block per
// (token, QKV_WARPS * HPW of its q, k and v heads), HPW heads a warp, one at a time (5 for
// prefill, so that a block takes a whole token and has all its heads' loads in flight at
// once; 1 for a few tokens, where more blocks run in parallel). The block first forms the
// token's rotary (cos, sin) pairs once in shared memory; q and k heads are RMSNorm'd and
// rotated (the head staged in shared memory so that each rotated pair reads both halves); q
// goes to q_out, k and v into the cache at the token's slot. A lane holds dims lane + 32 i,
// i < DIMS (head dims up to 32 DIMS).
#define QKV_WARPS 8
template <typename C, int DIMS, int HPW>
__device__ void qkv_norm_rope_store_impl(const float* qkv, const float* q_weight,
                                         const float* k_weight, const u32* positions,
                                         const u32* slots, u32 tokens, u32 heads, u32 kv_heads,
                                         u32 head_dim, u32 rotary_dim, float theta,
                                         float yarn_factor, float ramp_low, float ramp_width,
                                         float attention_factor, float eps, u64 cache_slots,
                                         float* q_out, C* cache_k, C* cache_v, Diag* diag) {
    __shared__ float staged[QKV_WARPS][32 * DIMS];
    __shared__ float2 rotation[16 * DIMS];  // (cos, sin) of pair p: rotary_dim / 2 <= 16 DIMS
    u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u32 t = blockIdx.x, h0 = blockIdx.y * QKV_WARPS * HPW + warp;
    u32 per_token = heads + 2 * kv_heads;
    if (t >= tokens) return;
    u32 kv_dim = kv_heads * head_dim, row_stride = kv_row_stride<C>(kv_heads, head_dim);
    // Every head's values in flight first, so that the angles are formed meanwhile.
    float vals[HPW][DIMS];
#pragma unroll
    for (int j = 0; j < HPW; j++) {
        u32 h = h0 + QKV_WARPS * j;
        const float* src = qkv + ((size_t)t * per_token + (h < per_token ? h : 0)) * head_dim;
#pragma unroll
        for (int i = 0; i < DIMS; i++) {
            u32 d = lane + 32 * i;
            vals[j][i] = h < per_token && d < head_dim ? src[d] : 0.f;
        }
    }
    // The cache slot, where this warp has a k or v head.
    bool slot_ok = false;
    u32 slot = 0;
    if (h0 + QKV_WARPS * (HPW - 1) >= heads && h0 < per_token) {
        slot = slots[t];
        slot_ok = slot < cache_slots;
        if (!slot_ok && lane == 0) raise_error(diag, ERR_KV_SLOT);
    }
    u32 half = rotary_dim / 2;
    if (blockIdx.y * QKV_WARPS * HPW < heads + kv_heads) {
        float pos = (float)positions[t];
        for (u32 p = threadIdx.x; p < half; p += blockDim.x) {
            float inv_freq =
                rope_inv_freq(p, rotary_dim, theta, yarn_factor, ramp_low, ramp_width);
            float s, c;
            sincosf(pos * inv_freq, &s, &c);
            rotation[p] = make_float2(c * attention_factor, s * attention_factor);
        }
    }
    __syncthreads();  // the angles
    float* row = staged[warp];
#pragma unroll
    for (int j = 0; j < HPW; j++) {
        u32 h = h0 + QKV_WARPS * j;
        bool is_q = h < heads, is_v = h >= heads + kv_heads;
        if (h >= per_token || (!is_q && !slot_ok)) continue;
        if (is_v) {
            u32 kvh = h - heads - kv_heads;
            if constexpr (sizeof(C) == 1) {
                float amax = 0.f;
#pragma unroll
                for (int i = 0; i < DIMS; i++) amax = fmaxf(amax, fabsf(vals[j][i]));
                amax = warp_max(amax);
                float scale = amax > 0.f && amax < 1e30f ? amax / 448.f : 1.f, inv = 1.f / scale;
                u8* dst = reinterpret_cast<u8*>(cache_v) + (size_t)slot * row_stride;
#pragma unroll
                for (int i = 0; i < DIMS; i++) {
                    u32 d = lane + 32 * i;
                    if (d < head_dim) dst[kvh * head_dim + d] = (u8)f32_to_e4m3(vals[j][i] * inv);
                }
                if (lane == 0) *reinterpret_cast<float*>(dst + kv_dim + 4 * kvh) = scale;
            } else {
                size_t dst = (size_t)slot * row_stride + (size_t)kvh * head_dim;
#pragma unroll
                for (int i = 0; i < DIMS; i++) {
                    u32 d = lane + 32 * i;
                    if (d < head_dim) store_kv(cache_v, dst + d, vals[j][i]);
                }
            }
            continue;
        }
        const float* w = is_q ? q_weight : k_weight;
        float ss = 0.f;
#pragma unroll
        for (int i = 0; i < DIMS; i++) ss += vals[j][i] * vals[j][i];
        ss = warp_sum(ss);
        float inv = rsqrtf(ss / (float)head_dim + eps);
        __syncwarp();  // the previous head's reads of the staged row are done
#pragma unroll
        for (int i = 0; i < DIMS; i++) {
            u32 d = lane + 32 * i;
            if (d < head_dim) row[d] = vals[j][i] * inv * w[d];
        }
        __syncwarp();
        float* q_dst = q_out + ((size_t)t * heads + h) * head_dim;
        size_t k_dst = (size_t)slot * row_stride + (size_t)(h - heads) * head_dim;
        // An fp8 k head is rotated in place in the staged row, then scaled and stored whole.
        bool k_fp8 = sizeof(C) == 1 && !is_q;
        auto emit = [&](u32 d, float v) {
            if (is_q)
                q_dst[d] = v;
            else if constexpr (sizeof(C) == 1)
                row[d] = v;
            else
                store_kv(cache_k, k_dst + d, v);
        };
        // Each lane rotates whole pairs (d, d + half).
        for (u32 p = lane; p < half; p += 32) {
            float2 cs = rotation[p];
            float a = row[p], b = row[p + half];
            emit(p, a * cs.x - b * cs.y);
            emit(p + half, b * cs.x + a * cs.y);
        }
        if (!k_fp8)
            for (u32 d = rotary_dim + lane; d < head_dim; d += 32) emit(d, row[d]);
        if constexpr (sizeof(C) == 1) {
            if (k_fp8) {
                __syncwarp();
                store_fp8_head(reinterpret_cast<u8*>(cache_k) + (size_t)slot * row_stride,
                               h - heads, head_dim, kv_dim, [&](u32 d) { return row[d]; });
            }
        }
    }
}

#define QKV_NORM_ROPE_STORE(SUFFIX, C, DIMS, HPW)                                             \
    extern "C" __global__ void __launch_bounds__(QKV_WARPS * 32)                              \
        qkv_norm_rope_store_##SUFFIX##_d##DIMS##_h##HPW(                                      \
            const float* qkv, const float* q_weight, const float* k_weight,                   \
            const u32* positions, const u32* slots, u32 tokens, u32 heads, u32 kv_heads,      \
            u32 head_dim, u32 rotary_dim, float theta, float yarn_factor, float ramp_low,     \
            float ramp_width, float attention_factor, float eps, u64 cache_slots,             \
            float* q_out, C* cache_k, C* cache_v, Diag* diag) {                               \
        begin_small_kernel();                                                                 \
        qkv_norm_rope_store_impl<C, DIMS, HPW>(                                               \
            qkv, q_weight, k_weight, positions, slots, tokens, heads, kv_heads, head_dim,     \
            rotary_dim, theta, yarn_factor, ramp_low, ramp_width, attention_factor, eps,      \
            cache_slots, q_out, cache_k, cache_v, diag);                                      \
    }
QKV_NORM_ROPE_STORE(bf16, u16, 4, 1)
QKV_NORM_ROPE_STORE(bf16, u16, 4, 5)
QKV_NORM_ROPE_STORE(bf16, u16, 16, 1)
QKV_NORM_ROPE_STORE(bf16, u16, 16, 5)
QKV_NORM_ROPE_STORE(f32, float, 4, 1)
QKV_NORM_ROPE_STORE(f32, float, 4, 5)
QKV_NORM_ROPE_STORE(f32, float, 16, 1)
QKV_NORM_ROPE_STORE(f32, float, 16, 5)
QKV_NORM_ROPE_STORE(fp8, u8, 4, 1)
QKV_NORM_ROPE_STORE(fp8, u8, 4, 5)
QKV_NORM_ROPE_STORE(fp8, u8, 16, 1)
QKV_NORM_ROPE_STORE(fp8, u8, 16, 5)

#define ATTN_WARPS 4         // warps of a block, taking alternate chunks of its keys
#define ATTN_MAX_SPLITS 64   // splits of the keys that the last block merges
#define ATTN_HEAD_SLOTS 1024 // floats per warp for merging its heads' outputs (8 x 128)

// Lane `lane`'s D consecutive dims of a cached row, as f32.
template <int D, typename C>
__device__ __forceinline__ void load_lane_dims(const C* row, u32 d0, u32 head_dim, bool vec,
                                               float* out) {
    if (vec) {
        if (D == 1) {
            out[0] = load_kv(row, d0);
        } else if (sizeof(C) == 2 && D == 2) {
            u32 v = *reinterpret_cast<const u32*>(row + d0);
            out[0] = __uint_as_float(v << 16);
            out[1] = __uint_as_float(v & 0xffff0000u);
        } else if (sizeof(C) == 2 && D == 4) {
            uint2 v = *reinterpret_cast<const uint2*>(row + d0);
            out[0] = __uint_as_float(v.x << 16);
            out[1] = __uint_as_float(v.x & 0xffff0000u);
            out[2] = __uint_as_float(v.y << 16);
            out[3] = __uint_as_float(v.y & 0xffff0000u);
        } else if (sizeof(C) == 2 && D % 8 == 0) {
#pragma unroll
            for (int i = 0; i < D; i += 8)
                load_w8(reinterpret_cast<const bf16w*>(row) + d0 + i, out + i);
        } else {
#pragma unroll
            for (int i = 0; i < D; i++) out[i] = load_kv(row, d0 + i);
        }
    } else {
#pragma unroll
        for (int i = 0; i < D; i++) out[i] = d0 + i < head_dim ? load_kv(row, d0 + i) : 0.f;
    }
}

// Query heads of a group handled per pass over the keys (their q and output in registers).
template <int D> struct AttnHeads { static const int value = D <= 4 ? 8 : (D == 8 ? 4 : 2); };
// Keys a warp scores per step, their K and V rows loaded together.
template <int D> struct AttnKeys { static const int value = D <= 4 ? 8 : 4; };

// Merges online-softmax states: (m, l, o) absorbs (m2, l2, o2).
__device__ __forceinline__ float merge_scale(float& m, float& l, float m2, float l2,
                                             float* f_self) {
    float m_new = fmaxf(m, m2);
    float a = m == NEG_INF ? 0.f : expf(m - m_new), b = m2 == NEG_INF ? 0.f : expf(m2 - m_new);
    l = l * a + l2 * b;
    m = m_new;
    *f_self = a;
    return b;
}

#define ATTN_MERGE_SLOTS 1024  // (head, split) pairs that one merge holds: heads × splits

// The splits of a (token, KV head) that hold keys: split_keys each over the run's len keys.
__device__ __forceinline__ u32 active_splits(u32 len, u32 split_keys, u32 splits) {
    return min(splits, max(1u, (len + split_keys - 1) / split_keys));
}

// A decode-attention block's keys: split `split` of token t's run, [begin, end) of its
// `active` splits that hold keys, through the run's block table. False for a split past the
// run's keys (the grid is sized for the widest table): the block has nothing to do. A run or
// position beyond the tables raises the flag (once, from split 0) and is clamped.
__device__ __forceinline__ bool split_keys_of(const u32* positions, const u32* token_runs,
                                              u32 runs, const u32* block_tables, u32 max_blocks,
                                              u32 block_size, u32 t, u32 split, u32 split_keys,
                                              u32 splits, Diag* diag, const u32** table,
                                              u32* begin, u32* end, u32* active) {
    u32 run = token_runs[t];
    if (run >= runs) {
        if (threadIdx.x == 0 && split == 0) raise_error(diag, ERR_BLOCK_TABLE);
        run = 0;
    }
    u32 len = positions[t] + 1;
    if (len > max_blocks * block_size) {
        if (threadIdx.x == 0 && split == 0) raise_error(diag, ERR_POSITION);
        len = max_blocks * block_size;
    }
    *active = active_splits(len, split_keys, splits);
    if (split >= *active) return false;
    *begin = split * split_keys;
    *end = min(len, *begin + split_keys);
    *table = block_tables + (size_t)run * max_blocks;
    return true;
}

// The last of a (token, KV head)'s `active` splits to finish (a ticket per block row in
// `counters`, reset by that block) merges them for all the group's heads at once: the
// splits' (max, sum) pairs are read in one pass, each head's weights e^(m_s - m) are formed
// in shared memory, then each thread sums its (head, dim) outputs over the splits:
// out = Σ_s e^(m_s - m) o_s / Σ_s e^(m_s - m) l_s. Partial states are laid out `splits` to a
// head. Block-wide: every thread calls it; group × active <= ATTN_MERGE_SLOTS (the host
// caps the splits).
__device__ void merge_splits(const float* partial, u32* counters, u32 t, u32 kvh, u32 group,
                             u32 num_heads, u32 head_dim, u32 splits, u32 active, float* out) {
    __shared__ float2 ml[ATTN_MERGE_SLOTS];  // (max, sum), then (weight, sum)
    __shared__ u32 is_last;
    u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) is_last = atomicAdd(&counters[blockIdx.x], 1u) == active - 1;
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    size_t item0 = (size_t)t * num_heads + kvh * group;
    u32 stride = head_dim + 2;
    for (u32 i = threadIdx.x; i < group * active; i += blockDim.x) {
        u32 h = i / active, sp = i % active;
        const float* ps = partial + ((item0 + h) * splits + sp) * stride;
        ml[i] = make_float2(__ldcg(ps), __ldcg(ps + 1));
    }
    __syncthreads();
    for (u32 h = warp; h < group; h += warps) {
        float m_all = NEG_INF;
        for (u32 sp = lane; sp < active; sp += 32) {
            float2 v = ml[h * active + sp];
            if (v.y > 0.f) m_all = fmaxf(m_all, v.x);
        }
        m_all = warp_max(m_all);
        __syncwarp();
        for (u32 sp = lane; sp < active; sp += 32) {
            float2 v = ml[h * active + sp];
            ml[h * active + sp].x = v.y > 0.f ? expf(v.x - m_all) : 0.f;
        }
    }
    __syncthreads();
    // MERGE_OUTPUTS (head, dim) outputs a thread, MERGE_SPLITS splits' reads of each in
    // flight at once: a few trips to the L2 rather than one per output and split.
    const int MERGE_OUTPUTS = 8, MERGE_SPLITS = 4;
    u32 total = group * head_dim;
    for (u32 base = 0; base < total; base += MERGE_OUTPUTS * blockDim.x) {
        const float* p[MERGE_OUTPUTS];
        const float2* w[MERGE_OUTPUTS];
        float o[MERGE_OUTPUTS], l[MERGE_OUTPUTS];
#pragma unroll
        for (int r = 0; r < MERGE_OUTPUTS; r++) {
            u32 idx = min(base + r * blockDim.x + threadIdx.x, total - 1);
            u32 h = idx / head_dim, d = idx % head_dim;
            p[r] = partial + (item0 + h) * splits * stride + 2 + d;
            w[r] = ml + h * active;
            o[r] = l[r] = 0.f;
        }
        for (u32 sp0 = 0; sp0 < active; sp0 += MERGE_SPLITS) {
            float v[MERGE_SPLITS][MERGE_OUTPUTS];
#pragma unroll
            for (int s = 0; s < MERGE_SPLITS; s++)
#pragma unroll
                for (int r = 0; r < MERGE_OUTPUTS; r++)
                    v[s][r] = sp0 + s < active ? __ldcg(p[r] + (size_t)(sp0 + s) * stride) : 0.f;
#pragma unroll
            for (int s = 0; s < MERGE_SPLITS; s++)
#pragma unroll
                for (int r = 0; r < MERGE_OUTPUTS; r++) {
                    if (sp0 + s < active) {
                        float2 ws = w[r][sp0 + s];
                        o[r] += ws.x * v[s][r];
                        l[r] += ws.x * ws.y;
                    }
                }
        }
#pragma unroll
        for (int r = 0; r < MERGE_OUTPUTS; r++) {
            u32 idx = base + r * blockDim.x + threadIdx.x;
            if (idx < total) out[item0 * head_dim + idx] = o[r] / l[r];
        }
    }
    if (threadIdx.x == 0) counters[blockIdx.x] = 0;
}

// Decode-shaped attention on CUDA cores (an f32 cache, groups of more than 8 heads, other
// head dims): one block per (token, KV head, split of the keys). Each warp
// takes alternate chunks of the split's keys for up to AttnHeads query heads of the group at
// once (more heads: more passes), so each K and V row is read once per pass; its lanes hold
// D dims each of q and of the output and load a chunk's K and V rows together, with the next
// chunk's block-table entries already fetched. The block's warps then merge their softmax
// states in shared memory. With one split the block writes the normalised output; with
// several, each writes (max, sum, unnormalised output) to `partial`, and the last of a
// (token, KV head)'s splits to finish merges them (merge_splits).
// Keys 0..=position of the token's run, through its block table.
template <typename C, int D>
__device__ void paged_attention_impl(const float* q, const C* cache_k, const C* cache_v,
                                     const u32* positions, const u32* token_runs, u32 runs,
                                     const u32* block_tables, u32 max_blocks, u32 block_size,
                                     u32 num_blocks, u32 tokens, u32 num_heads, u32 num_kv_heads,
                                     u32 head_dim, float scale, u32 split_keys, float* partial,
                                     u32* counters, float* out, Diag* diag) {
    const int HG = AttnHeads<D>::value, KEYS = AttnKeys<D>::value;
    __shared__ float merge_o[ATTN_WARPS][ATTN_HEAD_SLOTS];
    __shared__ float merge_ml[ATTN_WARPS][2][8];
    u32 t = blockIdx.x / num_kv_heads, kvh = blockIdx.x % num_kv_heads;
    u32 split = blockIdx.y, splits = gridDim.y;
    if (t >= tokens) return;
    u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u32 group = num_heads / num_kv_heads;
    u32 kv_dim = num_kv_heads * head_dim, row_stride = kv_row_stride<C>(num_kv_heads, head_dim);
    u32 d0 = lane * D;
    bool vec = head_dim == 32 * D;
    u32 begin, end, active;
    const u32* table;
    if (!split_keys_of(positions, token_runs, runs, block_tables, max_blocks, block_size, t,
                       split, split_keys, splits, diag, &table, &begin, &end, &active))
        return;
    const u32 stride = ATTN_WARPS * KEYS;
    for (u32 h0 = 0; h0 < group; h0 += HG) {
        u32 heads = min((u32)HG, group - h0);
        float qv[HG][D], acc[HG][D], m[HG], l[HG];
#pragma unroll
        for (int h = 0; h < HG; h++) {
            const float* qh = q + ((size_t)t * num_heads + kvh * group + h0 + h) * head_dim;
#pragma unroll
            for (int i = 0; i < D; i++) {
                qv[h][i] = h < heads && d0 + i < head_dim ? qh[d0 + i] * scale : 0.f;
                acc[h][i] = 0.f;
            }
            m[h] = NEG_INF;
            l[h] = 0.f;
        }
        // Row offsets of this warp's next chunk of keys (clamped to the last key).
        size_t rows[KEYS];
        auto fetch_rows = [&](u32 j0) {
#pragma unroll
            for (int jj = 0; jj < KEYS; jj++) {
                u32 j = min(j0 + jj, end > 0 ? end - 1 : 0);
                rows[jj] = slot_of(table, j, block_size, num_blocks, diag) * row_stride;
            }
        };
        u32 j0 = begin + warp * KEYS;
        if (j0 < end) fetch_rows(j0);
        for (; j0 < end; j0 += stride) {
            float kr[KEYS][D], vr[KEYS][D], ks[KEYS], vs[KEYS];
#pragma unroll
            for (int jj = 0; jj < KEYS; jj++) {
                size_t head = rows[jj] + (size_t)kvh * head_dim;
                load_lane_dims<D>(cache_k + head, d0, head_dim, vec, kr[jj]);
                load_lane_dims<D>(cache_v + head, d0, head_dim, vec, vr[jj]);
                ks[jj] = kv_scale(cache_k + rows[jj], kvh, kv_dim);
                vs[jj] = kv_scale(cache_v + rows[jj], kvh, kv_dim);
            }
            if (j0 + stride < end) fetch_rows(j0 + stride);
#pragma unroll
            for (int h = 0; h < HG; h++) {
                if (h >= heads) break;
                float s[KEYS];
                float chunk_max = NEG_INF;
#pragma unroll
                for (int jj = 0; jj < KEYS; jj++) {
                    float dot = 0.f;
#pragma unroll
                    for (int i = 0; i < D; i++) dot += qv[h][i] * kr[jj][i];
                    s[jj] = warp_sum(dot) * ks[jj];
                    if (j0 + jj >= end) s[jj] = NEG_INF;
                    chunk_max = fmaxf(chunk_max, s[jj]);
                }
                float m_new = fmaxf(m[h], chunk_max);
                float correction = expf(m[h] - m_new);  // 0 while m is -inf
                l[h] *= correction;
#pragma unroll
                for (int i = 0; i < D; i++) acc[h][i] *= correction;
#pragma unroll
                for (int jj = 0; jj < KEYS; jj++) {
                    float p = expf(s[jj] - m_new);  // 0 past the end
                    l[h] += p;
                    float pv = p * vs[jj];
#pragma unroll
                    for (int i = 0; i < D; i++) acc[h][i] += pv * vr[jj][i];
                }
                m[h] = m_new;
            }
        }
        // Merge the warps' states for these heads: each warp publishes, warp w merges head w.
        __syncthreads();
#pragma unroll
        for (int h = 0; h < HG; h++) {
            if (lane == 0) {
                merge_ml[warp][0][h] = m[h];
                merge_ml[warp][1][h] = l[h];
            }
#pragma unroll
            for (int i = 0; i < D; i++)
                if (d0 + i < head_dim) merge_o[warp][h * head_dim + d0 + i] = acc[h][i];
        }
        __syncthreads();
        for (u32 h = warp; h < heads; h += ATTN_WARPS) {
            float mm = NEG_INF, ll = 0.f, o[D];
#pragma unroll
            for (int i = 0; i < D; i++) o[i] = 0.f;
            for (int w = 0; w < ATTN_WARPS; w++) {
                float a;
                float b = merge_scale(mm, ll, merge_ml[w][0][h], merge_ml[w][1][h], &a);
#pragma unroll
                for (int i = 0; i < D; i++)
                    o[i] = o[i] * a + (d0 + i < head_dim ? merge_o[w][h * head_dim + d0 + i] * b : 0.f);
            }
            u32 item = t * num_heads + kvh * group + h0 + h;
            if (active > 1) {
                float* part = partial + ((size_t)item * splits + split) * (head_dim + 2);
                if (lane == 0) {
                    part[0] = mm;
                    part[1] = ll;
                }
#pragma unroll
                for (int i = 0; i < D; i++)
                    if (d0 + i < head_dim) part[2 + d0 + i] = o[i];
            } else {
#pragma unroll
                for (int i = 0; i < D; i++)
                    if (d0 + i < head_dim) out[(size_t)item * head_dim + d0 + i] = o[i] / ll;
            }
        }
    }
    if (active > 1)
        merge_splits(partial, counters, t, kvh, group, num_heads, head_dim, splits, active, out);
}

// mma.sync m16n8k16 (bf16, or f16 for an fp8 cache's values, exact in f16; f32
// accumulation) whose A rows 8-15 are zero: only the accumulators of rows 0-7 (c0, c1: row g,
// columns 2 tq and 2 tq + 1) are kept.
template <bool F16>
__device__ __forceinline__ void mma_rows_lo(float& c0, float& c1, u32 a0, u32 a2, u32 b0, u32 b1) {
    float d2, d3;
    if constexpr (F16)
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%10,%11,%12,%13};"
            : "=f"(c0), "=f"(c1), "=f"(d2), "=f"(d3)
            : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1), "f"(c0), "f"(c1), "f"(0.f),
              "f"(0.f));
    else
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%10,%11,%12,%13};"
            : "=f"(c0), "=f"(c1), "=f"(d2), "=f"(d3)
            : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1), "f"(c0), "f"(c1), "f"(0.f),
              "f"(0.f));
}

__device__ __forceinline__ uint4 load16(const u16* p) { return *reinterpret_cast<const uint4*>(p); }
// Eight fp8 values as the eight f16 (times 2^-8) that load16 gives of eight bf16.
__device__ __forceinline__ uint4 load16(const u8* p) {
    uint2 w = *reinterpret_cast<const uint2*>(p);
    return make_uint4(e4m3x2_as_f16x2(w.x, 0x1404u), e4m3x2_as_f16x2(w.x, 0x3424u),
                      e4m3x2_as_f16x2(w.y, 0x1404u), e4m3x2_as_f16x2(w.y, 0x3424u));
}

__device__ __forceinline__ u32 word(uint4 v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

#define DECODE_MMA_MAX_GROUP 8  // query heads per KV head that fit the m16 tile's rows 0-7

// Decode-shaped attention on tensor cores over the bf16 (or fp8) cache, for groups of at most 8
// query heads; grid, splits and merging as paged_attention. The group's heads are rows 0-7
// of an m16 tile and each warp takes alternate chunks of 16 keys: S = Q·Kᵀ, the online
// softmax in base 2 (q pre-scaled by log2 e), O += P·V, with S's accumulators as the A
// operand of P·V. Both B operands come straight from global memory. For S, lane (g, tq)
// loads 8 consecutive dims of key g with one 16-byte load and uses them as two k16 steps
// (the k index mapped onto memory that way, q packed through the same map). For P·V, n is
// the head dim, mapped so that lane g loads dims 64 c + 8 g .. + 8 of each of its 4 keys
// (2 tq, 2 tq + 1, 2 tq + 8, 2 tq + 9); byte permutes pair two keys' values per register.
// The kernel begins deferred: the block tables, and with `one_token_runs` (every run of the
// batch one token, so that only a token's own key is this step's) a warp's first chunk of
// keys when it ends before the token's own, are read before it waits for the kernel before.
// Over an fp8 cache (C = u8) the operands are f16 (e4m3 values are exact in f16, times
// 2^-8): each key's K scale multiplies its scores and its V scale its probabilities, both
// with the 2^8 back.
template <int HD, typename C>
__device__ void decode_attention_mma_impl(
    const float* q, const C* cache_k, const C* cache_v, const u32* positions,
    const u32* token_runs, u32 runs, const u32* block_tables, u32 max_blocks, u32 block_size,
    u32 num_blocks, u32 tokens, u32 num_heads, u32 num_kv_heads, float scale, u32 split_keys,
    u32 one_token_runs, float* partial, u32* counters, float* out, Diag* diag) {
    const int KC = HD / 32;  // 16-byte pieces of a K row per lane, two k16 steps each
    const int VC = HD / 64;  // 16-byte pieces of a V row per lane, eight n8 tiles each
    const int DT = HD / 8;   // n8 tiles of the output
    // Rows padded by a float: a store's lanes (8 heads, 4 column groups) meet 2 to a bank,
    // not 16.
    __shared__ float merge_o[ATTN_WARPS][DECODE_MMA_MAX_GROUP][HD + 1];
    __shared__ float merge_ml[ATTN_WARPS][2][DECODE_MMA_MAX_GROUP];
    __shared__ float head_f[DECODE_MMA_MAX_GROUP][ATTN_WARPS];
    __shared__ float head_m[DECODE_MMA_MAX_GROUP], head_l[DECODE_MMA_MAX_GROUP];
    u32 t = blockIdx.x / num_kv_heads, kvh = blockIdx.x % num_kv_heads;
    u32 split = blockIdx.y, splits = gridDim.y;
    if (t >= tokens) return;
    u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
    u32 group = num_heads / num_kv_heads;
    u32 kv_dim = num_kv_heads * HD, row_stride = kv_row_stride<C>(num_kv_heads, HD);
    constexpr bool FP8 = sizeof(C) == 1;
    // From a head's values to its scale in an fp8 row.
    size_t to_scale = (size_t)kv_dim + 4 * kvh - (size_t)kvh * HD;
    u32 begin, end, active;
    const u32* table;
    if (!split_keys_of(positions, token_runs, runs, block_tables, max_blocks, block_size, t,
                       split, split_keys, splits, diag, &table, &begin, &end, &active))
        return;
    // Keys past the end read the last key's row (their scores are masked; their rows must
    // still be finite). A chunk starts at a multiple of 16 keys, so with blocks of a multiple
    // of 16 keys its keys share one block-table entry.
    bool chunk_in_one_block = block_size % 16 == 0;
    u32 chunk_row0 = 0;  // cache row of the current chunk's first key (one-block chunks)
    auto key_row = [&](u32 j0, u32 j) -> size_t {
        j = min(j, end - 1);
        if (chunk_in_one_block)
            return ((size_t)chunk_row0 + (j - j0)) * row_stride + (size_t)kvh * HD;
        return slot_of(table, j, block_size, num_blocks, diag) * row_stride + (size_t)kvh * HD;
    };
    float o[DT][2];
#pragma unroll
    for (int dt = 0; dt < DT; dt++) o[dt][0] = o[dt][1] = 0.f;
    float m = NEG_INF, l = 0.f;  // row g, base 2; l sums this lane's columns only
    // This lane's cache rows of a chunk: K of keys g and 8 + g, V of its four keys.
    size_t rk[2], rv[4];
    auto fetch_rows = [&](u32 j0) {
        if (chunk_in_one_block) {
            chunk_row0 = (u32)slot_of(table, j0, block_size, num_blocks, diag);
        }
        rk[0] = key_row(j0, j0 + g);
        rk[1] = key_row(j0, j0 + 8 + g);
        rv[0] = key_row(j0, j0 + 2 * tq);
        rv[1] = key_row(j0, j0 + 2 * tq + 1);
        rv[2] = key_row(j0, j0 + 8 + 2 * tq);
        rv[3] = key_row(j0, j0 + 9 + 2 * tq);
    };
    const u32 stride = ATTN_WARPS * 16;
    u32 j0 = begin + warp * 16;
    uint4 k0[KC], k1[KC], v[4][VC];
    float ks[4], vs[4];  // fp8: the scales (times 2^8) of this lane's S columns' keys
    auto load_chunk = [&]() {
        if constexpr (FP8) {
#pragma unroll
            for (int kk = 0; kk < 4; kk++) {
                ks[kk] = 256.f * *reinterpret_cast<const float*>(cache_k + rv[kk] + to_scale);
                vs[kk] = 256.f * *reinterpret_cast<const float*>(cache_v + rv[kk] + to_scale);
            }
        }
#pragma unroll
        for (int c = 0; c < KC; c++) {
            k0[c] = load16(cache_k + rk[0] + 32 * c + 8 * tq);
            k1[c] = load16(cache_k + rk[1] + 32 * c + 8 * tq);
        }
#pragma unroll
        for (int kk = 0; kk < 4; kk++)
#pragma unroll
            for (int c = 0; c < VC; c++) v[kk][c] = load16(cache_v + rv[kk] + 64 * c + 8 * g);
    };
    // The first chunk in flight before the wait when all its rows are earlier steps' (keys
    // past the end read the last key's row, so the chunk must end before the token's own).
    bool loaded = false;
    if (j0 < end) {
        fetch_rows(j0);
        if (one_token_runs && min(j0 + 15, end - 1) < positions[t]) {
            load_chunk();
            loaded = true;
        }
    }
    wait_for_previous_kernel();
    release_dependents();
    // Q row g (head g of the group; zero past it), pre-scaled, packed through the k map.
    u32 qa[KC][4];
    {
        bool ok = g < group;
        const float* qh = q + ((size_t)t * num_heads + kvh * group + (ok ? g : 0)) * HD;
        float f = scale * 1.4426950408889634f;
#pragma unroll
        for (int c = 0; c < KC; c++) {
            float4 a = make_float4(0.f, 0.f, 0.f, 0.f), b = a;
            if (ok) {
                a = *reinterpret_cast<const float4*>(qh + 32 * c + 8 * tq);
                b = *reinterpret_cast<const float4*>(qh + 32 * c + 8 * tq + 4);
            }
            qa[c][0] = pack2<FP8>(a.x * f, a.y * f);
            qa[c][1] = pack2<FP8>(a.z * f, a.w * f);
            qa[c][2] = pack2<FP8>(b.x * f, b.y * f);
            qa[c][3] = pack2<FP8>(b.z * f, b.w * f);
        }
    }
    for (; j0 < end; j0 += stride) {
        if (!loaded) load_chunk();
        loaded = false;
        // The next chunk's block-table entries, while this chunk's rows are in flight.
        if (j0 + stride < end) fetch_rows(j0 + stride);
        // S for keys j0 + 2 tq, + 1 (s[0]) and j0 + 8 + 2 tq, + 1 (s[1]).
        float s[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
#pragma unroll
        for (int c = 0; c < KC; c++) {
            mma_rows_lo<FP8>(s[0][0], s[0][1], qa[c][0], qa[c][1], k0[c].x, k0[c].y);
            mma_rows_lo<FP8>(s[1][0], s[1][1], qa[c][0], qa[c][1], k1[c].x, k1[c].y);
            mma_rows_lo<FP8>(s[0][0], s[0][1], qa[c][2], qa[c][3], k0[c].z, k0[c].w);
            mma_rows_lo<FP8>(s[1][0], s[1][1], qa[c][2], qa[c][3], k1[c].z, k1[c].w);
        }
        if constexpr (FP8) {
#pragma unroll
            for (int h = 0; h < 2; h++)
#pragma unroll
                for (int c = 0; c < 2; c++) s[h][c] *= ks[2 * h + c];
        }
        float mx = NEG_INF;
#pragma unroll
        for (int h = 0; h < 2; h++)
#pragma unroll
            for (int c = 0; c < 2; c++) {
                if (j0 + 8 * h + 2 * tq + c >= end) s[h][c] = NEG_INF;
                mx = fmaxf(mx, s[h][c]);
            }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        float m_new = fmaxf(m, mx);  // finite: key j0 is in range
        float corr = exp2f(m - m_new);
        l *= corr;
#pragma unroll
        for (int dt = 0; dt < DT; dt++) {
            o[dt][0] *= corr;
            o[dt][1] *= corr;
        }
#pragma unroll
        for (int h = 0; h < 2; h++)
#pragma unroll
            for (int c = 0; c < 2; c++) {
                s[h][c] = exp2f(s[h][c] - m_new);
                l += s[h][c];
            }
        m = m_new;
        u32 pa0, pa2;
        if constexpr (FP8) {
            pa0 = pack_f16(s[0][0] * vs[0], s[0][1] * vs[1]);
            pa2 = pack_f16(s[1][0] * vs[2], s[1][1] * vs[3]);
        } else {
            pa0 = pack_bf16(s[0][0], s[0][1]);
            pa2 = pack_bf16(s[1][0], s[1][1]);
        }
#pragma unroll
        for (int c = 0; c < VC; c++)
#pragma unroll
            for (int i = 0; i < 8; i++) {
                u32 sel = (i & 1) ? 0x7632u : 0x5410u;
                u32 b0 = __byte_perm(word(v[0][c], i >> 1), word(v[1][c], i >> 1), sel);
                u32 b1 = __byte_perm(word(v[2][c], i >> 1), word(v[3][c], i >> 1), sel);
                mma_rows_lo<FP8>(o[8 * c + i][0], o[8 * c + i][1], pa0, pa2, b0, b1);
            }
    }
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    // Merge the warps: o[8 c + i][e] is head g's dim 64 c + 16 tq + 8 e + i.
    if (g < group) {
        if (tq == 0) {
            merge_ml[warp][0][g] = m;
            merge_ml[warp][1][g] = l;
        }
#pragma unroll
        for (int c = 0; c < VC; c++)
#pragma unroll
            for (int i = 0; i < 8; i++)
#pragma unroll
                for (int e = 0; e < 2; e++)
                    merge_o[warp][g][64 * c + 16 * tq + 8 * e + i] = o[8 * c + i][e];
    }
    __syncthreads();
    // Each head's weight per warp, e^(m_w - m), and merged sum, once per head.
    if (threadIdx.x < group) {
        u32 h = threadIdx.x;
        float m_all = NEG_INF;
#pragma unroll
        for (int w = 0; w < ATTN_WARPS; w++)
            if (merge_ml[w][1][h] > 0.f) m_all = fmaxf(m_all, merge_ml[w][0][h]);
        float l_all = 0.f;
#pragma unroll
        for (int w = 0; w < ATTN_WARPS; w++) {
            float lw = merge_ml[w][1][h];
            float f = lw > 0.f ? exp2f(merge_ml[w][0][h] - m_all) : 0.f;
            head_f[h][w] = f;
            l_all += f * lw;
        }
        head_m[h] = m_all;
        head_l[h] = l_all;
    }
    __syncthreads();
    for (u32 idx = threadIdx.x; idx < group * HD; idx += blockDim.x) {
        u32 h = idx / HD, d = idx % HD;
        float acc = 0.f;
#pragma unroll
        for (int w = 0; w < ATTN_WARPS; w++) acc += head_f[h][w] * merge_o[w][h][d];
        float m_all = head_m[h], l_all = head_l[h];
        size_t item = (size_t)t * num_heads + kvh * group + h;
        if (active == 1) {
            out[item * HD + d] = acc / l_all;
        } else {
            // Partial states in natural-log units, as merge_splits reads them.
            float* part = partial + (item * splits + split) * (HD + 2);
            if (d == 0) {
                part[0] = m_all * 0.6931471805599453f;
                part[1] = l_all;
            }
            part[2 + d] = acc;
        }
    }
    if (active > 1)
        merge_splits(partial, counters, t, kvh, group, num_heads, HD, splits, active, out);
}

#define DECODE_ATTENTION_MMA(HD, C, SUFFIX)                                                   \
    extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32)                             \
        decode_attention_mma##SUFFIX##_hd##HD(                                                \
            const float* q, const C* cache_k, const C* cache_v, const u32* positions,         \
            const u32* token_runs, u32 runs, const u32* block_tables, u32 max_blocks,         \
            u32 block_size, u32 num_blocks, u32 tokens, u32 num_heads, u32 num_kv_heads,      \
            u32 head_dim, float scale, u32 split_keys, u32 one_token_runs, float* partial,    \
            u32* counters, float* out, Diag* diag) {                                          \
        begin_deferred_kernel();                                                              \
        decode_attention_mma_impl<HD, C>(q, cache_k, cache_v, positions, token_runs, runs,    \
                                         block_tables, max_blocks, block_size, num_blocks,    \
                                         tokens, num_heads, num_kv_heads, scale, split_keys,  \
                                         one_token_runs, partial, counters, out, diag);       \
    }
DECODE_ATTENTION_MMA(64, u16, )
DECODE_ATTENTION_MMA(128, u16, )
DECODE_ATTENTION_MMA(256, u16, )
DECODE_ATTENTION_MMA(64, u8, _fp8)
DECODE_ATTENTION_MMA(128, u8, _fp8)
DECODE_ATTENTION_MMA(256, u8, _fp8)

#define PAGED_ATTENTION(SUFFIX, C, D)                                                         \
    extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32)                         \
        paged_attention_##SUFFIX##_d##D(                                                      \
            const float* q, const C* cache_k, const C* cache_v, const u32* positions,         \
            const u32* token_runs, u32 runs, const u32* block_tables, u32 max_blocks,         \
            u32 block_size, u32 num_blocks, u32 tokens, u32 num_heads, u32 num_kv_heads,      \
            u32 head_dim, float scale, u32 split_keys, float* partial, u32* counters,         \
            float* out, Diag* diag) {                                                         \
        begin_small_kernel();                                                                 \
        paged_attention_impl<C, D>(q, cache_k, cache_v, positions, token_runs, runs,          \
                                   block_tables, max_blocks, block_size, num_blocks, tokens,  \
                                   num_heads, num_kv_heads, head_dim, scale, split_keys,      \
                                   partial, counters, out, diag);                             \
    }
#define PAGED_ATTENTION_DIMS(SUFFIX, C) \
    PAGED_ATTENTION(SUFFIX, C, 1)       \
    PAGED_ATTENTION(SUFFIX, C, 2)       \
    PAGED_ATTENTION(SUFFIX, C, 4)       \
    PAGED_ATTENTION(SUFFIX, C, 8)       \
    PAGED_ATTENTION(SUFFIX, C, 16)
PAGED_ATTENTION_DIMS(bf16, u16)
PAGED_ATTENTION_DIMS(f32, float)
PAGED_ATTENTION_DIMS(fp8, u8)
