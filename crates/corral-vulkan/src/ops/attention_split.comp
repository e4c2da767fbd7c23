// Causal GQA attention in splits of the keys: workgroup (token, KV head, chunk, split)
// takes the token's keys from split * split_len up to its position (at most split_len of
// them) for a chunk of the KV head's query heads (all of them, up to MAX_GROUP and
// MAX_GROUP * MAX_DIM values) at once, each key and value row read once for the chunk;
// keys TILE at a time, a running maximum and sum per head. With one split it writes the
// output; with more, each split's maximum, sum and unnormalised output for
// attention_combine.comp. A block id past the cache or a position past the block table is
// reported as a fault.
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
    uint splits;
    uint split_len;
    uint chunk_heads;
} args;

// Query heads a workgroup, and their values (`ATTENTION_CHUNK_*` in ops/attention.rs);
// keys a tile.
const uint MAX_GROUP = 16;
const uint MAX_DIM = 256;
const uint TILE = 32;
const uint NO_ROW = 0xffffffffu;

shared float qs[MAX_GROUP * MAX_DIM];
shared float scores[MAX_GROUP][TILE];
shared uint key_rows[TILE];
shared float key_scales[TILE];
shared float value_scales[TILE];
shared float head_max[MAX_GROUP];
shared float head_sum[MAX_GROUP];
shared float head_correction[MAX_GROUP];

void main() {
    uint group = args.heads / args.kv_heads;
    uint chunks = (group + args.chunk_heads - 1) / args.chunk_heads;
    uint per_token = args.kv_heads * chunks * args.splits;
    uint g = flat_group();
    if (g >= args.tokens * per_token) {
        return;
    }
    uint token = g / per_token;
    uint kvh = (g % per_token) / (chunks * args.splits);
    uint chunk = (g % (chunks * args.splits)) / args.splits;
    uint split = g % args.splits;
    // This workgroup's query heads: `count` of them from `first`.
    uint first = kvh * group + chunk * args.chunk_heads;
    uint count = min(args.chunk_heads, group - chunk * args.chunk_heads);
    uint hd = args.head_dim;
    uint lane = gl_LocalInvocationID.x;
    uint pos = args.positions.v[token];
    uint run = args.token_runs.v[token];
    if (pos / args.block_size >= args.max_blocks) {
        if (lane == 0) {
            report(args.fault, FAULT_BLOCK_TABLE);
        }
        return;
    }
    uint start = split * args.split_len;
    uint end = min(pos + 1, start + args.split_len);
    uint outputs = count * hd;
    for (uint i = lane; i < outputs; i += GROUP_SIZE) {
        qs[i] = args.q.v[(token * args.heads + first) * hd + i];
    }
    if (lane < count) {
        head_max[lane] = uintBitsToFloat(0xff800000u);
        head_sum[lane] = 0.0;
    }
    float acc[MAX_GROUP * MAX_DIM / GROUP_SIZE];
    for (uint j = 0; j < MAX_GROUP * MAX_DIM / GROUP_SIZE; j++) {
        acc[j] = 0.0;
    }
    barrier();
    for (uint tile = start; tile < end; tile += TILE) {
        uint n = min(TILE, end - tile);
        if (lane < n) {
            uint p = tile + lane;
            uint block = args.tables.v[run * args.max_blocks + p / args.block_size];
            uint row = NO_ROW;
            if (block >= args.num_blocks) {
                report(args.fault, FAULT_BLOCK_TABLE);
            } else {
                row = block * args.block_size + p % args.block_size;
                key_scales[lane] = kv_head_scale(args.cache_k, args.kv_type, row, args.kv_heads, hd, kvh);
                value_scales[lane] = kv_head_scale(args.cache_v, args.kv_type, row, args.kv_heads, hd, kvh);
            }
            key_rows[lane] = row;
        }
        barrier();
        for (uint i = lane; i < count * TILE; i += GROUP_SIZE) {
            uint h = i / TILE;
            uint key = i % TILE;
            float s = uintBitsToFloat(0xff800000u);
            if (key < n && key_rows[key] != NO_ROW) {
                uint64_t k = kv_head_address(args.cache_k, args.kv_type, key_rows[key], args.kv_heads, hd, kvh);
                float dot_ = 0.0;
                for (uint d = 0; d < hd; d++) {
                    dot_ += qs[h * hd + d] * kv_raw(k, args.kv_type, d);
                }
                s = args.scale * (dot_ * key_scales[key]);
            }
            scores[h][key] = s;
        }
        barrier();
        if (lane < count) {
            float old_max = head_max[lane];
            float m = old_max;
            for (uint key = 0; key < n; key++) {
                m = max(m, scores[lane][key]);
            }
            float sum = 0.0;
            for (uint key = 0; key < n; key++) {
                float s = scores[lane][key];
                float w = isinf(s) ? 0.0 : exp(s - m);
                scores[lane][key] = w;
                sum += w;
            }
            float correction = isinf(old_max) ? 0.0 : exp(old_max - m);
            head_sum[lane] = head_sum[lane] * correction + sum;
            head_max[lane] = m;
            head_correction[lane] = correction;
        }
        barrier();
        for (uint j = 0; j < MAX_GROUP * MAX_DIM / GROUP_SIZE; j++) {
            uint o = lane + GROUP_SIZE * j;
            if (o < outputs) {
                uint h = o / hd;
                uint d = o % hd;
                float a = acc[j] * head_correction[h];
                for (uint key = 0; key < n; key++) {
                    float w = scores[h][key];
                    if (w != 0.0) {
                        uint64_t v = kv_head_address(args.cache_v, args.kv_type, key_rows[key], args.kv_heads, hd, kvh);
                        a += w * value_scales[key] * kv_raw(v, args.kv_type, d);
                    }
                }
                acc[j] = a;
            }
        }
        barrier();
    }
    for (uint j = 0; j < MAX_GROUP * MAX_DIM / GROUP_SIZE; j++) {
        uint o = lane + GROUP_SIZE * j;
        if (o < outputs) {
            uint h = o / hd;
            uint d = o % hd;
            uint head = first + h;
            if (args.splits == 1) {
                float l = head_sum[h];
                args.out_.v[(token * args.heads + head) * hd + d] = l > 0.0 ? acc[j] / l : 0.0;
            } else {
                uint at = ((token * args.heads + head) * args.splits + split) * (hd + 2);
                args.out_.v[at + 2 + d] = acc[j];
                if (d == 0) {
                    args.out_.v[at] = head_max[h];
                    args.out_.v[at + 1] = head_sum[h];
                }
            }
        }
    }
}
