// Block-format weights (ggml's Q4_0 ... Q6_K, and FP8 rows of 128 with an f32 scale), one
// value at a time from its block: what `weight_at` reads for the portable kernels. Blocks
// are an even number of bytes, so every block starts 2-byte aligned and is read in 16-bit
// words (no 8-bit storage needed). The layouts are corral_backend::quant's.

// The byte at `at`.
uint block_byte(uint64_t at) {
    uint word = uint(Halves(at & ~uint64_t(1)).v[0]);
    return (at & 1) != 0 ? word >> 8 : word & 0xff;
}

// The byte at `at` as a signed value.
int block_signed(uint64_t at) {
    return int(block_byte(at) << 24) >> 24;
}

// The f16 at `at` (2-byte aligned), as f32.
float block_half(uint64_t at) {
    return unpackHalf2x16(uint(Halves(at).v[0])).x;
}

// The little-endian u32 at `at` (2-byte aligned).
uint block_word(uint64_t at) {
    return uint(Halves(at).v[0]) | (uint(Halves(at + 2).v[0]) << 16);
}

// Nibble `j` of 32 packed as 16 bytes at `qs`: low nibbles are values 0..16, high 16..32.
uint nibble_of_32(uint64_t qs, uint j) {
    uint b = block_byte(qs + (j & 15));
    return j < 16 ? b & 15 : b >> 4;
}

// Scale and min of sub-block `j` (0..8) of a Q4_K/Q5_K super-block's 12 packed bytes.
uvec2 k_scale_min(uint64_t scales, uint j) {
    if (j < 4) {
        return uvec2(block_byte(scales + j) & 63, block_byte(scales + j + 4) & 63);
    }
    uint hi = block_byte(scales + j + 4);
    return uvec2(
        (hi & 15) | ((block_byte(scales + j - 4) >> 6) << 4),
        (hi >> 4) | ((block_byte(scales + j) >> 6) << 4));
}

// An e4m3 byte's value (0x7f and 0xff are NaN).
float e4m3(uint b) {
    if ((b & 0x7f) == 0x7f) {
        return uintBitsToFloat(0x7fc00000u);
    }
    uint e = (b >> 3) & 15;
    float m = float(b & 7);
    float magnitude = e == 0 ? ldexp(m / 8.0, -6) : ldexp(1.0 + m / 8.0, int(e) - 7);
    return (b & 0x80) != 0 ? -magnitude : magnitude;
}

// Block formats, as the host passes them after the float types (`weight_type` in
// ops/mod.rs): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, F8_E4M3x128.
const uint WEIGHT_Q4_0 = 3;
const uint WEIGHT_Q4_1 = 4;
const uint WEIGHT_Q5_0 = 5;
const uint WEIGHT_Q5_1 = 6;
const uint WEIGHT_Q8_0 = 7;
const uint WEIGHT_Q4_K = 8;
const uint WEIGHT_Q5_K = 9;
const uint WEIGHT_Q6_K = 10;
const uint WEIGHT_F8_X128 = 11;

// (values, bytes) of one block of block format `type`.
uvec2 block_shape(uint type) {
    switch (type) {
    case WEIGHT_Q4_0: return uvec2(32, 18);
    case WEIGHT_Q4_1: return uvec2(32, 20);
    case WEIGHT_Q5_0: return uvec2(32, 22);
    case WEIGHT_Q5_1: return uvec2(32, 24);
    case WEIGHT_Q8_0: return uvec2(32, 34);
    case WEIGHT_Q4_K: return uvec2(256, 144);
    case WEIGHT_Q5_K: return uvec2(256, 176);
    case WEIGHT_Q6_K: return uvec2(256, 210);
    default: return uvec2(128, 132);
    }
}

// Value `j` of the block of format `type` at `b`.
float block_value(uint64_t b, uint type, uint j) {
    switch (type) {
    case WEIGHT_Q4_0:
        return float(int(nibble_of_32(b + 2, j)) - 8) * block_half(b);
    case WEIGHT_Q4_1:
        return float(nibble_of_32(b + 4, j)) * block_half(b) + block_half(b + 2);
    case WEIGHT_Q5_0: {
        uint high = ((block_word(b + 2) >> j) & 1) << 4;
        return float(int(nibble_of_32(b + 6, j) | high) - 16) * block_half(b);
    }
    case WEIGHT_Q5_1: {
        uint high = ((block_word(b + 4) >> j) & 1) << 4;
        return float(nibble_of_32(b + 8, j) | high) * block_half(b) + block_half(b + 2);
    }
    case WEIGHT_Q8_0:
        return float(block_signed(b + 2 + j)) * block_half(b);
    case WEIGHT_Q4_K:
    case WEIGHT_Q5_K: {
        // Each 64 values: the low nibbles of 32 bytes (sub-block 2i), then their high
        // nibbles (2i + 1); Q5_K's fifth bits are bits 2i and 2i + 1 of 32 `qh` bytes.
        bool five = type == WEIGHT_Q5_K;
        uint i = j / 64, within = j % 64, l = within % 32, upper = within / 32;
        uvec2 sm = k_scale_min(b + 4, 2 * i + upper);
        uint byte = block_byte(b + (five ? 48 : 16) + 32 * i + l);
        uint q = upper == 0 ? byte & 15 : byte >> 4;
        if (five && ((block_byte(b + 16 + l) >> (2 * i + upper)) & 1) != 0) {
            q += 16;
        }
        float d = block_half(b) * float(sm.x);
        float m = block_half(b + 2) * float(sm.y);
        return d * float(q) - m;
    }
    case WEIGHT_Q6_K: {
        // Each half of 128 values: lanes l of 32, four values each (l, l + 32, l + 64,
        // l + 96) from ql[l] and ql[l + 32]'s low then high nibbles with two bits of qh[l].
        uint h = j / 128, within = j % 128, l = within % 32, quarter = within / 32;
        uint low = block_byte(b + 64 * h + l + 32 * (quarter & 1));
        low = quarter < 2 ? low & 15 : low >> 4;
        uint high = (block_byte(b + 128 + 32 * h + l) >> (2 * quarter)) & 3;
        int scale = block_signed(b + 192 + 8 * h + l / 16 + 2 * quarter);
        float d = block_half(b + 208) * float(scale);
        return d * float(int(low | (high << 4)) - 32);
    }
    default:
        return e4m3(block_byte(b + 4 + j)) * uintBitsToFloat(block_word(b));
    }
}

// Element `i` of block-format weights of type `type` starting at `base`.
float block_weight_at(uint64_t base, uint type, uint64_t i) {
    uvec2 shape = block_shape(type);
    uint64_t block = i / shape.x;
    return block_value(base + block * shape.y, type, uint(i - block * shape.x));
}
