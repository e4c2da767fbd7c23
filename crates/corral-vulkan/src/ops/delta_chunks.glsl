// What the chunked delta rule's two shaders share (delta_rule_chunk_prepare.comp makes each
// chunk's products, delta_rule_chunk_scan.comp carries a run's state through its chunks):
// chunks of CHUNK tokens numbered in run order, and where a (chunk, value head)'s products
// lie in the scratch buffer. Include after recurrent.glsl.

// Both shaders' arguments (one set a wave, `chunked_delta_rule` in recurrent.rs): the chunks
// [first, first + wave) of the runs' chunks in run order.
layout(push_constant) uniform Args {
    uint64_t qkv;
    Floats g;
    Floats beta;
    uint64_t runs;
    uint64_t scratch;
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
    uint wave;
} args;

// Tokens of a chunk (DELTA_CHUNK in recurrent.rs).
#define CHUNK 32

// Floats of one (chunk, value head) in the scratch: W [CHUNK][dk], U [CHUNK][dv],
// M [CHUNK][CHUNK], then the tail: each token's q scale (e^γ_t / |q_t| / √dk) and k scale
// (e^{γ_last − γ_t} / |k_t|), and e^{γ_last} ([CHUNK], [CHUNK], [CHUNK] with one used).
uint chunk_floats(uint dk, uint dv) {
    return CHUNK * (dk + dv + CHUNK + 3);
}

uint chunks_of(uint len) {
    return (len + CHUNK - 1) / CHUNK;
}

// The chunks of run `r`: none where the run is not one to step (run_of's faults).
uint run_chunks(uint64_t runs, uint r, uint tokens, uint slots, uint longest, Fault fault) {
    Run run;
    return run_of(runs, 0, r, tokens, slots, longest, fault, false, run) ? chunks_of(run.len) : 0;
}
