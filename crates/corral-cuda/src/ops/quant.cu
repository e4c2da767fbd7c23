// Block-format weights (GGUF's Q8_0, Q4_0, Q5_0, Q4_K, Q5_K, Q6_K) read as stored: a lane
// decodes 32 values of a row at a time in registers, as quant.rs defines them (the same
// products in the same order, so that a decoded value is the CPU's bit for bit), and meets
// them with f32 activations. Few rows (decode) and the per-token experts read the blocks
// directly; many rows decode a matrix to bf16 for the tensor-core paths.

#define QMV_WARPS 8  // output features (a warp each) per block of the few-row products

// Unaligned-safe little-endian reads of a block's fields: blocks of 34, 18, 22 and 210 bytes
// are only 2-byte aligned.
__device__ __forceinline__ u32 byte_at(const u16* h, u32 i) { return (h[i >> 1] >> (8 * (i & 1))) & 0xffu; }

// q · d and d·scale · q − dmin·min, rounded as the CPU rounds them (no fused multiply-add).
__device__ __forceinline__ float q_times(float d, int q) { return __fmul_rn((float)q, d); }
__device__ __forceinline__ float q_affine(float d1, u32 q, float m1) {
    return __fsub_rn(__fmul_rn(d1, (float)q), m1);
}

// Scale and min of sub-block j of a Q4_K/Q5_K super-block's 12 packed bytes (quant.rs's
// k_scale_min).
__device__ __forceinline__ void k_scale_min(const u8* scales, u32 j, u32* sc, u32* m) {
    if (j < 4) {
        *sc = scales[j] & 63u;
        *m = scales[j + 4] & 63u;
    } else {
        *sc = (scales[j + 4] & 0x0fu) | ((scales[j - 4] >> 6) << 4);
        *m = (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4);
    }
}

struct q8_0 { enum { VALUES = 32, BYTES = 34 }; };
struct q4_0 { enum { VALUES = 32, BYTES = 18 }; };
struct q5_0 { enum { VALUES = 32, BYTES = 22 }; };
struct q4_k { enum { VALUES = 256, BYTES = 144 }; };
struct q5_k { enum { VALUES = 256, BYTES = 176 }; };
struct q6_k { enum { VALUES = 256, BYTES = 210 }; };
struct f8_128 { enum { VALUES = 128, BYTES = 132 }; };

// Values 32c .. 32c + 31 of a row of blocks starting at `row`.
template <typename F> __device__ void decode32(const u8* row, u32 c, float (&v)[32]);

template <> __device__ __forceinline__ void decode32<q8_0>(const u8* row, u32 c, float (&v)[32]) {
    const u16* h = reinterpret_cast<const u16*>(row + (size_t)c * 34);
    float d = f16_to_f32(h[0]);
#pragma unroll
    for (int i = 0; i < 16; i++) {
        u32 w = h[1 + i];
        v[2 * i] = q_times(d, (int)(signed char)(w & 0xffu));
        v[2 * i + 1] = q_times(d, (int)(signed char)(w >> 8));
    }
}

template <> __device__ __forceinline__ void decode32<q4_0>(const u8* row, u32 c, float (&v)[32]) {
    const u16* h = reinterpret_cast<const u16*>(row + (size_t)c * 18);
    float d = f16_to_f32(h[0]);
#pragma unroll
    for (int j = 0; j < 16; j++) {
        u32 q = byte_at(h + 1, j);
        v[j] = q_times(d, (int)(q & 15u) - 8);
        v[j + 16] = q_times(d, (int)(q >> 4) - 8);
    }
}

template <> __device__ __forceinline__ void decode32<q5_0>(const u8* row, u32 c, float (&v)[32]) {
    const u16* h = reinterpret_cast<const u16*>(row + (size_t)c * 22);
    float d = f16_to_f32(h[0]);
    u32 qh = (u32)h[1] | ((u32)h[2] << 16);
#pragma unroll
    for (int j = 0; j < 16; j++) {
        u32 q = byte_at(h + 3, j);
        u32 lo = ((qh >> j) << 4) & 0x10u, hi = (qh >> (j + 12)) & 0x10u;
        v[j] = q_times(d, (int)((q & 15u) | lo) - 16);
        v[j + 16] = q_times(d, (int)((q >> 4) | hi) - 16);
    }
}

// Q4_K and Q5_K: sub-block s of super-block c / 8 is the low (s even) or high nibbles of the
// 32 bytes of the s / 2-th 64 values, with bit s of each qh byte as a fifth bit (Q5_K).
template <bool FIFTH>
__device__ __forceinline__ void decode32_k(const u8* sb, u32 s, float (&v)[32]) {
    const u16* h = reinterpret_cast<const u16*>(sb);
    float d = f16_to_f32(h[0]), dmin = f16_to_f32(h[1]);
    u32 sc, m;
    k_scale_min(sb + 4, s, &sc, &m);
    float d1 = d * (float)sc, m1 = dmin * (float)m;
    const u32* qs = reinterpret_cast<const u32*>(sb + (FIFTH ? 48 : 16) + 32 * (s >> 1));
    const u32* qh = reinterpret_cast<const u32*>(sb + 16);
    u32 shift = 4 * (s & 1);
#pragma unroll
    for (int i = 0; i < 8; i++) {
        u32 w = qs[i], hw = FIFTH ? qh[i] : 0u;
#pragma unroll
        for (int b = 0; b < 4; b++) {
            u32 q = (w >> (8 * b + shift)) & 15u;
            if (FIFTH) q |= ((hw >> (8 * b + s)) & 1u) << 4;
            v[4 * i + b] = q_affine(d1, q, m1);
        }
    }
}

template <> __device__ __forceinline__ void decode32<q4_k>(const u8* row, u32 c, float (&v)[32]) {
    decode32_k<false>(row + (size_t)(c >> 3) * 144, c & 7, v);
}

template <> __device__ __forceinline__ void decode32<q5_k>(const u8* row, u32 c, float (&v)[32]) {
    decode32_k<true>(row + (size_t)(c >> 3) * 176, c & 7, v);
}

// Q6_K: sub-block s is quarter k = s % 4 of half s / 4: low (k < 2) or high nibbles of ql
// bytes 0..32 (k even) or 32..64 (k odd) of the half, with bits 2k..2k+1 of its qh bytes
// as the top two; scale 16 values at a time.
template <> __device__ __forceinline__ void decode32<q6_k>(const u8* row, u32 c, float (&v)[32]) {
    const u8* sb = row + (size_t)(c >> 3) * 210;
    u32 s = c & 7, half = s >> 2, k = s & 3;
    const u16* ql = reinterpret_cast<const u16*>(sb + 64 * half + 32 * (k & 1));
    const u16* qh = reinterpret_cast<const u16*>(sb + 128 + 32 * half);
    const u16* hsc = reinterpret_cast<const u16*>(sb + 192 + 8 * half);
    float d = f16_to_f32(reinterpret_cast<const u16*>(sb)[104]);
    float scale[2];
#pragma unroll
    for (int i = 0; i < 2; i++) scale[i] = d * (float)(signed char)byte_at(hsc, i + 2 * k);
    u32 lo_shift = 4 * (k >> 1), hi_shift = 2 * k;
#pragma unroll
    for (int i = 0; i < 16; i++) {
        u32 l = ql[i], hh = qh[i];
#pragma unroll
        for (int b = 0; b < 2; b++) {
            u32 q = ((l >> (8 * b + lo_shift)) & 15u) | (((hh >> (8 * b + hi_shift)) & 3u) << 4);
            v[2 * i + b] = q_times(scale[i >> 3], (int)q - 32);
        }
    }
}

// FP8 blocks: an f32 scale, then 128 e4m3 bytes; each value e4m3 · scale.
template <> __device__ __forceinline__ void decode32<f8_128>(const u8* row, u32 c, float (&v)[32]) {
    const u8* blk = row + (size_t)(c >> 2) * 132;
    float scale = *reinterpret_cast<const float*>(blk);
    const u32* q = reinterpret_cast<const u32*>(blk + 4 + 32 * (c & 3));
#pragma unroll
    for (int i = 0; i < 8; i++) {
        u32 w = q[i];
#pragma unroll
        for (int b = 0; b < 4; b++) {
            u32 q = (w >> (8 * b)) & 0xffu;
            // 0x7f and 0xff are NaN in e4m3 (no infinities), as the CPU decodes them.
            float e = (q & 0x7fu) == 0x7fu ? __int_as_float(0x7fc00000) : e4m3_to_f32(q);
            v[4 * i + b] = __fmul_rn(e, scale);
        }
    }
}

template <typename F> __device__ __forceinline__ size_t row_bytes(u32 k) {
    return (size_t)(k / F::VALUES) * F::BYTES;
}

// Activations quantized as the CPU quantizes them (quant_dot.rs, bit for bit): q =
// round-half-even(x / d) in int8 with d = max|x| / 127 over each 32 values, or with `supers`
// over each 256 (a K-quant super-block: its 8 blocks get the same d), and the sums of each
// 16-value half's q (for formats whose values carry an offset or a min). A warp per 32
// values, a block of 8 warps per 256 (rows are whole super-blocks when `supers`).
extern "C" __global__ void quantize_q8(const float* x, u64 blocks, signed char* q, float* d,
                                       int2* sums, u32 supers) {
    begin_kernel();
    __shared__ float block_max[8];
    u64 b = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    bool in = b < blocks;
    float v = in ? x[b * 32 + lane] : 0.f, amax = fabsf(v);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if (supers) {
        if (lane == 0) block_max[warp] = amax;
        __syncthreads();
#pragma unroll
        for (int w = 0; w < 8; w++) amax = fmaxf(amax, block_max[w]);
    }
    if (!in) return;
    float dd = amax / 127.f, inv = dd > 0.f ? 1.f / dd : 0.f;
    // Rounded half to even, then as Rust's `as i8` converts: NaN to 0, out of range saturated.
    float r = rintf(__fmul_rn(v, inv));
    int qi = r != r ? 0 : (int)fminf(127.f, fmaxf(-128.f, r));
    q[b * 32 + lane] = (signed char)qi;
    int half = qi;
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) half += __shfl_xor_sync(0xffffffffu, half, o);
    int other = __shfl_xor_sync(0xffffffffu, half, 16);
    if (lane == 0) {
        d[b] = dd;
        sums[b] = make_int2(half, other);
    }
}

// `N` bytes from p (2-byte aligned at least) as N / 4 little-endian words: the aligned 4-byte
// words that cover them, funnel-shifted into place. Where p is not 4-aligned that reads up to
// 2 bytes either side of the N, within the words that hold them (so within the allocation's
// pages; a memory checker may still name them).
template <int N>
__device__ __forceinline__ void load_words(const u8* p, u32 (&w)[N / 4]) {
    const u32* base = reinterpret_cast<const u32*>((size_t)p & ~(size_t)3);
    u32 sh = 8 * ((u32)(size_t)p & 3u), a[N / 4 + 1];
#pragma unroll
    for (int i = 0; i < N / 4; i++) a[i] = base[i];
    a[N / 4] = sh ? base[N / 4] : 0u;
#pragma unroll
    for (int i = 0; i < N / 4; i++) w[i] = __funnelshift_r(a[i], a[i + 1], sh);
}

__device__ __forceinline__ void load_words16(const u8* p, u32 (&w)[8]) {
    uint4 a = reinterpret_cast<const uint4*>(p)[0], b = reinterpret_cast<const uint4*>(p)[1];
    w[0] = a.x; w[1] = a.y; w[2] = a.z; w[3] = a.w;
    w[4] = b.x; w[5] = b.y; w[6] = b.z; w[7] = b.w;
}

// 32 values of a row as the integer products need them: w[j] holds values 4j .. 4j + 3 as
// bytes (signed for Q8_0; the others' are below 64), and value i is a[i / 16] · w_i + o[i / 16].
struct QChunk {
    u32 w[8];
    float a[2], o[2];
};

template <typename F> __device__ void int_chunk(const u8* row, u32 c, QChunk& q);

template <> __device__ __forceinline__ void int_chunk<q8_0>(const u8* row, u32 c, QChunk& q) {
    const u8* b = row + (size_t)c * 34;
    float d = f16_to_f32(*reinterpret_cast<const u16*>(b));
    load_words<32>(b + 2, q.w);
    q.a[0] = q.a[1] = d;
    q.o[0] = q.o[1] = 0.f;
}

template <> __device__ __forceinline__ void int_chunk<q4_0>(const u8* row, u32 c, QChunk& q) {
    const u8* b = row + (size_t)c * 18;
    float d = f16_to_f32(*reinterpret_cast<const u16*>(b));
    u32 raw[4];
    load_words<16>(b + 2, raw);
#pragma unroll
    for (int j = 0; j < 4; j++) {
        q.w[j] = raw[j] & 0x0f0f0f0fu;
        q.w[4 + j] = (raw[j] >> 4) & 0x0f0f0f0fu;
    }
    q.a[0] = q.a[1] = d;
    q.o[0] = q.o[1] = -8.f * d;
}

// Bits 4k .. 4k + 3 of qh into bit 4 of each byte of a word.
__device__ __forceinline__ u32 spread4(u32 qh, int k) {
    u32 b = (qh >> (4 * k)) & 15u;
    return ((b & 1u) << 4) | ((b & 2u) << 11) | ((b & 4u) << 18) | ((b & 8u) << 25);
}

template <> __device__ __forceinline__ void int_chunk<q5_0>(const u8* row, u32 c, QChunk& q) {
    const u8* b = row + (size_t)c * 22;
    const u16* h = reinterpret_cast<const u16*>(b);
    float d = f16_to_f32(h[0]);
    u32 qh = (u32)h[1] | ((u32)h[2] << 16), raw[4];
    load_words<16>(b + 6, raw);
#pragma unroll
    for (int j = 0; j < 4; j++) {
        q.w[j] = (raw[j] & 0x0f0f0f0fu) | spread4(qh, j);
        q.w[4 + j] = ((raw[j] >> 4) & 0x0f0f0f0fu) | spread4(qh, 4 + j);
    }
    q.a[0] = q.a[1] = d;
    q.o[0] = q.o[1] = -16.f * d;
}

template <bool FIFTH>
__device__ __forceinline__ void int_chunk_k(const u8* sb, u32 s, QChunk& q) {
    u32 dm = *reinterpret_cast<const u32*>(sb);
    float d = f16_to_f32((u16)(dm & 0xffffu)), dmin = f16_to_f32((u16)(dm >> 16));
    u32 sc, m;
    k_scale_min(sb + 4, s, &sc, &m);
    u32 qs[8];
    load_words16(sb + (FIFTH ? 48 : 16) + 32 * (s >> 1), qs);
    u32 shift = 4 * (s & 1);
#pragma unroll
    for (int j = 0; j < 8; j++) q.w[j] = (qs[j] >> shift) & 0x0f0f0f0fu;
    if (FIFTH) {
        u32 qh[8];
        load_words16(sb + 16, qh);
#pragma unroll
        for (int j = 0; j < 8; j++) q.w[j] |= ((qh[j] >> s) & 0x01010101u) << 4;
    }
    q.a[0] = q.a[1] = d * (float)sc;
    q.o[0] = q.o[1] = -(dmin * (float)m);
}

template <> __device__ __forceinline__ void int_chunk<q4_k>(const u8* row, u32 c, QChunk& q) {
    int_chunk_k<false>(row + (size_t)(c >> 3) * 144, c & 7, q);
}

template <> __device__ __forceinline__ void int_chunk<q5_k>(const u8* row, u32 c, QChunk& q) {
    int_chunk_k<true>(row + (size_t)(c >> 3) * 176, c & 7, q);
}

template <> __device__ __forceinline__ void int_chunk<q6_k>(const u8* row, u32 c, QChunk& q) {
    const u8* sb = row + (size_t)(c >> 3) * 210;
    u32 s = c & 7, half = s >> 2, k = s & 3;
    u32 ql[8], qh[8];
    load_words<32>(sb + 64 * half + 32 * (k & 1), ql);
    load_words<32>(sb + 128 + 32 * half, qh);
    u32 ls = 4 * (k >> 1), hs = 2 * k;
#pragma unroll
    for (int j = 0; j < 8; j++)
        q.w[j] = ((ql[j] >> ls) & 0x0f0f0f0fu) | (((qh[j] >> hs) & 0x03030303u) << 4);
    float d = f16_to_f32(reinterpret_cast<const u16*>(sb)[104]);
    const u8* sc = sb + 192 + 8 * half + 2 * k;
#pragma unroll
    for (int i = 0; i < 2; i++) {
        q.a[i] = d * (float)(signed char)sc[i];
        q.o[i] = -32.f * q.a[i];
    }
}

// The chunk times 32 quantized activations: dx · Σ_h (a_h · Σ w·q + o_h · Σ q).
__device__ __forceinline__ float chunk_dot(const QChunk& w, const signed char* xq, float dx,
                                           int2 sums) {
    int4 lo = reinterpret_cast<const int4*>(xq)[0], hi = reinterpret_cast<const int4*>(xq)[1];
    int x[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    int s0 = 0, s1 = 0;
#pragma unroll
    for (int j = 0; j < 4; j++) s0 = __dp4a((int)w.w[j], x[j], s0);
#pragma unroll
    for (int j = 4; j < 8; j++) s1 = __dp4a((int)w.w[j], x[j], s1);
    return dx * (w.a[0] * (float)s0 + w.o[0] * (float)sums.x + w.a[1] * (float)s1 +
                 w.o[1] * (float)sums.y);
}

// Rows of activations quantized by quantize_q8: row r's 32 values from c·32.
struct QActs {
    const signed char* q;
    const float* d;
    const int2* sums;
    u32 k;  // values a row
    __device__ __forceinline__ float dot(const QChunk& w, u32 r, u32 c) const {
        size_t b = (size_t)r * (k / 32) + c;
        return chunk_dot(w, q + b * 32, d[b], sums[b]);
    }
};

// out[rows, N] = x[rows, K] · Wᵀ, rows ≤ ROWS, out's rows `ld` apart (a projection written
// into columns of a wider output): a warp per output feature, its lanes over the row's
// 32-value pieces, each piece's integers unpacked once for every row of x.
template <typename F, int ROWS>
__device__ void matvec_q_impl(QActs x, u32 rows, const u8* w, u32 N, u32 K, float* out, u32 ld,
                              Diag* diag) {
    u32 lane = threadIdx.x & 31, n = blockIdx.x * QMV_WARPS + (threadIdx.x >> 5);
    if (threadIdx.x == 0)
        count_weight_bytes(diag, min((u32)QMV_WARPS, N - blockIdx.x * QMV_WARPS) * row_bytes<F>(K));
    if (n >= N) return;
    const u8* wr = w + (size_t)n * row_bytes<F>(K);
    float acc[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; r++) acc[r] = 0.f;
    for (u32 c = lane; c < K / 32; c += 32) {
        QChunk q;
        int_chunk<F>(wr, c, q);
#pragma unroll
        for (int r = 0; r < ROWS; r++)
            if (r < rows) acc[r] += x.dot(q, r, c);
    }
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        float s = warp_sum(acc[r]);
        if (lane == 0 && r < rows) out[(size_t)r * ld + n] = s;
    }
}

// Per-token experts, first half: act[p, i] = silu(gate[e] x[t]) · up[e] x[t], a warp per
// (pair, row). Grid: ceil(I / 8) blocks per pair, pair-major.
template <typename F>
__device__ void per_token_gate_up_q_impl(QActs x, u32 hidden, const u32* ids, u32 top_k,
                                         u32 num_experts, const u64* gate_table,
                                         const u64* up_table, u32 inter, float* act, Diag* diag) {
    u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u32 chunks = (inter + 7) / 8;
    u32 p = blockIdx.x / chunks, chunk = blockIdx.x % chunks, i = chunk * 8 + warp;
    u32 e = ids[p];
    if (e >= num_experts) {
        if (threadIdx.x == 0) raise_error(diag, ERR_EXPERT_ID);
        return;
    }
    if (threadIdx.x == 0) count_weight_bytes(diag, 2ull * min(8u, inter - chunk * 8) * row_bytes<F>(hidden));
    if (i >= inter) return;
    u32 t = p / top_k;
    const u8* g = reinterpret_cast<const u8*>(gate_table[e]) + i * row_bytes<F>(hidden);
    const u8* u = reinterpret_cast<const u8*>(up_table[e]) + i * row_bytes<F>(hidden);
    float gv = 0.f, uv = 0.f;
    for (u32 c = lane; c < hidden / 32; c += 32) {
        QChunk qg, qu;
        int_chunk<F>(g, c, qg);
        int_chunk<F>(u, c, qu);
        gv += x.dot(qg, t, c);
        uv += x.dot(qu, t, c);
    }
    gv = warp_sum(gv);
    uv = warp_sum(uv);
    if (lane == 0) act[(size_t)p * inter + i] = silu(gv) * uv;
}

// Per-token experts, second half: out[t, h] = Σ_j w[t, j] · down[e_j][h] · act[t·k + j], a
// warp per (token, row), its lanes over the (slot, 32 values) pieces of every slot at once.
// Grid: ceil(H / 8) blocks per token.
template <typename F>
__device__ void per_token_down_q_impl(QActs act, u32 inter, const u32* ids,
                                      const float* route_weights, u32 top_k, u32 num_experts,
                                      const u64* down_table, u32 hidden, float* out, Diag* diag) {
    u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u32 chunks = (hidden + 7) / 8;
    u32 t = blockIdx.x / chunks, chunk = blockIdx.x % chunks, h = chunk * 8 + warp;
    if (threadIdx.x == 0)
        count_weight_bytes(diag, (u64)min(8u, hidden - chunk * 8) * row_bytes<F>(inter) * top_k);
    if (h >= hidden) return;
    u32 per_slot = inter / 32;
    float total = 0.f;
    for (u32 q = lane; q < top_k * per_slot; q += 32) {
        u32 j = q / per_slot, c = q % per_slot, p = t * top_k + j, e = ids[p];
        if (e >= num_experts) {
            raise_error(diag, ERR_EXPERT_ID);
            e = 0;
        }
        QChunk w;
        int_chunk<F>(reinterpret_cast<const u8*>(down_table[e]) + h * row_bytes<F>(inter), c, w);
        total += route_weights[p] * act.dot(w, p, c);
    }
    total = warp_sum(total);
    if (lane == 0) out[(size_t)t * hidden + h] = total;
}

// FP8 blocks (F8_E4M3x128: per row block an f32 scale, then 128 e4m3 values) on tensor cores
// (sm_89 and newer, whose hardware converts e4m3 to f16; the host reads FP8 blocks only
// there). The block stages the rows of x it needs in shared memory first, as f16 scaled per
// 128 values (the block's f32 scale kept beside them); the weights' e4m3 become f16 in
// registers (exact), and f16 mmas (m16n8k16, f32 accumulate) take a column per row of x. Each
// k-block's products are scaled once, by the weight row's scale and x's. (Hopper's mma.sync
// on e4m3 operands is no faster: it converts both to f16 itself.) The k index within a block
// is mapped onto memory so that lane (g, t) holds words t + 4i (i = 0..7) of its rows (the
// four lanes of a row read 16 contiguous bytes a load), and x is staged in that order, a
// lane's values together.
#define F8_WARPS 8  // warps of an FP8 block, splitting K's blocks (or units) between them

// A staged x: per row and k-block 64 words (f16 pairs), then the f32 scales.
struct F8Staged {
    const u32* words;
    u32 blocks;
    const float* scales;
    __device__ u32 at(u32 r, u32 blk) const { return (r * blocks + blk) * 64; }
    __device__ float scale(u32 r, u32 blk) const { return scales[r * blocks + blk]; }
};

// A k-block of a 16-row tile as lane (g, t) holds it: words t + 4i of rows g (lo) and g + 8
// (hi), zeros for a null row, and the rows' scales.
struct F8Tile {
    u32 lo[8], hi[8];
    float s_lo, s_hi;
};

#if __CUDA_ARCH__ >= 890
// Four e4m3 values (a word's bytes, low first) as two f16 pairs, exactly.
__device__ __forceinline__ void e4m3x4_to_f16x4(u32 w, u32& lo, u32& hi) {
    asm("{.reg .b16 a, b;\n"
        " mov.b32 {a, b}, %2;\n"
        " cvt.rn.f16x2.e4m3x2 %0, a;\n"
        " cvt.rn.f16x2.e4m3x2 %1, b;}"
        : "=r"(lo), "=r"(hi)
        : "r"(w));
}

// Rows [0, rows) of x (`ldx` floats apart, `blocks` k-blocks each) staged at `words` for the
// products (F8Staged's layout), the block's warps taking (row, k-block) items, LOADS of them
// in flight a warp; a lane quantizes 4 values. Ends with the block synchronised.
template <int LOADS, int WARPS = F8_WARPS>
__device__ void f8_stage_x(const float* x, u32 ldx, u32 rows, u32 blocks, u32* words,
                           F8Staged& st) {
    u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u32 items = rows * blocks, pos = (lane & 3) * 8 + (lane >> 2);
    float* scales = reinterpret_cast<float*>(words + items * 64);
    st = F8Staged{words, blocks, scales};
    for (u32 i0 = warp; i0 < items; i0 += LOADS * WARPS) {
        float4 v[LOADS];
#pragma unroll
        for (int u = 0; u < LOADS; u++) {
            u32 i = i0 + u * WARPS;
            v[u] = i < items ? *reinterpret_cast<const float4*>(x + (size_t)(i / blocks) * ldx +
                                                                (i % blocks) * 128 + lane * 4)
                             : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int u = 0; u < LOADS; u++) {
            u32 i = i0 + u * WARPS;
            if (i >= items) break;
            float m = warp_max(fmaxf(fmaxf(fabsf(v[u].x), fabsf(v[u].y)),
                                     fmaxf(fabsf(v[u].z), fabsf(v[u].w))));
            // Scaled to at most 2^14: f16's 11 bits for the block's largest, its range for
            // the rest.
            float inv = m > 0.f ? 16384.f / m : 0.f;
            uint2 pair = make_uint2(pack2<true>(v[u].x * inv, v[u].y * inv),
                                    pack2<true>(v[u].z * inv, v[u].w * inv));
            reinterpret_cast<uint2*>(words + i * 64)[pos] = pair;
            if (lane == 0) scales[i] = m * (1.f / 16384.f);
        }
    }
    __syncthreads();
}

// Lane (g, t)'s B operands for k-block `blk`: staged row r, or zeros where `live` is false.
__device__ __forceinline__ void f8_x_operands(const F8Staged& st, u32 r, bool live, u32 blk,
                                              u32 (&b)[16]) {
    if (live) {
        const uint4* p = reinterpret_cast<const uint4*>(st.words + st.at(r, blk) + (threadIdx.x & 3) * 16);
#pragma unroll
        for (int q = 0; q < 4; q++) {
            uint4 v = p[q];
            b[4 * q] = v.x, b[4 * q + 1] = v.y, b[4 * q + 2] = v.z, b[4 * q + 3] = v.w;
        }
    } else {
#pragma unroll
        for (int i = 0; i < 16; i++) b[i] = 0u;
    }
}

__device__ __forceinline__ void f8_load_row(const u8* row, u32 blk, u32 (&w)[8], float& s) {
    if (row) {
        const u8* block = row + (size_t)blk * 132;
        const u32* p = reinterpret_cast<const u32*>(block + 4) + (threadIdx.x & 3);
        s = *reinterpret_cast<const float*>(block);
#pragma unroll
        for (int i = 0; i < 8; i++) w[i] = p[4 * i];
    } else {
        s = 0.f;
#pragma unroll
        for (int i = 0; i < 8; i++) w[i] = 0u;
    }
}

// k-block `blk` of the tile whose rows g and g + 8 start at `lo` and `hi` (null: zeros).
__device__ __forceinline__ void f8_load_tile(const u8* lo, const u8* hi, u32 blk, F8Tile& a) {
    f8_load_row(lo, blk, a.lo, a.s_lo);
    f8_load_row(hi, blk, a.hi, a.s_hi);
}

// One k-block's products of a tile and a staged x, added to acc: entries 0, 1 row g against
// x rows 2t, 2t + 1 (the lane's columns), 2, 3 row g + 8; scaled by the weight rows' scales
// and those x rows' `sx` (0 for a column without a row).
__device__ __forceinline__ void f8_block(const F8Tile& a, const u32 (&b)[16], const float (&sx)[2],
                                         float (&acc)[4]) {
    float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int i = 0; i < 8; i++) {
        u32 l[2], h[2];
        e4m3x4_to_f16x4(a.lo[i], l[0], l[1]);
        e4m3x4_to_f16x4(a.hi[i], h[0], h[1]);
        u32 op[4] = {l[0], h[0], l[1], h[1]};
        mma16816<true>(c, op, &b[2 * i]);
    }
    acc[0] += a.s_lo * sx[0] * c[0];
    acc[1] += a.s_lo * sx[1] * c[1];
    acc[2] += a.s_hi * sx[0] * c[2];
    acc[3] += a.s_hi * sx[1] * c[3];
}

// out[rows, N] = x[rows, K] · Wᵀ for FP8 blocks, rows ≤ 8, out's rows `ld` apart: a block
// per 16 features, its warps taking K's blocks UB at a time; the first weight loads are in
// flight while the kernel before ends. Grid: ceil(N / 16).
template <int UB>
__device__ void matvec_f8_impl(const float* x, u32 rows, const u8* w, u32 N, u32 K, float* out,
                               u32 ld, Diag* diag) {
    extern __shared__ __align__(16) u32 f8_smem[];
    __shared__ float red[(F8_WARPS - 1) * 4 * 32];
    u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    u32 n0 = blockIdx.x * 16, blocks = K / 128;
    size_t rb = row_bytes<f8_128>(K);
    if (threadIdx.x == 0) count_weight_bytes(diag, min(16u, N - n0) * rb);
    const u8* lo = n0 + g < N ? w + (n0 + g) * rb : nullptr;
    const u8* hi = n0 + g + 8 < N ? w + (n0 + g + 8) * rb : nullptr;
    F8Tile a[UB];
#pragma unroll
    for (int u = 0; u < UB; u++) {
        u32 blk = warp + u * F8_WARPS;
        f8_load_tile(blk < blocks ? lo : nullptr, blk < blocks ? hi : nullptr, blk, a[u]);
    }
    wait_for_previous_kernel();
    F8Staged st;
    f8_stage_x<4>(x, K, rows, blocks, f8_smem, st);
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (u32 b0 = warp; b0 < blocks; b0 += UB * F8_WARPS) {
        if (b0 != warp) {
#pragma unroll
            for (int u = 0; u < UB; u++) {
                u32 blk = b0 + u * F8_WARPS;
                f8_load_tile(blk < blocks ? lo : nullptr, blk < blocks ? hi : nullptr, blk, a[u]);
            }
        }
#pragma unroll
        for (int u = 0; u < UB; u++) {
            u32 blk = b0 + u * F8_WARPS;
            if (blk >= blocks) break;
            u32 b[16];
            f8_x_operands(st, g, g < rows, blk, b);
            float sx[2] = {2 * t < rows ? st.scale(2 * t, blk) : 0.f,
                           2 * t + 1 < rows ? st.scale(2 * t + 1, blk) : 0.f};
            f8_block(a[u], b, sx, acc);
        }
    }
    if (!mvm_reduce<4>(acc, red)) return;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        u32 n = n0 + g + (i >= 2 ? 8 : 0), r = 2 * t + (i & 1);
        if (n < N && r < rows) out[(size_t)r * ld + n] = acc[i];
    }
}

// Per-token experts in FP8 blocks, first half: a block per (pair, 16 rows of gate and of up),
// x the pair's token row; its warps take the k-blocks UB at a time. Grid: ceil(I / 16) blocks
// per pair, pair-major.
template <int UB>
__device__ void per_token_gate_up_f8_impl(const float* x, u32 hidden, const u32* ids, u32 top_k,
                                          u32 num_experts, const u64* gate_table,
                                          const u64* up_table, u32 inter, float* act,
                                          Diag* diag) {
    extern __shared__ __align__(16) u32 f8_smem[];
    __shared__ float red[(F8_WARPS - 1) * 8 * 32];
    u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    u32 tiles = (inter + 15) / 16, p = blockIdx.x / tiles, i0 = (blockIdx.x % tiles) * 16;
    u32 blocks = hidden / 128, e = ids[p];
    if (e >= num_experts) {
        if (threadIdx.x == 0) raise_error(diag, ERR_EXPERT_ID);
        return;
    }
    size_t rb = row_bytes<f8_128>(hidden);
    if (threadIdx.x == 0) count_weight_bytes(diag, 2ull * min(16u, inter - i0) * rb);
    const u8* gate = reinterpret_cast<const u8*>(gate_table[e]);
    const u8* up = reinterpret_cast<const u8*>(up_table[e]);
    bool lo_ok = i0 + g < inter, hi_ok = i0 + g + 8 < inter;
    const u8* rows[2][2] = {{lo_ok ? gate + (i0 + g) * rb : nullptr, hi_ok ? gate + (i0 + g + 8) * rb : nullptr},
                            {lo_ok ? up + (i0 + g) * rb : nullptr, hi_ok ? up + (i0 + g + 8) * rb : nullptr}};
    F8Tile a[UB][2];
#pragma unroll
    for (int u = 0; u < UB; u++) {
        u32 blk = warp + u * F8_WARPS;
#pragma unroll
        for (int v = 0; v < 2; v++)
            f8_load_tile(blk < blocks ? rows[v][0] : nullptr, blk < blocks ? rows[v][1] : nullptr,
                         blk, a[u][v]);
    }
    F8Staged st;
    f8_stage_x<4>(x + (size_t)(p / top_k) * hidden, hidden, 1, blocks, f8_smem, st);
    float acc[2][4] = {};
    for (u32 b0 = warp; b0 < blocks; b0 += UB * F8_WARPS) {
        if (b0 != warp) {
#pragma unroll
            for (int u = 0; u < UB; u++) {
                u32 blk = b0 + u * F8_WARPS;
#pragma unroll
                for (int v = 0; v < 2; v++)
                    f8_load_tile(blk < blocks ? rows[v][0] : nullptr,
                                 blk < blocks ? rows[v][1] : nullptr, blk, a[u][v]);
            }
        }
#pragma unroll
        for (int u = 0; u < UB; u++) {
            u32 blk = b0 + u * F8_WARPS;
            if (blk >= blocks) break;
            u32 b[16];
            f8_x_operands(st, 0, g == 0, blk, b);
            float sx[2] = {t == 0 ? st.scale(0, blk) : 0.f, 0.f};
            f8_block(a[u][0], b, sx, acc[0]);
            f8_block(a[u][1], b, sx, acc[1]);
        }
    }
    if (!mvm_reduce<8>(&acc[0][0], red)) return;
    // The x row's column is lane t == 0's, entries 0 (row g) and 2 (row g + 8).
    if (t != 0) return;
#pragma unroll
    for (int i = 0; i < 4; i += 2) {
        u32 f = i0 + g + 4 * i;
        if (f < inter) act[(size_t)p * inter + f] = silu(acc[0][i]) * acc[1][i];
    }
}

// Per-token experts in FP8 blocks, second half: a block per (token, 16 features), its units
// the (routed slot, k-block) pairs, UB a warp at a time, each against its slot's act row; the
// slots' routing weights scale their products. Ids and routing weights come from the kernel
// before the one before, so the first weight loads are in flight while the gate/up kernel
// ends. Grid: ceil(H / 16) blocks per token.
template <int UB, int WARPS>
__device__ void per_token_down_f8_impl(const float* act, u32 inter, const u32* ids,
                                       const float* route_weights, u32 top_k, u32 num_experts,
                                       const u64* down_table, u32 hidden, float* out,
                                       float* red, Diag* diag) {
    extern __shared__ __align__(16) u32 f8_smem[];
    u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    u32 tiles = (hidden + 15) / 16, tok = blockIdx.x / tiles, h0 = (blockIdx.x % tiles) * 16;
    u32 blocks = inter / 128, units = top_k * blocks;
    size_t rb = row_bytes<f8_128>(inter);
    if (threadIdx.x == 0) count_weight_bytes(diag, (u64)min(16u, hidden - h0) * rb * top_k);
    bool lo_ok = h0 + g < hidden, hi_ok = h0 + g + 8 < hidden;
    // Unit u's tile and routing weight; a bad expert id reads nothing.
    auto load = [&](u32 u, F8Tile& a, float& weight) {
        const u8* base = nullptr;
        weight = 0.f;
        if (u < units) {
            u32 j = u / blocks, e = ids[tok * top_k + j];
            if (e < num_experts) {
                base = reinterpret_cast<const u8*>(down_table[e]);
                weight = route_weights[tok * top_k + j];
            } else {
                raise_error(diag, ERR_EXPERT_ID);
            }
        }
        u32 blk = u % blocks;
        f8_load_tile(base && lo_ok ? base + (h0 + g) * rb : nullptr,
                     base && hi_ok ? base + (h0 + g + 8) * rb : nullptr, blk, a);
    };
    F8Tile a[UB];
    float weight[UB];
#pragma unroll
    for (int u = 0; u < UB; u++) load(warp + u * WARPS, a[u], weight[u]);
    wait_for_previous_kernel();
    F8Staged st;
    f8_stage_x<8, WARPS>(act + (size_t)tok * top_k * inter, inter, top_k, blocks, f8_smem, st);
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (u32 u0 = warp; u0 < units; u0 += UB * WARPS) {
        if (u0 != warp) {
#pragma unroll
            for (int u = 0; u < UB; u++) load(u0 + u * WARPS, a[u], weight[u]);
        }
#pragma unroll
        for (int u = 0; u < UB; u++) {
            u32 unit = u0 + u * WARPS;
            if (unit >= units) break;
            u32 j = unit / blocks, blk = unit % blocks, b[16];
            f8_x_operands(st, j, g == 0, blk, b);
            float sx[2] = {t == 0 ? weight[u] * st.scale(j, blk) : 0.f, 0.f};
            f8_block(a[u], b, sx, acc);
        }
    }
    if (!mvm_reduce<4, WARPS>(acc, red)) return;
    if (t != 0) return;
    if (lo_ok) out[(size_t)tok * hidden + h0 + g] = acc[0];
    if (hi_ok) out[(size_t)tok * hidden + h0 + g + 8] = acc[2];
}
#endif

// The FP8 kernels' bodies need sm_89's e4m3 conversion; elsewhere they raise ERR_ARCH (the
// host does not launch them there).
#if __CUDA_ARCH__ >= 890
#define F8_BODY(call) call
#else
#define F8_BODY(call) \
    if (threadIdx.x == 0) raise_error(diag, ERR_ARCH)
#endif

#define MATVEC_F8(UB)                                                                          \
    extern "C" __global__ void __launch_bounds__(F8_WARPS * 32) matvec_f8_u##UB(               \
        const float* x, u32 rows, const u8* w, u32 N, u32 K, float* out, u32 ld, Diag* diag) { \
        begin_deferred_kernel();                                                               \
        F8_BODY((matvec_f8_impl<UB>(x, rows, w, N, K, out, ld, diag)));                        \
    }
MATVEC_F8(2)
MATVEC_F8(4)

// Three blocks an SM (80 registers), so that a token's 8 pairs of Qwen3-30B-A3B's experts are
// one wave (two k-blocks a warp in flight at two blocks an SM was 2% slower).
extern "C" __global__ void __launch_bounds__(F8_WARPS * 32, 3) moe_per_token_gate_up_f8(
    const float* x, u32 hidden, const u32* ids, u32 top_k, u32 num_experts, const u64* gate_table,
    const u64* up_table, u32 inter, float* act, Diag* diag) {
    begin_kernel();
    F8_BODY((per_token_gate_up_f8_impl<1>(x, hidden, ids, top_k, num_experts, gate_table,
                                          up_table, inter, act, diag)));
}

// Three units a warp in flight, in blocks of 8 warps or, when the grid is one wave of single
// blocks (a token of Qwen3-30B-A3B: 128 blocks), of 16: then a token's 48 units are all in
// flight at once. (All six units a warp held at once with 8 warps was no faster at one token
// and 18% slower at eight; 16 warps at eight tokens, a block an SM, 7% slower a step.)
#define F8_DOWN_WARPS 16
extern "C" __global__ void __launch_bounds__(F8_DOWN_WARPS * 32) moe_per_token_down_f8(
    const float* act, u32 inter, const u32* ids, const float* route_weights, u32 top_k,
    u32 num_experts, const u64* down_table, u32 hidden, float* out, Diag* diag) {
    begin_deferred_kernel();
    // One reduction array for both block sizes (the wider's size), not one each.
    __shared__ float red[(F8_DOWN_WARPS - 1) * 4 * 32];
    if (blockDim.x == F8_DOWN_WARPS * 32) {
        F8_BODY((per_token_down_f8_impl<3, F8_DOWN_WARPS>(act, inter, ids, route_weights, top_k,
                                                          num_experts, down_table, hidden, out,
                                                          red, diag)));
    } else {
        F8_BODY((per_token_down_f8_impl<3, F8_WARPS>(act, inter, ids, route_weights, top_k,
                                                     num_experts, down_table, hidden, out, red,
                                                     diag)));
    }
}

// Rows of a matrix decoded: a thread per 32 values, `pieces` of them; f32 or bf16 out.
__device__ __forceinline__ void store32(float* out, const float (&v)[32]) {
#pragma unroll
    for (int i = 0; i < 8; i++)
        reinterpret_cast<float4*>(out)[i] = make_float4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]);
}
__device__ __forceinline__ void store32(u16* out, const float (&v)[32]) {
#pragma unroll
    for (int i = 0; i < 4; i++) {
        u32 p[4];
#pragma unroll
        for (int j = 0; j < 4; j++) p[j] = pack_bf16(v[8 * i + 2 * j], v[8 * i + 2 * j + 1]);
        reinterpret_cast<uint4*>(out)[i] = make_uint4(p[0], p[1], p[2], p[3]);
    }
}

// out[r, :] = row r of w decoded, for rows of K values (K a multiple of the block).
template <typename F, typename O>
__device__ void dequantize_impl(const u8* w, u32 K, u64 pieces, O* out) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= pieces) return;
    u32 per_row = K / 32;
    u64 r = i / per_row;
    u32 c = (u32)(i % per_row);
    float v[32];
    decode32<F>(w + r * row_bytes<F>(K), c, v);
    store32(out + i * 32, v);
}

// The experts that have sorted rows decoded into out ([E][rows][K] bf16), `pieces` 32-value
// pieces an expert: grid (ceil(pieces / 256), E); an expert without rows is skipped.
template <typename F>
__device__ void dequantize_experts_impl(const u64* table, const u32* offsets, u32 K, u64 pieces,
                                        u16* out) {
    u32 e = blockIdx.y;
    if (offsets[e] == offsets[e + 1]) return;
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= pieces) return;
    u32 per_row = K / 32;
    float v[32];
    decode32<F>(reinterpret_cast<const u8*>(table[e]) + (i / per_row) * row_bytes<F>(K),
                (u32)(i % per_row), v);
    store32(out + ((u64)e * pieces + i) * 32, v);
}

// out[t] = row ids[t] of the table decoded; an id past `vocab` raises the flag, zeros.
template <typename F>
__device__ void embedding_q_impl(const u8* table, const u32* ids, u32 tokens, u32 hidden,
                                 u32 vocab, float* out, Diag* diag) {
    u32 t = blockIdx.x;
    if (t >= tokens) return;
    u32 id = ids[t];
    bool ok = id < vocab;
    if (!ok && threadIdx.x == 0) raise_error(diag, ERR_TOKEN_ID);
    for (u32 c = threadIdx.x; c < hidden / 32; c += blockDim.x) {
        float v[32];
        if (ok) {
            decode32<F>(table + (size_t)id * row_bytes<F>(hidden), c, v);
        } else {
#pragma unroll
            for (int i = 0; i < 32; i++) v[i] = 0.f;
        }
        store32(out + (size_t)t * hidden + 32 * c, v);
    }
}

#define QACTS const signed char *xq, const float *xd, const int2 *xs
#define QUANT_MATVEC(S, F, R)                                                                  \
    extern "C" __global__ void __launch_bounds__(QMV_WARPS * 32) matvec_##S##_r##R(            \
        QACTS, u32 rows, const u8* w, u32 N, u32 K, float* out, u32 ld, Diag* diag) {          \
        begin_kernel();                                                                        \
        matvec_q_impl<F, R>(QActs{xq, xd, xs, K}, rows, w, N, K, out, ld, diag);               \
    }
#define QUANT_DECODE_KERNELS(S, F)                                                             \
    extern "C" __global__ void dequantize_##S##_f32(const u8* w, u32 K, u64 pieces,            \
                                                    float* out) {                              \
        begin_kernel();                                                                        \
        dequantize_impl<F, float>(w, K, pieces, out);                                          \
    }                                                                                          \
    extern "C" __global__ void dequantize_##S##_bf16(const u8* w, u32 K, u64 pieces,           \
                                                     u16* out) {                               \
        begin_kernel();                                                                        \
        dequantize_impl<F, u16>(w, K, pieces, out);                                            \
    }                                                                                          \
    extern "C" __global__ void dequantize_experts_##S(const u64* table, const u32* offsets,    \
                                                      u32 K, u64 pieces, u16* out) {           \
        begin_kernel();                                                                        \
        dequantize_experts_impl<F>(table, offsets, K, pieces, out);                            \
    }                                                                                          \
    extern "C" __global__ void embedding_##S(const u8* table, const u32* ids, u32 tokens,      \
                                             u32 hidden, u32 vocab, float* out, Diag* diag) {  \
        begin_small_kernel();                                                                  \
        embedding_q_impl<F>(table, ids, tokens, hidden, vocab, out, diag);                     \
    }
#define QUANT_KERNELS(S, F)                                                                    \
    QUANT_MATVEC(S, F, 1)                                                                      \
    QUANT_MATVEC(S, F, 2)                                                                      \
    QUANT_MATVEC(S, F, 4)                                                                      \
    QUANT_MATVEC(S, F, 8)                                                                      \
    extern "C" __global__ void __launch_bounds__(256) moe_per_token_gate_up_##S(               \
        QACTS, u32 hidden, const u32* ids, u32 top_k, u32 num_experts, const u64* gate_table,  \
        const u64* up_table, u32 inter, float* act, Diag* diag) {                              \
        begin_kernel();                                                                        \
        per_token_gate_up_q_impl<F>(QActs{xq, xd, xs, hidden}, hidden, ids, top_k,             \
                                    num_experts, gate_table, up_table, inter, act, diag);      \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(256) moe_per_token_down_##S(                  \
        QACTS, u32 inter, const u32* ids, const float* route_weights, u32 top_k,               \
        u32 num_experts, const u64* down_table, u32 hidden, float* out, Diag* diag) {          \
        begin_kernel();                                                                        \
        per_token_down_q_impl<F>(QActs{xq, xd, xs, inter}, inter, ids, route_weights, top_k,   \
                                 num_experts, down_table, hidden, out, diag);                  \
    }                                                                                          \
    QUANT_DECODE_KERNELS(S, F)
QUANT_KERNELS(q8_0, q8_0)
QUANT_KERNELS(q4_0, q4_0)
QUANT_KERNELS(q5_0, q5_0)
QUANT_KERNELS(q4_k, q4_k)
QUANT_KERNELS(q5_k, q5_k)
QUANT_KERNELS(q6_k, q6_k)
QUANT_DECODE_KERNELS(f8, f8_128)

// dst[r, col0 + n] = src[r, n] for rows of n values, dst's rows `ld` apart: a product's
// output moved into its columns of a wider one. A thread per value.
extern "C" __global__ void copy_columns(const float* src, u32 rows, u32 n, float* dst, u32 ld,
                                        u32 col0) {
    begin_small_kernel();
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (u64)rows * n) return;
    u64 r = i / n;
    dst[r * ld + col0 + i % n] = src[i];
}

// Synthetic blocks: the little-endian bytes of splitmix64(seed + i) for the i-th 8 bytes,
// with each block's scale (d_bytes bytes at d_at) set to d_bits and its min (at m_at, unless
// 0xffffffff) to m_bits, and FP8 blocks' NaN codes moved to ±448: quant.rs's
// synthetic_blocks, byte for byte. A thread per 8 bytes.
extern "C" __global__ void synthetic_blocks(u8* out, u64 len, u32 block_bytes, u64 seed,
                                            u32 d_at, u32 d_bits, u32 d_bytes, u32 m_at,
                                            u32 m_bits, u32 fp8) {
    begin_kernel();
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i * 8 >= len) return;
    u64 z = seed + (i + 1) * 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    for (u32 b = 0; b < 8 && i * 8 + b < len; b++) {
        u64 k = i * 8 + b;
        u32 at = (u32)(k % block_bytes), byte = (u32)(z >> (8 * b)) & 0xffu;
        if (fp8 && (byte & 0x7fu) == 0x7fu) byte &= 0xfeu;
        if (at >= d_at && at < d_at + d_bytes) byte = (d_bits >> (8 * (at - d_at))) & 0xffu;
        if (m_at != 0xffffffffu && at >= m_at && at < m_at + 2) byte = (m_bits >> (8 * (at - m_at))) & 0xffu;
        out[k] = (u8)byte;
    }
}
