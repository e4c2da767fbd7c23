// The chunked gated delta rule's second half: one workgroup per (run, value head, slice of
// SLICE state columns; the columns evolve independently) carries the state slice [dk, SLICE]
// in shared memory through the run's chunks of the wave, in order, from what
// delta_rule_chunk_prepare.comp made of each: V' = U − W S; O = (q scales ⊙ Q) S + M V';
// S ← e^{γ_last} S + (k scales ⊙ K)ᵀ V'. The state comes from the run's slot (zero where a
// fresh run starts in this wave) and goes back to it, where the next wave continues.
#version 450
#extension GL_GOOGLE_include_directive : require
#define GROUP_SIZE 256
#include "common.glsl"
#include "recurrent.glsl"
#include "delta_chunks.glsl"
// State columns a workgroup carries (DELTA_SLICE in recurrent.rs).
#define SLICE 16
// The largest key dim (MAX_DELTA_KEY_DIM in corral-backend's checked.rs).
#define MAX_KEY_DIM 128
// Tokens of a chunk an invocation takes in V' and O (CHUNK · SLICE / GROUP_SIZE).
#define ROWS 2


shared float s_slice[MAX_KEY_DIM][SLICE];
shared float v_new[CHUNK][SLICE];

void main() {
    uint slices = (args.dv + SLICE - 1) / SLICE;
    uint group = flat_group();
    uint r = group / (args.nv * slices);
    if (r >= args.num_runs) {
        return;
    }
    uint h = (group / slices) % args.nv;
    uint j0 = (group % slices) * SLICE;
    uint tid = gl_LocalInvocationID.x;
    Run run;
    if (!run_of(args.runs, 0, r, args.tokens, args.slots, args.longest, args.fault, tid == 0,
                run)) {
        return;
    }
    // The run's chunks [at, at + n) in run order, and those of this wave.
    uint at = 0;
    for (uint p = 0; p < r; p++) {
        at += run_chunks(args.runs, p, args.tokens, args.slots, args.longest, args.fault);
    }
    uint n = chunks_of(run.len);
    uint lo = max(at, args.first);
    uint hi = min(at + n, args.first + args.wave);
    // A fresh run starts from zeros in the wave holding its first chunk (the first wave where
    // it has none).
    bool zero = run.fresh && (n == 0 ? args.first == 0 : at >= args.first && at < hi);
    if (lo >= hi && !zero) {
        return;
    }
    uint dk = args.dk;
    uint dv = args.dv;
    uint width = 2 * args.nk * dk + args.nv * dv;
    uint kh = h / (args.nv / args.nk);
    uint qa = kh * dk;
    uint ka = args.nk * dk + kh * dk;
    Floats own = Floats(args.state + (uint64_t(run.slot) * args.nv + h) * (dk * dv) * 4);
    for (uint e = tid; e < dk * SLICE; e += GROUP_SIZE) {
        uint j = j0 + e % SLICE;
        s_slice[e / SLICE][e % SLICE] = zero || j >= dv ? 0.0 : own.v[(e / SLICE) * dv + j];
    }
    barrier();

    uint jj = tid % SLICE;
    uint j = j0 + jj;
    for (uint c = lo; c < hi; c++) {
        uint chunk = c - at;
        uint t0 = run.start + chunk * CHUNK;
        uint m = min(CHUNK, run.len - chunk * CHUNK);
        uint64_t base = args.scratch
            + uint64_t((c - args.first) * args.nv + h) * chunk_floats(dk, dv) * 4;
        Floats w = Floats(base);
        Floats u = Floats(base + uint64_t(CHUNK * dk) * 4);
        Floats mask = Floats(base + uint64_t(CHUNK * (dk + dv)) * 4);
        Floats tail = Floats(base + uint64_t(CHUNK * (dk + dv + CHUNK)) * 4);
        // V' = U − W S, and Q S, from one pass over the state.
        float qs[ROWS];
        for (uint p = 0; p < ROWS; p++) {
            uint t = tid / SLICE + p * (GROUP_SIZE / SLICE);
            float vn = 0.0;
            float q = 0.0;
            if (t < m && j < dv) {
                Floats row = Floats(args.qkv + uint64_t(t0 + t) * width * 4);
                vn = u.v[t * dv + j];
                for (uint i = 0; i < dk; i++) {
                    float s = s_slice[i][jj];
                    vn -= w.v[t * dk + i] * s;
                    q += row.v[qa + i] * s;
                }
            }
            v_new[t][jj] = vn;
            qs[p] = q;
        }
        barrier();
        // O = (q scales ⊙ Q) S + M V'.
        for (uint p = 0; p < ROWS; p++) {
            uint t = tid / SLICE + p * (GROUP_SIZE / SLICE);
            if (t < m && j < dv) {
                float o = tail.v[t] * qs[p];
                for (uint s = 0; s <= t; s++) {
                    o += mask.v[t * CHUNK + s] * v_new[s][jj];
                }
                Floats(args.out_ + ((uint64_t(t0 + t) * args.nv + h) * dv + j) * 4).v[0] = o;
            }
        }
        // S ← e^{γ_last} S + (k scales ⊙ K)ᵀ V', an invocation SLICE entries apart.
        float decay = tail.v[2 * CHUNK];
        for (uint e = tid; e < dk * SLICE; e += GROUP_SIZE) {
            uint i = e / SLICE;
            uint col = e % SLICE;
            float s = decay * s_slice[i][col];
            for (uint t = 0; t < m; t++) {
                s += tail.v[CHUNK + t] * Floats(args.qkv + uint64_t(t0 + t) * width * 4).v[ka + i]
                    * v_new[t][col];
            }
            s_slice[i][col] = s;
        }
        barrier();
    }
    for (uint e = tid; e < dk * SLICE; e += GROUP_SIZE) {
        uint j = j0 + e % SLICE;
        if (j < dv) {
            own.v[(e / SLICE) * dv + j] = s_slice[e / SLICE][e % SLICE];
        }
    }
}
