// Sampling where the logits are: penalties applied in place, and each logits row reduced to
// its best candidates, its normalisers and a Gumbel-max draw, so that a step reads back a
// few hundred bytes a row instead of the vocabulary (layouts: sampling.rs).

#define CAND 64
#define ROW_WORDS (2 * CAND + 8)
#define SAMPLE_THREADS 1024
#define SAMPLE_WARPS (SAMPLE_THREADS / 32)
// Logits a thread holds: a block reduces SAMPLE_CHUNK of a row, at most SAMPLE_MAX_PARTS
// blocks a row (the host's SAMPLE_CHUNK and SAMPLE_MAX_PARTS).
#define SAMPLE_PER_THREAD 16
#define SAMPLE_CHUNK (SAMPLE_THREADS * SAMPLE_PER_THREAD)
#define SAMPLE_MAX_PARTS 32
// Groups of 16 threads whose maxima bound a block's threshold, and the keys a block keeps
// above it (more and the row is marked truncated: only its best candidate is exact).
#define SAMPLE_GROUPS (SAMPLE_THREADS / 16)
#define SURVIVORS 2048

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
    float u = ((float)(u32)(z >> 41) + 0.5f) * (1.0f / 8388608.0f);
    return -logf(-logf(u));
}

// Sorts n (a power of two) keys in descending order, by the whole block.
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

__device__ __forceinline__ u64 max_u64(u64 a, u64 b) { return a > b ? a : b; }
__device__ __forceinline__ u64 min_u64(u64 a, u64 b) { return a < b ? a : b; }

// A block's (or a row's) result in the row layout: keys [0, 2 CAND) as pairs of words,
// then m, s, st, draw score, id, logit, truncated.
#define PART_M (2 * CAND)

// Reduces every thread's normaliser and draw; thread 0 gets the block's.
__device__ void block_reduce(Normaliser& norm, Draw& draw, float inv_t, Normaliser* norms,
                             Draw* draws) {
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int round = 0; round < 2; round++) {
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
        if (round == 1) break;
        if (lane == 0) {
            norms[warp] = norm;
            draws[warp] = draw;
        }
        __syncthreads();
        if (warp != 0) return;
        norm = lane < blockDim.x / 32 ? norms[lane] : Normaliser{NEG_INF, 0.f, 0.f};
        draw = lane < blockDim.x / 32 ? draws[lane] : Draw{0.f, 0xffffffffu, 0.f};
    }
}

// Sorts the block's first n keys (padded with no-keys to a power of two of at least CAND).
__device__ void sort_kept(u64* keys, u32 n) {
    u32 size = CAND;
    while (size < n) size <<= 1;
    for (u32 i = n + threadIdx.x; i < size; i += blockDim.x) keys[i] = 0;
    __syncthreads();
    block_sort_desc(keys, size);
}

// Row `blockIdx.y`'s logits reduced over blockIdx.x-th SAMPLE_CHUNK: its best CAND keys,
// normaliser and draw into scratch; the row's last block to finish merges the parts into
// out[row]: the CAND best (id, logit), how many there are, the max, ln Σ exp(l),
// ln Σ exp(l / T), the Gumbel-max draw argmax(l / T + G) if the row asks, and whether a
// block had more than SURVIVORS keys at its threshold (then only the best is exact).
// A block keeps the keys at or above the least of its 64 groups' maxima: at least 64 keys
// are, so its best CAND are among them. params: [rows, 4] u32 of (1/T bits, key low, key
// high, draw?); tickets: one a row, zero between launches.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    top_candidates(const float* logits, u32 vocab, const u32* params, u32* scratch,
                   u32* tickets, u32* out) {
    begin_kernel();
    __shared__ u64 keys[SURVIVORS];
    __shared__ u64 group_max[SAMPLE_GROUPS];
    __shared__ Normaliser norms[SAMPLE_WARPS];
    __shared__ Draw draws[SAMPLE_WARPS];
    __shared__ u32 kept;
    __shared__ u32 last;
    const u32 row = blockIdx.y, part = blockIdx.x, parts = gridDim.x;
    const u32 lane = threadIdx.x & 31;
    const float* x = logits + (size_t)row * vocab;
    const float inv_t = __uint_as_float(params[4 * row]);
    const u64 gkey = (u64)params[4 * row + 1] | ((u64)params[4 * row + 2] << 32);
    const bool drawing = params[4 * row + 3] != 0;
    const u32 base = part * SAMPLE_CHUNK;

    float v[SAMPLE_PER_THREAD];
#pragma unroll
    for (u32 j = 0; j < SAMPLE_PER_THREAD; j++) {
        u32 i = base + j * SAMPLE_THREADS + threadIdx.x;
        v[j] = i < vocab ? x[i] : NEG_INF;
    }
    Normaliser norm = {NEG_INF, 0.f, 0.f};
    Draw draw = {0.f, 0xffffffffu, 0.f};
    u64 mine = 0;
#pragma unroll
    for (u32 j = 0; j < SAMPLE_PER_THREAD; j++) {
        u32 i = base + j * SAMPLE_THREADS + threadIdx.x;
        float l = v[j];
        if (i < vocab && is_finite(l)) {
            mine = max_u64(mine, candidate_key(l, i));
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
    }
    for (int o = 8; o > 0; o >>= 1) mine = max_u64(mine, __shfl_xor_sync(0xffffffffu, mine, o));
    if ((lane & 15) == 0) group_max[threadIdx.x >> 4] = mine;
    if (threadIdx.x == 0) kept = 0;
    __syncthreads();
    // The least group maximum (0, every finite key, if a group has none).
    u64 threshold = min_u64(group_max[lane], group_max[lane + 32]);
    for (int o = 16; o > 0; o >>= 1)
        threshold = min_u64(threshold, __shfl_xor_sync(0xffffffffu, threshold, o));
#pragma unroll
    for (u32 j = 0; j < SAMPLE_PER_THREAD; j++) {
        u32 i = base + j * SAMPLE_THREADS + threadIdx.x;
        u64 key = i < vocab && is_finite(v[j]) ? candidate_key(v[j], i) : 0;
        bool take = key != 0 && key >= threshold;
        u32 mask = __ballot_sync(0xffffffffu, take);
        if (mask == 0) continue;
        u32 first = 0;
        if (lane == 0) first = atomicAdd(&kept, (u32)__popc(mask));
        first = __shfl_sync(0xffffffffu, first, 0);
        u32 at = first + __popc(mask & ((1u << lane) - 1));
        if (take && at < SURVIVORS) keys[at] = key;
    }
    __syncthreads();
    const u32 n = kept;
    const bool truncated = n > SURVIVORS;
    if (truncated) {
        // Only the block's best is known: its groups' largest maximum.
        __syncthreads();
        if (threadIdx.x < CAND) keys[threadIdx.x] = 0;
        __syncthreads();
        if (threadIdx.x < SAMPLE_GROUPS) atomicMax(&keys[0], group_max[threadIdx.x]);
        __syncthreads();
    } else {
        sort_kept(keys, n);
    }
    u32* part_out = scratch + ((size_t)row * SAMPLE_MAX_PARTS + part) * ROW_WORDS;
    if (threadIdx.x < CAND) {
        part_out[2 * threadIdx.x] = (u32)keys[threadIdx.x];
        part_out[2 * threadIdx.x + 1] = (u32)(keys[threadIdx.x] >> 32);
    }
    block_reduce(norm, draw, inv_t, norms, draws);
    if (threadIdx.x == 0) {
        part_out[PART_M] = __float_as_uint(norm.m);
        part_out[PART_M + 1] = __float_as_uint(norm.s);
        part_out[PART_M + 2] = __float_as_uint(norm.st);
        part_out[PART_M + 3] = __float_as_uint(draw.score);
        part_out[PART_M + 4] = draw.id;
        part_out[PART_M + 5] = __float_as_uint(draw.logit);
        part_out[PART_M + 6] = truncated;
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(&tickets[row], 1u) == parts - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();

    // The row's last block: merge every part.
    const u32* parts_in = scratch + (size_t)row * SAMPLE_MAX_PARTS * ROW_WORDS;
    for (u32 i = threadIdx.x; i < parts * CAND; i += blockDim.x) {
        const u32* p = parts_in + (i / CAND) * ROW_WORDS + 2 * (i % CAND);
        keys[i] = (u64)__ldcg(p) | ((u64)__ldcg(p + 1) << 32);
    }
    __syncthreads();
    sort_kept(keys, parts * CAND);
    norm = Normaliser{NEG_INF, 0.f, 0.f};
    draw = Draw{0.f, 0xffffffffu, 0.f};
    bool any_truncated = false;
    if (threadIdx.x < parts) {
        const u32* p = parts_in + threadIdx.x * ROW_WORDS + PART_M;
        norm = Normaliser{__uint_as_float(__ldcg(p)), __uint_as_float(__ldcg(p + 1)),
                          __uint_as_float(__ldcg(p + 2))};
        draw = Draw{__uint_as_float(__ldcg(p + 3)), __ldcg(p + 4), __uint_as_float(__ldcg(p + 5))};
        any_truncated = __ldcg(p + 6) != 0;
    }
    any_truncated = __syncthreads_or(any_truncated);
    u32* o = out + (size_t)row * ROW_WORDS;
    if (threadIdx.x < CAND) {
        u64 key = keys[threadIdx.x];
        o[threadIdx.x] = key == 0 ? 0u : ~(u32)key;
        o[CAND + threadIdx.x] = key == 0 ? 0u : __float_as_uint(candidate_logit(key));
    }
    u32 count = __syncthreads_count(threadIdx.x < CAND && keys[threadIdx.x] != 0);
    block_reduce(norm, draw, inv_t, norms, draws);
    if (threadIdx.x == 0) {
        bool any = norm.m != NEG_INF;
        o[2 * CAND] = count;
        o[2 * CAND + 1] = __float_as_uint(norm.m);
        o[2 * CAND + 2] = __float_as_uint(any ? norm.m + logf(norm.s) : NEG_INF);
        o[2 * CAND + 3] = __float_as_uint(any ? norm.m * inv_t + logf(norm.st) : NEG_INF);
        o[2 * CAND + 4] = draw.id;
        o[2 * CAND + 5] = __float_as_uint(draw.id == 0xffffffffu ? 0.f : draw.logit);
        o[2 * CAND + 6] = any_truncated;
        o[2 * CAND + 7] = 0;
        tickets[row] = 0;
    }
}

// ids[r]: the id of row r's largest finite logit, ties to the lower id (0xffffffff where
// none is finite): a greedy token chosen where the logits are. A block a row, its threads
// striding over the vocabulary, then the largest key of the block (candidate_key orders
// larger logits first, then lower ids; 0 is none).
extern "C" __global__ void __launch_bounds__(256) argmax_rows(const float* logits, u32 vocab,
                                                                u32* ids) {
    begin_small_kernel();
    const float* row = logits + (size_t)blockIdx.x * vocab;
    u64 best = 0;
    for (u32 i = threadIdx.x; i < vocab; i += blockDim.x) {
        float l = row[i];
        u64 key = is_finite(l) ? candidate_key(l, i) : 0;
        best = key > best ? key : best;
    }
    for (int o = 16; o > 0; o >>= 1) {
        u64 other = __shfl_xor_sync(0xffffffffu, best, o);
        best = other > best ? other : best;
    }
    __shared__ u64 warp_best[8];
    if ((threadIdx.x & 31) == 0) warp_best[threadIdx.x >> 5] = best;
    __syncthreads();
    if (threadIdx.x != 0) return;
    for (u32 w = 1; w < blockDim.x / 32; ++w) best = warp_best[w] > best ? warp_best[w] : best;
    ids[blockIdx.x] = best ? ~(u32)best : 0xffffffffu;
}
