// The fp32 logits llama.cpp's CPU build computes for every position of a token sequence, for
// scripts/gguf_fidelity.py to compare with Corral's and with the file's exact reference.
//
//   llama-logits MODEL.gguf OUT.f32 KV_TYPE THREADS TOKEN_ID...
//
// One sequence, one batch, every position's logits; KV_TYPE is f16 (llama.cpp's default) or
// f32. OUT gets the positions' rows, vocabulary-long, as raw little-endian f32. Built against
// the libllama that scripts/llama_cpp_side_by_side.sh builds (scripts/gguf_fidelity.sh).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "llama.h"

int main(int argc, char ** argv) {
    if (argc < 6) {
        fprintf(stderr, "usage: %s MODEL.gguf OUT.f32 f16|f32 THREADS TOKEN_ID...\n", argv[0]);
        return 2;
    }
    const char * model_path = argv[1];
    const char * out_path = argv[2];
    const bool kv_f32 = strcmp(argv[3], "f32") == 0;
    const int threads = atoi(argv[4]);
    std::vector<llama_token> tokens;
    for (int i = 5; i < argc; i++) {
        tokens.push_back((llama_token) atoi(argv[i]));
    }
    const int n = (int) tokens.size();

    llama_backend_init();
    llama_model_params mparams = llama_model_default_params();
    mparams.n_gpu_layers = 0;
    llama_model * model = llama_model_load_from_file(model_path, mparams);
    if (model == nullptr) {
        fprintf(stderr, "%s: could not load\n", model_path);
        return 1;
    }
    llama_context_params cparams = llama_context_default_params();
    cparams.n_ctx = n;
    cparams.n_batch = n;
    cparams.n_ubatch = n;
    cparams.n_threads = threads;
    cparams.n_threads_batch = threads;
    if (kv_f32) {
        cparams.type_k = GGML_TYPE_F32;
        cparams.type_v = GGML_TYPE_F32;
    }
    llama_context * ctx = llama_init_from_model(model, cparams);
    if (ctx == nullptr) {
        fprintf(stderr, "could not make a context\n");
        return 1;
    }
    llama_batch batch = llama_batch_init(n, 0, 1);
    for (int i = 0; i < n; i++) {
        batch.token[i] = tokens[i];
        batch.pos[i] = i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = 1;
    }
    batch.n_tokens = n;
    if (llama_decode(ctx, batch) != 0) {
        fprintf(stderr, "decode failed\n");
        return 1;
    }
    const int vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    FILE * out = fopen(out_path, "wb");
    if (out == nullptr) {
        fprintf(stderr, "%s: could not open\n", out_path);
        return 1;
    }
    for (int i = 0; i < n; i++) {
        const float * row = llama_get_logits_ith(ctx, i);
        fwrite(row, sizeof(float), vocab, out);
    }
    fclose(out);
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
