// A 64x64 output tile of C = A · Wᵀ on tensor cores (mma.sync m16n8k16, 16-bit operands,
// f32 accumulation): A rows are f32 activations, converted to the operand type as they are
// staged in shared memory; W is a [N, K] row-major weight of any stored type. With NW = 2 the block computes
// the same tile of two weights (gate and up) over one staged A. 128 threads: 2x2 warps of
// 32x32, tiles of 32 along K, the next tile's loads in flight while the current one computes.

#define TILE_M 64
#define TILE_N 64
#define TILE_K 32
#define TILE_THREADS 128
#define SMEM_STRIDE 40  // u16 per staged row: 32 + 8 of padding, conflict-free fragments

// Two values rounded to nearest even and packed, `lo` in the low half: one instruction.
__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
    u32 d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

// x as a split pair: hi = bf16(x), lo = bf16(x − hi), about 16 significant bits together.
// A product of a split operand and a bf16 one is hi·w + lo·w, near f32's own precision.
__device__ __forceinline__ void split_bf16(float x, u16* hi, u16* lo) {
    u16 h = f32_to_bf16(x);
    *hi = h;
    *lo = f32_to_bf16(x - bf16_to_f32(h));
}

// Two adjacent values as split pairs, packed (the first in the low half).
__device__ __forceinline__ void split_bf16x2(float v0, float v1, u32* hi, u32* lo) {
    u32 h = pack_bf16(v0, v1);
    *hi = h;
    *lo = pack_bf16(v0 - __uint_as_float(h << 16), v1 - __uint_as_float(h & 0xffff0000u));
}

__device__ __forceinline__ u32 pack_f16(float lo, float hi) {
    u32 d;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

// The tensor-core operand type for weights of type W: bf16 weights run as bf16, f16 and
// f32 weights as f16 (more mantissa than bf16: rounding an f16 or f32 checkpoint's weights
// to bf16 would lose precision the checkpoint has).
template <typename W> struct F16Operands { static const bool value = true; };
template <> struct F16Operands<bf16w> { static const bool value = false; };

template <bool F16>
__device__ __forceinline__ u32 pack2(float lo, float hi) {
    return F16 ? pack_f16(lo, hi) : pack_bf16(lo, hi);
}

// Eight f32 values of x at p (16-byte aligned; zeros where `ok` is false) as the two B
// operand pairs of a k16 step: b[0..2] values 0-3, b[2..4] values 4-7. Sets range_error
// where an f16 operand would overflow.
template <bool F16>
__device__ __forceinline__ void x_operands8(const float* p, bool ok, u32* b, bool& range_error) {
    float4 xa = make_float4(0.f, 0.f, 0.f, 0.f), xb = xa;
    if (ok) {
        const float4* v = reinterpret_cast<const float4*>(p);
        xa = v[0];
        xb = v[1];
    }
    if (F16) {
        float m = fmaxf(fmaxf(fmaxf(fabsf(xa.x), fabsf(xa.y)), fmaxf(fabsf(xa.z), fabsf(xa.w))),
                        fmaxf(fmaxf(fabsf(xb.x), fabsf(xb.y)), fmaxf(fabsf(xb.z), fabsf(xb.w))));
        range_error |= m > 65504.f;
    }
    b[0] = pack2<F16>(xa.x, xa.y);
    b[1] = pack2<F16>(xa.z, xa.w);
    b[2] = pack2<F16>(xb.x, xb.y);
    b[3] = pack2<F16>(xb.z, xb.w);
}

// 16 consecutive f32 values starting at p (k0 .. k0+15 of a row with `k_left` = K - k0 left)
// as 8 packed operand pairs; out-of-range values are zero. `vec`: 16-byte aligned rows,
// K % 8 == 0.
template <bool F16>
__device__ __forceinline__ void stage16(const float* p, int k_left, bool vec, u32* out) {
    if (vec && k_left >= 16) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float4 v = reinterpret_cast<const float4*>(p)[i];
            out[2 * i] = pack2<F16>(v.x, v.y);
            out[2 * i + 1] = pack2<F16>(v.z, v.w);
        }
    } else {
#pragma unroll
        for (int i = 0; i < 8; i++) {
            float lo = 2 * i < k_left ? p[2 * i] : 0.f;
            float hi = 2 * i + 1 < k_left ? p[2 * i + 1] : 0.f;
            out[i] = pack2<F16>(lo, hi);
        }
    }
}

// 16-bit weights are staged as they are stored (their type is the operand type).
__device__ __forceinline__ void stage16_bits(const u16* p, int k_left, bool vec, u32* out) {
    if (vec && k_left >= 16) {
        uint4 a = reinterpret_cast<const uint4*>(p)[0];
        uint4 b = reinterpret_cast<const uint4*>(p)[1];
        out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
        out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
    } else {
#pragma unroll
        for (int i = 0; i < 8; i++) {
            u32 lo = 2 * i < k_left ? p[2 * i] : 0u;
            u32 hi = 2 * i + 1 < k_left ? p[2 * i + 1] : 0u;
            out[i] = lo | (hi << 16);
        }
    }
}

__device__ __forceinline__ void stage16_w(const bf16w* p, int k_left, bool vec, u32* out) {
    stage16_bits(reinterpret_cast<const u16*>(p), k_left, vec, out);
}
__device__ __forceinline__ void stage16_w(const f16w* p, int k_left, bool vec, u32* out) {
    stage16_bits(reinterpret_cast<const u16*>(p), k_left, vec, out);
}
__device__ __forceinline__ void stage16_w(const float* p, int k_left, bool vec, u32* out) {
    stage16<true>(p, k_left, vec, out);
}

template <bool F16>
__device__ __forceinline__ void mma16816(float* c, const u32* a, const u32* b) {
    if (F16) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
}

// Four 8x8 16-bit matrices from shared memory: lanes 8i .. 8i + 7 give the row addresses of
// matrix i, whose fragment lands in r[i].
__device__ __forceinline__ void ldmatrix_x4(u32* r, const u16* smem) {
    u32 s = (u32)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}

// Four 8x8 16-bit matrices from shared memory, transposed: lanes 8i .. 8i + 7 give the row
// addresses of matrix i, whose transpose's fragment lands in r[i].
__device__ __forceinline__ void ldmatrix_x4_trans(u32* r, const u16* smem) {
    u32 s = (u32)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}

// Asynchronous 16-byte copy global -> shared; bytes < 16 zero-fills the rest (0: no read).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, u32 bytes) {
    u32 s = (u32)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

#define W_STAGES 3

// acc[w][mi][ni][4]: warp tile rows wm*32 + mi*16 + {g, g+8}, cols wn*32 + ni*8 + 2*tq + {0,1}.
// a_rows: shared [TILE_M] row pointers (null for rows past the end). w[i]: row 0 of the
// tile's weight rows; n_valid rows of them exist. a_vec / w_vec: 16-byte loads allowed.
//
// Weights stored as 16-bit values with 16-byte rows (w_vec) stream through a three-stage
// cp.async pipeline straight into shared memory; other weights (f32, odd shapes) are staged
// through registers like the activations, which are converted to the operand type on the
// way and double-buffered, the next tile's loads in flight while the current one computes.
//
// With f16 operands an activation beyond f16's range (|x| > 65504) raises ERR_F16_RANGE in
// `diag`: the step fails with an error instead of computing with infinities.
template <typename W, int NW>
__device__ void tile_mma(const float* const* a_rows, const W* const* w, int n_valid, int K,
                         bool a_vec, bool w_vec, float (*acc)[2][4][4], Diag* diag) {
    constexpr bool F16 = F16Operands<W>::value;
    constexpr bool BITS16 = sizeof(W) == 2;
    __shared__ __align__(16) u16 a_s[2][TILE_M * SMEM_STRIDE];
    __shared__ __align__(16) u16 w_s[NW][W_STAGES][TILE_N * SMEM_STRIDE];
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int wm = warp >> 1, wn = warp & 1, g = lane >> 2, tq = lane & 3;
    int row = tid >> 1, half = (tid & 1) * 16;
    const float* a_row = a_rows[row];
    bool async_w = BITS16 && w_vec;
    int tiles = (K + TILE_K - 1) / TILE_K;
    u32 a_stage[8], w_stage[NW][8];
#pragma unroll
    for (int x = 0; x < NW; x++)
#pragma unroll
        for (int mi = 0; mi < 2; mi++)
#pragma unroll
            for (int ni = 0; ni < 4; ni++)
#pragma unroll
                for (int r = 0; r < 4; r++) acc[x][mi][ni][r] = 0.f;

    auto load_a = [&](int kt) {
        int k0 = kt * TILE_K, k_left = K - k0 - half;
        if (a_row && k_left > 0) {
            stage16<F16>(a_row + k0 + half, k_left, a_vec, a_stage);
            if (F16) {
                bool over = false;
#pragma unroll
                for (int i = 0; i < 8; i++)
                    over |= (a_stage[i] & 0x7c00u) == 0x7c00u || (a_stage[i] & 0x7c000000u) == 0x7c000000u;
                if (over) raise_error(diag, ERR_F16_RANGE);
            }
        } else {
#pragma unroll
            for (int i = 0; i < 8; i++) a_stage[i] = 0u;
        }
    };
    auto store_a = [&](int buf) {
        u32* dst = reinterpret_cast<u32*>(a_s[buf] + row * SMEM_STRIDE + half);
#pragma unroll
        for (int i = 0; i < 8; i++) dst[i] = a_stage[i];
    };
    // Weights of tile kt into stage kt % W_STAGES: cp.async, or registers then a store.
    auto issue_w = [&](int kt) {
        int k0 = kt * TILE_K, stage = kt % W_STAGES;
        if (async_w) {
#pragma unroll
            for (int x = 0; x < NW; x++)
#pragma unroll
                for (int c = 0; c < 2; c++) {
                    int k = k0 + half + c * 8;
                    bool live = row < n_valid && k < K;
                    const W* src = live ? w[x] + (size_t)row * K + k : w[x];
                    cp_async16(w_s[x][stage] + row * SMEM_STRIDE + half + c * 8, src,
                               live ? 16u : 0u);
                }
        } else {
            int k_left = K - k0 - half;
#pragma unroll
            for (int x = 0; x < NW; x++) {
                if (row < n_valid && k_left > 0) {
                    stage16_w(w[x] + (size_t)row * K + k0 + half, k_left, w_vec, w_stage[x]);
                } else {
#pragma unroll
                    for (int i = 0; i < 8; i++) w_stage[x][i] = 0u;
                }
                u32* dst = reinterpret_cast<u32*>(w_s[x][stage] + row * SMEM_STRIDE + half);
#pragma unroll
                for (int i = 0; i < 8; i++) dst[i] = w_stage[x][i];
            }
        }
        cp_async_commit();
    };

    load_a(0);
    store_a(0);
    issue_w(0);
    if (tiles > 1) issue_w(1);
    for (int kt = 0; kt < tiles; kt++) {
        bool more = kt + 1 < tiles;
        if (more) load_a(kt + 1);
        // Tile kt's weights have landed once at most one later group is pending.
        if (more) {
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        if (kt + 2 < tiles) issue_w(kt + 2);
        const u16* as = a_s[kt & 1];
#pragma unroll
        for (int ks = 0; ks < TILE_K; ks += 16) {
            u32 af[2][4];
#pragma unroll
            for (int mi = 0; mi < 2; mi++) {
                const u16* base = as + (wm * 32 + mi * 16 + g) * SMEM_STRIDE + ks + 2 * tq;
                af[mi][0] = *reinterpret_cast<const u32*>(base);
                af[mi][1] = *reinterpret_cast<const u32*>(base + 8 * SMEM_STRIDE);
                af[mi][2] = *reinterpret_cast<const u32*>(base + 8);
                af[mi][3] = *reinterpret_cast<const u32*>(base + 8 * SMEM_STRIDE + 8);
            }
#pragma unroll
            for (int x = 0; x < NW; x++) {
                const u16* ws = w_s[x][kt % W_STAGES];
#pragma unroll
                for (int ni = 0; ni < 4; ni++) {
                    const u16* base = ws + (wn * 32 + ni * 8 + g) * SMEM_STRIDE + ks + 2 * tq;
                    u32 bf[2];
                    bf[0] = *reinterpret_cast<const u32*>(base);
                    bf[1] = *reinterpret_cast<const u32*>(base + 8);
#pragma unroll
                    for (int mi = 0; mi < 2; mi++) mma16816<F16>(acc[x][mi][ni], af[mi], bf);
                }
            }
        }
        if (more) store_a((kt + 1) & 1);
    }
}

// Calls f(mi, ni, r, tile_row, tile_col) for each pair of adjacent columns a thread holds:
// accumulator entries [mi][ni][r] and [mi][ni][r + 1] belong to tile_row and tile_col, +1.
template <typename F>
__device__ __forceinline__ void tile_for_each(F f) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int wm = warp >> 1, wn = warp & 1, g = lane >> 2, tq = lane & 3;
#pragma unroll
    for (int mi = 0; mi < 2; mi++)
#pragma unroll
        for (int ni = 0; ni < 4; ni++)
#pragma unroll
            for (int hh = 0; hh < 2; hh++)
                f(mi, ni, hh * 2, wm * 32 + mi * 16 + g + hh * 8, wn * 32 + ni * 8 + 2 * tq);
}
