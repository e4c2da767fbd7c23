// RMSNorm variants and rotary embedding. Statistics in f32.

#define NORM_PER_THREAD 8

__device__ __forceinline__ void store_norm(float* out, u32 d, float v) { out[d] = v; }
__device__ __forceinline__ void store_norm(u16* out, u32 d, float v) { out[d] = f32_to_bf16(v); }

__device__ __forceinline__ void store_norm4(float* out, u32 d, float4 v) {
    *reinterpret_cast<float4*>(out + d) = v;
}
__device__ __forceinline__ void store_norm4(u16* out, u32 d, float4 v) {
    u32 lo, hi;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(lo) : "f"(v.y), "f"(v.x));
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(hi) : "f"(v.w), "f"(v.z));
    *reinterpret_cast<uint2*>(out + d) = make_uint2(lo, hi);
}

__device__ __forceinline__ float4 load4(const float* p, u32 d) {
    return *reinterpret_cast<const float4*>(p + d);
}

// norm_row for rows of a multiple of 4 values that the block's registers hold: 16-byte loads
// and stores (the row's start 16-byte aligned).
template <typename O>
__device__ __forceinline__ void norm_row4(float* acc, const float* x, bool add,
                                          const float* weight, u32 dim, float eps,
                                          bool offset_one, O* out, float* scratch) {
    const int G = NORM_PER_THREAD / 4;
    float4 v[G], w[G];
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < G; j++) {
        u32 d = 4 * (threadIdx.x + j * blockDim.x);
        v[j] = w[j] = make_float4(0.f, 0.f, 0.f, 0.f);
        if (d < dim) {
            w[j] = load4(weight, d);
            if (offset_one) w[j] = make_float4(1.f + w[j].x, 1.f + w[j].y, 1.f + w[j].z, 1.f + w[j].w);
            v[j] = load4(acc, d);
            if (add) {
                float4 e = load4(x, d);
                v[j] = make_float4(v[j].x + e.x, v[j].y + e.y, v[j].z + e.z, v[j].w + e.w);
                *reinterpret_cast<float4*>(acc + d) = v[j];
            }
            ss += v[j].x * v[j].x + v[j].y * v[j].y + v[j].z * v[j].z + v[j].w * v[j].w;
        }
    }
    ss = block_sum(ss, scratch);
    float inv = rsqrtf(ss / (float)dim + eps);
#pragma unroll
    for (int j = 0; j < G; j++) {
        u32 d = 4 * (threadIdx.x + j * blockDim.x);
        if (d < dim)
            store_norm4(out, d,
                        make_float4(v[j].x * inv * w[j].x, v[j].y * inv * w[j].y,
                                    v[j].z * inv * w[j].z, v[j].w * inv * w[j].w));
    }
}

// The shared body of rms_norm and add_rms_norm: row r of (acc [+ x]) kept in registers
// (dim <= NORM_PER_THREAD * blockDim; longer rows are re-read), normalised into out: f32, or
// bf16 when its only readers are projections that round their input to bf16 anyway.
template <typename O>
__device__ __forceinline__ void norm_row(float* acc, const float* x, bool add,
                                         const float* weight, u32 dim, float eps,
                                         bool offset_one, O* out) {
    __shared__ float scratch[32];
    bool aligned = ((reinterpret_cast<size_t>(acc) | reinterpret_cast<size_t>(x) |
                     reinterpret_cast<size_t>(weight)) & 15) == 0 &&
                   (reinterpret_cast<size_t>(out) & (4 * sizeof(O) - 1)) == 0;
    if (dim % 4 == 0 && dim <= NORM_PER_THREAD * blockDim.x && aligned) {
        norm_row4(acc, x, add, weight, dim, eps, offset_one, out, scratch);
        return;
    }
    float v[NORM_PER_THREAD], w[NORM_PER_THREAD];
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < NORM_PER_THREAD; i++) {
        u32 d = threadIdx.x + i * blockDim.x;
        v[i] = 0.f;
        w[i] = 0.f;
        if (d < dim) {
            // The weight is read with the row, not after the reduction: one trip less.
            w[i] = offset_one ? 1.f + weight[d] : weight[d];
            v[i] = add ? acc[d] + x[d] : acc[d];
            if (add) acc[d] = v[i];
            ss += v[i] * v[i];
        }
    }
    for (u32 d = threadIdx.x + NORM_PER_THREAD * blockDim.x; d < dim; d += blockDim.x) {
        float e = add ? acc[d] + x[d] : acc[d];
        if (add) acc[d] = e;
        ss += e * e;
    }
    ss = block_sum(ss, scratch);
    float inv = rsqrtf(ss / (float)dim + eps);
#pragma unroll
    for (int i = 0; i < NORM_PER_THREAD; i++) {
        u32 d = threadIdx.x + i * blockDim.x;
        if (d < dim) store_norm(out, d, v[i] * inv * w[i]);
    }
    for (u32 d = threadIdx.x + NORM_PER_THREAD * blockDim.x; d < dim; d += blockDim.x)
        store_norm(out, d, acc[d] * inv * (offset_one ? 1.f + weight[d] : weight[d]));
}

// out = x / sqrt(mean(x^2) + eps) * w, with w = weight or 1 + weight; one block per row.
#define RMS_NORM(NAME, O)                                                                      \
    extern "C" __global__ void NAME(const float* x, const float* weight, u32 rows, u32 dim,    \
                                    float eps, u32 offset_one, O* out) {                       \
        begin_small_kernel();                                                                  \
        u32 r = blockIdx.x;                                                                    \
        if (r >= rows) return;                                                                 \
        norm_row(const_cast<float*>(x) + (size_t)r * dim, nullptr, false, weight, dim, eps,    \
                 offset_one != 0, out + (size_t)r * dim);                                      \
    }
RMS_NORM(rms_norm, float)
RMS_NORM(rms_norm_bf16, u16)

// out = (w * rmsnorm(x)) * silu(z), plain weight; one warp per row (rows are one head's
// values: a hundred or so), eight rows a block.
extern "C" __global__ void gated_rms_norm(const float* x, const float* z, const float* weight,
                                          u32 rows, u32 dim, float eps, float* out) {
    begin_small_kernel();
    u32 lane = threadIdx.x & 31, r = blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
    if (r >= rows) return;
    const float* xr = x + (size_t)r * dim;
    float ss = 0.f;
    for (u32 d = lane; d < dim; d += 32) ss += xr[d] * xr[d];
    float inv = rsqrtf(warp_sum(ss) / (float)dim + eps);
    for (u32 d = lane; d < dim; d += 32) {
        size_t i = (size_t)r * dim + d;
        out[i] = xr[d] * inv * weight[d] * silu(z[i]);
    }
}

// Rotate-half RoPE in place on the first `rotary_dim` dims of each head; one thread per
// (token, head, pair). inv_freq and angles in f32, as the reference computes them; YaRN's
// frequencies and factor on cos and sin when yarn_factor > 0 (rope_inv_freq).
extern "C" __global__ void rope(float* x, const u32* positions, u32 tokens, u32 heads,
                                u32 head_dim, u32 rotary_dim, float theta, float yarn_factor,
                                float ramp_low, float ramp_width, float attention_factor) {
    begin_small_kernel();
    u32 half = rotary_dim / 2;
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (u64)tokens * heads * half) return;
    u32 p = (u32)(i % half);
    u64 th = i / half;
    u32 t = (u32)(th / heads);
    float inv_freq = rope_inv_freq(p, rotary_dim, theta, yarn_factor, ramp_low, ramp_width);
    float angle = (float)positions[t] * inv_freq;
    float c = cosf(angle) * attention_factor, s = sinf(angle) * attention_factor;
    float* head = x + th * head_dim;
    float a = head[p], b = head[p + half];
    head[p] = a * c - b * s;
    head[p + half] = b * c + a * s;
}

// acc += x, then out = rms_norm(acc) (weight or 1 + weight); one block per row.
#define ADD_RMS_NORM(NAME, O)                                                                  \
    extern "C" __global__ void NAME(float* acc, const float* x, const float* weight, u32 rows, \
                                    u32 dim, float eps, u32 offset_one, O* out) {              \
        begin_small_kernel();                                                                  \
        u32 r = blockIdx.x;                                                                    \
        if (r >= rows) return;                                                                 \
        norm_row(acc + (size_t)r * dim, x + (size_t)r * dim, true, weight, dim, eps,           \
                 offset_one != 0, out + (size_t)r * dim);                                      \
    }
ADD_RMS_NORM(add_rms_norm, float)
ADD_RMS_NORM(add_rms_norm_bf16, u16)
