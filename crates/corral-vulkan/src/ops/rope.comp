// RoPE in place on the first `rotary_dim` dims of each head of x ([tokens, heads, head_dim]),
// one invocation a (token, head, pair), the pairs' inverse frequencies from `freqs`.
#version 450
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "rope.glsl"

layout(push_constant) uniform Args {
    Floats x;
    Uints positions;
    Floats freqs;
    uint len;
    uint heads;
    uint head_dim;
    uint half_rotary;
    float factor;
} args;

void main() {
    uint i = flat_index();
    if (i >= args.len) {
        return;
    }
    uint pair = i % args.half_rotary;
    uint head = i / args.half_rotary;
    uint token = head / args.heads;
    uint at = head * args.head_dim + pair;
    vec2 r = rotate(args.x.v[at], args.x.v[at + args.half_rotary], args.positions.v[token],
                    args.freqs.v[pair], args.factor);
    args.x.v[at] = r.x;
    args.x.v[at + args.half_rotary] = r.y;
}
