// The Gated DeltaNet's gates per (token, value head): g = -exp(a_log) · softplus(a + dt_bias)
// and beta = σ(b).
#version 450
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(push_constant) uniform Args {
    Floats a;
    Floats b;
    Floats a_log;
    Floats dt_bias;
    Floats g;
    Floats beta;
    uint len;
    uint heads;
} args;

// log(1 + exp(x)), as x itself past 20 (where the two agree in f32); log1p's correction
// keeps the precision of small exp(x).
float softplus(float x) {
    if (x > 20.0) {
        return x;
    }
    float e = exp(x);
    float u = 1.0 + e;
    return u == 1.0 ? e : log(u) * (e / (u - 1.0));
}

void main() {
    uint i = flat_index();
    if (i >= args.len) {
        return;
    }
    uint h = i % args.heads;
    args.g.v[i] = -exp(args.a_log.v[h]) * softplus(args.a.v[i] + args.dt_bias.v[h]);
    args.beta.v[i] = sigmoid(args.b.v[i]);
}
