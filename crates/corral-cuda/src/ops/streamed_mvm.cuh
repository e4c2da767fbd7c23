// Few-row products streamed (sm_90+): out[r, n] = Σ_k x[r, k] W[n, k] for at most a few
// rows of x, W's rows read once. A persistent block per SM takes a contiguous range of units
// (weight rows of one matrix: a hit expert's, or a dense projection's), so it meets at most a
// few matrices and reads long runs of each. Its producer warp copies each unit's rows whole
// into one of its shared-memory stages (as many as fit, up to STREAM_MAX_STAGES) by bulk
// copy, the next units in flight while the consumer warps compute, and writes the unit's
// record beside the stage, so the consumers read no metadata from global memory. The
// consumers take the staged rows as the mma's A operand for the matrix's rows of x, 8 at a
// time, K split between the warps, holding those x operands in registers from one unit to
// the next. Units: gate/up 8 features of gate (A rows g) and the same 8 of up (A rows g + 8);
// down and dense up to STREAM_GROUPS groups of 16 features. K is a multiple of 8 and at most
// STREAM_MAX_K, rows 16-byte aligned (the host checks).
//
// Modes: STREAM_GATE_UP (act = silu(x Gᵀ) ⊙ x Uᵀ over each hit expert's sorted rows),
// STREAM_DOWN (y = w_row · act Dᵀ, the routing weight of each sorted row), STREAM_DENSE (one
// matrix, rows of x in order). Down and dense begin deferred: the producer streams weights
// while the kernel before ends (down reads the sort's results for it, which that kernel
// waited for), the consumers wait for it before they read x.
#define STREAM_CONSUMERS 8
#define STREAM_THREADS ((STREAM_CONSUMERS + 1) * 32)
#define STREAM_MAX_STAGES 6
#define STREAM_MAX_K 2048
#define STREAM_SPANS (STREAM_MAX_K / 32 / STREAM_CONSUMERS)  // 32-wide spans of K a warp takes
#define STREAM_POOL_BYTES (3 * 16 * STREAM_MAX_K * 2)  // the stages: as many units as fit, up to 6
#define STREAM_GROUPS 2  // (each consumer thread writes one output of a unit's 8 rows)
#define STREAM_RED_FLOATS (STREAM_CONSUMERS * STREAM_GROUPS * 4 * 32)
#define STREAM_END 0xffffffffu  // a unit's `lo` that tells the consumers the range is done
#define STREAM_SMEM_BYTES \
    (STREAM_POOL_BYTES + 2 * STREAM_RED_FLOATS * 4 + STREAM_MAX_STAGES * (2 * 8 + 16))
#define STREAM_GATE_UP 0
#define STREAM_DOWN 1
#define STREAM_DENSE 2

struct StreamUnit {
    u32 lo, hi;    // the matrix's rows of x (an expert's sorted rows)
    u32 n0, rows;  // the unit's first feature and how many it has
};

// What a streamed launch reads and writes. Experts: x (gate/up: tokens' rows, found through
// sorted_pairs and top_k; down: act rows by sorted position), the sorted routing, the
// experts' weight tables (a: gate or down, b: up). Dense: x's `rows` rows and the matrix
// `dense`.
struct StreamArgs {
    const float* x;
    u32 K, N;
    u32 top_k;
    const float* route_weights;
    const u32* offsets;
    const u32* hit_experts;
    const u32* sorted_pairs;
    u32 pairs, num_experts;
    const u64* table_a;
    const u64* table_b;
    const u16* dense;
    u32 rows;
    float* out;
    Diag* diag;
};

template <typename W, int MODE>
__device__ void streamed_mvm_impl(const StreamArgs& p) {
#if __CUDA_ARCH__ >= 900
    extern __shared__ __align__(128) unsigned char st_smem[];
    constexpr bool GATE_UP = MODE == STREAM_GATE_UP, DENSE = MODE == STREAM_DENSE;
    const u32 K = p.K, N = p.N;
    // Features a unit: gate/up 8 (16 rows); else the groups of 16 that fit a third of the
    // pool.
    const u32 groups = GATE_UP ? 1 : max(1u, min((u32)STREAM_GROUPS, STREAM_POOL_BYTES / 3 / (2 * K) / 16));
    const u32 features = GATE_UP ? 8 : 16 * groups;
    const u32 unit_bytes = (GATE_UP ? 16 : features) * K * 2;
    const u32 stage_bytes = (unit_bytes + 127) / 128 * 128;
    const u32 stages = min((u32)STREAM_MAX_STAGES, STREAM_POOL_BYTES / stage_bytes);
    float* red = reinterpret_cast<float*>(st_smem + STREAM_POOL_BYTES);
    u64* full = reinterpret_cast<u64*>(red + 2 * STREAM_RED_FLOATS);
    u64* empty = full + STREAM_MAX_STAGES;
    StreamUnit* unit_of = reinterpret_cast<StreamUnit*>(empty + STREAM_MAX_STAGES);
    u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    if (threadIdx.x == 0) {
        for (u32 s = 0; s < stages; s++) {
            barrier_init(&full[s], 1);
            barrier_init(&empty[s], STREAM_CONSUMERS);
        }
        barrier_init_fence();
    }
    __syncthreads();
    if (warp == STREAM_CONSUMERS) {
        if (lane != 0) return;
        u32 it = 0;
        const u32 matrices = DENSE ? 1 : min(p.hit_experts[0], p.num_experts);
        const u32 per = (N + features - 1) / features, units = matrices * per;
        u32 share = units / gridDim.x, extra = units % gridDim.x;
        u32 begin = blockIdx.x * share + min(blockIdx.x, extra);
        u32 end = begin + share + (blockIdx.x < extra ? 1 : 0);
        u32 cur = STREAM_END, lo = 0, hi = 0;
        const u16 *a = p.dense, *b = nullptr;
        for (u32 u = begin; u < end; u++) {
            u32 n = u / per;
            if (n != cur) {
                cur = n;
                if (DENSE) {
                    hi = p.rows;
                } else {
                    u32 e = p.hit_experts[1 + n];
                    lo = hi = 0;
                    if (e >= p.num_experts) {
                        raise_error(p.diag, ERR_EXPERT_ID);
                    } else {
                        lo = min(p.offsets[e], p.pairs);
                        hi = min(p.offsets[e + 1], p.pairs);
                        a = reinterpret_cast<const u16*>(p.table_a[e]);
                        if (GATE_UP) b = reinterpret_cast<const u16*>(p.table_b[e]);
                    }
                }
            }
            if (lo >= hi) continue;
            u32 n0 = (u % per) * features, rows = min(features, N - n0);
            u32 s = it % stages;
            barrier_wait(&empty[s], ((it / stages) & 1) ^ 1);
            unit_of[s] = StreamUnit{lo, hi, n0, rows};
            u32 bytes = rows * K * 2;
            barrier_arrive_expect(&full[s], GATE_UP ? 2 * bytes : bytes);
            count_weight_bytes(p.diag, GATE_UP ? 2 * bytes : bytes);
            u16* stage = reinterpret_cast<u16*>(st_smem + s * stage_bytes);
            bulk_copy_to_shared(stage, a + (size_t)n0 * K, bytes, &full[s]);
            if (GATE_UP) bulk_copy_to_shared(stage + 8 * K, b + (size_t)n0 * K, bytes, &full[s]);
            it++;
        }
        u32 s = it % stages;
        barrier_wait(&empty[s], ((it / stages) & 1) ^ 1);
        unit_of[s].lo = STREAM_END;
        barrier_arrive(&full[s]);
        return;
    }
    if (!GATE_UP) wait_for_previous_kernel();
    constexpr bool f16 = F16Operands<W>::value;
    const u32 consumers = STREAM_CONSUMERS * 32;
    const u32 spans = (K + 31) / 32;
    bool range_error = false;
    u32 it = 0, rb = 0, x_key = STREAM_END;
    u32 bf[STREAM_SPANS][4];
    float row_weight = 1.f;  // down: the routing weight of the row this thread writes
    for (;; it++) {
        u32 s = it % stages;
        barrier_wait(&full[s], (it / stages) & 1);
        StreamUnit unit = unit_of[s];
        if (unit.lo == STREAM_END) break;
        const u32 unit_groups = GATE_UP ? 1 : (unit.rows + 15) / 16;
        const u16* stage = reinterpret_cast<const u16*>(st_smem + s * stage_bytes);
        for (u32 c0 = unit.lo; c0 < unit.hi; c0 += 8) {
            // This lane's B column, row c0 + g of x, as operands: kept while the block's
            // units stay on these rows.
            if (c0 != x_key) {
                x_key = c0;
                const float* xr = nullptr;
                if (c0 + g < unit.hi)
                    xr = p.x + (size_t)(GATE_UP ? p.sorted_pairs[c0 + g] / p.top_k : c0 + g) * K;
#pragma unroll
                for (int q = 0; q < STREAM_SPANS; q++) {
                    u32 k = (warp + q * STREAM_CONSUMERS) * 32 + t * 8;
                    x_operands8<f16>(xr + k, xr && k < K, bf[q], range_error);
                }
                if (MODE == STREAM_DOWN) {
                    u32 sr = c0 + 2 * (lane & 3) + ((threadIdx.x >> 5) & 1);
                    row_weight = sr < unit.hi ? p.route_weights[p.sorted_pairs[sr]] : 0.f;
                }
            }
            float acc[STREAM_GROUPS][4];
#pragma unroll
            for (int d = 0; d < STREAM_GROUPS; d++)
#pragma unroll
                for (int i = 0; i < 4; i++) acc[d][i] = 0.f;
#pragma unroll
            for (int q = 0; q < STREAM_SPANS; q++) {
                u32 sp = warp + q * STREAM_CONSUMERS;
                if (sp >= spans) break;
                u32 k = sp * 32 + t * 8;
                bool k_ok = k < K;
#pragma unroll
                for (int d = 0; d < STREAM_GROUPS; d++) {
                    if (d >= (int)unit_groups) break;
                    u32 r_lo = GATE_UP ? g : d * 16 + g, r_hi = GATE_UP ? 8 + g : d * 16 + g + 8;
                    bool lo_ok = k_ok && (GATE_UP ? g : r_lo) < unit.rows;
                    bool hi_ok = k_ok && (GATE_UP ? g : r_hi) < unit.rows;
                    uint4 wl = lo_ok ? *reinterpret_cast<const uint4*>(stage + r_lo * K + k)
                                     : make_uint4(0, 0, 0, 0);
                    uint4 wh = hi_ok ? *reinterpret_cast<const uint4*>(stage + r_hi * K + k)
                                     : make_uint4(0, 0, 0, 0);
                    u32 a0[4] = {wl.x, wh.x, wl.y, wh.y};
                    u32 a1[4] = {wl.z, wh.z, wl.w, wh.w};
                    mma16816<f16>(acc[d], a0, &bf[q][0]);
                    mma16816<f16>(acc[d], a1, &bf[q][2]);
                }
            }
            // The stage's last reads are done (the mmas consumed them): hand it back.
            if (c0 + 8 >= unit.hi) {
                __syncwarp();
                if (lane == 0) barrier_arrive(&empty[s]);
            }
            // acc[d][i]: A row (feature) d 16 + g (+ 8 for i >= 2), row c0 + 2 t + (i & 1).
            float* rbuf = red + rb * STREAM_RED_FLOATS;
#pragma unroll
            for (int d = 0; d < STREAM_GROUPS; d++) {
                if (d >= (int)unit_groups) break;
#pragma unroll
                for (int i = 0; i < 4; i++) rbuf[((warp * unit_groups + d) * 4 + i) * 32 + lane] = acc[d][i];
            }
            sync_threads_of(consumers);
            if (GATE_UP) {
                if (threadIdx.x < 64) {
                    u32 l = threadIdx.x & 31, ih = threadIdx.x >> 5;
                    float gate = 0.f, up = 0.f;
#pragma unroll
                    for (int w = 0; w < STREAM_CONSUMERS; w++) {
                        gate += rbuf[(w * 4 + ih) * 32 + l];
                        up += rbuf[(w * 4 + ih + 2) * 32 + l];
                    }
                    u32 f = l >> 2, sr = c0 + 2 * (l & 3) + ih;
                    if (f < unit.rows && sr < unit.hi) p.out[(size_t)sr * N + unit.n0 + f] = silu(gate) * up;
                }
            } else {
                // Thread j writes output (group d, accumulator i, lane l) = j, at most one
                // (groups * 128 <= consumers); its row's weight was read with x.
                u32 j = threadIdx.x, d = j >> 7, i = (j >> 5) & 3, l = j & 31;
                if (d < unit_groups) {
                    float sum = 0.f;
#pragma unroll
                    for (int w = 0; w < STREAM_CONSUMERS; w++) sum += rbuf[((w * unit_groups + d) * 4 + i) * 32 + l];
                    u32 f = d * 16 + (l >> 2) + (i >= 2 ? 8 : 0), sr = c0 + 2 * (l & 3) + (i & 1);
                    if (f < unit.rows && sr < unit.hi) p.out[(size_t)sr * N + unit.n0 + f] = row_weight * sum;
                }
            }
            rb ^= 1;
        }
    }
    if (range_error) raise_error(p.diag, ERR_F16_RANGE);
#endif
}
