// Causal attention for prefill on tensor cores (mma.sync m16n8k16, bf16 operands, f32
// accumulation and softmax), over the paged bf16 KV cache. A block takes 64 consecutive
// tokens of the batch and one query head: each warp holds 16 query rows, and the block walks
// the run's keys 64 at a time through its block table, staging K (row-major) and V
// (transposed) in shared memory. S = Q·Kᵀ stays in registers and its accumulators become the
// A operand of P·V directly; the online softmax keeps each row's max and sum. No T×T matrix
// exists anywhere. A tile whose tokens are not one run at consecutive positions (decode rows
// mixed into the batch) is computed a token at a time by the block's warps instead.

#define FA_ROWS 64
#define FA_KEYS 64
#define FA_THREADS 128

template <int HD>
__device__ __forceinline__ void fa_mma(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// One token's attention for one head by one warp: lanes own HD/32 dims, keys 0..len-1.
template <int HD>
__device__ void fa_one_token(const float* qh, const u16* cache_k, const u16* cache_v,
                             const u32* table, u32 len, u32 block_size, u32 num_blocks,
                             u32 kv_dim, u32 kv_off, float scale, float* out, Diag* diag) {
    const int D = HD / 32;
    u32 lane = threadIdx.x & 31, d0 = lane * D;
    float qv[D], acc[D];
#pragma unroll
    for (int i = 0; i < D; i++) {
        qv[i] = qh[d0 + i] * scale;
        acc[i] = 0.f;
    }
    float m = NEG_INF, l = 0.f;
    for (u32 j = 0; j < len; j++) {
        u32 block = table[j / block_size];
        if (block >= num_blocks) {
            raise_error(diag, ERR_BLOCK_TABLE);
            block = 0;
        }
        size_t row = ((size_t)block * block_size + j % block_size) * kv_dim + kv_off + d0;
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < D; i++) dot += qv[i] * bf16_to_f32(cache_k[row + i]);
        dot = warp_sum(dot);
        float m_new = fmaxf(m, dot);
        float correction = expf(m - m_new), p = expf(dot - m_new);
        l = l * correction + p;
#pragma unroll
        for (int i = 0; i < D; i++) acc[i] = acc[i] * correction + p * bf16_to_f32(cache_v[row + i]);
        m = m_new;
    }
#pragma unroll
    for (int i = 0; i < D; i++) out[d0 + i] = acc[i] / l;
}

template <int HD>
__device__ void flash_attention_impl(const float* q, const u16* cache_k, const u16* cache_v,
                                     const u32* positions, const u32* token_runs, u32 runs,
                                     const u32* block_tables, u32 max_blocks, u32 block_size,
                                     u32 num_blocks, u32 tokens, u32 num_heads, u32 num_kv_heads,
                                     float scale, float* out, Diag* diag) {
    const int KT = HD / 16;  // k16 steps of Q·Kᵀ
    const int DT = HD / 8;   // n8 tiles of the output
    const int KS = HD + 8;   // staged K row stride (u16)
    const int VS = FA_KEYS + 8;
    __shared__ __align__(16) u16 k_s[FA_KEYS * KS];
    __shared__ __align__(16) u16 vt_s[HD * VS];
    u32 t0 = blockIdx.x * FA_ROWS, h = blockIdx.y;
    if (t0 >= tokens) return;
    u32 rows = min((u32)FA_ROWS, tokens - t0), t_last = t0 + rows - 1;
    u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
    u32 kv_dim = num_kv_heads * HD;
    u32 kvh = h / (num_heads / num_kv_heads), kv_off = kvh * HD;
    u32 run = token_runs[t0];
    u32 pos0 = positions[t0];
    const u32* table = block_tables + (size_t)min(run, runs - 1) * max_blocks;
    bool uniform = run < runs && token_runs[t_last] == run &&
                   positions[t_last] == pos0 + (rows - 1) &&
                   pos0 + rows <= max_blocks * block_size;
    if (!uniform) {
        // Per token: a run or position beyond the block tables raises the flag and is clamped.
        for (u32 r = warp; r < rows; r += FA_THREADS / 32) {
            u32 t = t0 + r;
            u32 len = positions[t] + 1, tr = token_runs[t];
            if (len > max_blocks * block_size || tr >= runs) {
                if (lane == 0) raise_error(diag, tr >= runs ? ERR_BLOCK_TABLE : ERR_POSITION);
                len = min(len, max_blocks * block_size);
                tr = min(tr, runs - 1);
            }
            const u32* tt = block_tables + (size_t)tr * max_blocks;
            size_t item = (size_t)t * num_heads + h;
            fa_one_token<HD>(q + item * HD, cache_k, cache_v, tt, len, block_size, num_blocks,
                             kv_dim, kv_off, scale, out + item * HD, diag);
        }
        return;
    }
    // This warp's two query rows (g and g + 8 of its 16) and their positions.
    u32 r_lo = warp * 16 + g, r_hi = r_lo + 8;
    u32 qp_lo = pos0 + r_lo, qp_hi = pos0 + r_hi;
    u32 qa[KT][4];
    {
        const float* q_lo = q + ((size_t)(t0 + r_lo) * num_heads + h) * HD;
        const float* q_hi = q + ((size_t)(t0 + r_hi) * num_heads + h) * HD;
        bool lo_ok = r_lo < rows, hi_ok = r_hi < rows;
#pragma unroll
        for (int kk = 0; kk < KT; kk++) {
            int c = kk * 16 + 2 * tq;
            qa[kk][0] = lo_ok ? pack_bf16(q_lo[c] * scale, q_lo[c + 1] * scale) : 0u;
            qa[kk][1] = hi_ok ? pack_bf16(q_hi[c] * scale, q_hi[c + 1] * scale) : 0u;
            qa[kk][2] = lo_ok ? pack_bf16(q_lo[c + 8] * scale, q_lo[c + 9] * scale) : 0u;
            qa[kk][3] = hi_ok ? pack_bf16(q_hi[c + 8] * scale, q_hi[c + 9] * scale) : 0u;
        }
    }
    float o[DT][4];
#pragma unroll
    for (int dt = 0; dt < DT; dt++)
#pragma unroll
        for (int i = 0; i < 4; i++) o[dt][i] = 0.f;
    float m_lo = NEG_INF, m_hi = NEG_INF, l_lo = 0.f, l_hi = 0.f;
    u32 key_end = pos0 + rows;  // keys 0 .. last position
    for (u32 j0 = 0; j0 < key_end; j0 += FA_KEYS) {
        __syncthreads();
        // Stage 64 keys: each thread copies 8-dim pieces of K rows and V rows (transposed).
#pragma unroll
        for (int it = 0; it < FA_KEYS * (HD / 8) / FA_THREADS; it++) {
            u32 piece = threadIdx.x + it * FA_THREADS;
            u32 kr = piece / (HD / 8), d = (piece % (HD / 8)) * 8;
            u32 j = j0 + kr;
            uint4 kv = make_uint4(0, 0, 0, 0), vv = make_uint4(0, 0, 0, 0);
            if (j < key_end) {
                u32 block = table[j / block_size];
                if (block >= num_blocks) {
                    raise_error(diag, ERR_BLOCK_TABLE);
                    block = 0;
                }
                size_t row = ((size_t)block * block_size + j % block_size) * kv_dim + kv_off + d;
                kv = *reinterpret_cast<const uint4*>(cache_k + row);
                vv = *reinterpret_cast<const uint4*>(cache_v + row);
            }
            *reinterpret_cast<uint4*>(k_s + kr * KS + d) = kv;
            u32 vw[4] = {vv.x, vv.y, vv.z, vv.w};
#pragma unroll
            for (int i = 0; i < 4; i++) {
                vt_s[(d + 2 * i) * VS + kr] = (u16)(vw[i] & 0xffffu);
                vt_s[(d + 2 * i + 1) * VS + kr] = (u16)(vw[i] >> 16);
            }
        }
        __syncthreads();
        // S = Q·Kᵀ for this warp's 16 rows and the 64 keys.
        float s[8][4];
#pragma unroll
        for (int nt = 0; nt < 8; nt++) {
#pragma unroll
            for (int i = 0; i < 4; i++) s[nt][i] = 0.f;
            const u16* kb = k_s + (nt * 8 + g) * KS + 2 * tq;
#pragma unroll
            for (int kk = 0; kk < KT; kk++) {
                u32 b0 = *reinterpret_cast<const u32*>(kb + kk * 16);
                u32 b1 = *reinterpret_cast<const u32*>(kb + kk * 16 + 8);
                fa_mma<HD>(s[nt], qa[kk], b0, b1);
            }
        }
        // Causal mask and the online softmax, rows lo (entries 0, 1) and hi (2, 3).
        float mx_lo = NEG_INF, mx_hi = NEG_INF;
#pragma unroll
        for (int nt = 0; nt < 8; nt++) {
#pragma unroll
            for (int c = 0; c < 2; c++) {
                u32 kp = j0 + nt * 8 + 2 * tq + c;
                if (kp > qp_lo || kp >= key_end) s[nt][c] = NEG_INF;
                if (kp > qp_hi || kp >= key_end) s[nt][2 + c] = NEG_INF;
                mx_lo = fmaxf(mx_lo, s[nt][c]);
                mx_hi = fmaxf(mx_hi, s[nt][2 + c]);
            }
        }
#pragma unroll
        for (int o_ = 1; o_ <= 2; o_ <<= 1) {
            mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, o_));
            mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, o_));
        }
        float new_lo = fmaxf(m_lo, mx_lo), new_hi = fmaxf(m_hi, mx_hi);
        // A row with nothing unmasked yet keeps a finite base, so that exp gives 0, not NaN.
        float base_lo = new_lo == NEG_INF ? 0.f : new_lo;
        float base_hi = new_hi == NEG_INF ? 0.f : new_hi;
        float corr_lo = expf(m_lo - base_lo), corr_hi = expf(m_hi - base_hi);
        l_lo *= corr_lo;
        l_hi *= corr_hi;
#pragma unroll
        for (int dt = 0; dt < DT; dt++) {
            o[dt][0] *= corr_lo;
            o[dt][1] *= corr_lo;
            o[dt][2] *= corr_hi;
            o[dt][3] *= corr_hi;
        }
#pragma unroll
        for (int nt = 0; nt < 8; nt++) {
            s[nt][0] = expf(s[nt][0] - base_lo);
            s[nt][1] = expf(s[nt][1] - base_lo);
            s[nt][2] = expf(s[nt][2] - base_hi);
            s[nt][3] = expf(s[nt][3] - base_hi);
            l_lo += s[nt][0] + s[nt][1];
            l_hi += s[nt][2] + s[nt][3];
        }
        m_lo = new_lo;
        m_hi = new_hi;
        // O += P·V: the S accumulators of two key tiles are one A operand of 16 keys.
#pragma unroll
        for (int kc = 0; kc < 4; kc++) {
            u32 pa[4] = {pack_bf16(s[2 * kc][0], s[2 * kc][1]), pack_bf16(s[2 * kc][2], s[2 * kc][3]),
                         pack_bf16(s[2 * kc + 1][0], s[2 * kc + 1][1]),
                         pack_bf16(s[2 * kc + 1][2], s[2 * kc + 1][3])};
#pragma unroll
            for (int dt = 0; dt < DT; dt++) {
                const u16* vb = vt_s + (dt * 8 + g) * VS + kc * 16 + 2 * tq;
                u32 b0 = *reinterpret_cast<const u32*>(vb);
                u32 b1 = *reinterpret_cast<const u32*>(vb + 8);
                fa_mma<HD>(o[dt], pa, b0, b1);
            }
        }
    }
#pragma unroll
    for (int o_ = 1; o_ <= 2; o_ <<= 1) {
        l_lo += __shfl_xor_sync(0xffffffffu, l_lo, o_);
        l_hi += __shfl_xor_sync(0xffffffffu, l_hi, o_);
    }
#pragma unroll
    for (int dt = 0; dt < DT; dt++) {
        u32 d = dt * 8 + 2 * tq;
        if (r_lo < rows) {
            float* dst = out + ((size_t)(t0 + r_lo) * num_heads + h) * HD + d;
            dst[0] = o[dt][0] / l_lo;
            dst[1] = o[dt][1] / l_lo;
        }
        if (r_hi < rows) {
            float* dst = out + ((size_t)(t0 + r_hi) * num_heads + h) * HD + d;
            dst[0] = o[dt][2] / l_hi;
            dst[1] = o[dt][3] / l_hi;
        }
    }
}

#define FLASH_ATTENTION(HD)                                                                   \
    extern "C" __global__ void __launch_bounds__(FA_THREADS) flash_attention_bf16_hd##HD(     \
        const float* q, const u16* cache_k, const u16* cache_v, const u32* positions,         \
        const u32* token_runs, u32 runs, const u32* block_tables, u32 max_blocks,             \
        u32 block_size, u32 num_blocks, u32 tokens, u32 num_heads, u32 num_kv_heads,          \
        float scale, float* out, Diag* diag) {                                                \
        begin_kernel();                                                                       \
        flash_attention_impl<HD>(q, cache_k, cache_v, positions, token_runs, runs,            \
                                 block_tables,                                                \
                                 max_blocks, block_size, num_blocks, tokens, num_heads,       \
                                 num_kv_heads, scale, out, diag);                             \
    }
FLASH_ATTENTION(64)
FLASH_ATTENTION(128)
