// out[rows[i]] += scales[i] * y[i] over rows of `dim` (rows do not repeat), one invocation
// an element; a row past `out_rows` is reported as a fault.
#version 450
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(push_constant) uniform Args {
    Floats y;
    Uints rows;
    Floats scales;
    Floats out_;
    Fault fault;
    uint len;
    uint dim;
    uint out_rows;
} args;

void main() {
    uint i = flat_index();
    if (i >= args.len) {
        return;
    }
    uint r = i / args.dim;
    uint row = args.rows.v[r];
    if (row >= args.out_rows) {
        report(args.fault, FAULT_ROW_INDEX);
        return;
    }
    uint at = row * args.dim + (i - r * args.dim);
    args.out_.v[at] += args.scales.v[r] * args.y.v[i];
}
