"""The inputs of a verl SFT run, made from the committed fixtures: run with the env's python.

    python -m subjects.verl.prepare DIR

writes DIR/train.parquet and DIR/val.parquet (verl's multi-turn format: a ``messages`` column of
``{"role", "content"}`` lists, from ``fixtures/charcount/*.jsonl``; the other fixture fields are
kept as columns, which verl ignores) and DIR/model/, the tiny Qwen2 with its tokenizer in the form
transformers 4.x loads: the committed tokenizer is saved by transformers 5 (``TokenizersBackend``,
``extra_special_tokens`` as a list), which 4.x refuses, so the config says
``PreTrainedTokenizerFast`` with the same ``tokenizer.json``, special tokens and chat template.
The weights are the fixture's ``model.safetensors`` byte for byte.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"


def write_parquet(out: Path) -> None:
    import pandas as pd

    for split in ("train", "val"):
        rows = [json.loads(line) for line in (FIXTURES / "charcount" / f"{split}.jsonl").open()]
        pd.DataFrame(rows).to_parquet(out / f"{split}.parquet", index=False)


def write_model(out: Path) -> None:
    model = out / "model"
    model.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copyfile(FIXTURES / "tiny-qwen2" / name, model / name)
    shutil.copyfile(FIXTURES / "tokenizer" / "tokenizer.json", model / "tokenizer.json")
    committed = json.loads((FIXTURES / "tokenizer" / "tokenizer_config.json").read_text())
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": committed["bos_token"],
        "eos_token": committed["eos_token"],
        "pad_token": committed["pad_token"],
        "unk_token": committed["unk_token"],
        "additional_special_tokens": committed["extra_special_tokens"],
        "model_max_length": committed["model_max_length"],
        "chat_template": (FIXTURES / "tokenizer" / "chat_template.jinja").read_text(),
    }
    (model / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m subjects.verl.prepare DIR", file=sys.stderr)
        return 2
    out = Path(args[0])
    out.mkdir(parents=True, exist_ok=True)
    write_parquet(out)
    write_model(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
