// Copies `count` blocks of `block_units` units (32-bit words, or 16-bit halves where `halves`
// is set): block src_ids[b] of `src` (block b where src_ids is 0) to block dst_ids[b] of
// `dst` (likewise); an id past its side's blocks is reported as a fault. KV blocks gathered
// and scattered, one state slot or block copied to another.
#version 450
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(push_constant) uniform Args {
    uint64_t src;
    uint64_t dst;
    uint64_t src_ids;
    uint64_t dst_ids;
    Fault fault;
    uint len;
    uint block_units;
    uint src_blocks;
    uint dst_blocks;
    uint halves;
} args;

void main() {
    uint i = flat_index();
    if (i >= args.len) {
        return;
    }
    uint b = i / args.block_units;
    uint u = i - b * args.block_units;
    uint from = args.src_ids != 0 ? Uints(args.src_ids).v[b] : b;
    uint to = args.dst_ids != 0 ? Uints(args.dst_ids).v[b] : b;
    if (from >= args.src_blocks || to >= args.dst_blocks) {
        report(args.fault, FAULT_ROW_INDEX);
        return;
    }
    uint s = from * args.block_units + u;
    uint d = to * args.block_units + u;
    if (args.halves != 0) {
        Halves(args.dst).v[d] = Halves(args.src).v[s];
    } else {
        Uints(args.dst).v[d] = Uints(args.src).v[s];
    }
}
