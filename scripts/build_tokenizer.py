"""Build the bundled tokenizer used by the tiny presets.

    python scripts/build_tokenizer.py   # -> src/hybridtune/models/tokenizer/

A byte-level BPE (any UTF-8 text encodes; no unknown token) trained on the bundled sample data,
digits split one per token so arithmetic is learnable, ChatML special tokens and a ChatML chat
template. Loads with `transformers.AutoTokenizer.from_pretrained(dir)`. Deterministic.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "src" / "hybridtune" / "data" / "sample" / "arithmetic.jsonl"
OUT = ROOT / "src" / "hybridtune" / "models" / "tokenizer"
VOCAB_SIZE = 512
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# A little general English so plain-text and instruction datasets do not fall back to raw bytes.
GENERAL_TEXT = """Below is an instruction that describes a task. Write a response that appropriately completes
the request. The quick brown fox jumps over the lazy dog. What is the answer? Explain your reasoning
step by step. The result of the calculation is shown here. Question: Answer: Input: Output: Response:
system user assistant human gpt You are a helpful assistant. Thank you. Please add the numbers.
"""


def corpus() -> list[str]:
    texts = [GENERAL_TEXT] * 20
    with SAMPLE.open() as f:
        for line in f:
            msgs = json.loads(line)["messages"]
            texts.append("".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in msgs))
    return texts


def main() -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        bos_token=None,
        unk_token=None,
        additional_special_tokens=["<|endoftext|>", "<|im_start|>"],
        model_max_length=4096,
    )
    fast.chat_template = CHAT_TEMPLATE
    OUT.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(OUT)
    print(f"wrote tokenizer with {len(fast)} tokens to {OUT}")


if __name__ == "__main__":
    main()
