// The chunked gated delta rule's first half (the math of the CPU's `chunked`): one workgroup
// per (chunk of the wave, value head) makes what depends on the chunk's inputs alone. With
// q̂ and k̂ the L2-normalised q (also scaled by dk^-1/2) and k, and γ the cumulative log-decay
// within the chunk: A = diag(β) K̂ K̂ᵀ ⊙ e^{γ_t − γ_s} (strictly lower), and by forward
// substitution through (I + A) W = diag(β e^γ) K̂ and U = (I + A)⁻¹ diag(β) V, an invocation a
// column of [W | U]; M = (Q̂ K̂ᵀ) ⊙ e^{γ_t − γ_s} (lower, the diagonal included); each token's
// scales. The scan then needs no norm or exponential of its own.
#version 450
#extension GL_GOOGLE_include_directive : require
#define GROUP_SIZE 256
#include "common.glsl"
#include "recurrent.glsl"
#include "delta_chunks.glsl"

// The invocations summing a token's squares (GROUP_SIZE / CHUNK).
#define PARTS 8

shared float a_lower[CHUNK][CHUNK + 1];
shared float gamma[CHUNK];
shared float betas[CHUNK];
shared float q_norm[CHUNK];
shared float k_norm[CHUNK];
shared float q_parts[CHUNK][PARTS];
shared float k_parts[CHUNK][PARTS];

void main() {
    uint group = flat_group();
    uint h = group % args.nv;
    uint at = args.first + group / args.nv;
    // The run and chunk of run-ordered chunk `at` (a run that is not one to step has none).
    Run run;
    uint r = 0;
    uint acc = 0;
    for (; r < args.num_runs; r++) {
        bool steps = run_of(args.runs, 0, r, args.tokens, args.slots, args.longest, args.fault,
                            false, run);
        uint n = steps ? chunks_of(run.len) : 0;
        if (at < acc + n) {
            break;
        }
        acc += n;
    }
    if (r >= args.num_runs) {
        return;
    }
    uint chunk = at - acc;
    uint t0 = run.start + chunk * CHUNK;
    uint m = min(CHUNK, run.len - chunk * CHUNK);
    uint dk = args.dk;
    uint dv = args.dv;
    uint width = 2 * args.nk * dk + args.nv * dv;
    uint kh = h / (args.nv / args.nk);
    uint qa = kh * dk;
    uint ka = args.nk * dk + kh * dk;
    uint va = 2 * args.nk * dk + h * dv;
    uint tid = gl_LocalInvocationID.x;
    uint64_t base = args.scratch
        + uint64_t((at - args.first) * args.nv + h) * chunk_floats(dk, dv) * 4;
    Floats w = Floats(base);
    Floats u = Floats(base + uint64_t(CHUNK * dk) * 4);
    Floats mask = Floats(base + uint64_t(CHUNK * (dk + dv)) * 4);
    Floats tail = Floats(base + uint64_t(CHUNK * (dk + dv + CHUNK)) * 4);

    // The norms, PARTS invocations a token.
    {
        uint t = tid / PARTS;
        uint part = tid % PARTS;
        float qq = 0.0;
        float kk = 0.0;
        if (t < m) {
            Floats row = Floats(args.qkv + uint64_t(t0 + t) * width * 4);
            for (uint i = part; i < dk; i += PARTS) {
                float q = row.v[qa + i];
                float k = row.v[ka + i];
                qq += q * q;
                kk += k * k;
            }
        }
        q_parts[t][part] = qq;
        k_parts[t][part] = kk;
    }
    barrier();
    if (tid < CHUNK) {
        float qq = 0.0;
        float kk = 0.0;
        for (uint p = 0; p < PARTS; p++) {
            qq += q_parts[tid][p];
            kk += k_parts[tid][p];
        }
        q_norm[tid] = inversesqrt(float(dk)) / sqrt(qq + 1e-6);
        k_norm[tid] = 1.0 / sqrt(kk + 1e-6);
    }
    if (tid == 0) {
        float sum = 0.0;
        for (uint t = 0; t < m; t++) {
            sum += args.g.v[(t0 + t) * args.nv + h];
            gamma[t] = sum;
            betas[t] = args.beta.v[(t0 + t) * args.nv + h];
        }
    }
    barrier();

    // A (strictly lower) and M (lower), a (t, s) pair at a time.
    for (uint pair = tid; pair < CHUNK * CHUNK; pair += GROUP_SIZE) {
        uint t = pair / CHUNK;
        uint s = pair % CHUNK;
        float a = 0.0;
        if (t < m && s <= t) {
            Floats rt = Floats(args.qkv + uint64_t(t0 + t) * width * 4);
            Floats rs = Floats(args.qkv + uint64_t(t0 + s) * width * 4);
            float qk = 0.0;
            float kk = 0.0;
            for (uint i = 0; i < dk; i++) {
                float k = rs.v[ka + i];
                qk += rt.v[qa + i] * k;
                kk += rt.v[ka + i] * k;
            }
            float decay = exp(gamma[t] - gamma[s]);
            mask.v[t * CHUNK + s] = decay * q_norm[t] * k_norm[s] * qk;
            if (s < t) {
                a = betas[t] * decay * k_norm[t] * k_norm[s] * kk;
            }
        }
        a_lower[t][s] = a;
    }
    barrier();

    // Forward substitution, an invocation a column of [W | U]: x_t = src_t − Σ_{s<t} A_ts x_s.
    for (uint c = tid; c < dk + dv; c += GROUP_SIZE) {
        float x[CHUNK];
        for (uint t = 0; t < m; t++) {
            Floats row = Floats(args.qkv + uint64_t(t0 + t) * width * 4);
            float v = c < dk ? betas[t] * exp(gamma[t]) * k_norm[t] * row.v[ka + c]
                             : betas[t] * row.v[va + c - dk];
            for (uint s = 0; s < t; s++) {
                v -= a_lower[t][s] * x[s];
            }
            x[t] = v;
            if (c < dk) {
                w.v[t * dk + c] = v;
            } else {
                u.v[t * dv + c - dk] = v;
            }
        }
    }
    if (tid < m) {
        float last = gamma[m - 1];
        tail.v[tid] = exp(gamma[tid]) * q_norm[tid];
        tail.v[CHUNK + tid] = exp(last - gamma[tid]) * k_norm[tid];
        if (tid == 0) {
            tail.v[2 * CHUNK] = exp(last);
        }
    }
}
