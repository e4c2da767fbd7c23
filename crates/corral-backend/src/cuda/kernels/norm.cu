// RMSNorm variants and rotary embedding. Statistics in f32.

// out = x / sqrt(mean(x^2) + eps) * w, with w = weight or 1 + weight; one block per row.
extern "C" __global__ void rms_norm(const float* x, const float* weight, u32 rows, u32 dim,
                                    float eps, u32 offset_one, float* out) {
    __shared__ float scratch[32];
    u32 r = blockIdx.x;
    if (r >= rows) return;
    const float* xr = x + (size_t)r * dim;
    float ss = 0.f;
    for (u32 d = threadIdx.x; d < dim; d += blockDim.x) ss += xr[d] * xr[d];
    ss = block_sum(ss, scratch);
    float inv = rsqrtf(ss / (float)dim + eps);
    for (u32 d = threadIdx.x; d < dim; d += blockDim.x) {
        float w = offset_one ? 1.f + weight[d] : weight[d];
        out[(size_t)r * dim + d] = xr[d] * inv * w;
    }
}

// out = (w * rmsnorm(x)) * silu(z), plain weight; one block per row.
extern "C" __global__ void gated_rms_norm(const float* x, const float* z, const float* weight,
                                          u32 rows, u32 dim, float eps, float* out) {
    __shared__ float scratch[32];
    u32 r = blockIdx.x;
    if (r >= rows) return;
    const float* xr = x + (size_t)r * dim;
    float ss = 0.f;
    for (u32 d = threadIdx.x; d < dim; d += blockDim.x) ss += xr[d] * xr[d];
    ss = block_sum(ss, scratch);
    float inv = rsqrtf(ss / (float)dim + eps);
    for (u32 d = threadIdx.x; d < dim; d += blockDim.x) {
        size_t i = (size_t)r * dim + d;
        out[i] = xr[d] * inv * weight[d] * silu(z[i]);
    }
}

// Rotate-half RoPE in place on the first `rotary_dim` dims of each head; one thread per
// (token, head, pair). inv_freq and angles in f32, as the reference computes them.
extern "C" __global__ void rope(float* x, const u32* positions, u32 tokens, u32 heads,
                                u32 head_dim, u32 rotary_dim, float theta) {
    u32 half = rotary_dim / 2;
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (u64)tokens * heads * half) return;
    u32 p = (u32)(i % half);
    u64 th = i / half;
    u32 t = (u32)(th / heads);
    float inv_freq = 1.f / powf(theta, (float)(2 * p) / (float)rotary_dim);
    float angle = (float)positions[t] * inv_freq;
    float c = cosf(angle), s = sinf(angle);
    float* head = x + th * head_dim;
    float a = head[p], b = head[p + half];
    head[p] = a * c - b * s;
    head[p + half] = b * c + a * s;
}
