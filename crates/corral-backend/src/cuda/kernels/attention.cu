// Paged KV cache: storing this batch's K and V, and causal GQA attention over the cache.
// The cache holds K/V as bf16 (default) or f32; scores, softmax and accumulation in f32.

__device__ __forceinline__ void store_kv(u16* p, size_t i, float v) { p[i] = f32_to_bf16(v); }
__device__ __forceinline__ void store_kv(float* p, size_t i, float v) { p[i] = v; }
__device__ __forceinline__ float load_kv(const u16* p, size_t i) { return bf16_to_f32(p[i]); }
__device__ __forceinline__ float load_kv(const float* p, size_t i) { return p[i]; }

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
        kv_store_impl<C>(k, v, slots, tokens, kv_dim, cache_slots, cache_k, cache_v, diag);   \
    }
KV_STORE(bf16, u16)
KV_STORE(f32, float)

#define ATTN_MAX_GROUP 16  // query heads per KV head handled by one block's warps
#define ATTN_KEYS 8        // keys scored together (their loads in flight at once)

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

// One block per (token, KV head, split of the keys); warp w is query head
// kv_head * group + w (more heads than warps loop). The warp's lanes hold D dims each of q
// and of the output, read each key and value row together (coalesced), and score
// ATTN_KEYS keys at a time with an online softmax. The group's warps read the same rows,
// so they come from L1 after the first. With one split the block writes the normalised
// output; with several, (max, sum, unnormalised output) to `partial` for
// attention_combine. Keys 0..=position of the token's run, through its block table.
template <typename C, int D>
__device__ void paged_attention_impl(const float* q, const C* cache_k, const C* cache_v,
                                     const u32* positions, const u32* token_runs,
                                     const u32* block_tables, u32 max_blocks, u32 block_size,
                                     u32 num_blocks, u32 tokens, u32 num_heads, u32 num_kv_heads,
                                     u32 head_dim, float scale, u32 split_keys, float* partial,
                                     float* out, Diag* diag) {
    u32 t = blockIdx.x / num_kv_heads, kvh = blockIdx.x % num_kv_heads;
    u32 split = blockIdx.y, splits = gridDim.y;
    if (t >= tokens) return;
    u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    u32 group = num_heads / num_kv_heads;
    u32 kv_dim = num_kv_heads * head_dim;
    u32 d0 = lane * D;
    bool vec = head_dim == 32 * D;
    u32 run = token_runs[t];
    u32 len = positions[t] + 1;
    if (len > max_blocks * block_size) {
        if (threadIdx.x == 0 && split == 0) raise_error(diag, ERR_POSITION);
        len = max_blocks * block_size;
    }
    u32 begin = split * split_keys, end = min(len, begin + split_keys);
    const u32* table = block_tables + (size_t)run * max_blocks;
    for (u32 g = warp; g < group; g += warps) {
        u32 h = kvh * group + g;
        u32 item = t * num_heads + h;
        float qv[D], acc[D];
        const float* qh = q + (size_t)item * head_dim;
#pragma unroll
        for (int i = 0; i < D; i++) {
            qv[i] = d0 + i < head_dim ? qh[d0 + i] * scale : 0.f;
            acc[i] = 0.f;
        }
        float m = NEG_INF, l = 0.f;
        for (u32 j0 = begin; j0 < end; j0 += ATTN_KEYS) {
            float s[ATTN_KEYS];
            size_t rows[ATTN_KEYS];
#pragma unroll
            for (int jj = 0; jj < ATTN_KEYS; jj++) {
                u32 j = min(j0 + jj, end - 1);
                u32 block = table[j / block_size];
                if (block >= num_blocks) {
                    raise_error(diag, ERR_BLOCK_TABLE);
                    block = 0;
                }
                rows[jj] = ((size_t)block * block_size + j % block_size) * kv_dim +
                           (size_t)kvh * head_dim;
            }
#pragma unroll
            for (int jj = 0; jj < ATTN_KEYS; jj++) {
                float kv[D];
                load_lane_dims<D>(cache_k + rows[jj], d0, head_dim, vec, kv);
                float dot = 0.f;
#pragma unroll
                for (int i = 0; i < D; i++) dot += qv[i] * kv[i];
                s[jj] = dot;
            }
            float chunk_max = NEG_INF;
#pragma unroll
            for (int jj = 0; jj < ATTN_KEYS; jj++) {
                s[jj] = warp_sum(s[jj]);
                if (j0 + jj >= end) s[jj] = NEG_INF;
                chunk_max = fmaxf(chunk_max, s[jj]);
            }
            float m_new = fmaxf(m, chunk_max);
            float correction = expf(m - m_new);  // 0 while m is -inf
            l *= correction;
#pragma unroll
            for (int i = 0; i < D; i++) acc[i] *= correction;
#pragma unroll
            for (int jj = 0; jj < ATTN_KEYS; jj++) {
                float p = expf(s[jj] - m_new);  // 0 past the end
                l += p;
                float vv[D];
                load_lane_dims<D>(cache_v + rows[jj], d0, head_dim, vec, vv);
#pragma unroll
                for (int i = 0; i < D; i++) acc[i] += p * vv[i];
            }
            m = m_new;
        }
        if (splits > 1) {
            float* part = partial + ((size_t)item * splits + split) * (head_dim + 2);
            if (lane == 0) {
                part[0] = m;
                part[1] = l;
            }
#pragma unroll
            for (int i = 0; i < D; i++)
                if (d0 + i < head_dim) part[2 + d0 + i] = acc[i];
        } else {
#pragma unroll
            for (int i = 0; i < D; i++)
                if (d0 + i < head_dim) out[(size_t)item * head_dim + d0 + i] = acc[i] / l;
        }
    }
}

#define PAGED_ATTENTION(SUFFIX, C, D)                                                         \
    extern "C" __global__ void __launch_bounds__(ATTN_MAX_GROUP * 32)                         \
        paged_attention_##SUFFIX##_d##D(                                                      \
            const float* q, const C* cache_k, const C* cache_v, const u32* positions,         \
            const u32* token_runs, const u32* block_tables, u32 max_blocks, u32 block_size,   \
            u32 num_blocks, u32 tokens, u32 num_heads, u32 num_kv_heads, u32 head_dim,        \
            float scale, u32 split_keys, float* partial, float* out, Diag* diag) {            \
        paged_attention_impl<C, D>(q, cache_k, cache_v, positions, token_runs, block_tables,  \
                                   max_blocks, block_size, num_blocks, tokens, num_heads,     \
                                   num_kv_heads, head_dim, scale, split_keys, partial, out,   \
                                   diag);                                                     \
    }
#define PAGED_ATTENTION_DIMS(SUFFIX, C) \
    PAGED_ATTENTION(SUFFIX, C, 1)       \
    PAGED_ATTENTION(SUFFIX, C, 2)       \
    PAGED_ATTENTION(SUFFIX, C, 4)       \
    PAGED_ATTENTION(SUFFIX, C, 8)       \
    PAGED_ATTENTION(SUFFIX, C, 16)
PAGED_ATTENTION_DIMS(bf16, u16)
PAGED_ATTENTION_DIMS(f32, float)

// Merges the splits of paged_attention: out = Σ_s e^(m_s - m) o_s / Σ_s e^(m_s - m) l_s.
extern "C" __global__ void attention_combine(const float* partial, u32 items, u32 splits,
                                             u32 head_dim, float* out) {
    u32 item = blockIdx.x;
    if (item >= items) return;
    const float* p = partial + (size_t)item * splits * (head_dim + 2);
    float m_all = NEG_INF;
    for (u32 s = 0; s < splits; s++)
        if (p[s * (head_dim + 2) + 1] > 0.f) m_all = fmaxf(m_all, p[s * (head_dim + 2)]);
    float l_all = 0.f;
    for (u32 s = 0; s < splits; s++) {
        const float* ps = p + s * (head_dim + 2);
        if (ps[1] > 0.f) l_all += ps[1] * expf(ps[0] - m_all);
    }
    for (u32 d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float o = 0.f;
        for (u32 s = 0; s < splits; s++) {
            const float* ps = p + s * (head_dim + 2);
            if (ps[1] > 0.f) o += ps[2 + d] * expf(ps[0] - m_all);
        }
        out[(size_t)item * head_dim + d] = o / l_all;
    }
}
