"""The charcount task: a seeded generator, an offline character tokenizer, and encoding.

A sample asks how many times a letter occurs in a hyphenated word and answers with one reasoning
line per letter and a boxed count. Everything is seeded so `python -m worker.data.charcount`
rewrites the committed fixtures bit for bit.
"""

from __future__ import annotations

import argparse
import json
import random
import string
from dataclasses import dataclass
from pathlib import Path

import torch

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
DATA_DIR = FIXTURES / "charcount"
TOKENIZER_DIR = FIXTURES / "tokenizer"

IM_START, IM_END, PAD, UNK = "<|im_start|>", "<|im_end|>", "<|pad|>", "<|unk|>"
SPECIAL_TOKENS = [PAD, UNK, IM_START, IM_END]
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def make_sample(rng: random.Random) -> dict:
    """One charcount sample: a 5-20 letter word, a target letter occurring k times."""
    length = rng.randint(5, 20)
    target = rng.choice(string.ascii_lowercase)
    count = rng.randint(1, length)
    others = [c for c in string.ascii_lowercase if c != target]
    letters = [target] * count + [rng.choice(others) for _ in range(length - count)]
    rng.shuffle(letters)
    word = "-".join(letters)
    lines = [f"{x} = {target}." if x == target else f"{x} != {target}." for x in letters]
    lines.append(f"\\boxed{{{count}}} {target} in {word}.")
    prompt = f"How many {target} are there in word {word}?"
    return {
        "messages": [
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": "\n".join(lines)},
        ],
        "target": target,
        "word": word,
        "count": count,
    }


def generate(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [make_sample(rng) for _ in range(n)]


def build_tokenizer():
    """A character-level PreTrainedTokenizerFast with a chat template, built without any hub."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\x0b\x0c\r"]
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + chars)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        unk_token=UNK,
        bos_token=None,
        eos_token=IM_END,
        additional_special_tokens=[IM_START, IM_END],
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def load_tokenizer(path: str | Path = TOKENIZER_DIR):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def read_jsonl(path: str | Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@dataclass(frozen=True, eq=False)
class Encoded:
    """One tokenized sample: ids and the mask of tokens the loss is taken on (the response)."""

    input_ids: torch.Tensor  # int64 [L]
    loss_mask: torch.Tensor  # int64 [L], 1 on assistant tokens

    def __len__(self) -> int:
        return int(self.input_ids.numel())


def encode(sample: dict, tokenizer, max_length: int) -> Encoded:
    """Token ids of the chat, with the loss on the assistant turn only (truncated to max_length)."""
    messages = sample["messages"]
    prompt_ids = tokenizer.apply_chat_template(
        messages[:-1], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    full_ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    if list(full_ids[: len(prompt_ids)]) != list(prompt_ids):
        raise ValueError("chat template is not prefix-consistent; cannot mask the prompt")
    ids = torch.tensor(list(full_ids)[:max_length], dtype=torch.int64)
    mask = torch.zeros_like(ids)
    mask[len(prompt_ids) :] = 1
    return Encoded(ids, mask)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Regenerate the charcount fixtures bit for bit.")
    parser.add_argument("--train", type=int, default=384)
    parser.add_argument("--val", type=int, default=48)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", type=Path, default=FIXTURES)
    args = parser.parse_args(argv)
    from worker.model import build_tiny_model  # the model fixture belongs with the data fixtures

    samples = generate(args.train + args.val, args.seed)
    data_dir = args.out / "charcount"
    data_dir.mkdir(parents=True, exist_ok=True)
    for name, part in (("train", samples[: args.train]), ("val", samples[args.train :])):
        with open(data_dir / f"{name}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(s, sort_keys=True) + "\n" for s in part)
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(str(args.out / "tokenizer"))
    build_tiny_model(args.out / "tiny-qwen2", vocab_size=len(tokenizer), seed=args.seed)
    print(f"wrote {args.train} train / {args.val} val samples, tokenizer and model to {args.out}")


if __name__ == "__main__":
    main()
