// Depthwise causal convolution with SiLU, one invocation per (run, channel) stepping through
// tokens `first` to `first + count - 1` of the run (a dispatch a span, so that no invocation
// outlasts lavapipe's 65535 loop iterations): out[t, c] = silu(Σ_i w[c, i] · in[t - (kernel -
// 1) + i]), where `in` is the channel's history in the run's slot (its last kernel - 1 inputs,
// oldest first; zero where a fresh run starts) followed by the run's x[., c]. The history
// after each token but the run's last goes to its kept slots, after the span's last back to
// its own slot, where the next span continues.
#version 450
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "recurrent.glsl"

// The widest kernel (MAX_CONV_KERNEL in corral-backend's checked.rs).
#define MAX_KERNEL 16

layout(push_constant) uniform Args {
    uint64_t x;
    Floats weight;
    uint64_t runs;
    uint64_t kept;
    uint64_t state;
    uint64_t out_;
    Fault fault;
    uint channels;
    uint kernel;
    uint num_runs;
    uint longest;
    uint tokens;
    uint slots;
    uint first;
    uint count;
} args;

// Channel `c`'s history in slot `slot`.
Floats history(uint slot, uint c) {
    return Floats(args.state + ((uint64_t(slot) * args.channels + c) * (args.kernel - 1)) * 4);
}

// Element `c` of token `t`'s row of `channels` at `base`.
uint64_t element(uint64_t base, uint t, uint c) {
    return base + (uint64_t(t) * args.channels + c) * 4;
}

void main() {
    uint i = flat_index();
    uint r = i / args.channels;
    uint c = i - r * args.channels;
    if (r >= args.num_runs) {
        return;
    }
    Run run;
    if (!run_of(args.runs, args.kept, r, args.tokens, args.slots, args.longest, args.fault,
                c == 0, run)) {
        return;
    }
    uint hist = args.kernel - 1;
    float w[MAX_KERNEL];
    // The previous `hist` inputs, then the current one.
    float window[MAX_KERNEL];
    for (uint k = 0; k < args.kernel; k++) {
        w[k] = args.weight.v[c * args.kernel + k];
    }
    if (args.first >= run.len && args.first > 0) {
        return;
    }
    bool zero = run.fresh && args.first == 0;
    Floats own = history(run.slot, c);
    for (uint k = 0; k < hist; k++) {
        window[k] = zero ? 0.0 : own.v[k];
    }
    uint end = min(run.len, args.first + args.count);
    for (uint n = args.first; n < end; n++) {
        uint t = run.start + n;
        window[hist] = Floats(element(args.x, t, c)).v[0];
        float y = 0.0;
        for (uint k = 0; k < args.kernel; k++) {
            y += w[k] * window[k];
        }
        Floats(element(args.out_, t, c)).v[0] = y * sigmoid(y);
        for (uint k = 0; k < hist; k++) {
            window[k] = window[k + 1];
        }
        if (run.kept != NO_KEPT && n + 1 < run.len) {
            Floats after = history(run.kept + n, c);
            for (uint k = 0; k < hist; k++) {
                after.v[k] = window[k];
            }
        }
    }
    for (uint k = 0; k < hist; k++) {
        own.v[k] = window[k];
    }
}
