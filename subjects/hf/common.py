"""What the HF Trainer and the TRL SFTTrainer subjects share: options, the GA-bug mutant, and a
recorder that writes the harness's diagnosis files next to the Trainer's own output.

Imports only torch, transformers and the standard library: the TRL subject runs it in its own
venv, where neither `parity` nor `worker` is installed.

The recorder (``Recorder`` mixin + ``RecorderCallback``) writes, per rank, ``ranks/rank{r}.jsonl``
(the rank's own logged metrics and a digest of the micro-batches it trained on that step, the
format ``parity.diagnose`` reads) and, at ``--fingerprint-steps``, ``fingerprints.jsonl`` (rank 0:
a hash of every parameter before the step's update and of every pre-clip gradient). With
``--dump-grads-at K`` rank 0 also saves the reduced pre-clip gradients of step K
(``grads-step{K}.safetensors``), for per-tensor comparisons such as the TRL GA-gap analysis.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path

import torch
from transformers import TrainerCallback

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "fixtures"
DIGEST_SIZE = 8  # as worker/fingerprint.py: 16 hex characters
MUTANTS = {
    "ga-bug": "the pre-fix gradient-accumulation loss: each micro-batch's loss is its own token "
    "mean, divided by the GA steps (and averaged over ranks by DDP), instead of the sum over the "
    "whole accumulated global batch divided by its token count",
}
# Trainer's end-of-training summary record has train_loss; wall-clock figures (train_runtime,
# *_per_second) ride along on every step's record: neither goes into a rank record, since clocks
# differ between ranks.
_SUMMARY_KEY = "train_loss"
_WALL_CLOCK = ("runtime", "per_second")


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
    p.add_argument("--no-recorder", action="store_true", help="write no ranks/ digests")
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


def _update(h, t: torch.Tensor | None) -> None:
    if t is None:
        h.update(b"none;")
        return
    t = t.detach().cpu().contiguous()
    h.update(f"{tuple(t.shape)}:{t.dtype};".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())


def tensor_hash(t: torch.Tensor | None) -> str | None:
    if t is None:
        return None
    h = hashlib.blake2b(digest_size=DIGEST_SIZE)
    _update(h, t)
    return h.hexdigest()


def parse_steps(text: str, total: int) -> set[int]:
    if not text:
        return set()
    if text == "all":
        return set(range(1, total + 1))
    return {int(s) for s in text.split(",") if s.strip()}


class Recorder:
    """Mixin for a Trainer subclass (put it first in the bases): digests every micro-batch a rank
    trains on, and at chosen steps hashes or saves the reduced pre-clip gradients.

    Why a training_step override: it is the one Trainer hook that sees each micro-batch, and
    after the step's last micro-batch (``accelerator.sync_gradients``) DDP has reduced the
    gradients and they are not clipped yet.
    """

    recorder_dir: Path | None = None
    fingerprint_steps: set[int] = set()
    dump_grads_at: int | None = None
    mutant: str | None = None

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.recorder_dir is not None:
            self._digest_batch(inputs)
        loss = super().training_step(model, inputs, num_items_in_batch)
        step = self.state.global_step + 1  # the optimizer step this micro-batch belongs to
        if self.accelerator.sync_gradients and self.args.process_index == 0:
            if step in self.fingerprint_steps:
                self._fingerprint(step)
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

    # --- recording -----------------------------------------------------------------------------

    def _digest_batch(self, inputs) -> None:
        d = getattr(self, "_digest", None)
        if d is None:
            d = self._digest = {"h": hashlib.blake2b(digest_size=DIGEST_SIZE), "mb": 0, "tok": 0}
        keys = ("input_ids", "labels", "attention_mask", "position_ids", "completion_mask")
        for key in keys:
            _update(d["h"], inputs.get(key))
        d["mb"] += 1
        mask = inputs.get("attention_mask")
        d["tok"] += int(mask.sum()) if mask is not None else int(inputs["input_ids"].numel())
        labels = inputs.get("labels")
        d["loss_tok"] = d.get("loss_tok", 0) + (
            int((labels[..., 1:] != -100).sum()) if labels is not None else 0
        )

    def take_digest(self) -> dict:
        d = getattr(self, "_digest", None)
        self._digest = None
        if d is None:
            return {}
        return {
            "train": {
                "hash": d["h"].hexdigest(),
                "micro_batches": d["mb"],
                "tokens": d["tok"],
                "loss_tokens": d.get("loss_tok", 0),
            }
        }

    def _named(self):
        model = self.accelerator.unwrap_model(self.model)
        return list(model.named_parameters())

    def _fingerprint(self, step: int) -> None:
        named = self._named()
        record = {
            "step": step,
            "params": {n: tensor_hash(p) for n, p in named},
            "grads": {n: tensor_hash(p.grad) for n, p in named},
        }
        assert self.recorder_dir is not None
        with open(self.recorder_dir / "fingerprints.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def _dump_grads(self, step: int) -> None:
        from safetensors.torch import save_file

        grads = {n: p.grad.detach().clone() for n, p in self._named() if p.grad is not None}
        out = Path(self.args.output_dir) / f"grads-step{step}.safetensors"
        save_file(grads, str(out), metadata={"order": json.dumps([n for n, _ in self._named()])})


class RecorderCallback(TrainerCallback):
    """Writes ranks/rank{r}.jsonl: each logged training step's metrics as this rank logged them
    (Trainer reduces loss and grad_norm over ranks, so they must be rank 0's bit for bit) with
    the digest of the micro-batches it ran, and an end record when training ends."""

    def __init__(self, trainer: Recorder, out: Path):
        self.trainer = trainer
        rank = int(os.environ.get("RANK", "0"))
        (out / "ranks").mkdir(parents=True, exist_ok=True)
        self.path = out / "ranks" / f"rank{rank}.jsonl"
        self.path.write_text("")

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if "loss" not in logs or _SUMMARY_KEY in logs:
            return
        metrics = {
            k: float(v)
            for k, v in logs.items()
            if isinstance(v, int | float)
            and not isinstance(v, bool)
            and not any(w in k for w in _WALL_CLOCK)
        }
        record = {
            "step": state.global_step,
            **metrics,
            "_meta": {"data": self.trainer.take_digest()},
        }
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def on_train_end(self, args, state, control, **kwargs):
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"event": "end"}) + "\n")


def install_recorder(trainer: Recorder, args: argparse.Namespace) -> None:
    trainer.mutant = args.mutant
    trainer.fingerprint_steps = parse_steps(args.fingerprint_steps, args.steps)
    trainer.dump_grads_at = args.dump_grads_at
    if not args.no_recorder:
        trainer.recorder_dir = args.out
        trainer.add_callback(RecorderCallback(trainer, args.out))
    elif trainer.fingerprint_steps:
        trainer.recorder_dir = args.out


def finish(trainer, args: argparse.Namespace) -> None:
    """trainer_state.json in the output dir (Trainer writes it only into checkpoints otherwise)
    and manifest.json, both on rank 0. The manifest carries the environment keys a golden is
    fingerprinted by (parity/golden.py), from worker.metrics_log.environment (stdlib only, so
    it imports from this checkout in the TRL venv too)."""
    import sys

    trainer.save_state()
    if not trainer.is_world_process_zero():
        return
    from worker.metrics_log import environment

    env = environment()
    try:
        import trl

        env["trl"] = trl.__version__
    except ImportError:
        pass
    manifest = {
        "subject": Path(sys.argv[0]).name,
        "argv": sys.argv[1:],
        "mutant": args.mutant,
        "environment": env,
        "backend": "gloo",
        "device": "cpu",
        "world_size": trainer.args.world_size,
        "determinism": {"full_determinism": True, "num_threads": torch.get_num_threads()},
    }
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")


def exit_cleanly() -> None:
    """Barrier, destroy the process group, exit without interpreter teardown.

    Why: left to the interpreter's teardown, gloo aborts a rank ("terminate called without an
    active exception", SIGABRT) in about one 2-rank run of three here; worker/entry.py and
    worker/distributed.py end their jobs the same way.
    """
    import sys

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
