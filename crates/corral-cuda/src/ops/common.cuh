// Shared helpers of every kernel file: raw 16-bit float conversions (no CUDA headers, so the
// same sources compile under NVRTC anywhere), weight-type tags, reductions and the device
// diagnostics block (error flag and weight-byte counter) that each step reads back once.

#define NEG_INF __int_as_float(0xff800000)

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

// Every kernel's first statement. Kernels are launched with programmatic dependent launch
// (sm_90+): one may be scheduled while the kernel before it on the stream is finishing, and
// waits here until that kernel has completed and its writes are visible. Before sm_90 (and
// without the launch attribute) it is a no-op and kernels run back to back as usual.
// begin_kernel() lets the next kernel be scheduled once this one's blocks have exited, so
// that a kernel of many waves keeps its SMs; begin_small_kernel() lets it be scheduled at
// once, so that its blocks are resident and waiting when a short kernel (a norm, the
// routing, a recurrence) ends. Which kernels are short was measured on the H200.
__device__ __forceinline__ void begin_kernel() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void begin_small_kernel() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// A kernel that begins with begin_deferred_kernel() reads, before its own
// wait_for_previous_kernel(), only what no kernel of the step writes (weights; the step's
// positions and block tables, uploaded before it; KV cached by earlier steps), so that those
// reads overlap the kernel before; it writes nothing before then but the diagnostics block's
// atomic counters and error flag. It releases its dependents where it calls
// release_dependents(), else at exit. No kernel releases before its own wait, so a deferred
// kernel may also read early what the kernels before the one before it wrote.
__device__ __forceinline__ void begin_deferred_kernel() {}

__device__ __forceinline__ void wait_for_previous_kernel() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void release_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

struct bf16w { u16 bits; };
struct f16w { u16 bits; };

__device__ __forceinline__ float bf16_to_f32(u16 h) { return __uint_as_float(((u32)h) << 16); }

__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// fp8 e4m3 (the KV cache's fp8: 4 exponent bits of bias 7, 3 mantissa bits, no infinity,
// largest 448). Its bits shifted into an f16's give the value times 2^-8 exactly, subnormals
// included (the two biases differ by 8): a shift and a mask, no table.
__device__ __forceinline__ u16 e4m3_as_f16_bits(u32 b) {
    return (u16)(((b & 0x80u) << 8) | ((b & 0x7fu) << 7));
}
__device__ __forceinline__ float e4m3_to_f32(u32 b) { return f16_to_f32(e4m3_as_f16_bits(b)) * 256.f; }
// Bytes 0, 1 (sel 0x1404) or 2, 3 (sel 0x3424) of x as two f16 of their values times 2^-8,
// packed low first: the operand pair of an f16 mma.
__device__ __forceinline__ u32 e4m3x2_as_f16x2(u32 x, u32 sel) {
    u32 r = __byte_perm(x, 0u, sel);  // each byte in the high half of a 16-bit lane
    return (r & 0x80008000u) | ((r >> 1) & 0x3f803f80u);
}
// x rounded to the nearest e4m3 (ties to even), saturating at ±448.
__device__ __forceinline__ u32 f32_to_e4m3(float x) {
    u32 sign = (__float_as_uint(x) >> 24) & 0x80u;
    float a = fminf(fabsf(x), 448.f);
    if (!(a >= 0.015625f)) return sign | (u32)rintf(a * 512.f);  // subnormals, 2^-9 units
    int e;
    float f = frexpf(a, &e);  // a = f 2^e, f in [0.5, 1)
    // A mantissa rounding up to 8 carries into the exponent field, as the encoding runs on.
    return sign | (((u32)(e + 6) << 3) + (u32)rintf((f * 2.f - 1.f) * 8.f));
}
// Bytes of one fp8 KV cache slot: kv_heads rows of head_dim values, then their f32 scales,
// padded to 16 bytes (kv_row_elems in dtype.rs).
__device__ __forceinline__ u32 fp8_row_bytes(u32 kv_heads, u32 head_dim) {
    return (kv_heads * head_dim + 4 * kv_heads + 15) / 16 * 16;
}

// Element `i` of a weight stored as W, as f32.
__device__ __forceinline__ float load_w(const bf16w* p, size_t i) { return bf16_to_f32(p[i].bits); }
__device__ __forceinline__ float load_w(const f16w* p, size_t i) { return f16_to_f32(p[i].bits); }
__device__ __forceinline__ float load_w(const float* p, size_t i) { return p[i]; }

// Eight consecutive weights from p (16-byte aligned for 16-bit types, 32 for f32) as f32.
__device__ __forceinline__ void load_w8(const bf16w* p, float* out) {
    uint4 v = *reinterpret_cast<const uint4*>(p);
    u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        out[2 * i] = __uint_as_float(w[i] << 16);
        out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}
__device__ __forceinline__ void load_w8(const f16w* p, float* out) {
    uint4 v = *reinterpret_cast<const uint4*>(p);
    u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        out[2 * i] = f16_to_f32((u16)(w[i] & 0xffffu));
        out[2 * i + 1] = f16_to_f32((u16)(w[i] >> 16));
    }
}
__device__ __forceinline__ void load_w8(const float* p, float* out) {
    float4 a = *reinterpret_cast<const float4*>(p);
    float4 b = *reinterpret_cast<const float4*>(p + 4);
    out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
    out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
}

// Element alignment that load_w8 needs, in elements.
template <typename W> struct WeightAlign { static const int value = 8; };

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets it.
__device__ __forceinline__ float block_sum(float v, float* scratch32) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch32[warp] = v;
    __syncthreads();
    float total = lane < warps ? scratch32[lane] : 0.f;
    return warp_sum(total);
}

__device__ __forceinline__ float block_max(float v, float* scratch32) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch32[warp] = v;
    __syncthreads();
    float m = lane < warps ? scratch32[lane] : NEG_INF;
    return warp_max(m);
}

// Sums over the warp of x[0..K) with two weight rows at once (their loads in flight
// together, x read once): *d0 = x · w0, *d1 = x · w1; every lane gets them.
template <typename W>
__device__ __forceinline__ void warp_dot2(const float* x, const W* w0, const W* w1, u32 K,
                                          bool vec, float* d0, float* d1) {
    u32 lane = threadIdx.x & 31;
    float acc0 = 0.f, acc1 = 0.f;
    if (vec) {
        u32 k = lane * 8;
        for (; k + 256 < K; k += 512) {
            float wa[8], wb[8], ua[8], ub[8];
            load_w8(w0 + k, wa);
            load_w8(w0 + k + 256, wb);
            load_w8(w1 + k, ua);
            load_w8(w1 + k + 256, ub);
            const float4* xa = reinterpret_cast<const float4*>(x + k);
            const float4* xb = reinterpret_cast<const float4*>(x + k + 256);
            float4 a0 = xa[0], a1 = xa[1], b0 = xb[0], b1 = xb[1];
            acc0 += a0.x * wa[0] + a0.y * wa[1] + a0.z * wa[2] + a0.w * wa[3] + a1.x * wa[4] +
                    a1.y * wa[5] + a1.z * wa[6] + a1.w * wa[7];
            acc0 += b0.x * wb[0] + b0.y * wb[1] + b0.z * wb[2] + b0.w * wb[3] + b1.x * wb[4] +
                    b1.y * wb[5] + b1.z * wb[6] + b1.w * wb[7];
            acc1 += a0.x * ua[0] + a0.y * ua[1] + a0.z * ua[2] + a0.w * ua[3] + a1.x * ua[4] +
                    a1.y * ua[5] + a1.z * ua[6] + a1.w * ua[7];
            acc1 += b0.x * ub[0] + b0.y * ub[1] + b0.z * ub[2] + b0.w * ub[3] + b1.x * ub[4] +
                    b1.y * ub[5] + b1.z * ub[6] + b1.w * ub[7];
        }
        for (; k < K; k += 256) {
            float wv[8], uv[8];
            load_w8(w0 + k, wv);
            load_w8(w1 + k, uv);
            float4 a = *reinterpret_cast<const float4*>(x + k);
            float4 b = *reinterpret_cast<const float4*>(x + k + 4);
            acc0 += a.x * wv[0] + a.y * wv[1] + a.z * wv[2] + a.w * wv[3] + b.x * wv[4] +
                    b.y * wv[5] + b.z * wv[6] + b.w * wv[7];
            acc1 += a.x * uv[0] + a.y * uv[1] + a.z * uv[2] + a.w * uv[3] + b.x * uv[4] +
                    b.y * uv[5] + b.z * uv[6] + b.w * uv[7];
        }
    } else {
        for (u32 k = lane; k < K; k += 32) {
            acc0 += x[k] * load_w(w0, k);
            acc1 += x[k] * load_w(w1, k);
        }
    }
    *d0 = warp_sum(acc0);
    *d1 = warp_sum(acc1);
}

// x[0..8) · (8 weights unpacked from a 16-byte load).
template <typename W>
__device__ __forceinline__ float dot8(const float* x, uint4 raw) {
    float w[8];
    load_w8(reinterpret_cast<const W*>(&raw), w);
    float4 a = *reinterpret_cast<const float4*>(x);
    float4 b = *reinterpret_cast<const float4*>(x + 4);
    return a.x * w[0] + a.y * w[1] + a.z * w[2] + a.w * w[3] + b.x * w[4] + b.y * w[5] +
           b.z * w[6] + b.w * w[7];
}

// Sums over the warp of xs[r] · ws[r] over [0, K) for R pairs of rows (16-bit weights,
// 16-byte aligned, K % 8 == 0): every 16-byte weight load of a pass of P pieces of 256
// elements is issued before the first is used, so a row of up to 256 P elements costs one
// trip to memory. Every lane gets the sums. WAIT: the kernel began deferred, and each pass
// waits for the kernel before between its weight loads and its reads of x.
template <typename W, int R, int P, bool WAIT = false>
__device__ __forceinline__ void warp_dots16(const float* const (&xs)[R], const W* const (&ws)[R],
                                            u32 K, float (&out)[R]) {
    u32 lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < R; r++) out[r] = 0.f;
    for (u32 k0 = lane * 8; k0 < K; k0 += P * 256) {
        uint4 raw[R][P];
#pragma unroll
        for (int u = 0; u < P; u++)
#pragma unroll
            for (int r = 0; r < R; r++)
                raw[r][u] = k0 + u * 256 < K
                                ? *reinterpret_cast<const uint4*>(ws[r] + k0 + u * 256)
                                : make_uint4(0, 0, 0, 0);
        if constexpr (WAIT) wait_for_previous_kernel();
#pragma unroll
        for (int u = 0; u < P; u++) {
            if (k0 + u * 256 >= K) break;
#pragma unroll
            for (int r = 0; r < R; r++) out[r] += dot8<W>(xs[r] + k0 + u * 256, raw[r][u]);
        }
    }
#pragma unroll
    for (int r = 0; r < R; r++) out[r] = warp_sum(out[r]);
}

// As warp_dots16, any weight type and layout (vec: 16-bit weights 16-byte aligned, K % 8 == 0).
template <typename W, int R, int P>
__device__ __forceinline__ void warp_dots(const float* const (&xs)[R], const W* const (&ws)[R],
                                          u32 K, bool vec, float (&out)[R]) {
    if constexpr (sizeof(W) == 2) {
        if (vec) {
            warp_dots16<W, R, P>(xs, ws, K, out);
            return;
        }
    }
    u32 lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < R; r++) out[r] = 0.f;
    if (vec) {
        for (u32 k = lane * 8; k < K; k += 256)
#pragma unroll
            for (int r = 0; r < R; r++) {
                float w[8];
                load_w8(ws[r] + k, w);
#pragma unroll
                for (int i = 0; i < 8; i++) out[r] += xs[r][k + i] * w[i];
            }
    } else {
        for (u32 k = lane; k < K; k += 32)
#pragma unroll
            for (int r = 0; r < R; r++) out[r] += xs[r][k] * load_w(ws[r], k);
    }
#pragma unroll
    for (int r = 0; r < R; r++) out[r] = warp_sum(out[r]);
}

__device__ __forceinline__ float silu(float g) { return g / (1.f + expf(-g)); }
__device__ __forceinline__ float sigmoid(float g) { return 1.f / (1.f + expf(-g)); }

// Diagnostics written by kernels and read back with the step's one read-back: the first
// error code raised (an index out of range), and the weight bytes the kernels read.
struct Diag {
    u32 error;
    u32 pad;
    u64 weight_bytes;
};

// Error codes; the host names the op from the code.
#define ERR_TOKEN_ID 1u
#define ERR_ROW_INDEX 2u
#define ERR_KV_SLOT 3u
#define ERR_BLOCK_TABLE 4u
#define ERR_EXPERT_ID 5u
#define ERR_POSITION 6u
#define ERR_F16_RANGE 7u
#define ERR_STATE_SLOT 8u
#define ERR_RUN_LENGTH 9u
#define ERR_ARCH 10u

__device__ __forceinline__ void raise_error(Diag* d, u32 code) { atomicCAS(&d->error, 0u, code); }

// A cache slot's row elements and scale, shared by the attention kernels. The cache holds
// bf16 (u16), f32, or fp8 e4m3 (u8) rows; an fp8 row is its heads' values, then their f32
// scales.
__device__ __forceinline__ float load_kv(const u16* p, size_t i) { return bf16_to_f32(p[i]); }
__device__ __forceinline__ float load_kv(const float* p, size_t i) { return p[i]; }
// An fp8 value without its head's scale (which the reader applies).
__device__ __forceinline__ float load_kv(const u8* p, size_t i) { return e4m3_to_f32(p[i]); }

// Elements from one cache slot's row to the next's.
template <typename C> __device__ __forceinline__ u32 kv_row_stride(u32 kv_heads, u32 head_dim) {
    return sizeof(C) == 1 ? fp8_row_bytes(kv_heads, head_dim) : kv_heads * head_dim;
}

// The scale of KV head `kvh` in the fp8 row starting at `row` (1 for other caches).
template <typename C>
__device__ __forceinline__ float kv_scale(const C* row, u32 kvh, u32 kv_dim) {
    if constexpr (sizeof(C) == 1)
        return *reinterpret_cast<const float*>(reinterpret_cast<const u8*>(row) + kv_dim + 4 * kvh);
    else
        return 1.f;
}

// The cache slot of key `j` of a run with block table `table`; a block past the cache's
// `num_blocks` raises ERR_BLOCK_TABLE and reads block 0.
__device__ __forceinline__ size_t slot_of(const u32* table, u32 j, u32 block_size,
                                          u32 num_blocks, Diag* diag) {
    u32 block = table[j / block_size];
    if (block >= num_blocks) {
        raise_error(diag, ERR_BLOCK_TABLE);
        block = 0;
    }
    return (size_t)block * block_size + j % block_size;
}

__device__ __forceinline__ void count_weight_bytes(Diag* d, u64 bytes) {
    if (bytes) atomicAdd(&d->weight_bytes, bytes);
}

// RoPE's inverse frequency of pair p of rotary_dim rotated dims, in f32 as transformers forms
// it (rope.rs's RopeArgs::inverse_frequency): 1 / theta^(2p/d), and under YaRN (factor > 0)
// blended with 1 / (factor theta^(2p/d)) from pair ramp_low over ramp_width pairs. The
// kernels scale cos and sin by YaRN's attention factor.
__device__ __forceinline__ float rope_inv_freq(u32 p, u32 rotary_dim, float theta, float factor,
                                               float ramp_low, float ramp_width) {
    float pos_freq = powf(theta, (float)(2 * p) / (float)rotary_dim);
    float extrapolated = 1.f / pos_freq;
    if (factor == 0.f) return extrapolated;
    float interpolated = 1.f / (factor * pos_freq);
    float ramp = fminf(fmaxf(((float)p - ramp_low) / ramp_width, 0.f), 1.f);
    float extrapolation = 1.f - ramp;
    return interpolated * (1.f - extrapolation) + extrapolated * extrapolation;
}
