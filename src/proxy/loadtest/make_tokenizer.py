"""Build a small Hugging Face tokenizer offline, for guidellm where huggingface.co is unreachable.

guidellm needs a tokenizer to size synthetic prompts (prompt_tokens=...) and to count tokens; it
loads one with transformers' AutoTokenizer.from_pretrained(PATH). This trains a byte-level BPE
tokenizer (GPT-2 style, 4k merges) on text found locally and saves it as a directory that
AutoTokenizer loads without any download:

    python make_tokenizer.py OUT_DIR [TEXT_FILE ...]

Token counts differ from the model's real tokenizer (the simulated fleet has its own anyway): use a
real tokenizer directory instead when you have one.
"""

import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast


def corpus(paths):
    for p in paths:
        for line in Path(p).read_text(errors="ignore").splitlines():
            if line.strip():
                yield line


def main():
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "tokenizer")
    here = Path(__file__).resolve().parents[3]
    texts = sys.argv[2:] or [str(p) for p in [here / "README.md", here / "src/proxy/README.md"] if p.exists()]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=4096,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus(texts), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>")
    fast.model_max_length = 131072
    fast.save_pretrained(out)
    print(f"tokenizer with {fast.vocab_size} tokens written to {out}")


if __name__ == "__main__":
    main()
