// The gated delta rule token by token, one workgroup per (run, value head, block of 64 state
// columns), over tokens `first` to `first + count - 1` of each run (a dispatch a span, so that
// no invocation outlasts lavapipe's 65535 loop iterations). Invocation j keeps column j of
// the head's fp32 state S [dk, dv] (zero where a fresh run starts) and per token takes q and
// k L2-normalised (q also scaled by dk^-1/2) and computes S ← exp(g) S, S += k · β (v_j -
// kᵀS), out_j = qᵀS. Columns depend on each other only through q and k, which every
// invocation reads itself, so they share nothing. The state after each token but the run's
// last goes to its kept slots, after the span's last back to its own slot, where the next
// span continues.
#version 450
#extension GL_GOOGLE_include_directive : require
#define GROUP_SIZE 64
#include "common.glsl"
#include "recurrent.glsl"

// The largest key dim, a column's length (MAX_DELTA_KEY_DIM in corral-backend's checked.rs).
#define MAX_KEY_DIM 128

layout(push_constant) uniform Args {
    uint64_t qkv;
    Floats g;
    Floats beta;
    uint64_t runs;
    uint64_t kept;
    uint64_t state;
    uint64_t out_;
    Fault fault;
    uint nk;
    uint nv;
    uint dk;
    uint dv;
    uint num_runs;
    uint longest;
    uint tokens;
    uint slots;
    uint first;
    uint count;
} args;

// Value head `h`'s state in slot `slot`.
Floats state_of(uint slot, uint h) {
    return Floats(args.state + (uint64_t(slot) * args.nv + h) * (args.dk * args.dv) * 4);
}

void main() {
    uint blocks = (args.dv + GROUP_SIZE - 1) / GROUP_SIZE;
    uint group = flat_group();
    uint r = group / (args.nv * blocks);
    if (r >= args.num_runs) {
        return;
    }
    uint h = (group / blocks) % args.nv;
    uint j = (group % blocks) * GROUP_SIZE + gl_LocalInvocationID.x;
    Run run;
    if (!run_of(args.runs, args.kept, r, args.tokens, args.slots, args.longest, args.fault,
                gl_LocalInvocationID.x == 0, run)
        || j >= args.dv) {
        return;
    }
    uint dk = args.dk;
    uint dv = args.dv;
    uint width = 2 * args.nk * dk + args.nv * dv;
    // Where the token's q, k and v_j are in its row.
    uint kh = h / (args.nv / args.nk);
    uint qa = kh * dk;
    uint ka = args.nk * dk + kh * dk;
    uint va = 2 * args.nk * dk + h * dv + j;
    float scale = inversesqrt(float(dk));

    if (args.first >= run.len && args.first > 0) {
        return;
    }
    bool zero = run.fresh && args.first == 0;
    float s[MAX_KEY_DIM];
    Floats own = state_of(run.slot, h);
    for (uint i = 0; i < dk; i++) {
        s[i] = zero ? 0.0 : own.v[i * dv + j];
    }
    uint end = min(run.len, args.first + args.count);
    for (uint n = args.first; n < end; n++) {
        uint t = run.start + n;
        Floats row = Floats(args.qkv + uint64_t(t) * width * 4);
        // One pass for the norms and kᵀS (before the decay, which scales it alike), one to
        // update S and read qᵀS.
        float qq = 0.0;
        float kk = 0.0;
        float ks = 0.0;
        for (uint i = 0; i < dk; i++) {
            float q = row.v[qa + i];
            float k = row.v[ka + i];
            qq += q * q;
            kk += k * k;
            ks += k * s[i];
        }
        float kn = 1.0 / sqrt(kk + 1e-6);
        float decay = exp(args.g.v[t * args.nv + h]);
        float delta = args.beta.v[t * args.nv + h] * (row.v[va] - decay * kn * ks);
        float o = 0.0;
        for (uint i = 0; i < dk; i++) {
            s[i] = decay * s[i] + row.v[ka + i] * kn * delta;
            o += row.v[qa + i] * s[i];
        }
        o *= scale / sqrt(qq + 1e-6);
        Floats(args.out_ + ((uint64_t(t) * args.nv + h) * dv + j) * 4).v[0] = o;
        if (run.kept != NO_KEPT && n + 1 < run.len) {
            Floats after = state_of(run.kept + n, h);
            for (uint i = 0; i < dk; i++) {
                after.v[i * dv + j] = s[i];
            }
        }
    }
    for (uint i = 0; i < dk; i++) {
        own.v[i * dv + j] = s[i];
    }
}
