// The paged KV cache's rows: f32, bf16, or fp8 e4m3 with an f32 scale per (slot, KV head),
// a slot's row of bytes holding its heads' codes, then their scales, padded to 16 bytes
// (`kv_row_elems` in dtype.rs), each head scaled so that its largest magnitude is 448.
// Heads are read through their address and scale, stored whole by a workgroup from
// `kv_values` (the fp8 codes two at a time, in 16-bit words: no 8-bit storage needed).
// Include after common.glsl and reduce.glsl.

// KV cache element types, as the host passes them (`kv_type` in ops/attention.rs).
const uint KV_F32 = 0;
const uint KV_BF16 = 1;
const uint KV_F8 = 2;

// `x` rounded to the nearest bf16 (ties to even), as its bits.
uint bf16_bits(float x) {
    uint u = floatBitsToUint(x);
    if (isnan(x)) {
        return (u >> 16) | 0x40;
    }
    return (u + 0x7fff + ((u >> 16) & 1)) >> 16;
}

// `x` rounded to the nearest e4m3 (ties to even), saturating at ±448, as its code.
uint e4m3_code(float x) {
    uint sign = (floatBitsToUint(x) >> 24) & 0x80u;
    float a = min(abs(x), 448.0);
    if (!(a >= 0.015625)) {
        return sign | uint(roundEven(a * 512.0));
    }
    int e;
    float f = frexp(a, e);
    // A mantissa rounding up to 8 carries into the exponent field, as the encoding runs on.
    return sign | ((uint(e + 6) << 3) + uint(roundEven((f * 2.0 - 1.0) * 8.0)));
}

// Elements (bytes, for fp8) of one slot's row.
uint kv_row_elems(uint type, uint kv_heads, uint hd) {
    uint kv_dim = kv_heads * hd;
    return type == KV_F8 ? (kv_dim + 4 * kv_heads + 15) / 16 * 16 : kv_dim;
}

// The address of slot `row`'s head `kvh` in a cache of type `type` at `base`.
uint64_t kv_head_address(uint64_t base, uint type, uint row, uint kv_heads, uint hd, uint kvh) {
    uint64_t elem = type == KV_F32 ? 4 : (type == KV_BF16 ? 2 : 1);
    return base + (uint64_t(row) * kv_row_elems(type, kv_heads, hd) + kvh * hd) * elem;
}

// The address of that head's fp8 scale.
uint64_t kv_scale_address(uint64_t base, uint row, uint kv_heads, uint hd, uint kvh) {
    return base + uint64_t(row) * kv_row_elems(KV_F8, kv_heads, hd) + kv_heads * hd + 4 * kvh;
}

// That head's scale: 1 unless the cache is fp8.
float kv_head_scale(uint64_t base, uint type, uint row, uint kv_heads, uint hd, uint kvh) {
    return type == KV_F8 ? Floats(kv_scale_address(base, row, kv_heads, hd, kvh)).v[0] : 1.0;
}

// Value `d` of the head at address `head`, before its scale.
float kv_raw(uint64_t head, uint type, uint d) {
    if (type == KV_F32) {
        return Floats(head).v[d];
    }
    if (type == KV_BF16) {
        return uintBitsToFloat(uint(Halves(head).v[d]) << 16);
    }
    return e4m3(block_byte(head + d));
}

// A head's values to store (head_dim up to 512).
shared float kv_values[512];

// Stores `kv_values[0 .. hd]` as slot `row`'s head `kvh`. Every invocation of the
// workgroup calls it, in uniform control flow, after a barrier following the values' writes.
void kv_store_head(uint64_t base, uint type, uint row, uint kv_heads, uint hd, uint kvh) {
    uint64_t head = kv_head_address(base, type, row, kv_heads, hd, kvh);
    uint lane = gl_LocalInvocationID.x;
    if (type != KV_F8) {
        for (uint i = lane; i < hd; i += GROUP_SIZE) {
            if (type == KV_F32) {
                Floats(head).v[i] = kv_values[i];
            } else {
                Halves(head).v[i] = uint16_t(bf16_bits(kv_values[i]));
            }
        }
        return;
    }
    float amax = 0.0;
    for (uint i = lane; i < hd; i += GROUP_SIZE) {
        amax = max(amax, abs(kv_values[i]));
    }
    amax = workgroup_max(amax);
    // Finite, so that no reader multiplies a zero by it into NaN.
    float scale = amax > 0.0 && amax < 1e30 ? amax / 448.0 : 1.0;
    float inv = 1.0 / scale;
    for (uint i = 2 * lane; i < hd; i += 2 * GROUP_SIZE) {
        uint lo = e4m3_code(kv_values[i] * inv);
        uint hi = e4m3_code(kv_values[i + 1] * inv);
        Halves(head + i).v[0] = uint16_t(lo | (hi << 8));
    }
    if (lane == 0) {
        Floats(kv_scale_address(base, row, kv_heads, hd, kvh)).v[0] = scale;
    }
}
