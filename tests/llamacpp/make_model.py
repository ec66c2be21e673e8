#!/usr/bin/env python3
"""Write a seeded random-weight tiny llama model as GGUF, for tests that run a real llama-server.

The tokenizer is llama.cpp's vocab-only `ggml-vocab-llama-spm.gguf` (MIT, copied from llama.cpp's
source tree, see LICENSE.llama.cpp beside it). The weights are random: the model talks nonsense,
but the server does all the real work of an inference engine (tokenize, prefill, decode in
continuous batches over its slots, a prompt cache per slot), and its cost per token grows with
the size chosen here, so the tests can make it as slow as they need.

One change to the vocab, on purpose: its 256 BYTE tokens (`<0x00>`..`<0xFF>`) are marked NORMAL.
Random sampling emits lone byte tokens; llama-server renders a BYTE token as the raw byte, which
is invalid UTF-8 on its own, and then ends a stream without `[DONE]`. As NORMAL tokens they render
as their text (`<0x41>`), and streams run to their length.

Usage: make_model.py OUT.gguf [--seed N] [--embd 256] [--layers 4] [--heads 4] [--ff 768]
Same arguments, same file (byte for byte).
"""
import argparse
import os
import sys

import numpy as np
import gguf

HERE = os.path.dirname(os.path.abspath(__file__))
VOCAB = os.path.join(HERE, "ggml-vocab-llama-spm.gguf")


def field_value(reader, key):
    f = reader.fields[key]
    return f.parts[f.data[0]][0]


def read_vocab(path):
    r = gguf.GGUFReader(path)
    tok = r.fields["tokenizer.ggml.tokens"]
    tokens = [bytes(tok.parts[i]).decode("utf-8") for i in tok.data]
    sc = r.fields["tokenizer.ggml.scores"]
    scores = [float(sc.parts[i][0]) for i in sc.data]
    ty = r.fields["tokenizer.ggml.token_type"]
    types = [int(ty.parts[i][0]) for i in ty.data]
    ids = {
        k: int(field_value(r, "tokenizer.ggml." + k))
        for k in ("bos_token_id", "eos_token_id", "unknown_token_id")
    }
    return tokens, scores, types, ids


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--embd", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ff", type=int, default=768)
    p.add_argument("--context", type=int, default=4096)
    a = p.parse_args()
    if a.embd % a.heads:
        sys.exit(f"--embd {a.embd} is not a multiple of --heads {a.heads}")

    tokens, scores, types, ids = read_vocab(VOCAB)
    byte_type = int(gguf.TokenType.BYTE)
    types = [int(gguf.TokenType.NORMAL) if t == byte_type else t for t in types]
    n_vocab = len(tokens)

    w = gguf.GGUFWriter(a.out, "llama")
    w.add_name(f"random-llama-e{a.embd}-l{a.layers}-s{a.seed}")
    w.add_context_length(a.context)
    w.add_embedding_length(a.embd)
    w.add_block_count(a.layers)
    w.add_feed_forward_length(a.ff)
    w.add_head_count(a.heads)
    w.add_head_count_kv(a.heads)
    w.add_rope_dimension_count(a.embd // a.heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_vocab_size(n_vocab)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(ids["bos_token_id"])
    w.add_eos_token_id(ids["eos_token_id"])
    w.add_unk_token_id(ids["unknown_token_id"])
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)

    rng = np.random.default_rng(a.seed)

    def rand(*shape):
        # Scaled like an initialised network so activations stay finite through the layers.
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    ones = lambda n: np.ones(n, dtype=np.float32)  # noqa: E731
    w.add_tensor("token_embd.weight", rand(n_vocab, a.embd))
    for i in range(a.layers):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", ones(a.embd))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            w.add_tensor(b + name + ".weight", rand(a.embd, a.embd))
        w.add_tensor(b + "ffn_norm.weight", ones(a.embd))
        w.add_tensor(b + "ffn_gate.weight", rand(a.ff, a.embd))
        w.add_tensor(b + "ffn_up.weight", rand(a.ff, a.embd))
        w.add_tensor(b + "ffn_down.weight", rand(a.embd, a.ff))
    w.add_tensor("output_norm.weight", ones(a.embd))
    w.add_tensor("output.weight", rand(n_vocab, a.embd))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
