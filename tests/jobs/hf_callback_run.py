"""A 3-step HF Trainer run with the recorder's callback, and what two such runs must show.

    python tests/jobs/hf_callback_run.py --out DIR [--max-grad-norm 1.0]

`run` is the Trainer job (tiny Qwen2, random ids, one process on CPU, an evaluation at step 2,
fingerprints at steps 1 and 2, step 1 traced op by op); `check` is what a run clipped at 1.0 and
one clipped at 1e-3 must show against each other. tests/record/test_recorder.py runs both in its own
venv; tests/project/test_install.py runs `run` as this script with the python of another environment
(another transformers, the harness installed from its wheel) and `check` here. The script needs
torch, transformers and `parity.record`; `check` needs the rest of the harness.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(out: Path, max_grad_norm: float) -> Path:
    """Train 3 steps with ParityCallback attached; trainer_state.json saved beside its files."""
    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from parity.record.hf import ParityCallback

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(
        str(ROOT / "fixtures" / "tiny-qwen2"), use_safetensors=True, dtype=torch.float32
    )
    ids = torch.randint(0, 100, (8, 12), generator=torch.Generator().manual_seed(0))
    rows = [{"input_ids": r, "labels": r} for r in ids]
    args = TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=2, max_steps=3, logging_steps=1,
        eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=4, use_cpu=True,
        report_to=[], save_strategy="no", seed=0, max_grad_norm=max_grad_norm, disable_tqdm=True,
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=rows, eval_dataset=rows[:4])
    ParityCallback.attach(trainer, fingerprint_steps="1,2", trace_step=1)
    trainer.train()
    trainer.save_state()
    return out


def check(a: Path, b: Path) -> None:
    """`a` clipped at 1.0, `b` at 1e-3: the callback wrote exactly what Trainer logged, the
    digests, the manifest, the pre-clip gradients and the op trace that tell them apart."""
    from parity.judge.compare import compare_frames
    from parity.judge.diagnose import diagnose, read_rank_data
    from parity.readers import read_metrics

    mine, hf = read_metrics(a), read_metrics(a / "trainer_state.json")
    assert mine.attrs["complete"] is True
    # the same names and bits as HF's own log: training, evaluation and summary in one record
    # HF rounds `epoch` to 2 decimals in what it logs: judged at what both sources hold
    comparison = compare_frames(mine, hf, at_source_precision=True)
    assert comparison.verdict == "aligned", comparison.table()
    assert {"train/loss", "eval/loss", "train/total_flos", "train/train_loss"} <= set(mine.columns)
    data = read_rank_data(a)[0]
    assert set(data[2]) == {"train", "val"} and data[1]["train"]["tokens"] == 24
    manifest = json.loads((a / "manifest.json").read_text())
    assert (manifest["device"], manifest["world_size"]) == ("cpu", 1)
    assert manifest["config"]["max_grad_norm"] == 1.0
    # clipped hard, the weights part after step 1; the gradients of step 1 were hashed before
    # the clip, so they are the same
    d = diagnose(a, b, compare_frames(read_metrics(a), read_metrics(b)))
    assert d.kind == "same batches, numbers differ" and d.step == 2, d.lines()
    assert d.fingerprints.root[:2] == ("weights", 2) and d.fingerprints.first_grad_step == 2
    # step 1 traced op by op (trace_step=1): the clip is where they part, by its max norm
    assert d.ops.status == "differ" and d.ops.step == 1, d.ops.line()
    assert (d.ops.first["phase"], d.ops.origin) == ("step", "scalar argument"), d.ops.line()
    assert "1.0 vs 0.001" in d.ops.line() or "1 vs 0.001" in d.ops.line(), d.ops.line()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    args = p.parse_args()
    run(args.out, args.max_grad_norm)


if __name__ == "__main__":
    main()
