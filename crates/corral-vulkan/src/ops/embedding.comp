// out[t, i] = table[ids[t], i] for `tokens` ids, rows `cols` wide, the table's weights of
// any float type from element `offset`; an id past `rows` is reported as a fault.
#version 450
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(push_constant) uniform Args {
    uint64_t table;
    Uints ids;
    Floats out_;
    Fault fault;
    uint len;
    uint cols;
    uint rows;
    uint weight_type;
    uint offset;
} args;

void main() {
    uint i = flat_index();
    if (i >= args.len) {
        return;
    }
    uint t = i / args.cols;
    uint id = args.ids.v[t];
    if (id >= args.rows) {
        report(args.fault, FAULT_TOKEN_ID);
        return;
    }
    uint64_t at = uint64_t(args.offset) + uint64_t(id) * args.cols + (i - t * args.cols);
    args.out_.v[i] = weight_at(args.table, args.weight_type, at);
}
