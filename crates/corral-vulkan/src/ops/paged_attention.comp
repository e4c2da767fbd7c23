// Causal GQA attention of each token over positions 0..=position of its sequence, read
// through the sequence's block table from a paged cache (kv.glsl): one workgroup a
// (token, head), keys taken GROUP_SIZE at a time with a running maximum and sum (the
// softmax of each tile folded into the last). A block id past the cache or a position past
// the block table is reported as a fault.
#version 450
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "reduce.glsl"
#include "kv.glsl"

layout(push_constant) uniform Args {
    Floats q;
    uint64_t cache_k;
    uint64_t cache_v;
    Uints positions;
    Uints token_runs;
    Uints tables;
    Floats out_;
    Fault fault;
    uint tokens;
    uint heads;
    uint kv_heads;
    uint head_dim;
    uint max_blocks;
    uint block_size;
    uint num_blocks;
    float scale;
    uint kv_type;
} args;

// Head dims up to 512: two a lane.
shared float qs[512];
shared float weights[GROUP_SIZE];
shared uint rows[GROUP_SIZE];

void main() {
    uint g = flat_group();
    if (g >= args.tokens * args.heads) {
        return;
    }
    uint lane = gl_LocalInvocationID.x;
    uint token = g / args.heads;
    uint h = g - token * args.heads;
    uint hd = args.head_dim;
    uint kv_head = h / (args.heads / args.kv_heads);
    for (uint d = lane; d < hd; d += GROUP_SIZE) {
        qs[d] = args.q.v[g * hd + d];
    }
    uint pos = args.positions.v[token];
    uint run = args.token_runs.v[token];
    if (pos / args.block_size >= args.max_blocks) {
        if (lane == 0) {
            report(args.fault, FAULT_BLOCK_TABLE);
        }
        return;
    }
    barrier();
    float m = uintBitsToFloat(0xff800000u);
    float l = 0.0;
    float acc0 = 0.0;
    float acc1 = 0.0;
    for (uint tile = 0; tile <= pos; tile += GROUP_SIZE) {
        uint p = tile + lane;
        float score = uintBitsToFloat(0xff800000u);
        uint row = 0;
        if (p <= pos) {
            uint block = args.tables.v[run * args.max_blocks + p / args.block_size];
            if (block >= args.num_blocks) {
                report(args.fault, FAULT_BLOCK_TABLE);
            } else {
                row = block * args.block_size + p % args.block_size;
                uint64_t key = kv_head_address(args.cache_k, args.kv_type, row, args.kv_heads,
                                               hd, kv_head);
                float dot_ = 0.0;
                for (uint d = 0; d < hd; d++) {
                    dot_ += qs[d] * kv_raw(key, args.kv_type, d);
                }
                float key_scale = kv_head_scale(args.cache_k, args.kv_type, row, args.kv_heads,
                                                hd, kv_head);
                score = args.scale * (dot_ * key_scale);
            }
        }
        float m_new = max(m, workgroup_max(score));
        float w = isinf(score) ? 0.0 : exp(score - m_new);
        weights[lane] = w;
        rows[lane] = row;
        float correction = isinf(m) ? 0.0 : exp(m - m_new);
        l = l * correction + workgroup_sum(w);
        uint count = min(GROUP_SIZE, pos + 1 - tile);
        acc0 *= correction;
        acc1 *= correction;
        for (uint t = 0; t < count; t++) {
            uint64_t value = kv_head_address(args.cache_v, args.kv_type, rows[t], args.kv_heads,
                                             hd, kv_head);
            float wt = weights[t] * kv_head_scale(args.cache_v, args.kv_type, rows[t],
                                                  args.kv_heads, hd, kv_head);
            if (lane < hd) {
                acc0 += wt * kv_raw(value, args.kv_type, lane);
            }
            if (lane + GROUP_SIZE < hd) {
                acc1 += wt * kv_raw(value, args.kv_type, lane + GROUP_SIZE);
            }
        }
        m = m_new;
        barrier();
    }
    float inv = l > 0.0 ? 1.0 / l : 0.0;
    if (lane < hd) {
        args.out_.v[g * hd + lane] = acc0 * inv;
    }
    if (lane + GROUP_SIZE < hd) {
        args.out_.v[g * hd + lane + GROUP_SIZE] = acc1 * inv;
    }
}
