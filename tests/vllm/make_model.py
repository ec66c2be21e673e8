#!/usr/bin/env python3
"""Write a seeded random-weight tiny Llama model (Hugging Face format), for tests that run a real vLLM.

Nothing is downloaded: the tokenizer is a byte-level BPE trained here, with `tokenizers`, on text
generated here from the seed, and saved as a `PreTrainedTokenizerFast` with a ChatML chat template;
the model is a `LlamaForCausalLM` with random weights, saved with `save_pretrained` (safetensors).
The model talks nonsense, but vLLM does all the real work of an inference engine on it (tokenize,
chat template, prefill, decode in continuous batches, paged KV cache, prefix caching), and its cost
per token grows with the size chosen here.

One change to the random weights, on purpose: the model can never emit a special token (the eos
`</s>`, `<|im_end|>`, ...). Random sampling would otherwise end about one stream in eight of 256
tokens early, at random. Dimension 0 of the residual stream is held at a constant (every embedding
has it, no layer writes to it), so after the final norm it is a positive constant, and the output
rows of the special tokens weigh it with a large negative number: their logits sit far below all
the others. Streams run to their `max_tokens`.

Usage: make_model.py OUT_DIR [--seed N] [--embd 256] [--layers 2] [--heads 4] [--ff 512]
                             [--vocab 2048] [--context 8192] [--dtype bfloat16]
Same arguments, same files (byte for byte).
"""
import argparse
import os
import random
import sys

# Before torch/tokenizers load: single-threaded and offline, for byte-identical output.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

BOS, EOS, PAD, IM_START, IM_END = "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"
SPECIAL = [BOS, EOS, PAD, IM_START, IM_END]

# ChatML. `content` may be a string or a list of {"type": "text", "text": ...} parts.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

COMMON = (
    "the of and to a in is it you that he was for on are with as I his they be at one have this "
    "from or had by hot word but what some we can out other were all there when up use your how "
    "said an each she which do their time if will way about many then them write would like so "
    "these her long make thing see him two has look more day could go come did number sound no "
    "most people my over know water than call first who may down side been now find any new work "
    "part take get place made live where after back little only round man year came show every "
    "good me give our under name very through just form sentence great think say help low line "
    "request server model token cache queue prompt answer question system user assistant"
).split()
PUNCT = [".", ",", "?", "!", ":", ";", " -", "'s", "(", ")", '"', "\n"]


def training_text(seed, n_sentences=12000):
    """Deterministic pseudo-English: common words, made-up words, numbers, punctuation, unicode."""
    rng = random.Random(seed)
    syll = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"] + ["th", "st", "qu", "ing", "er"]
    made_up = ["".join(rng.choice(syll) for _ in range(rng.randint(1, 4))) for _ in range(3000)]
    extra = ["é", "ü", "ß", "ñ", "你好", "日本", "Ω", "→", "€", "😀", "{", "}", "[", "]", "=", "_", "/", "#"]
    out = []
    for _ in range(n_sentences):
        words = []
        for _ in range(rng.randint(3, 24)):
            r = rng.random()
            if r < 0.55:
                w = rng.choice(COMMON)
            elif r < 0.9:
                w = rng.choice(made_up)
            elif r < 0.96:
                w = str(rng.randint(0, 10 ** rng.randint(1, 6)))
            else:
                w = rng.choice(extra)
            if rng.random() < 0.1:
                w = w.capitalize()
            words.append(w)
            if rng.random() < 0.08:
                words[-1] += rng.choice(PUNCT)
        out.append(" ".join(words) + rng.choice([".", "?", "!", ".\n"]))
    return out


def build_tokenizer(seed, vocab):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        min_frequency=2,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_text(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=10 ** 6,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--embd", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ff", type=int, default=512)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    a = p.parse_args()
    if a.embd % a.heads:
        sys.exit(f"--embd {a.embd} is not a multiple of --heads {a.heads}")

    hf_logging.disable_progress_bar()
    random.seed(a.seed)
    torch.manual_seed(a.seed)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)

    tokenizer = build_tokenizer(a.seed, a.vocab)
    n_vocab = len(tokenizer)
    special_ids = [tokenizer.convert_tokens_to_ids(t) for t in SPECIAL]

    config = LlamaConfig(
        vocab_size=n_vocab,
        hidden_size=a.embd,
        intermediate_size=a.ff,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.heads,
        max_position_embeddings=a.context,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=0.02,
    )
    model = LlamaForCausalLM(config)  # random init from torch's seeded generator

    with torch.no_grad():
        # Hold residual dimension 0 at 1.0: set it in every embedding, let no layer write to it.
        model.model.embed_tokens.weight[:, 0] = 1.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0, :] = 0.0
            layer.mlp.down_proj.weight[0, :] = 0.0
        # After the final norm that dimension is a positive constant; only special tokens read it.
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[special_ids, :] = 0.0
        model.lm_head.weight[special_ids, 0] = -100.0

    model = model.to(getattr(torch, a.dtype))
    model.config.name_or_path = f"random-llama-e{a.embd}-l{a.layers}-s{a.seed}"
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(IM_END)]

    os.makedirs(a.out, exist_ok=True)
    model.save_pretrained(a.out, safe_serialization=True)
    tokenizer.save_pretrained(a.out)
    n_params = sum(t.numel() for t in model.parameters())
    print(f"wrote {a.out}: {n_params} parameters, vocab {n_vocab}, {a.dtype}", file=sys.stderr)


if __name__ == "__main__":
    main()
