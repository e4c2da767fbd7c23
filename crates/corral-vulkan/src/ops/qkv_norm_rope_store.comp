// From one fused projection qkv ([tokens, (heads + 2 kv_heads) head_dim]), one workgroup a
// (token, q or k head): the head RMSNorm'd (plain weight) and rotated, a q head into q_out,
// a k head with its v head (as it is) into the cache at the token's slot (kv.glsl).
#version 450
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "reduce.glsl"
#include "rope.glsl"
#include "kv.glsl"

layout(push_constant) uniform Args {
    Floats qkv;
    Floats q_weight;
    Floats k_weight;
    Uints positions;
    Uints slots;
    Floats freqs;
    Floats q_out;
    uint64_t cache_k;
    uint64_t cache_v;
    Fault fault;
    uint tokens;
    uint heads;
    uint kv_heads;
    uint head_dim;
    uint half_rotary;
    float factor;
    float eps;
    uint capacity;
    uint kv_type;
} args;

shared float normed[512];

void main() {
    uint per_token = args.heads + args.kv_heads;
    uint g = flat_group();
    if (g >= args.tokens * per_token) {
        return;
    }
    uint token = g / per_token;
    uint head = g - token * per_token;
    bool is_q = head < args.heads;
    uint hd = args.head_dim;
    uint width = (args.heads + 2 * args.kv_heads) * hd;
    uint src = token * width + head * hd;
    Floats weight = is_q ? args.q_weight : args.k_weight;
    float sum = 0.0;
    for (uint i = gl_LocalInvocationID.x; i < hd; i += GROUP_SIZE) {
        float x = args.qkv.v[src + i];
        sum += x * x;
    }
    float inv = inversesqrt(workgroup_sum(sum) / float(hd) + args.eps);
    for (uint i = gl_LocalInvocationID.x; i < hd; i += GROUP_SIZE) {
        normed[i] = args.qkv.v[src + i] * inv * weight.v[i];
    }
    barrier();
    uint pos = args.positions.v[token];
    uint slot = args.slots.v[token];
    if (!is_q && slot >= args.capacity) {
        if (gl_LocalInvocationID.x == 0) {
            report(args.fault, FAULT_KV_SLOT);
        }
        return;
    }
    uint kv_head = head - args.heads;
    for (uint i = gl_LocalInvocationID.x; i < hd; i += GROUP_SIZE) {
        float value = normed[i];
        if (i < 2 * args.half_rotary) {
            uint pair = i % args.half_rotary;
            vec2 r = rotate(normed[pair], normed[pair + args.half_rotary], pos,
                            args.freqs.v[pair], args.factor);
            value = i < args.half_rotary ? r.x : r.y;
        }
        if (is_q) {
            args.q_out.v[(token * args.heads + head) * hd + i] = value;
        } else {
            kv_values[i] = value;
        }
    }
    if (is_q) {
        return;
    }
    barrier();
    kv_store_head(args.cache_k, args.kv_type, slot, args.kv_heads, hd, kv_head);
    barrier();
    uint v_at = token * width + (args.heads + args.kv_heads + kv_head) * hd;
    for (uint i = gl_LocalInvocationID.x; i < hd; i += GROUP_SIZE) {
        kv_values[i] = args.qkv.v[v_at + i];
    }
    barrier();
    kv_store_head(args.cache_v, args.kv_type, slot, args.kv_heads, hd, kv_head);
}
