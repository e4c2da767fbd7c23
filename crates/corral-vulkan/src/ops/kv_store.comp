// Each token's K and V rows ([tokens, kv_dim]) stored at its slot of a layer's paged cache
// (f32 or bf16); a slot past the cache is reported as a fault.
#version 450
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(push_constant) uniform Args {
    Floats k;
    Floats v;
    Uints slots;
    uint64_t cache_k;
    uint64_t cache_v;
    Fault fault;
    uint len;
    uint kv_dim;
    uint capacity;
    uint kv_type;
} args;

void main() {
    uint i = flat_index();
    if (i >= args.len) {
        return;
    }
    uint t = i / args.kv_dim;
    uint slot = args.slots.v[t];
    if (slot >= args.capacity) {
        report(args.fault, FAULT_KV_SLOT);
        return;
    }
    uint at = slot * args.kv_dim + (i - t * args.kv_dim);
    kv_put(args.cache_k, args.kv_type, at, args.k.v[i]);
    kv_put(args.cache_v, args.kv_type, at, args.v.v[i]);
}
