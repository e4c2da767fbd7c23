"""A checkpoint directory's tokenizer written into a GGUF file as llama.cpp's converter
writes it (shared by the GGUF fixture and bench scripts)."""
import json


def add_vocab(w, directory, vocab_size):
    """The directory's tokenizer.json and chat template as the converter writes them: token
    strings by id (added tokens CONTROL when special, else USER_DEFINED; ids without a token
    UNUSED), merges as "left right", Qwen's pre-tokenizer name."""
    tok = json.loads((directory / "tokenizer.json").read_text())
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [5] * vocab_size
    for text, i in tok["model"]["vocab"].items():
        tokens[i], types[i] = text, 1
    for added in tok["added_tokens"]:
        tokens[added["id"]] = added["content"]
        types[added["id"]] = 3 if added["special"] else 4
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "qwen2")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", types)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_array("tokenizer.ggml.merges", merges)
    template = json.loads((directory / "tokenizer_config.json").read_text()).get("chat_template")
    if template:
        w.add_string("tokenizer.chat_template", template)
