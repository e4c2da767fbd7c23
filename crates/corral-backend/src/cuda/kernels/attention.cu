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

#define ATTN_WARPS 4
#define ATTN_MAX_DIMS_PER_LANE 16  // head_dim <= 512

// One block per (token, query head); each warp walks chunks of 32 keys (one key per lane for
// the scores, then every lane accumulates its own dims of V over the chunk) with an online
// softmax; the warps' partial results are merged at the end. Keys 0..=position of the
// token's run, read through its block table.
template <typename C>
__device__ void paged_attention_impl(const float* q, const C* cache_k, const C* cache_v,
                                     const u32* positions, const u32* token_runs,
                                     const u32* block_tables, u32 max_blocks, u32 block_size,
                                     u32 num_blocks, u32 tokens, u32 num_heads, u32 num_kv_heads,
                                     u32 head_dim, float scale, float* out, Diag* diag) {
    __shared__ float q_s[512];
    __shared__ float m_s[ATTN_WARPS], l_s[ATTN_WARPS];
    __shared__ float acc_s[ATTN_WARPS][512];
    u32 item = blockIdx.x;
    u32 t = item / num_heads, h = item % num_heads;
    if (t >= tokens) return;
    u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u32 kv_dim = num_kv_heads * head_dim;
    u32 kv_off = (h / (num_heads / num_kv_heads)) * head_dim;
    const float* qh = q + (size_t)item * head_dim;
    for (u32 d = threadIdx.x; d < head_dim; d += blockDim.x) q_s[d] = qh[d] * scale;
    __syncthreads();
    u32 run = token_runs[t];
    u32 len = positions[t] + 1;
    if (len > max_blocks * block_size) {
        if (threadIdx.x == 0) raise_error(diag, ERR_POSITION);
        len = max_blocks * block_size;
    }
    const u32* table = block_tables + (size_t)run * max_blocks;
    float m = NEG_INF, l = 0.f;
    float acc[ATTN_MAX_DIMS_PER_LANE];
#pragma unroll
    for (int i = 0; i < ATTN_MAX_DIMS_PER_LANE; i++) acc[i] = 0.f;
    u32 dims_per_lane = (head_dim + 31) / 32;
    for (u32 base = warp * 32; base < len; base += ATTN_WARPS * 32) {
        u32 j = base + lane;
        float s = NEG_INF;
        size_t row = 0;
        if (j < len) {
            u32 block = table[j / block_size];
            if (block >= num_blocks) {
                raise_error(diag, ERR_BLOCK_TABLE);
                block = 0;
            }
            row = ((size_t)block * block_size + j % block_size) * kv_dim + kv_off;
            float dot = 0.f;
            for (u32 d = 0; d < head_dim; d++) dot += q_s[d] * load_kv(cache_k, row + d);
            s = dot;
        }
        float chunk_max = warp_max(s);
        float m_new = fmaxf(m, chunk_max);
        float p = j < len ? expf(s - m_new) : 0.f;
        float correction = expf(m - m_new);  // 0 when m is -inf
        l = l * correction + warp_sum(p);
#pragma unroll
        for (int i = 0; i < ATTN_MAX_DIMS_PER_LANE; i++) acc[i] *= correction;
        u32 valid = min(32u, len - base);
        for (u32 jj = 0; jj < valid; jj++) {
            float pj = __shfl_sync(0xffffffffu, p, jj);
            size_t rj = __shfl_sync(0xffffffffu, row, jj);
#pragma unroll
            for (int i = 0; i < ATTN_MAX_DIMS_PER_LANE; i++) {
                u32 d = lane + 32 * i;
                if (i < dims_per_lane && d < head_dim) acc[i] += pj * load_kv(cache_v, rj + d);
            }
        }
        m = m_new;
    }
    if (lane == 0) {
        m_s[warp] = m;
        l_s[warp] = l;
    }
#pragma unroll
    for (int i = 0; i < ATTN_MAX_DIMS_PER_LANE; i++) {
        u32 d = lane + 32 * i;
        if (i < dims_per_lane && d < head_dim) acc_s[warp][d] = acc[i];
    }
    __syncthreads();
    float m_all = NEG_INF;
    for (int w = 0; w < ATTN_WARPS; w++) m_all = fmaxf(m_all, m_s[w]);
    float l_all = 0.f;
    for (int w = 0; w < ATTN_WARPS; w++)
        if (l_s[w] > 0.f) l_all += l_s[w] * expf(m_s[w] - m_all);
    for (u32 d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float o = 0.f;
        for (int w = 0; w < ATTN_WARPS; w++)
            if (l_s[w] > 0.f) o += acc_s[w][d] * expf(m_s[w] - m_all);
        out[(size_t)item * head_dim + d] = o / l_all;
    }
}

#define PAGED_ATTENTION(SUFFIX, C)                                                            \
    extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32) paged_attention_##SUFFIX(   \
        const float* q, const C* cache_k, const C* cache_v, const u32* positions,             \
        const u32* token_runs, const u32* block_tables, u32 max_blocks, u32 block_size,       \
        u32 num_blocks, u32 tokens, u32 num_heads, u32 num_kv_heads, u32 head_dim,            \
        float scale, float* out, Diag* diag) {                                                \
        paged_attention_impl<C>(q, cache_k, cache_v, positions, token_runs, block_tables,     \
                                max_blocks, block_size, num_blocks, tokens, num_heads,        \
                                num_kv_heads, head_dim, scale, out, diag);                    \
    }
PAGED_ATTENTION(bf16, u16)
PAGED_ATTENTION(f32, float)
