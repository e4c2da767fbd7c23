// Sampling where the logits are: penalties applied in place, and each logits row reduced to
// its best candidates, its normalisers and a Gumbel-max draw, so that a step reads back a
// few hundred bytes a row instead of the vocabulary (layouts: sampling.rs).

#define CAND 64
#define ROW_WORDS (2 * CAND + 8)
#define SAMPLE_THREADS 1024
#define SAMPLE_WARPS (SAMPLE_THREADS / 32)
// Each warp keeps its best CAND keys and up to CAND pending ones.
#define WARP_KEYS (2 * CAND)
// Logits a lane loads before it looks at any (loads in flight).
#define SAMPLE_UNROLL 16

// entries: [n, 4] u32 of (index into the `len` logits, subtracted, repetition penalty, 0).
extern "C" __global__ void logit_penalties(float* logits, u32 len, const u32* entries, u32 n,
                                           Diag* diag) {
    begin_small_kernel();
    u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    u32 at = entries[4 * i];
    if (at >= len) {
        raise_error(diag, ERR_ROW_INDEX);
        return;
    }
    float l = __fsub_rn(logits[at], __uint_as_float(entries[4 * i + 1]));
    float rep = __uint_as_float(entries[4 * i + 2]);
    logits[at] = l > 0.f ? __fdiv_rn(l, rep) : __fmul_rn(l, rep);
}

__device__ __forceinline__ bool is_finite(float l) {
    return (__float_as_uint(l) & 0x7f800000u) != 0x7f800000u;
}

// Larger logit first, then lower id; 0 is no key (a finite logit never maps to it).
__device__ __forceinline__ u64 candidate_key(float l, u32 id) {
    u32 u = __float_as_uint(l);
    u32 s = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ((u64)s << 32) | (u64)(~id);
}

__device__ __forceinline__ float candidate_logit(u64 key) {
    u32 s = (u32)(key >> 32);
    return __uint_as_float((s & 0x80000000u) ? (s & 0x7fffffffu) : ~s);
}

// Mirrors gumbel_noise of sampling.rs.
__device__ __forceinline__ float gumbel(u64 key, u32 id) {
    u64 z = key + (u64)(id + 1) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    float u = ((float)(u32)(z >> 40) + 0.5f) * (1.0f / 16777216.0f);
    return -logf(-logf(u));
}

// Sorts n (a power of two) keys in descending order, by one warp.
__device__ void warp_sort_desc(u64* a, u32 n, u32 lane) {
    for (u32 k = 2; k <= n; k <<= 1)
        for (u32 j = k >> 1; j > 0; j >>= 1) {
            for (u32 i = lane; i < n; i += 32) {
                u32 p = i ^ j;
                if (p > i) {
                    u64 x = a[i], y = a[p];
                    if ((i & k) == 0 ? x < y : x > y) {
                        a[i] = y;
                        a[p] = x;
                    }
                }
            }
            __syncwarp();
        }
}

// As warp_sort_desc, by the whole block.
__device__ void block_sort_desc(u64* a, u32 n) {
    for (u32 k = 2; k <= n; k <<= 1)
        for (u32 j = k >> 1; j > 0; j >>= 1) {
            for (u32 i = threadIdx.x; i < n; i += blockDim.x) {
                u32 p = i ^ j;
                if (p > i) {
                    u64 x = a[i], y = a[p];
                    if ((i & k) == 0 ? x < y : x > y) {
                        a[i] = y;
                        a[p] = x;
                    }
                }
            }
            __syncthreads();
        }
}

// Running max m with Σ exp(l - m) and Σ exp((l - m) / T), merged as log-sum-exp pieces.
struct Normaliser {
    float m, s, st;
};

__device__ __forceinline__ float rescale(float from, float to, float inv_t) {
    return from == NEG_INF ? 0.f : __expf((from - to) * inv_t);
}

__device__ __forceinline__ Normaliser merge(Normaliser a, Normaliser b, float inv_t) {
    float m = fmaxf(a.m, b.m);
    if (m == NEG_INF) return a;
    Normaliser r;
    r.m = m;
    r.s = a.s * rescale(a.m, m, 1.f) + b.s * rescale(b.m, m, 1.f);
    r.st = a.st * rescale(a.m, m, inv_t) + b.st * rescale(b.m, m, inv_t);
    return r;
}

// A draw (score, id, logit); higher score wins, ties to the lower id.
struct Draw {
    float score;
    u32 id;
    float logit;
};

__device__ __forceinline__ Draw better(Draw a, Draw b) {
    if (b.id == 0xffffffffu) return a;
    if (a.id == 0xffffffffu) return b;
    return (b.score > a.score || (b.score == a.score && b.id < a.id)) ? b : a;
}

// One block a row: out[row] gets the row's CAND best (id, logit), how many there are, the
// max, ln Σ exp(l), ln Σ exp(l / T) and, if the row asks, argmax(l / T + Gumbel noise).
// params: [rows, 4] u32 of (1/T bits, key low, key high, draw?).
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    top_candidates(const float* logits, u32 vocab, const u32* params, u32* out) {
    begin_kernel();
    __shared__ u64 keys[SAMPLE_WARPS * WARP_KEYS];
    __shared__ Normaliser norms[SAMPLE_WARPS];
    __shared__ Draw draws[SAMPLE_WARPS];
    const u32 row = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const float* x = logits + (size_t)row * vocab;
    const float inv_t = __uint_as_float(params[4 * row]);
    const u64 gkey = (u64)params[4 * row + 1] | ((u64)params[4 * row + 2] << 32);
    const bool drawing = params[4 * row + 3] != 0;

    u64* mine = keys + warp * WARP_KEYS;
    for (u32 i = lane; i < WARP_KEYS; i += 32) mine[i] = 0;
    __syncwarp();
    // Each warp scans a contiguous slice, a whole number of 32-wide steps long.
    const u32 slice = ((vocab + SAMPLE_WARPS - 1) / SAMPLE_WARPS + 31) / 32 * 32;
    const u32 start = min(warp * slice, vocab), end = min(start + slice, vocab);
    Normaliser norm = {NEG_INF, 0.f, 0.f};
    Draw draw = {0.f, 0xffffffffu, 0.f};
    u64 threshold = 0;
    u32 pending = 0;
    for (u32 base = start; base < end; base += 32 * SAMPLE_UNROLL) {
        float v[SAMPLE_UNROLL];
#pragma unroll
        for (u32 j = 0; j < SAMPLE_UNROLL; j++) {
            u32 i = base + j * 32 + lane;
            v[j] = i < end ? x[i] : NEG_INF;
        }
#pragma unroll
        for (u32 j = 0; j < SAMPLE_UNROLL; j++) {
            u32 i = base + j * 32 + lane;
            float l = v[j];
            u64 key = 0;
            if (i < end && is_finite(l)) {
                key = candidate_key(l, i);
                if (l > norm.m) {
                    norm.s = norm.s * rescale(norm.m, l, 1.f) + 1.f;
                    norm.st = norm.st * rescale(norm.m, l, inv_t) + 1.f;
                    norm.m = l;
                } else {
                    norm.s += __expf(l - norm.m);
                    norm.st += __expf((l - norm.m) * inv_t);
                }
                if (drawing) {
                    Draw d = {__fadd_rn(__fmul_rn(l, inv_t), gumbel(gkey, i)), i, l};
                    draw = better(draw, d);
                }
            }
            bool take = key > threshold;
            u32 mask = __ballot_sync(0xffffffffu, take);
            if (take) mine[CAND + pending + __popc(mask & ((1u << lane) - 1))] = key;
            pending += __popc(mask);
            if (pending > 32) {
                __syncwarp();
                warp_sort_desc(mine, WARP_KEYS, lane);
                threshold = mine[CAND - 1];
                for (u32 i = CAND + lane; i < WARP_KEYS; i += 32) mine[i] = 0;
                pending = 0;
                __syncwarp();
            }
        }
    }
    if (pending > 0) {
        __syncwarp();
        warp_sort_desc(mine, WARP_KEYS, lane);
    }
    for (int o = 16; o > 0; o >>= 1) {
        Normaliser other = {__shfl_xor_sync(0xffffffffu, norm.m, o),
                            __shfl_xor_sync(0xffffffffu, norm.s, o),
                            __shfl_xor_sync(0xffffffffu, norm.st, o)};
        norm = merge(norm, other, inv_t);
        Draw d = {__shfl_xor_sync(0xffffffffu, draw.score, o),
                  __shfl_xor_sync(0xffffffffu, draw.id, o),
                  __shfl_xor_sync(0xffffffffu, draw.logit, o)};
        draw = better(draw, d);
    }
    if (lane == 0) {
        norms[warp] = norm;
        draws[warp] = draw;
    }
    // Each warp's best CAND keys, side by side, then sorted together.
    u64 a = mine[lane], b = mine[lane + 32];
    __syncthreads();
    keys[warp * CAND + lane] = a;
    keys[warp * CAND + lane + 32] = b;
    __syncthreads();
    block_sort_desc(keys, SAMPLE_WARPS * CAND);

    u32* o = out + (size_t)row * ROW_WORDS;
    if (threadIdx.x < CAND) {
        u64 key = keys[threadIdx.x];
        o[threadIdx.x] = key == 0 ? 0u : ~(u32)key;
        o[CAND + threadIdx.x] = key == 0 ? 0u : __float_as_uint(candidate_logit(key));
    }
    if (warp == 0) {
        Normaliser n = norms[lane];
        Draw d = draws[lane];
        for (int s = 16; s > 0; s >>= 1) {
            Normaliser other = {__shfl_xor_sync(0xffffffffu, n.m, s),
                                __shfl_xor_sync(0xffffffffu, n.s, s),
                                __shfl_xor_sync(0xffffffffu, n.st, s)};
            n = merge(n, other, inv_t);
            Draw e = {__shfl_xor_sync(0xffffffffu, d.score, s),
                      __shfl_xor_sync(0xffffffffu, d.id, s),
                      __shfl_xor_sync(0xffffffffu, d.logit, s)};
            d = better(d, e);
        }
        u32 count = __popc(__ballot_sync(0xffffffffu, keys[lane] != 0)) +
                    __popc(__ballot_sync(0xffffffffu, keys[lane + 32] != 0));
        if (lane == 0) {
            bool any = n.m != NEG_INF;
            o[2 * CAND] = count;
            o[2 * CAND + 1] = __float_as_uint(n.m);
            o[2 * CAND + 2] = __float_as_uint(any ? n.m + logf(n.s) : NEG_INF);
            o[2 * CAND + 3] = __float_as_uint(any ? n.m * inv_t + logf(n.st) : NEG_INF);
            o[2 * CAND + 4] = d.id;
            o[2 * CAND + 5] = __float_as_uint(d.id == 0xffffffffu ? 0.f : d.logit);
            o[2 * CAND + 6] = 0;
            o[2 * CAND + 7] = 0;
        }
    }
}
