"""The recorder as an HF `TrainerCallback`: HF's Trainer and TRL's trainers (which inherit it)
write the run folder the harness reads, next to their own output.

    from parity.record.hf import ParityCallback

    trainer = Trainer(model, args, train_dataset=ds)            # or trl.SFTTrainer(...)
    ParityCallback.attach(trainer, fingerprint_steps="1,5")      # or callbacks=[ParityCallback()]
    trainer.train()

What it writes into `args.output_dir` (or `out`):
- metrics.jsonl (rank 0; `metrics=False` leaves the metrics to trainer_state.json): each log
  Trainer makes, as it makes it, the values exactly as Trainer logged them, under the names HF's
  TensorBoard callback gives them (`train/loss`, `eval/loss`; parity/readers/hf.py reads
  trainer_state.json alike). A step's training log, its evaluation and, at the last step, the
  end-of-training summary (`train/train_loss`, ...) are `Recorder.log` calls of one step, which
  the readers merge into one step (the recorder's rule for a step logged in several calls). A
  key the step already has is left out when its value is the same (`epoch` is on every log)
  or when the summary repeats it (keep the step's own, as parity/readers/hf.py does); with
  another value it is refused at the call, as the reader would refuse trainer_state.json; then
  the end record, when training ends;
- manifest.json (rank 0, when training begins): TrainingArguments, the environment fingerprint,
  device, backend, world size, torch's determinism flags and Trainer's seed;
- ranks/rank{r}.jsonl: every rank's logged metrics and the digest of the micro-batches its model
  ran since the last log (a forward pre-hook on the model: input_ids, labels, attention_mask and
  position_ids; "train" with gradients, "val" in evaluation);
- fingerprints.jsonl (rank 0, at `fingerprint_steps`): every parameter before the step's update
  and its pre-clip gradient. Trainer runs no callback between the last backward and the clip
  (`on_pre_optimizer_step` comes after it), so this needs `attach`, which hooks the trainer's
  `accelerator.clip_grad_norm_` (called every step, with or without clipping).
- ops/rank{r}.jsonl (every rank, with `trace_step=K`): every op of step K, from its first forward
  to the end of its optimizer step (`on_step_begin` to `on_step_end`; parity.record.optrace), for
  `parity.judge.opdiff` to name the first op that differs from another run's trace of that step.
A run resumed from a checkpoint continues its files from the checkpoint's step.

Imports transformers (when this module is imported); `parity.record` itself needs only torch.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from parity.record.digest import chosen_steps
from parity.record.env import determinism_flags, package_version
from parity.record.names import HF_SUMMARY_KEY, hf_metric_name
from parity.record.recorder import Recorder

LIBRARIES = ("accelerate", "trl", "peft", "deepspeed", "datasets")

BATCH_KEYS = ("input_ids", "labels", "attention_mask", "position_ids")


def _same(a: float, b: float) -> bool:
    """The same bits, or both NaN (a repeat of a value, not another value)."""
    return a == b and math.copysign(1.0, a) == math.copysign(1.0, b) or a != a and b != b


class ParityCallback(TrainerCallback):
    """Writes the run folder of a Trainer run (module doc). out: default args.output_dir;
    fingerprint_steps: "1,5", "all" or a list (needs `attach`); metrics: write metrics.jsonl;
    manifest: extra fields for manifest.json."""

    def __init__(
        self,
        out: str | Path | None = None,
        *,
        fingerprint_steps: str | Iterable[int] | None = None,
        metrics: bool = True,
        manifest: dict[str, Any] | None = None,
        trace_step: int = 0,
    ):
        self.out = out
        self.fingerprint_steps = fingerprint_steps
        self.metrics = metrics
        self.manifest_extra = dict(manifest or {})
        self.recorder: Recorder | None = None
        self.model: torch.nn.Module | None = None
        self._attached = False
        self._hook = None
        self._logged: tuple[int, dict[str, float]] = (-1, {})  # a step and what it has logged
        self._fingerprinted: int | None = None
        self.trace_step = trace_step
        self._trace: contextlib.ExitStack | None = None

    @classmethod
    def attach(cls, trainer, out: str | Path | None = None, **kwargs: Any) -> ParityCallback:
        """Add a ParityCallback to `trainer` and hook its gradient clip, where the fingerprints
        of the pre-clip gradients are taken. Returns the callback."""
        callback = cls(out, **kwargs)
        callback._attached = True
        trainer.add_callback(callback)
        accelerator = trainer.accelerator
        clip = accelerator.clip_grad_norm_

        def clip_grad_norm_(parameters, *args, **kw):
            parameters = list(parameters)
            callback._before_clip(trainer.state.global_step + 1)
            return clip(parameters, *args, **kw)

        accelerator.clip_grad_norm_ = clip_grad_norm_
        return callback

    # --- events ---------------------------------------------------------------------------------

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if chosen_steps(self.fingerprint_steps) and not self._attached:
            raise ValueError(
                "ParityCallback: fingerprints of the pre-clip gradients need the trainer: use "
                "ParityCallback.attach(trainer, fingerprint_steps=...)"
            )
        resumed = state.global_step > 0
        self.recorder = Recorder(
            Path(self.out if self.out is not None else args.output_dir),
            rank=args.process_index,
            fingerprint_steps=self.fingerprint_steps,
            metrics=self.metrics,
            append=resumed,
        )
        if resumed:
            self.recorder.resume_at(state.global_step + 1)
        self._logged = (-1, {})
        self.model = model
        if model is not None:
            self._hook = model.register_forward_pre_hook(self._digest, with_kwargs=True)
        libraries = {n: package_version(n) for n in LIBRARIES if n in sys.modules}
        self.recorder.manifest(
            args.to_dict(),
            device="cpu" if args.device.type == "cpu" else str(args.device),  # not "cpu:0"
            world_size=args.world_size,
            determinism={**determinism_flags(), "seed": args.seed},
            libraries=libraries,
            **self.manifest_extra,
        )

    def on_step_begin(self, args, state, control, **kwargs):
        if self.trace_step and state.global_step + 1 == self.trace_step and self._trace is None:
            from parity.record.optrace import trace_ops

            self._trace = contextlib.ExitStack()
            out = self.recorder.out if self.recorder is not None else args.output_dir
            trace = trace_ops(out, self.trace_step, self.model, rank=args.process_index)
            self._trace.enter_context(trace)

    def on_step_end(self, args, state, control, **kwargs):
        if self._trace is not None:  # after the optimizer step and zero_grad: the step is whole
            self._trace.close()
            self._trace = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.recorder is None or not logs:
            return
        step = state.global_step
        if self._logged[0] != step:
            self._logged = (step, {})
        given = self._logged[1]
        # the row Trainer.log appended to the history: `logs` itself has lost total_flos to
        # the progress callback (it pops it) by the time user callbacks see it
        history = state.log_history[-1] if state.log_history else {}
        row = history if history.get("step") == step and logs.keys() <= history.keys() else logs
        summary = HF_SUMMARY_KEY in row
        new: dict[str, float] = {}
        for key, value in row.items():
            if key == "step":
                continue
            if not isinstance(value, (int, float)):  # a bool is a number, 1.0 or 0.0, there too
                continue  # not a number: HF's TensorBoard callback drops it too
            name, value = hf_metric_name(key), float(value)
            if name in given and (summary or _same(given[name], value)):
                continue  # `epoch` again, or the summary's repeat: the step's own stays
            new[name] = value
        if new or not given:  # a step's first log writes its record even without numbers
            self.recorder.log(step, new)
        given.update(new)

    def on_train_end(self, args, state, control, **kwargs):
        if self.recorder is None:
            return
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self.recorder.finish(state.global_step)
        self.recorder = None

    # --- recording ------------------------------------------------------------------------------

    def _digest(self, module, args, kwargs) -> None:
        if self.recorder is None:
            return
        inputs = dict(kwargs)
        if args and "input_ids" not in inputs:
            inputs["input_ids"] = args[0]
        ids, labels, mask = (inputs.get(k) for k in ("input_ids", "labels", "attention_mask"))
        if mask is not None:
            tokens = int(mask.sum())
        else:
            tokens = ids.numel() if isinstance(ids, torch.Tensor) else 0
        loss_tokens = int((labels[..., 1:] != -100).sum()) if labels is not None else 0
        kind = "train" if module.training and torch.is_grad_enabled() else "val"
        tensors = [v if isinstance(v, torch.Tensor) else None for v in map(inputs.get, BATCH_KEYS)]
        self.recorder.digest.add_tensors(kind, tensors, tokens, loss_tokens)

    def _before_clip(self, step: int) -> None:
        rec, model = self.recorder, self.model
        if rec is None or model is None or not rec.wants_fingerprint(step):
            return
        if step != self._fingerprinted:  # once a step, however often the norm is taken
            self._fingerprinted = step
            rec.fingerprint(step, model)
