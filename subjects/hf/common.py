"""What the HF Trainer and the TRL SFTTrainer subjects share: options, the GA-bug mutant, and
the harness's recorder (`parity.record.hf.ParityCallback`) next to the Trainer's own output.

Imports torch, transformers, the standard library and `parity.record` (which needs only torch):
the TRL subject runs it in its own venv, where `parity` is not installed but this checkout is on
the path.

The recorder writes, per rank, ``ranks/rank{r}.jsonl`` (the rank's own logged metrics and a
digest of the micro-batches its model ran that step, the format ``parity.judge.diagnose`` reads), at
``--fingerprint-steps`` ``fingerprints.jsonl`` (rank 0: a hash of every parameter before the
step's update and of every pre-clip gradient) and ``manifest.json`` (rank 0: the environment
golden baselines are keyed on). The metrics stay Trainer's own ``trainer_state.json``: the
recorder writes no metrics.jsonl here, so the harness reads these subjects as shipped. With
``--dump-grads-at K`` rank 0 also saves the reduced pre-clip gradients of step K
(``grads-step{K}.safetensors``), for per-tensor comparisons such as the TRL GA-gap analysis.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "fixtures"
MUTANTS = {
    "ga-bug": "the pre-fix gradient-accumulation loss: each micro-batch's loss is its own token "
    "mean, divided by the GA steps (and averaged over ranks by DDP), instead of the sum over the "
    "whole accumulated global batch divided by its token count",
}


def base_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, allow_abbrev=False)
    p.add_argument("--out", type=Path, required=True, help="output dir (Trainer's output_dir)")
    p.add_argument("--per-device-batch", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--data", type=Path, default=FIXTURES / "charcount")
    p.add_argument("--model", type=Path, default=FIXTURES / "tiny-qwen2")
    p.add_argument("--tokenizer", type=Path, default=FIXTURES / "tokenizer")
    p.add_argument("--report-to", choices=("none", "tensorboard"), default="none")
    p.add_argument("--mutant", choices=sorted(MUTANTS), default=None)
    p.add_argument(
        "--fingerprint-steps", default="", help="e.g. 1,5 or all: hash params and grads there"
    )
    p.add_argument("--dump-grads-at", type=int, default=None, help="save step K's grads (rank 0)")
    p.add_argument(
        "--no-recorder", action="store_true", help="write no ranks/, fingerprints or manifest"
    )
    p.add_argument(
        "--tokens-seen",
        action="store_true",
        help="log num_input_tokens_seen (non-padding); transformers 5 then also puts "
        "train_runtime and train_tokens_per_second on every step's log row",
    )
    return p


def common_args(args: argparse.Namespace) -> dict:
    """TrainingArguments shared by both subjects: the settings that make Trainer bitwise
    reproducible on CPU under torchrun (gloo, full determinism, one log record per step).
    TensorBoard events go to OUT/tb (transformers 5 has no logging_dir: it reads this variable)."""
    if args.report_to == "tensorboard":
        os.environ["TENSORBOARD_LOGGING_DIR"] = str(args.out / "tb")
    return dict(
        output_dir=str(args.out),
        per_device_train_batch_size=args.per_device_batch,
        gradient_accumulation_steps=args.grad_accum,
        max_steps=args.steps,
        learning_rate=args.lr,
        lr_scheduler_type="linear",
        warmup_steps=0,
        weight_decay=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[] if args.report_to == "none" else [args.report_to],
        use_cpu=True,
        ddp_backend="gloo",
        full_determinism=True,
        seed=args.seed,
        data_seed=args.seed,
        dataloader_num_workers=0,
        disable_tqdm=True,
        include_num_input_tokens_seen="non_padding" if args.tokens_seen else "no",
    )


class Subject:
    """Mixin for a Trainer subclass (put it first in the bases): the GA-bug mutant, and at
    ``--dump-grads-at`` the reduced pre-clip gradients saved.

    Why a training_step override: after the step's last micro-batch
    (``accelerator.sync_gradients``) DDP has reduced the gradients and they are not clipped yet.
    """

    dump_grads_at: int | None = None
    mutant: str | None = None

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        step = self.state.global_step + 1  # the optimizer step this micro-batch belongs to
        if self.accelerator.sync_gradients and self.args.process_index == 0:
            if step == self.dump_grads_at:
                self._dump_grads(step)
        return loss

    # --- the GA-bug mutant ---------------------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.mutant == "ga-bug":
            # Without num_items_in_batch the model (HF) or SFTTrainer (TRL) takes the mean over
            # this micro-batch's own tokens and does not scale by the world size; with
            # loss_is_scaled_for_ga False, Trainer.training_step divides it by the GA steps.
            self.loss_is_scaled_for_ga = False
            num_items_in_batch = None
        return super().compute_loss(
            model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )

    def _dump_grads(self, step: int) -> None:
        from safetensors.torch import save_file

        named = list(self.accelerator.unwrap_model(self.model).named_parameters())
        grads = {n: p.grad.detach().clone() for n, p in named if p.grad is not None}
        out = Path(self.args.output_dir) / f"grads-step{step}.safetensors"
        save_file(grads, str(out), metadata={"order": json.dumps([n for n, _ in named])})


def install(trainer: Subject, args: argparse.Namespace) -> None:
    """The mutant and the gradient dump on the trainer, and the recorder (unless
    --no-recorder): ranks/ digests, fingerprints and the manifest, the metrics left to
    trainer_state.json. The manifest names the subject, its arguments and the mutant."""
    from parity.record.hf import ParityCallback

    trainer.mutant = args.mutant
    trainer.dump_grads_at = args.dump_grads_at
    if args.no_recorder:
        return
    subject = {"subject": Path(sys.argv[0]).name, "argv": sys.argv[1:], "mutant": args.mutant}
    ParityCallback.attach(
        trainer, args.out, fingerprint_steps=args.fingerprint_steps, metrics=False, manifest=subject
    )


def finish(trainer) -> None:
    """trainer_state.json in the output dir (Trainer writes it only into checkpoints otherwise)."""
    trainer.save_state()


def exit_cleanly() -> None:
    """Barrier, destroy the process group, exit without interpreter teardown.

    Why: left to the interpreter's teardown, gloo aborts a rank ("terminate called without an
    active exception", SIGABRT) in about one 2-rank run of three here; worker/entry.py and
    worker/distributed.py end their jobs the same way.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
