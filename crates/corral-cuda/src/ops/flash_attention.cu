// Causal attention for prefill on tensor cores (mma.sync m16n8k16, bf16 operands, f32
// accumulation and softmax), over the paged bf16 KV cache (or fp8: below). A block takes 64 consecutive
// tokens of the batch and one query head: each warp holds 16 query rows, and the block walks
// the run's keys 64 at a time through its block table, K and V rows streamed into shared
// memory by cp.async (the next 64 keys in flight while these compute) and read as operands
// by ldmatrix (V transposed on the way). S = Q·Kᵀ stays in registers and its accumulators
// become the A operand of P·V directly; the online softmax keeps each row's max and sum. No
// T×T matrix exists anywhere. A tile that holds the end of one run and the start of the next
// takes each span on its own. Where the tiles are too few to fill the GPU (a short prompt
// after a long history), the keys split over blocks (grid z) and flash_merge joins their
// partial states. Over an fp8 cache the keys' raw bytes and head scales stream into shared
// memory by cp.async, the next 64 keys in flight while these compute; each thread turns the
// pieces it loaded into one f16 tile (values times their scale) and the products run on f16
// operands.

#define FA_ROWS 64
#define FA_KEYS 64
#define FA_THREADS 128

// Not volatile: a pure register operation, which the compiler may interleave with others.
// bf16 operands, or f16 (F16).
template <bool F16>
__device__ __forceinline__ void fa_mma(float* c, const u32* a, u32 b0, u32 b1) {
    if constexpr (F16)
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    else
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two f16 products at once.
__device__ __forceinline__ u32 hmul2(u32 a, u32 b) {
    u32 d;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

// 4 bytes from global to shared memory, asynchronously (a head scale); zeros where `bytes`
// is 0.
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem, u32 bytes) {
    u32 s = (u32)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(gmem), "r"(bytes)
                 : "memory");
}

// The output in f32, or in bf16 for an output projection that takes it so.
__device__ __forceinline__ void fa_store(float* p, float v) { *p = v; }
__device__ __forceinline__ void fa_store(u16* p, float v) { *p = f32_to_bf16(v); }
__device__ __forceinline__ void fa_store2(float* p, float a, float b) {
    *reinterpret_cast<float2*>(p) = make_float2(a, b);
}
__device__ __forceinline__ void fa_store2(u16* p, float a, float b) {
    *reinterpret_cast<u32*>(p) = (u32)f32_to_bf16(a) | ((u32)f32_to_bf16(b) << 16);
}

// A cached value of a bf16 cache, or of an fp8 one (times its head's scale, `s`).
__device__ __forceinline__ float fa_load(const u16* p, size_t i, float) { return bf16_to_f32(p[i]); }
__device__ __forceinline__ float fa_load(const u8* p, size_t i, float s) { return e4m3_to_f32(p[i]) * s; }

// Elements from one slot's cache row to the next's, and where a row's head scale sits
// (fp8 rows: after the row's values; attention.cu's layout).
template <typename C> __device__ __forceinline__ u32 fa_row_stride(u32 kv_dim, u32 kv_heads) {
    return sizeof(C) == 1 ? fp8_row_bytes(kv_heads, kv_dim / kv_heads) : kv_dim;
}
template <typename C>
__device__ __forceinline__ float fa_scale(const C* cache, size_t row0, u32 kv_dim, u32 kvh) {
    if constexpr (sizeof(C) == 1)
        return *reinterpret_cast<const float*>(cache + row0 + kv_dim + 4 * kvh);
    else
        return 1.f;
}

// One token's attention for one head by one warp: lanes own HD/32 dims, keys 0..len-1.
template <int HD, typename O, typename C>
__device__ void fa_one_token(const float* qh, const C* cache_k, const C* cache_v,
                             const u32* table, u32 len, u32 block_size, u32 num_blocks,
                             u32 kv_dim, u32 kv_off, float scale, O* out, Diag* diag) {
    const int D = HD / 32;
    u32 lane = threadIdx.x & 31, d0 = lane * D;
    float qv[D], acc[D];
#pragma unroll
    for (int i = 0; i < D; i++) {
        qv[i] = qh[d0 + i] * scale;
        acc[i] = 0.f;
    }
    float m = NEG_INF, l = 0.f;
    u32 kv_heads = kv_dim / HD, stride = fa_row_stride<C>(kv_dim, kv_heads);
    for (u32 j = 0; j < len; j++) {
        size_t row0 = slot_of(table, j, block_size, num_blocks, diag) * stride;
        size_t row = row0 + kv_off + d0;
        float ks = fa_scale(cache_k, row0, kv_dim, kv_off / HD);
        float vs = fa_scale(cache_v, row0, kv_dim, kv_off / HD);
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < D; i++) dot += qv[i] * fa_load(cache_k, row + i, ks);
        dot = warp_sum(dot);
        float m_new = fmaxf(m, dot);
        float correction = expf(m - m_new), p = expf(dot - m_new);
        l = l * correction + p;
#pragma unroll
        for (int i = 0; i < D; i++) acc[i] = acc[i] * correction + p * fa_load(cache_v, row + i, vs);
        m = m_new;
    }
#pragma unroll
    for (int i = 0; i < D; i++) fa_store(out + d0 + i, acc[i] / l);
}

// Stages of K and V in shared memory: two (the next 64 keys of both load while these
// compute) at head dims 64 and 128; one each at 256, which halves the block's shared memory
// so that two blocks fit an SM: V loads during Q·Kᵀ, the next K during P·V.
template <int HD> struct FaStages { static const int value = HD == 256 ? 1 : 2; };
// Shared memory of one block: its stages of 64 keys of K and of V, rows of HD + 8 values;
// over an fp8 cache one f16 tile of each, and their raw bytes and each 16-byte piece's scale.
#define FA_SMEM_BYTES(HD) (FaStages<HD>::value * 2 * FA_KEYS * ((HD) + 8) * 2)
#define FA_FP8_SMEM_BYTES(HD) (2 * FA_KEYS * ((HD) + 8) * 2 + 2 * FA_KEYS * (HD) + 2 * FA_KEYS * (HD) / 16 * 4)

__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Where a split's partial states go: per (split, token, head), the unnormalized output
// (HD floats) and its (max in log2 units, sum). Null `o`: the keys are not split, and the
// output is written normalized.
struct FaPartial {
    float* o;
    float2* ml;
    u32 split, items;  // items: tokens × heads of the launch
};

// Rows t0 .. t0 + rows - 1 of the batch, one run (`table`) at consecutive positions from
// pos0, for head h, over keys [k_lo, k_hi) of the run (k_lo a multiple of 64). Over an fp8
// cache (C = u8) the operands are f16.
template <int HD, typename O, typename C>
__device__ void flash_span(const float* q, const C* cache_k, const C* cache_v,
                           const u32* table, u32 block_size, u32 num_blocks, u32 t0, u32 rows,
                           u32 pos0, u32 h, u32 num_heads, u32 num_kv_heads, float scale,
                           u32 k_lo, u32 k_hi, O* out, FaPartial part, Diag* diag) {
    const int KT = HD / 16;  // k16 steps of Q·Kᵀ
    const int DT = HD / 8;   // n8 tiles of the output
    const int KS = HD + 8;   // staged K and V row stride (u16): conflict-free ldmatrix rows
    constexpr bool FP8 = sizeof(C) == 1;
    const int STAGES = FP8 ? 1 : FaStages<HD>::value;
    const int PIECES = FA_KEYS * HD / 16 / FA_THREADS;  // fp8: 16-byte pieces a thread loads
    extern __shared__ __align__(16) unsigned char fa_smem[];
    u16* k_s = reinterpret_cast<u16*>(fa_smem);         // [STAGES][FA_KEYS * KS]
    u16* v_s = k_s + STAGES * FA_KEYS * KS;               // [STAGES][FA_KEYS * KS]
    // fp8: raw K and V bytes [FA_KEYS * HD], then each piece's scale, piece-major.
    u8* k_raw = reinterpret_cast<u8*>(v_s + FA_KEYS * KS);
    u8* v_raw = k_raw + FA_KEYS * HD;
    float* k_sc = reinterpret_cast<float*>(v_raw + FA_KEYS * HD);
    float* v_sc = k_sc + FA_KEYS * HD / 16;
    u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
    u32 kv_dim = num_kv_heads * HD, row_stride = fa_row_stride<C>(kv_dim, num_kv_heads);
    u32 kvh = h / (num_heads / num_kv_heads), kv_off = kvh * HD;
    u32 key_end = pos0 + rows;  // keys 0 .. last position
    u32 j_end = min(k_hi, key_end);
    // bf16: 64 keys of K, of V, or of both (`which`) from j0 into stage `stage`, 16-byte
    // pieces by cp.async, each key's slot looked up once; keys past the end are zero.
    enum { K_ONLY, V_ONLY, K_AND_V };
    auto issue = [&](u32 j0, int stage, int which) {
        u16* k_dst = k_s + stage * FA_KEYS * KS;
        u16* v_dst = v_s + stage * FA_KEYS * KS;
#pragma unroll
        for (int it = 0; it < FA_KEYS * (HD / 8) / FA_THREADS; it++) {
            u32 piece = threadIdx.x + it * FA_THREADS;
            u32 kr = piece / (HD / 8), d = (piece % (HD / 8)) * 8;
            u32 j = j0 + kr;
            bool live = j < key_end;
            size_t at = (live ? slot_of(table, j, block_size, num_blocks, diag) * row_stride : 0) + kv_off + d;
            if (which != V_ONLY) cp_async16(k_dst + kr * KS + d, cache_k + at, live ? 16u : 0u);
            if (which != K_ONLY) cp_async16(v_dst + kr * KS + d, cache_v + at, live ? 16u : 0u);
        }
    };
    // fp8: this thread's pieces of 64 keys of K and V from j0, raw, with their scales (keys
    // past the end read zero bytes and a zero scale), ...
    auto issue_fp8 = [&](u32 j0) {
#pragma unroll
        for (int it = 0; it < PIECES; it++) {
            u32 piece = threadIdx.x + it * FA_THREADS;
            u32 kr = piece / (HD / 16), d = (piece % (HD / 16)) * 16;
            u32 j = j0 + kr;
            bool live = j < key_end;
            size_t row0 = live ? slot_of(table, j, block_size, num_blocks, diag) * row_stride : 0;
            cp_async16(k_raw + kr * HD + d, cache_k + row0 + kv_off + d, live ? 16u : 0u);
            cp_async16(v_raw + kr * HD + d, cache_v + row0 + kv_off + d, live ? 16u : 0u);
            cp_async4(k_sc + piece, cache_k + row0 + kv_dim + 4 * kvh, live ? 4u : 0u);
            cp_async4(v_sc + piece, cache_v + row0 + kv_dim + 4 * kvh, live ? 4u : 0u);
        }
    };
    // ... and the same pieces, once landed, into the f16 tiles: an e4m3 byte's bits moved
    // into an f16's are its value times 2^-8, so the scale times 2^8 multiplies them.
    auto convert_fp8 = [&]() {
#pragma unroll
        for (int it = 0; it < PIECES; it++) {
            u32 piece = threadIdx.x + it * FA_THREADS;
            u32 kr = piece / (HD / 16), d = (piece % (HD / 16)) * 16;
#pragma unroll
            for (int which = 0; which < 2; which++) {
                const u8* raw = (which == 0 ? k_raw : v_raw) + kr * HD + d;
                float sc = 256.f * (which == 0 ? k_sc : v_sc)[piece];
                u32 sc2 = pack_f16(sc, sc);
                uint4 w = *reinterpret_cast<const uint4*>(raw);
                u32 words[4] = {w.x, w.y, w.z, w.w}, f[8];
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    f[2 * i] = hmul2(e4m3x2_as_f16x2(words[i], 0x1404u), sc2);
                    f[2 * i + 1] = hmul2(e4m3x2_as_f16x2(words[i], 0x3424u), sc2);
                }
                u16* dst = (which == 0 ? k_s : v_s) + kr * KS + d;
                *reinterpret_cast<uint4*>(dst) = make_uint4(f[0], f[1], f[2], f[3]);
                *reinterpret_cast<uint4*>(dst + 8) = make_uint4(f[4], f[5], f[6], f[7]);
            }
        }
    };
    if (k_lo < j_end) {
        if constexpr (FP8) {
            issue_fp8(k_lo);
        } else {
            issue(k_lo, 0, STAGES == 2 ? K_AND_V : K_ONLY);
        }
        cp_async_commit();
    }
    // This warp's two query rows (g and g + 8 of its 16) and their positions. Scores are
    // kept in log2 units (the scale times log2 e folded into Q) so that exp2 applies.
    u32 r_lo = warp * 16 + g, r_hi = r_lo + 8;
    u32 qp_lo = pos0 + r_lo, qp_hi = pos0 + r_hi;
    float qscale = scale * 1.4426950408889634f;
    u32 qa[KT][4];
    {
        const float* q_lo = q + ((size_t)(t0 + r_lo) * num_heads + h) * HD;
        const float* q_hi = q + ((size_t)(t0 + r_hi) * num_heads + h) * HD;
        bool lo_ok = r_lo < rows, hi_ok = r_hi < rows;
#pragma unroll
        for (int kk = 0; kk < KT; kk++) {
            int c = kk * 16 + 2 * tq;
            qa[kk][0] = lo_ok ? pack2<FP8>(q_lo[c] * qscale, q_lo[c + 1] * qscale) : 0u;
            qa[kk][1] = hi_ok ? pack2<FP8>(q_hi[c] * qscale, q_hi[c + 1] * qscale) : 0u;
            qa[kk][2] = lo_ok ? pack2<FP8>(q_lo[c + 8] * qscale, q_lo[c + 9] * qscale) : 0u;
            qa[kk][3] = hi_ok ? pack2<FP8>(q_hi[c + 8] * qscale, q_hi[c + 9] * qscale) : 0u;
        }
    }
    float o[DT][4];
#pragma unroll
    for (int dt = 0; dt < DT; dt++)
#pragma unroll
        for (int i = 0; i < 4; i++) o[dt][i] = 0.f;
    float m_lo = NEG_INF, m_hi = NEG_INF, l_lo = 0.f, l_hi = 0.f;
    int stage = 0;
    for (u32 j0 = k_lo; j0 < j_end; j0 += FA_KEYS, stage ^= STAGES - 1) {
        if constexpr (FP8) {
            // This thread's pieces have landed, and every warp is done with the tiles.
            cp_async_wait<0>();
            __syncthreads();
            convert_fp8();
            // The plain reads of this thread's raw pieces before cp.async overwrites them.
            asm volatile("" ::: "memory");
            if (j0 + FA_KEYS < j_end) {
                issue_fp8(j0 + FA_KEYS);
                cp_async_commit();
            }
            __syncthreads();
        } else if constexpr (STAGES == 2) {
            // The next 64 keys load while these compute.
            if (j0 + FA_KEYS < j_end) {
                issue(j0 + FA_KEYS, stage ^ 1, K_AND_V);
                cp_async_commit();
                cp_async_wait<1>();
            } else {
                cp_async_wait<0>();
            }
            __syncthreads();
        } else {
            // K is here, and every warp is done with the last V: V loads during Q·Kᵀ.
            cp_async_wait<0>();
            __syncthreads();
            issue(j0, 0, V_ONLY);
            cp_async_commit();
        }
        const u16* ks = k_s + stage * FA_KEYS * KS;
        const u16* vs = v_s + stage * FA_KEYS * KS;
        // S = Q·Kᵀ for this warp's 16 rows and the 64 keys; K fragments by ldmatrix, two
        // k16 steps at a time. Four key tiles at a time, so that no mma waits for the one
        // just before it (a tile's products accumulate in order: the k steps of a pair
        // are four mmas apart).
        float s[8][4];
#pragma unroll
        for (int nt = 0; nt < 8; nt++)
#pragma unroll
            for (int i = 0; i < 4; i++) s[nt][i] = 0.f;
        const u16* kb = ks + (lane & 7) * KS + (lane >> 3) * 8;
#pragma unroll
        for (int kp = 0; kp < KT / 2; kp++) {
#pragma unroll
            for (int n4 = 0; n4 < 8; n4 += 4) {
                u32 b[4][4];
#pragma unroll
                for (int u = 0; u < 4; u++) ldmatrix_x4(b[u], kb + (n4 + u) * 8 * KS + kp * 32);
#pragma unroll
                for (int u = 0; u < 4; u++) fa_mma<FP8>(s[n4 + u], qa[2 * kp], b[u][0], b[u][1]);
#pragma unroll
                for (int u = 0; u < 4; u++) fa_mma<FP8>(s[n4 + u], qa[2 * kp + 1], b[u][2], b[u][3]);
            }
        }
        // Causal mask (only the tiles that reach past a row's position) and the online
        // softmax, rows lo (entries 0, 1) and hi (2, 3).
        if (j0 + FA_KEYS > pos0) {
#pragma unroll
            for (int nt = 0; nt < 8; nt++) {
#pragma unroll
                for (int c = 0; c < 2; c++) {
                    u32 kp = j0 + nt * 8 + 2 * tq + c;
                    if (kp > qp_lo || kp >= key_end) s[nt][c] = NEG_INF;
                    if (kp > qp_hi || kp >= key_end) s[nt][2 + c] = NEG_INF;
                }
            }
        }
        float mx_lo = NEG_INF, mx_hi = NEG_INF;
#pragma unroll
        for (int nt = 0; nt < 8; nt++) {
            mx_lo = fmaxf(mx_lo, fmaxf(s[nt][0], s[nt][1]));
            mx_hi = fmaxf(mx_hi, fmaxf(s[nt][2], s[nt][3]));
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
        float corr_lo = fast_exp2(m_lo - base_lo), corr_hi = fast_exp2(m_hi - base_hi);
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
            s[nt][0] = fast_exp2(s[nt][0] - base_lo);
            s[nt][1] = fast_exp2(s[nt][1] - base_lo);
            s[nt][2] = fast_exp2(s[nt][2] - base_hi);
            s[nt][3] = fast_exp2(s[nt][3] - base_hi);
            l_lo += s[nt][0] + s[nt][1];
            l_hi += s[nt][2] + s[nt][3];
        }
        m_lo = new_lo;
        m_hi = new_hi;
        if constexpr (!FP8 && STAGES == 1) {
            // V is here, and every warp is done with K: the next K loads during P·V.
            cp_async_wait<0>();
            __syncthreads();
            if (j0 + FA_KEYS < j_end) {
                issue(j0 + FA_KEYS, 0, K_ONLY);
                cp_async_commit();
            }
        }
        // O += P·V: the S accumulators of two key tiles are one A operand of 16 keys; V
        // fragments by transposing ldmatrix, two n8 tiles of dims at a time.
#pragma unroll
        for (int kc = 0; kc < 4; kc++) {
            u32 pa[4] = {pack2<FP8>(s[2 * kc][0], s[2 * kc][1]),
                         pack2<FP8>(s[2 * kc][2], s[2 * kc][3]),
                         pack2<FP8>(s[2 * kc + 1][0], s[2 * kc + 1][1]),
                         pack2<FP8>(s[2 * kc + 1][2], s[2 * kc + 1][3])};
            const u16* vb = vs + (kc * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * KS + (lane >> 4) * 8;
#pragma unroll
            for (int dp = 0; dp < DT / 2; dp++) {
                u32 b[4];
                ldmatrix_x4_trans(b, vb + dp * 16);
                fa_mma<FP8>(o[2 * dp], pa, b[0], b[1]);
                fa_mma<FP8>(o[2 * dp + 1], pa, b[2], b[3]);
            }
        }
        // Every warp is done with this stage before the next iteration loads into it.
        if constexpr (STAGES == 2) __syncthreads();
    }
#pragma unroll
    for (int o_ = 1; o_ <= 2; o_ <<= 1) {
        l_lo += __shfl_xor_sync(0xffffffffu, l_lo, o_);
        l_hi += __shfl_xor_sync(0xffffffffu, l_hi, o_);
    }
    if (part.o) {
        // Unnormalized, with the rows' (max, sum): rows with no key here leave (-inf, 0).
        size_t base = (size_t)part.split * part.items;
#pragma unroll
        for (int dt = 0; dt < DT; dt++) {
            u32 d = dt * 8 + 2 * tq;
            if (r_lo < rows) {
                size_t item = base + (size_t)(t0 + r_lo) * num_heads + h;
                fa_store2(part.o + item * HD + d, o[dt][0], o[dt][1]);
            }
            if (r_hi < rows) {
                size_t item = base + (size_t)(t0 + r_hi) * num_heads + h;
                fa_store2(part.o + item * HD + d, o[dt][2], o[dt][3]);
            }
        }
        if (tq == 0) {
            if (r_lo < rows) part.ml[base + (size_t)(t0 + r_lo) * num_heads + h] = make_float2(m_lo, l_lo);
            if (r_hi < rows) part.ml[base + (size_t)(t0 + r_hi) * num_heads + h] = make_float2(m_hi, l_hi);
        }
        return;
    }
#pragma unroll
    for (int dt = 0; dt < DT; dt++) {
        u32 d = dt * 8 + 2 * tq;
        if (r_lo < rows) {
            O* dst = out + ((size_t)(t0 + r_lo) * num_heads + h) * HD + d;
            fa_store2(dst, o[dt][0] / l_lo, o[dt][1] / l_lo);
        }
        if (r_hi < rows) {
            O* dst = out + ((size_t)(t0 + r_hi) * num_heads + h) * HD + d;
            fa_store2(dst, o[dt][2] / l_hi, o[dt][3] / l_hi);
        }
    }
}

// One block's tile of 64 consecutive tokens of the batch for one head, taken as spans of
// one run at consecutive positions (a tile mixes runs where they meet in the batch), each on
// tensor cores, over split blockIdx.z of the keys (split_keys each; with more than one split
// the block leaves partial states in `partial`). A span whose run or positions lie beyond the
// block tables raises the flag and is computed a token at a time, clamped, by the first
// split. Tiles run heaviest first: grid (heads, tiles, splits), the last tile of the batch
// (the most keys under the causal mask) in the first block row.
template <int HD, typename O, typename C>
__device__ void flash_attention_impl(const float* q, const C* cache_k, const C* cache_v,
                                     const u32* positions, const u32* token_runs, u32 runs,
                                     const u32* block_tables, u32 max_blocks, u32 block_size,
                                     u32 num_blocks, u32 tokens, u32 num_heads, u32 num_kv_heads,
                                     float scale, u32 split_keys, float* partial, O* out,
                                     Diag* diag) {
    u32 tile = (gridDim.y - 1 - blockIdx.y) * FA_ROWS, h = blockIdx.x, split = blockIdx.z;
    if (tile >= tokens) return;
    u32 tile_end = min(tile + FA_ROWS, tokens);
    u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u32 kv_dim = num_kv_heads * HD, kv_off = h / (num_heads / num_kv_heads) * HD;
    u32 items = tokens * num_heads;
    FaPartial part = {nullptr, nullptr, split, items};
    if (gridDim.z > 1) {
        part.o = partial;
        part.ml = reinterpret_cast<float2*>(partial + (size_t)gridDim.z * items * HD);
    }
    u32 k_lo = split * split_keys;
    u32 k_hi = gridDim.z > 1 ? k_lo + split_keys : 0xffffffffu;
    for (u32 t0 = tile; t0 < tile_end;) {
        u32 run = token_runs[t0], pos0 = positions[t0], t1 = t0 + 1;
        while (t1 < tile_end && token_runs[t1] == run && positions[t1] == pos0 + (t1 - t0)) t1++;
        u32 rows = t1 - t0;
        if (run < runs && pos0 + rows <= max_blocks * block_size) {
            flash_span<HD, O, C>(q, cache_k, cache_v, block_tables + (size_t)run * max_blocks,
                              block_size, num_blocks, t0, rows, pos0, h, num_heads,
                              num_kv_heads, scale, k_lo, k_hi, out, part, diag);
        } else {
            for (u32 r = warp; r < rows; r += FA_THREADS / 32) {
                u32 t = t0 + r;
                u32 len = min(positions[t] + 1, max_blocks * block_size);
                if (lane == 0) raise_error(diag, run >= runs ? ERR_BLOCK_TABLE : ERR_POSITION);
                const u32* tt = block_tables + (size_t)min(run, runs - 1) * max_blocks;
                size_t item = (size_t)t * num_heads + h;
                if (!part.o) {
                    fa_one_token<HD, O, C>(q + item * HD, cache_k, cache_v, tt, len, block_size,
                                        num_blocks, kv_dim, kv_off, scale, out + item * HD, diag);
                    continue;
                }
                // Split: the first split's state is the whole answer (weight 1), the rest empty.
                size_t at = (size_t)split * items + item;
                if (split == 0)
                    fa_one_token<HD, float, C>(q + item * HD, cache_k, cache_v, tt, len, block_size,
                                            num_blocks, kv_dim, kv_off, scale, part.o + at * HD,
                                            diag);
                if (lane == 0) part.ml[at] = split == 0 ? make_float2(0.f, 1.f) : make_float2(NEG_INF, 0.f);
            }
        }
        t0 = t1;
    }
}

// Joins the splits of a split launch: a warp per (token, head), each lane 8 of the head's
// dims: out = Σ_s 2^(m_s - m) o_s / Σ_s 2^(m_s - m) l_s over the splits that hold keys.
template <int HD, typename O>
__device__ void flash_merge_impl(const float* partial, u32 splits, u32 items, O* out) {
    const int D = HD / 32;
    u32 lane = threadIdx.x & 31;
    u32 item = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (item >= items) return;
    const float2* ml = reinterpret_cast<const float2*>(partial + (size_t)splits * items * HD);
    float m_all = NEG_INF;
    for (u32 s = 0; s < splits; s++) {
        float2 v = ml[(size_t)s * items + item];
        if (v.y > 0.f) m_all = fmaxf(m_all, v.x);
    }
    float acc[D], l = 0.f;
#pragma unroll
    for (int i = 0; i < D; i++) acc[i] = 0.f;
    for (u32 s = 0; s < splits; s++) {
        float2 v = ml[(size_t)s * items + item];
        if (!(v.y > 0.f)) continue;
        float w = exp2f(v.x - m_all);
        l += w * v.y;
        const float* po = partial + ((size_t)s * items + item) * HD;
#pragma unroll
        for (int i = 0; i < D; i++) acc[i] += w * po[lane + 32 * i];
    }
    float inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
    for (int i = 0; i < D; i++) fa_store(out + (size_t)item * HD + lane + 32 * i, acc[i] * inv);
}

// Blocks an SM holds: 3 at head dims 64 and 128; 2 at 256 (the output and q fragments of a
// 256-wide head take all of a thread's registers; one stage of K and V each leaves room for
// two blocks' shared memory). Over a bf16 cache, or fp8 (CACHE fp8); the output in f32, or
// bf16 (suffix _o16).
#define FLASH_ATTENTION(HD, BLOCKS, O, SUFFIX, C, CACHE)                                      \
    extern "C" __global__ void __launch_bounds__(FA_THREADS, BLOCKS)                          \
        flash_attention_##CACHE##_hd##HD##SUFFIX(                                             \
            const float* q, const C* cache_k, const C* cache_v, const u32* positions,         \
            const u32* token_runs, u32 runs, const u32* block_tables, u32 max_blocks,         \
            u32 block_size, u32 num_blocks, u32 tokens, u32 num_heads, u32 num_kv_heads,      \
            float scale, u32 split_keys, float* partial, O* out, Diag* diag) {                \
        begin_kernel();                                                                       \
        flash_attention_impl<HD, O, C>(q, cache_k, cache_v, positions, token_runs, runs,      \
                                       block_tables, max_blocks, block_size, num_blocks,      \
                                       tokens, num_heads, num_kv_heads, scale, split_keys,    \
                                       partial, out, diag);                                   \
    }
#define FLASH_MERGE(HD, O, SUFFIX)                                                            \
    extern "C" __global__ void __launch_bounds__(256)                                         \
        flash_merge_hd##HD##SUFFIX(const float* partial, u32 splits, u32 items, O* out) {     \
        begin_kernel();                                                                       \
        flash_merge_impl<HD, O>(partial, splits, items, out);                                 \
    }
#define FLASH_HEAD_DIM(HD, BLOCKS)                          \
    FLASH_ATTENTION(HD, BLOCKS, float, , u16, bf16)         \
    FLASH_ATTENTION(HD, BLOCKS, u16, _o16, u16, bf16)       \
    FLASH_ATTENTION(HD, BLOCKS, float, , u8, fp8)           \
    FLASH_ATTENTION(HD, BLOCKS, u16, _o16, u8, fp8)         \
    FLASH_MERGE(HD, float, )                                \
    FLASH_MERGE(HD, u16, _o16)
FLASH_HEAD_DIM(64, 3)
FLASH_HEAD_DIM(128, 3)
FLASH_HEAD_DIM(256, 2)
