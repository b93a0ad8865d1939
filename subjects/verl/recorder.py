"""The harness's diagnosis files from inside verl 0.6/0.7's SFT trainer, through ``parity.record``.

Loaded ONLY through verl's own hook, after the CPU shim (``subjects.verl.run_sft`` sets both):
``VERL_USE_EXTERNAL_MODULES=subjects.verl.cpu_shim,subjects.verl.recorder``, the repository root
on ``PYTHONPATH`` (``parity.record`` needs only torch and the standard library) and
``PARITY_VERL_RECORD=OUT``. It edits no verl file: it wraps methods at import time
(``subjects.verl.hooks``) and writes into OUT, next to verl's own ``console.log``:

- ``ranks/rank{r}.jsonl`` (every rank): per step, the digest of the micro-batches the rank's
  engine trained on (``train``) and evaluated (``val``), and the rank's own copy of the reduced
  metrics verl logs on rank 0 (``train/loss``, ``train/grad_norm``, ``train/lr``, the token
  counters, ``train/mfu``; ``val/loss`` at validation steps);
- ``fingerprints.jsonl`` (rank 0), at ``PARITY_VERL_FINGERPRINT_STEPS`` ("2,4,6", "all"; none by
  default): a hash of every full parameter before the step's update and of its pre-clip gradient;
- ``manifest.json`` (rank 0): the environment, verl's version and the trainer's arguments.

No ``metrics.jsonl``: the metrics source stays verl's own log, read as its users read it. Where
it hooks (the same code in 0.6.1 and 0.7.0):

- ``FSDPEngineWithLMHead.forward_step(micro_batch, ..., forward_only)``: each micro-batch as the
  engine runs it (after verl's dynamic batching), folded into the digest: ``input_ids``,
  ``position_ids`` and ``loss_mask`` (jagged: values and offsets); ``forward_only`` is validation.
- the outermost ``train_batch`` the trainer calls, one per step (0.6.1: ``BaseEngine.train_batch``;
  0.7.0: ``TrainingWorker.train_batch``, which calls the engine's): it counts the steps and keeps
  the metrics dict it returns, the very dict ``fit`` then fills in place on every rank with the
  all-reduced loss, grad_norm, lr and token counters and hands to its logger on rank 0.
- ``FSDPEngine.optimizer_step``: gradients are reduced and not yet clipped, parameters not yet
  updated: the fingerprint, at the chosen steps (every rank takes part: the shards are gathered).
- ``torch.distributed.barrier`` as called from ``fit`` right after validation, on every rank:
  ``fit``'s local ``val_loss`` is all-reduced by then; its value is the rank's ``val/loss``. The
  step's record is written there at a validation step, else when the next step starts.
- ``verl.utils.distributed.destroy_global_process_group`` (the trainer's ``run_sft`` calls it
  once ``fit`` returned): the end records. A run that raised has none and reads as incomplete.

Steps are counted from 1 (``subjects.verl.run_sft`` disables resuming).
``PARITY_VERL_PLANT=repeat-batch@K`` plants a data-order bug for tests: at step K every rank's
engine trains on its batch of step K-1 again (verl's own log still counts step K's real batch).
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import torch

from subjects.verl.hooks import after_import
from subjects.verl.plant import PLANT, plant

OUT = "PARITY_VERL_RECORD"
FINGERPRINT_STEPS = "PARITY_VERL_FINGERPRINT_STEPS"
DIGESTED = ("input_ids", "position_ids", "loss_mask")  # in this order, None where absent
_TAG = "[subjects.verl.recorder]"


class _State:
    def __init__(self) -> None:
        self.rec = None  # parity.record.Recorder, made on first use (the process group is up)
        self.step = 0  # the step in progress (outermost train_batch calls so far)
        self.logged = 0  # the last step written
        self.metrics: dict | None = None  # the dict fit fills for self.step
        self.val_loss: float | None = None
        self.depth = 0  # nesting of train_batch (0.7.0's worker calls the engine's)
        self.previous = None  # the data of the previous step (for the plant)


_state = _State()
_HOOKS: list[str] = []


def hooks() -> list[str]:
    """The methods wrapped in this process, in the order they were wrapped."""
    return list(_HOOKS)


def _say(what: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(f"{_TAG} {what}", file=sys.stderr, flush=True)


def _wrap(owner, name: str, make) -> None:
    original = getattr(owner, name)
    if getattr(original, "_parity_recorder", False):
        return
    wrapper = functools.wraps(original)(make(original))
    wrapper._parity_recorder = True
    setattr(owner, name, wrapper)
    _HOOKS.append(f"{getattr(owner, '__name__', owner)}.{name}")


def _recorder():
    if _state.rec is None:
        import verl

        from parity.record import Recorder

        out = Path(os.environ[OUT])
        steps = os.environ.get(FINGERPRINT_STEPS, "")
        _state.rec = Recorder(out, fingerprint_steps=steps, metrics=False)
        _state.rec.manifest(
            {"argv": sys.argv[1:]},
            verl=verl.__version__,
            recorder={"fingerprint_steps": steps, "plant": os.environ.get(PLANT) or None},
        )
    return _state.rec


# -- what each micro-batch is ----------------------------------------------------------------


def _flat(t) -> list:
    """A tensor as plain tensors: a jagged one as its values and offsets."""
    if t is None:
        return [None]
    if getattr(t, "is_nested", False):
        return [t.values(), t.offsets()]
    return [t]


def _digest(micro_batch, kind: str) -> None:
    tensors = {k: micro_batch.get(k, None) for k in DIGESTED}
    flat = [x for k in DIGESTED for x in _flat(tensors[k])]
    ids, mask = flat[0], tensors["loss_mask"]
    tokens = ids.numel() if ids is not None else 0
    loss_tokens = None
    if mask is not None:
        loss_tokens = int((mask.values() if mask.is_nested else mask).sum())
    _recorder().batch(*flat, kind=kind, tokens=tokens, loss_tokens=loss_tokens)


def _forward_step(original):
    def forward_step(self, micro_batch, *args, **kwargs):
        forward_only = kwargs.get("forward_only", args[1] if len(args) > 1 else False)
        _digest(micro_batch, "val" if forward_only else "train")
        return original(self, micro_batch, *args, **kwargs)

    return forward_step


def _optimizer_step(original):
    def optimizer_step(self, *args, **kwargs):
        rec = _recorder()
        if rec.wants_fingerprint(_state.step):
            rec.fingerprint(_state.step, self.module)
        return original(self, *args, **kwargs)

    return optimizer_step


# -- the steps and their metrics -------------------------------------------------------------


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _flush() -> None:
    """Write the step in progress (once): the metrics fit filled, val/loss, the digests."""
    if _state.step <= _state.logged:
        return
    values = {k: v for k, v in (_state.metrics or {}).items() if _number(v)}
    if _state.val_loss is not None:
        values["val/loss"] = _state.val_loss
    _recorder().log(_state.step, values)
    _state.logged, _state.val_loss = _state.step, None


def _metrics_of(output) -> dict | None:
    if output is None:
        return None
    if isinstance(output, dict):
        return output.get("metrics")
    from verl.utils import tensordict_utils as tu  # 0.7.0's worker returns a TensorDict

    return tu.get(output, "metrics")


def _train_batch(original):
    def train_batch(self, *args, **kwargs):
        if _state.depth:  # the engine's, inside 0.7.0's worker
            return original(self, *args, **kwargs)
        _flush()
        _state.step += 1
        args, kwargs = _planted(args, kwargs)
        _state.depth += 1
        try:
            output = original(self, *args, **kwargs)
        finally:
            _state.depth -= 1
        _state.metrics = _metrics_of(output)
        return output

    return train_batch


def _planted(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    planted = plant()
    if planted is None:
        return args, kwargs
    data = kwargs["data"] if "data" in kwargs else args[0]
    previous, _state.previous = _state.previous, data
    if _state.step != planted or previous is None:
        return args, kwargs
    _say(f"plant: step {_state.step} trains on step {_state.step - 1}'s batch again")
    if "data" in kwargs:
        return args, {**kwargs, "data": previous}
    return (previous, *args[1:]), kwargs


def _is_fit_after_validation(frame) -> bool:
    code = frame.f_code
    return (
        code.co_name == "fit"
        and code.co_filename.replace(os.sep, "/").endswith("verl/trainer/sft_trainer.py")
        and "val_loss" in frame.f_locals
    )


def _barrier(original):
    def barrier(*args, **kwargs):
        frame = sys._getframe(1)
        if _state.rec is not None and _is_fit_after_validation(frame):
            value = frame.f_locals["val_loss"]
            _state.val_loss = float(value.item() if hasattr(value, "item") else value)
            _flush()
        del frame
        return original(*args, **kwargs)

    return barrier


def _destroy(original):
    def destroy_global_process_group(*args, **kwargs):
        if _state.rec is not None:
            _flush()
            _state.rec.finish()
        return original(*args, **kwargs)

    return destroy_global_process_group


# -- install ---------------------------------------------------------------------------------


def _hook_engine(module) -> None:
    _wrap(module.FSDPEngineWithLMHead, "forward_step", _forward_step)
    _wrap(module.FSDPEngine, "optimizer_step", _optimizer_step)


def _hook_worker(module) -> None:
    if hasattr(module, "TrainingWorker"):  # 0.7.0
        _wrap(module.TrainingWorker, "train_batch", _train_batch)


def install() -> None:
    if not os.environ.get(OUT):
        _say(f"{OUT} not set: nothing recorded")
        return
    plant()  # a bad value fails here, before anything runs
    after_import(
        "verl.workers.engine.base", lambda m: _wrap(m.BaseEngine, "train_batch", _train_batch)
    )
    after_import("verl.workers.engine.fsdp.transformer_impl", _hook_engine)
    after_import("verl.workers.engine_workers", _hook_worker)
    after_import(
        "verl.utils.distributed",
        lambda m: _wrap(m, "destroy_global_process_group", _destroy),
    )
    _wrap(torch.distributed, "barrier", _barrier)
    _say(
        f"recording into {os.environ[OUT]} (fingerprint steps: "
        f"{os.environ.get(FINGERPRINT_STEPS) or 'none'}; plant: {os.environ.get(PLANT) or 'none'})"
    )


install()
