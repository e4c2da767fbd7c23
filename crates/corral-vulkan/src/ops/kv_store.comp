// Each token's K and V rows ([tokens, kv_dim]) stored at its slot of a layer's paged cache
// (kv.glsl), a workgroup a (token, K or V head); a slot past the cache is reported as a
// fault.
#version 450
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "reduce.glsl"
#include "kv.glsl"

layout(push_constant) uniform Args {
    Floats k;
    Floats v;
    Uints slots;
    uint64_t cache_k;
    uint64_t cache_v;
    Fault fault;
    uint tokens;
    uint kv_heads;
    uint head_dim;
    uint capacity;
    uint kv_type;
} args;

void main() {
    uint g = flat_group();
    if (g >= args.tokens * 2 * args.kv_heads) {
        return;
    }
    uint t = g / (2 * args.kv_heads);
    uint head = g % (2 * args.kv_heads);
    bool is_v = head >= args.kv_heads;
    uint kvh = is_v ? head - args.kv_heads : head;
    uint slot = args.slots.v[t];
    if (slot >= args.capacity) {
        if (gl_LocalInvocationID.x == 0) {
            report(args.fault, FAULT_KV_SLOT);
        }
        return;
    }
    Floats src = is_v ? args.v : args.k;
    uint at = (t * args.kv_heads + kvh) * args.head_dim;
    for (uint i = gl_LocalInvocationID.x; i < args.head_dim; i += GROUP_SIZE) {
        kv_values[i] = src.v[at + i];
    }
    barrier();
    kv_store_head(is_v ? args.cache_v : args.cache_k, args.kv_type, slot, args.kv_heads,
                  args.head_dim, kvh);
}
