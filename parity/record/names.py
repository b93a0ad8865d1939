"""Metric names as the producing stack's own loggers give them, shared by the recorder's HF
callback and the trainer_state.json reader, so one HF run read from any of its outputs
compares name for name."""

from __future__ import annotations

# the key that makes a Trainer log its end-of-training summary (train_runtime, *_per_second,
# total_flos, epoch ride along): the callback joins it to the last step, the reader keeps it
HF_SUMMARY_KEY = "train_loss"


def hf_metric_name(key: str) -> str:
    """The name HF's TensorBoard and W&B callbacks give a logged key (`rewrite_logs` in
    transformers/integrations/integration_utils.py): `eval_x` is `eval/x`, `test_x` is
    `test/x`, anything else `train/x`."""
    if key.startswith("eval_"):
        return "eval/" + key[5:]
    if key.startswith("test_"):
        return "test/" + key[5:]
    return "train/" + key
