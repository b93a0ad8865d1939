"""TRL's SFTTrainer as a parity subject: SFT of the tiny Qwen2 on charcount, in TRL's own venv.

    torchrun --nproc-per-node 2 subjects/hf/train_trl.py --out runs/trl [--per-device-batch 4]
        [--grad-accum 1] [--steps 8] [--bf16 auto|on|off] [--gradient-checkpointing auto|on|off]
        [--mutant ga-bug]

The data is charcount as conversational prompt-completion pairs (user turn, assistant turn):
TRL applies the chat template and, by its default for that format, takes the loss on the
completion only (the assistant turn, as worker/ and subjects/hf/train.py do). Options left at
"auto" keep SFTConfig's own defaults (bf16 on, gradient checkpointing on: TRL as shipped).
The venv is made by subjects/envs.py from REQUIREMENTS (TRL is never installed in the main venv):
`python -c "from subjects.hf.train_trl import env_python; print(env_python())"` builds it and
prints its python, which runs this script (torchrun --no-python PYTHON subjects/hf/train_trl.py).
This file imports neither `worker` nor `parity` beyond `parity.record` (the recorder, which needs
only torch; this checkout is on the path).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from subjects.hf.common import (  # noqa: E402
    base_parser,
    common_args,
    exit_cleanly,
    finish,
    install,
)

# What the TRL venv holds. torch is the CPU wheel on disk (subjects.envs also pins it as a
# constraint: an unpinned torch would pull CUDA); transformers and accelerate as in the main
# venv, so that the HF and TRL subjects differ only by TRL. TRL 1.16 asks transformers>=4.56.2.
REQUIREMENTS = (
    "torch==2.13.0",
    "transformers==5.24.0",
    "accelerate==1.16.0",
    "trl==1.16.0",
    "datasets==5.2.0",
)


def env_python() -> Path:
    """The TRL venv's python, built by subjects.envs on first use and cached per machine
    (raises subjects.envs.EnvUnavailable when the package index cannot be reached)."""
    from subjects.envs import TORCH_BASE, EnvSpec, ensure

    return ensure(EnvSpec("trl-1.16.0", requirements=REQUIREMENTS, base=TORCH_BASE))


def load_pairs(data: Path) -> list[dict]:
    rows = []
    with open(data / "train.jsonl", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                messages = json.loads(line)["messages"]
                rows.append({"prompt": messages[:-1], "completion": messages[-1:]})
    return rows


def _switch(value: str) -> bool | None:
    return {"auto": None, "on": True, "off": False}[value]


def main(argv: list[str] | None = None) -> None:
    p = base_parser("TRL SFTTrainer on charcount (a parity subject)")
    p.add_argument("--bf16", choices=("auto", "on", "off"), default="auto")
    p.add_argument("--gradient-checkpointing", choices=("auto", "on", "off"), default="auto")
    args = p.parse_args(argv)

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from subjects.hf.common import Subject

    class SubjectSFTTrainer(Subject, SFTTrainer):
        pass

    extra = {}
    for name in ("bf16", "gradient_checkpointing"):
        value = _switch(getattr(args, name))
        if value is not None:
            extra[name] = value
    config = SFTConfig(**common_args(args), max_length=args.max_length, **extra)
    tokenizer = AutoTokenizer.from_pretrained(str(args.tokenizer))
    model = AutoModelForCausalLM.from_pretrained(
        str(args.model), use_safetensors=True, dtype=torch.float32
    )
    trainer = SubjectSFTTrainer(
        model=model,
        args=config,
        train_dataset=Dataset.from_list(load_pairs(args.data)),
        processing_class=tokenizer,
    )
    install(trainer, args)
    trainer.train()
    finish(trainer)
    exit_cleanly()


if __name__ == "__main__":
    main()
