// Weights sixteen values at a time: `weight_part` decodes the 16 consecutive values of a
// row from column `k0` (a multiple of 16), sharing a block's scales among them, for the
// kernels that split a row's dot product across invocations. Block-format rows are whole
// blocks (the host checks), so a part of a block-format row never straddles two blocks.

// The 16 bytes from `at` (2-byte aligned).
void bytes16(uint64_t at, out uint b[16]) {
    for (uint i = 0; i < 8; i++) {
        uint word = uint(Halves(at + 2 * i).v[0]);
        b[2 * i] = word & 0xff;
        b[2 * i + 1] = word >> 8;
    }
}

// A byte as a signed value.
int signed_byte(uint b) {
    return int(b << 24) >> 24;
}

// Values j0 .. j0 + 16 (j0 a multiple of 16) of the block of format `type` at `b`.
void block_part(uint64_t b, uint type, uint j0, out float w[16]) {
    uint q[16];
    switch (type) {
    case WEIGHT_Q4_0:
    case WEIGHT_Q4_1: {
        bool min_ = type == WEIGHT_Q4_1;
        float d = block_half(b);
        float m = min_ ? block_half(b + 2) : 0.0;
        bytes16(b + (min_ ? 4 : 2), q);
        for (uint i = 0; i < 16; i++) {
            uint n = j0 == 0 ? q[i] & 15 : q[i] >> 4;
            w[i] = min_ ? float(n) * d + m : float(int(n) - 8) * d;
        }
        return;
    }
    case WEIGHT_Q5_0:
    case WEIGHT_Q5_1: {
        bool min_ = type == WEIGHT_Q5_1;
        float d = block_half(b);
        float m = min_ ? block_half(b + 2) : 0.0;
        uint qh = block_word(b + (min_ ? 4 : 2));
        bytes16(b + (min_ ? 8 : 6), q);
        for (uint i = 0; i < 16; i++) {
            uint n = (j0 == 0 ? q[i] & 15 : q[i] >> 4) | (((qh >> (j0 + i)) & 1) << 4);
            w[i] = min_ ? float(n) * d + m : float(int(n) - 16) * d;
        }
        return;
    }
    case WEIGHT_Q8_0: {
        float d = block_half(b);
        bytes16(b + 2 + j0, q);
        for (uint i = 0; i < 16; i++) {
            w[i] = float(signed_byte(q[i])) * d;
        }
        return;
    }
    case WEIGHT_Q4_K:
    case WEIGHT_Q5_K: {
        bool five = type == WEIGHT_Q5_K;
        uint i64 = j0 / 64, within = j0 % 64, upper = within / 32, l0 = within % 32;
        uvec2 sm = k_scale_min(b + 4, 2 * i64 + upper);
        float d = block_half(b) * float(sm.x);
        float m = block_half(b + 2) * float(sm.y);
        bytes16(b + (five ? 48 : 16) + 32 * i64 + l0, q);
        uint h[16];
        if (five) {
            bytes16(b + 16 + l0, h);
        }
        for (uint i = 0; i < 16; i++) {
            uint n = upper == 0 ? q[i] & 15 : q[i] >> 4;
            if (five) {
                n += ((h[i] >> (2 * i64 + upper)) & 1) << 4;
            }
            w[i] = d * float(n) - m;
        }
        return;
    }
    case WEIGHT_Q6_K: {
        uint half_ = j0 / 128, within = j0 % 128, quarter = within / 32, l0 = within % 32;
        float d = block_half(b + 208) * float(block_signed(b + 192 + 8 * half_ + l0 / 16 + 2 * quarter));
        bytes16(b + 64 * half_ + l0 + 32 * (quarter & 1), q);
        uint h[16];
        bytes16(b + 128 + 32 * half_ + l0, h);
        for (uint i = 0; i < 16; i++) {
            uint low = quarter < 2 ? q[i] & 15 : q[i] >> 4;
            uint high = (h[i] >> (2 * quarter)) & 3;
            w[i] = d * float(int(low | (high << 4)) - 32);
        }
        return;
    }
    default: {
        float scale = uintBitsToFloat(block_word(b));
        bytes16(b + 4 + j0, q);
        for (uint i = 0; i < 16; i++) {
            w[i] = e4m3(q[i]) * scale;
        }
        return;
    }
    }
}

// Columns k0 .. k0 + 16 of the row starting at element `row` of weights of type `type` at
// `base`, `cols` wide: float rows in 16-byte loads where whole and aligned, else value by
// value (zero past `cols`); block-format rows a block's part.
void weight_part(uint64_t base, uint type, uint64_t row, uint k0, uint cols, out float w[16]) {
    if (type <= WEIGHT_F16) {
        uint64_t at = base + (row + k0) * (type == WEIGHT_F32 ? 4 : 2);
        if (k0 + 16 <= cols && (at & 15) == 0) {
            // Whole and aligned: 16-byte loads (four for f32, two for 16-bit types).
            if (type == WEIGHT_F32) {
                for (uint i = 0; i < 4; i++) {
                    uvec4 q = Quads(at + 16 * i).v[0];
                    w[4 * i] = uintBitsToFloat(q.x);
                    w[4 * i + 1] = uintBitsToFloat(q.y);
                    w[4 * i + 2] = uintBitsToFloat(q.z);
                    w[4 * i + 3] = uintBitsToFloat(q.w);
                }
                return;
            }
            for (uint i = 0; i < 2; i++) {
                uvec4 q = Quads(at + 16 * i).v[0];
                uint words[4] = uint[4](q.x, q.y, q.z, q.w);
                for (uint j = 0; j < 4; j++) {
                    if (type == WEIGHT_BF16) {
                        w[8 * i + 2 * j] = uintBitsToFloat(words[j] << 16);
                        w[8 * i + 2 * j + 1] = uintBitsToFloat(words[j] & 0xffff0000u);
                    } else {
                        vec2 h = unpackHalf2x16(words[j]);
                        w[8 * i + 2 * j] = h.x;
                        w[8 * i + 2 * j + 1] = h.y;
                    }
                }
            }
            return;
        }
        for (uint i = 0; i < 16; i++) {
            w[i] = k0 + i < cols ? weight_at(base, type, row + k0 + i) : 0.0;
        }
        return;
    }
    uvec2 shape = block_shape(type);
    uint64_t at = row + k0;
    uint64_t block = at / shape.x;
    block_part(base + block * shape.y, type, uint(at - block * shape.x), w);
}
