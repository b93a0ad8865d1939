"""The recorder any training loop calls to write the run folder the harness reads.

    from parity.record import record_run

    with record_run("runs/a", config=vars(args), fingerprint_steps="1,5") as rec:
        for step, (x, y) in enumerate(batches, 1):
            rec.batch(x, y)                        # what this rank trains on
            loss = loss_fn(model(x), y)
            loss.backward()
            rec.fingerprint(step, model)           # pre-clip gradients, at steps 1 and 5
            opt.step()
            opt.zero_grad()
            rec.log(step, {"train/loss": loss.item()})

It writes metrics.jsonl (exact floats, the end record last), manifest.json (the environment
golden baselines are keyed on), ranks/rank{r}.jsonl (batch digests and each rank's own metrics)
and fingerprints.jsonl; `with trace_ops(out, step, model):` around one step writes ops/ (every
op's output hash, parity.record.optrace): what `parity compare`, `report`, goldens, the noise
floor and `parity.judge.diagnose` read. `parity.record.hf.ParityCallback` does the same for HF's
Trainer and TRL's trainers, `parity.record.lightning.ParityLogger` for Lightning and
`parity.record.accelerate.ParityTracker` for accelerate's `Accelerator(log_with=...)`.

The bottom layer: it imports only torch and the standard library (nothing from the rest of
`parity`, nothing from `worker`), so a foreign trainer's environment needs nothing else.
"""

from __future__ import annotations

# lazy (PEP 562): the harness's own modules import parity.record.files without torch. What a
# training loop calls; the rest (the environment, atomic writes) is in the submodules.
_HOMES = {
    "DataDigest": "digest",
    "model_fingerprint": "digest",
    "tensor_hash": "digest",
    "OpTracer": "optrace",
    "trace_ops": "optrace",
    "Recorder": "recorder",
    "record_run": "recorder",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'parity.record' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"parity.record.{home}"), name)


def __dir__() -> list[str]:
    return sorted(__all__)
