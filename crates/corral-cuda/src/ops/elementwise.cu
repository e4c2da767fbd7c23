// Element-wise ops, embedding and row gathers. Activations are f32.

template <typename W>
__device__ void embedding_impl(const W* table, const u32* ids, u32 tokens, u32 hidden, u32 vocab,
                               float* out, Diag* diag) {
    u32 t = blockIdx.x;
    if (t >= tokens) return;
    u32 id = ids[t];
    bool ok = id < vocab;
    if (!ok && threadIdx.x == 0) raise_error(diag, ERR_TOKEN_ID);
    for (u32 d = threadIdx.x; d < hidden; d += blockDim.x)
        out[(size_t)t * hidden + d] = ok ? load_w(table, (size_t)id * hidden + d) : 0.f;
}

#define EMBEDDING(SUFFIX, W)                                                                   \
    extern "C" __global__ void embedding_##SUFFIX(const W* table, const u32* ids, u32 tokens,  \
                                                  u32 hidden, u32 vocab, float* out,           \
                                                  Diag* diag) {                                \
        begin_small_kernel();                                                                  \
        embedding_impl<W>(table, ids, tokens, hidden, vocab, out, diag);                       \
    }
EMBEDDING(bf16, bf16w)
EMBEDDING(f16, f16w)
EMBEDDING(f32, float)

// out[i] = x[rows[i]] for rows of `dim`; `src_rows` bounds the indices.
extern "C" __global__ void gather_rows(const float* x, const u32* rows, u32 num_rows, u32 dim,
                                       u32 src_rows, float* out, Diag* diag) {
    begin_small_kernel();
    u32 i = blockIdx.x;
    if (i >= num_rows) return;
    u32 r = rows[i];
    bool ok = r < src_rows;
    if (!ok && threadIdx.x == 0) raise_error(diag, ERR_ROW_INDEX);
    for (u32 d = threadIdx.x; d < dim; d += blockDim.x)
        out[(size_t)i * dim + d] = ok ? x[(size_t)r * dim + d] : 0.f;
}

// Whole blocks of `block_bytes` bytes between a paged buffer and a packed one: packed block
// i is paged block ids[i] (gather: paged to packed; else packed to paged). A block of threads
// per (block, 4096-byte piece), 16 bytes a thread when blocks are 16-byte multiples; an id
// past `paged_blocks` raises the flag and its block is skipped.
extern "C" __global__ void copy_blocks(const unsigned char* src, unsigned char* dst,
                                       const u32* ids, u32 count, u64 block_bytes,
                                       u32 paged_blocks, u32 gather, Diag* diag) {
    begin_kernel();
    u32 i = blockIdx.x;
    if (i >= count) return;
    u32 id = ids[i];
    if (id >= paged_blocks) {
        if (threadIdx.x == 0 && blockIdx.y == 0) raise_error(diag, ERR_BLOCK_TABLE);
        return;
    }
    u64 from = (u64)(gather ? id : i) * block_bytes, to = (u64)(gather ? i : id) * block_bytes;
    u64 piece = (u64)blockIdx.y * 4096;
    u64 end = min(block_bytes, piece + 4096);
    if (block_bytes % 16 == 0) {
        for (u64 b = piece + threadIdx.x * 16; b < end; b += blockDim.x * 16)
            *reinterpret_cast<uint4*>(dst + to + b) = *reinterpret_cast<const uint4*>(src + from + b);
    } else {
        for (u64 b = piece + threadIdx.x; b < end; b += blockDim.x) dst[to + b] = src[from + b];
    }
}

extern "C" __global__ void add_in_place(float* acc, const float* x, u64 len) {
    begin_small_kernel();
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < len) acc[i] += x[i];
}

extern "C" __global__ void silu_mul(const float* gate, const float* up, u64 len, float* out) {
    begin_small_kernel();
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < len) out[i] = silu(gate[i]) * up[i];
}

extern "C" __global__ void sigmoid_mul(const float* x, const float* gate, u64 len, float* out) {
    begin_small_kernel();
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < len) out[i] = x[i] * sigmoid(gate[i]);
}

// acc[t, d] += sigmoid(gate[t]) * x[t, d]
extern "C" __global__ void add_sigmoid_gated(float* acc, const float* x, const float* gate,
                                             u32 rows, u32 dim) {
    begin_small_kernel();
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < (u64)rows * dim) acc[i] += sigmoid(gate[i / dim]) * x[i];
}

// out[rows[i], d] += scales[i] * y[i, d]; rows never repeat, so no atomics.
extern "C" __global__ void scale_scatter_add(const float* y, const u32* rows, const float* scales,
                                             u32 num_rows, u32 dim, u32 out_rows, float* out,
                                             Diag* diag) {
    begin_small_kernel();
    u32 i = blockIdx.x;
    if (i >= num_rows) return;
    u32 r = rows[i];
    if (r >= out_rows) {
        if (threadIdx.x == 0) raise_error(diag, ERR_ROW_INDEX);
        return;
    }
    float s = scales[i];
    for (u32 d = threadIdx.x; d < dim; d += blockDim.x)
        out[(size_t)r * dim + d] += s * y[(size_t)i * dim + d];
}

// Deterministic normal values (std `std`), the same streams as the CPU's synthetic weights:
// element g is in chunk g >> 16, whose splitmix64 stream starts at
// base ^ (chunk * 0xD6E8FEB86659FD93); pair i of a chunk uses the stream's outputs 2i+1, 2i+2
// through Box-Muller.
__device__ __forceinline__ u64 splitmix_at(u64 start, u64 n) {
    u64 z = start + n * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

__device__ __forceinline__ void normal_pair(u64 base, u64 g, float stdev, float* a, float* b) {
    u64 chunk = g >> 16, pair = (g & 0xffffull) >> 1;
    u64 start = base ^ (chunk * 0xD6E8FEB86659FD93ull);
    double u1 = ((double)(splitmix_at(start, 2 * pair + 1) >> 11) + 1.0) / 9007199254740992.0;
    double u2 = (double)(splitmix_at(start, 2 * pair + 2) >> 11) / 9007199254740992.0;
    double r = sqrt(-2.0 * log(u1));
    double theta = 6.283185307179586 * u2;
    *a = (float)(r * cos(theta)) * stdev;
    *b = (float)(r * sin(theta)) * stdev;
}

#define NORMAL_FILL(SUFFIX, STORE)                                                            \
    extern "C" __global__ void normal_fill_##SUFFIX(u16* out16, float* out32, u64 len,        \
                                                    u64 base, float stdev) {                  \
        begin_kernel();                                                                       \
        u64 g = ((u64)blockIdx.x * blockDim.x + threadIdx.x) * 2;                             \
        if (g >= len) return;                                                                  \
        float a, b;                                                                            \
        normal_pair(base, g, stdev, &a, &b);                                                   \
        STORE(g, a);                                                                           \
        if (g + 1 < len) STORE(g + 1, b);                                                      \
    }
#define STORE_BF16(i, v) out16[i] = f32_to_bf16(v)
#define STORE_F16(i, v) out16[i] = f32_to_f16(v)
#define STORE_F32(i, v) out32[i] = (v)
NORMAL_FILL(bf16, STORE_BF16)
NORMAL_FILL(f16, STORE_F16)
NORMAL_FILL(f32, STORE_F32)

// out = x rounded to bf16, the operand of a cuBLAS projection, four values a thread (x and
// out 16- and 8-byte aligned); adds that projection's weight bytes (each read once, the
// least cuBLAS can read) to the step's counter.
extern "C" __global__ void to_bf16(const float* x, u64 len, u16* out, u64 weight_bytes,
                                   Diag* diag) {
    begin_small_kernel();
    u64 i = ((u64)blockIdx.x * blockDim.x + threadIdx.x) * 4;
    if (i == 0) count_weight_bytes(diag, weight_bytes);
    if (i + 4 <= len) {
        float4 v = *reinterpret_cast<const float4*>(x + i);
        u32 lo, hi;
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(lo) : "f"(v.y), "f"(v.x));
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(hi) : "f"(v.w), "f"(v.z));
        *reinterpret_cast<uint2*>(out + i) = make_uint2(lo, hi);
    } else {
        for (; i < len; i++) out[i] = f32_to_bf16(x[i]);
    }
}

// out = x (bf16) widened to f32, four values a thread (x and out 8- and 16-byte aligned): for
// an op without a bf16-input form, reading what a norm wrote in bf16.
extern "C" __global__ void to_f32(const u16* x, u64 len, float* out) {
    begin_small_kernel();
    u64 i = ((u64)blockIdx.x * blockDim.x + threadIdx.x) * 4;
    if (i + 4 <= len) {
        uint2 v = *reinterpret_cast<const uint2*>(x + i);
        *reinterpret_cast<float4*>(out + i) =
            make_float4(__uint_as_float(v.x << 16), __uint_as_float(v.x & 0xffff0000u),
                        __uint_as_float(v.y << 16), __uint_as_float(v.y & 0xffff0000u));
    } else {
        for (; i < len; i++) out[i] = bf16_to_f32(x[i]);
    }
}
