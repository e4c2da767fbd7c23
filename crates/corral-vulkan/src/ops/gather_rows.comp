// out[r, i] = x[rows[r], i] for rows `dim` wide; a row past `available` is reported as a
// fault.
#version 450
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(push_constant) uniform Args {
    Floats x;
    Uints rows;
    Floats out_;
    Fault fault;
    uint len;
    uint dim;
    uint available;
} args;

void main() {
    uint i = flat_index();
    if (i >= args.len) {
        return;
    }
    uint r = i / args.dim;
    uint row = args.rows.v[r];
    if (row >= args.available) {
        report(args.fault, FAULT_ROW_INDEX);
        return;
    }
    args.out_.v[i] = args.x.v[row * args.dim + (i - r * args.dim)];
}
