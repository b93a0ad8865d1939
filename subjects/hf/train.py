"""HF transformers Trainer as a parity subject: SFT of the tiny Qwen2 on charcount.

    torchrun --nproc-per-node 2 subjects/hf/train.py --out runs/hf [--per-device-batch 4]
        [--grad-accum 1] [--steps 8] [--report-to tensorboard] [--mutant ga-bug]

The loss is on the assistant turn only (worker.data.charcount.encode's mask), padded per
micro-batch. Trainer writes trainer_state.json (read by parity/readers/hf.py); the harness's
recorder (parity.record.hf, installed by subjects/hf/common.py) adds ranks/rank{r}.jsonl (batch
digests for the diagnosis), fingerprints and the manifest. Runs as shipped
on CPU: use_cpu, gloo, full_determinism, logging_steps=1. ``--mutant ga-bug`` re-creates the
pre-fix gradient-accumulation loss through a compute_loss override of our Trainer subclass.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a script: subjects.* and worker.* from this checkout
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402

from subjects.hf.common import (  # noqa: E402
    base_parser,
    common_args,
    exit_cleanly,
    finish,
    install,
)


class EncodedDataset(Dataset):
    def __init__(self, rows: list[dict]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]


def load_rows(data: Path, tokenizer, max_length: int) -> list[dict]:
    from worker.data.charcount import encode, read_jsonl

    rows = []
    for sample in read_jsonl(data / "train.jsonl"):
        enc = encode(sample, tokenizer, max_length)
        labels = enc.input_ids.masked_fill(enc.loss_mask == 0, -100)
        rows.append({"input_ids": enc.input_ids, "labels": labels})
    return rows


class PadCollator:
    """Right-pads a micro-batch to its longest row: pad id, label -100, attention mask 0."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, rows: list[dict]) -> dict:
        n = max(len(r["input_ids"]) for r in rows)
        ids = torch.full((len(rows), n), self.pad_id, dtype=torch.int64)
        labels = torch.full((len(rows), n), -100, dtype=torch.int64)
        mask = torch.zeros((len(rows), n), dtype=torch.int64)
        for i, r in enumerate(rows):
            k = len(r["input_ids"])
            ids[i, :k], labels[i, :k], mask[i, :k] = r["input_ids"], r["labels"], 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def main(argv: list[str] | None = None) -> None:
    p = base_parser("HF Trainer on charcount (a parity subject)")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (TRL's default; off here)")
    args = p.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

    from subjects.hf.common import Subject

    class SubjectTrainer(Subject, Trainer):
        pass

    training_args = TrainingArguments(
        **common_args(args), remove_unused_columns=False, bf16=args.bf16
    )
    tokenizer = AutoTokenizer.from_pretrained(str(args.tokenizer))
    model = AutoModelForCausalLM.from_pretrained(
        str(args.model), use_safetensors=True, dtype=torch.float32
    )
    trainer = SubjectTrainer(
        model=model,
        args=training_args,
        train_dataset=EncodedDataset(load_rows(args.data, tokenizer, args.max_length)),
        data_collator=PadCollator(tokenizer.pad_token_id),
        processing_class=tokenizer,
    )
    install(trainer, args)
    trainer.train()
    finish(trainer)
    exit_cleanly()


if __name__ == "__main__":
    main()
