"""The inputs of a verl PPO run (``verl.trainer.main_ppo``), made from the committed fixtures: run
with the env's python.

    python -m subjects.verl.prepare_rl DIR

writes, under DIR:

- ``train.parquet``, ``val.parquet``: verl's RL format, one row per charcount question: ``prompt``
  (the user turn as a chat message list), ``data_source`` ("charcount"), ``reward_model``
  (``{"style": "rule", "ground_truth": "<count>"}``), ``extra_info`` (split and index);
- ``model/``: the tiny Qwen2 actor with its tokenizer, as ``subjects.verl.prepare`` writes it;
- ``critic/``: the same Qwen2 body under a ``Qwen2ForTokenClassification`` with one label (the
  value head verl's critic loads), its ``score`` layer drawn once here from a fixed seed and saved.
  verl would otherwise draw that head itself when each side loads the critic, from whatever the
  RNG holds at that moment, which the two worker implementations need not share: with it saved,
  both sides start from the same critic weights, bit for bit.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from subjects.verl.prepare import FIXTURES, write_model

DATA_SOURCE = "charcount"
VALUE_HEAD_SEED = 1234


def write_parquet(out: Path) -> None:
    import pandas as pd

    for split in ("train", "val"):
        rows = []
        for index, line in enumerate((FIXTURES / "charcount" / f"{split}.jsonl").open()):
            record = json.loads(line)
            question = next(m for m in record["messages"] if m["role"] == "user")
            rows.append(
                {
                    "data_source": DATA_SOURCE,
                    "prompt": [{"role": "user", "content": question["content"]}],
                    "reward_model": {"style": "rule", "ground_truth": str(record["count"])},
                    "extra_info": {"split": split, "index": index},
                }
            )
        pd.DataFrame(rows).to_parquet(out / f"{split}.parquet", index=False)


def write_critic(out: Path) -> None:
    """The actor's weights under a one-label token-classification head, the head seeded."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForTokenClassification

    actor = out / "model"
    critic = out / "critic"
    config = AutoConfig.from_pretrained(actor)
    config.num_labels = 1
    config.classifier_dropout = 0.0
    torch.manual_seed(VALUE_HEAD_SEED)
    model = AutoModelForTokenClassification.from_pretrained(
        actor, config=config, torch_dtype=torch.float32, use_safetensors=True
    )
    model.save_pretrained(critic, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(actor / name, critic / name)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m subjects.verl.prepare_rl DIR", file=sys.stderr)
        return 2
    out = Path(args[0])
    out.mkdir(parents=True, exist_ok=True)
    write_parquet(out)
    write_model(out)
    write_critic(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
