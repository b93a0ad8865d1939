"""The recorder: one way to write a run folder the harness reads, from any training loop.

    out/metrics.jsonl          rank 0: one record per logged step, then {"event": "end", ...}
    out/manifest.json          rank 0: config, environment fingerprint, device, backend, world
    out/ranks/rank{r}.jsonl    every rank: its own metrics and the digest of what it ran
    out/fingerprints.jsonl     rank 0, at chosen steps: a hash of every parameter and gradient
    out/console.log            rank 0, optional: verl-style `step:N - key:value` lines

Every record is one complete line, flushed when written; the manifest is written atomically; the
end records come last (metrics.jsonl's very last), so a run that crashed reads as incomplete.

A step may be logged in more calls than one (its train metrics, then its eval metrics): each
call adds keys the step does not have yet. metrics.jsonl and console.log get another line of
that step (the readers merge a step's records); ranks/rank{r}.jsonl and fingerprints.jsonl keep
one record a step, which parity.judge.diagnose reads, so their line of the step is rewritten merged.
A key the step already has is refused at the call (ValueError), on the rank that logs it, as is
a step logged again after a later one: the readers would refuse the run after it ended.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from parity.record.digest import DIGEST_SIZE, DataDigest, chosen_steps, model_fingerprint
from parity.record.env import (
    default_device,
    determinism_flags,
    dist_facts,
    run_manifest,
)
from parity.record.files import (
    LineLog,
    console_line,
    console_step,
    jsonl_step,
    write_json_atomic,
)
from parity.record.runfolder import (
    CONSOLE,
    FINGERPRINTS,
    METRICS,
    RANKS_DIR,
    manifest_path,
    rank_file_name,
)

END = "end"


def as_number(value: Any) -> Any:
    """A metric value as JSON can hold it exactly: a Python int or float as it is, a one-element
    tensor or numpy scalar through .item() (a float32 becomes the float64 of the same value)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    item = getattr(value, "item", None)
    return item() if callable(item) else value


def _config(config: Any) -> Any:
    if isinstance(config, argparse.Namespace):
        return vars(config)
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return dataclasses.asdict(config)
    return config


def _merged_data(a: Mapping[str, dict], b: Mapping[str, dict]) -> dict[str, dict]:
    """The digests of one step taken in two calls: kinds of one call as they are; a kind in
    both (batches of one kind run between the calls) folds the two hashes into one, in order,
    and adds the counts."""
    out = {kind: dict(d) for kind, d in a.items()}
    for kind, d in b.items():
        if kind not in out:
            out[kind] = dict(d)
            continue
        first = out[kind]
        h = hashlib.blake2b(digest_size=DIGEST_SIZE)
        h.update(f"{first.get('hash')};{d.get('hash')}".encode())
        counts = {k: first.get(k, 0) + v for k, v in d.items() if k != "hash"}
        out[kind] = {"hash": h.hexdigest(), **counts}
    return out


def _code_dir() -> Path:
    """Where the running program's code lives: the script's folder, else the working folder."""
    script = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    if script is not None and script.is_file():
        return script.resolve().parent
    return Path.cwd()


class Recorder:
    """Writes one rank's share of a run folder. Make one on every rank, then per step:

        rec.batch(input_ids, labels)        # each micro-batch this rank trains on
        rec.fingerprint(step, model)        # after backward, before clipping (chosen steps only)
        rec.log(step, {"train/loss": ...})  # the step's reduced metrics, on every rank
        rec.log(step, {"eval/loss": ...})   # more of the step's metrics (other keys), if any
    and rec.finish() at the end (or use it as a context manager: the end records are written
    when the block ends normally; after an exception the files are closed without them).

    out: the run folder. rank: this process's rank (default: torch.distributed's, else RANK).
    fingerprint_steps: "1,5,10", "all" or a list of steps at which `fingerprint` hashes.
    metrics: rank 0 writes metrics.jsonl (off when the trainer's own log is the metrics source).
    ranks: every rank writes ranks/rank{r}.jsonl. console: rank 0 also writes console.log and
    prints each line. append: add to the files a run already has (see resume_at).
    """

    def __init__(
        self,
        out: str | Path,
        *,
        rank: int | None = None,
        fingerprint_steps: str | Iterable[int] | None = None,
        metrics: bool = True,
        ranks: bool = True,
        console: bool = False,
        append: bool = False,
    ):
        self.out = Path(out)
        self.rank = dist_facts()[0] if rank is None else rank
        self.fingerprint_steps = chosen_steps(fingerprint_steps)
        self.digest = DataDigest()
        self.last_step: int | None = None
        self.finished = False
        self._pending: dict[int, dict[str, dict]] = {}  # step -> fingerprint, until logged
        self._steps: set[int] = set()  # the steps logged so far
        self._keys: set[str] = set()  # what the last step has logged
        self._rank_record: dict[str, Any] | None = None  # the last step's ranks/ record
        self._printed: dict[str, Any] | None = None  # the last fingerprints.jsonl record
        lead = self.rank == 0

        def opened(name: str, wanted: bool) -> LineLog | None:
            return LineLog(self.out / name, append) if wanted else None

        self._metrics = opened(METRICS, metrics and lead)
        self._console = opened(CONSOLE, console and lead)
        self._ranks = opened(f"{RANKS_DIR}/{rank_file_name(self.rank)}", ranks)
        self._fingerprints = opened(FINGERPRINTS, lead and bool(self.fingerprint_steps))

    # --- the manifest ---------------------------------------------------------------------------

    def manifest(
        self,
        config: Any = None,
        *,
        device: str | None = None,
        backend: str | None = None,
        world_size: int | None = None,
        determinism: Mapping[str, Any] | None = None,
        code_dir: str | Path | None = None,
        **extra: Any,
    ) -> dict[str, Any] | None:
        """Write manifest.json (rank 0; returns it, None on other ranks): the config (a dict,
        dataclass or argparse namespace), the environment golden baselines are keyed on, device,
        backend and world size (default: torch.distributed's), torch's determinism flags, the git
        revision of `code_dir` (default: the running script's folder) and any `extra` fields."""
        if self.rank != 0:
            return None
        _, world, dist_backend = dist_facts()
        backend = backend if backend is not None else dist_backend
        data = run_manifest(
            config=_config(config) if config is not None else {},
            device=device if device is not None else default_device(backend),
            backend=backend,
            world_size=world_size if world_size is not None else world,
            determinism=dict(determinism) if determinism is not None else determinism_flags(),
            code_dir=Path(code_dir) if code_dir is not None else _code_dir(),
            **extra,
        )
        write_json_atomic(manifest_path(self.out), data)
        return data

    # --- what a step ran ------------------------------------------------------------------------

    def batch(
        self,
        input_ids: torch.Tensor | None,
        *tensors: torch.Tensor | None,
        kind: str = "train",
        tokens: int | None = None,
        loss_tokens: int | None = None,
    ) -> None:
        """Fold one micro-batch this rank runs (its tensors, always in the same order) into the
        step's digest of `kind` ("train"; "val" for evaluation). tokens: default the number of
        elements of input_ids; loss_tokens: the tokens the loss counts, default all of them."""
        if tokens is None:
            tokens = input_ids.numel() if input_ids is not None else 0
        self.digest.add_tensors(kind, (input_ids, *tensors), tokens, loss_tokens)

    def wants_fingerprint(self, step: int) -> bool:
        chosen = self.fingerprint_steps
        return chosen == "all" or step in chosen

    def fingerprint(
        self,
        step: int,
        model: torch.nn.Module | Iterable[tuple[str, torch.Tensor]],
        prefix: str = "",
    ) -> None:
        """At a chosen step, hash every parameter (before this step's update) and its gradient
        (call it after backward and the gradient reduction, before clipping). Call it on every
        rank: sharded (DTensor) parameters are gathered, which all ranks must do together."""
        if not self.wants_fingerprint(step):
            return
        named = list(model.named_parameters() if isinstance(model, torch.nn.Module) else model)
        if self._fingerprints is None and not any(hasattr(p, "full_tensor") for _, p in named):
            return  # nothing to write here, and nothing to gather with the others
        self.add_fingerprint(step, model_fingerprint(named), prefix)

    def add_fingerprint(self, step: int, hashes: Mapping[str, Mapping] | None, prefix="") -> None:
        """Hashes made elsewhere ({"params": {name: hash}, "grads": {...}}), written with the
        step's record, each name under `prefix` (several models in one run: "actor.")."""
        if self._fingerprints is None or not hashes:
            return
        record = self._pending.setdefault(step, {})
        for key, table in hashes.items():
            record.setdefault(key, {}).update({prefix + n: h for n, h in table.items()})

    # --- records --------------------------------------------------------------------------------

    def log(
        self,
        step: int,
        metrics: Mapping[str, Any],
        meta: Mapping[str, Any] | None = None,
        data: Mapping[str, Any] | None = None,
    ) -> None:
        """One step's record, on every rank: rank 0's metrics.jsonl (with `meta` as `_meta`),
        this rank's own record (its metrics, the digest of what it ran since the last log, and
        meta's `epoch`), and the step's fingerprint. `data`: a digest taken elsewhere.

        A second call for the step adds keys it does not have (module doc); a key it has
        already, or a step logged again after a later one, is a ValueError, nothing written."""
        values = {k: as_number(v) for k, v in metrics.items()}
        again = step == self.last_step
        self._check(step, values, again)
        if data is None:
            data = self.digest.take()
        new = bool(values) or not again  # a second call with no metrics adds no line
        if self._metrics is not None and new:
            record: dict[str, Any] = {"step": step, **values}
            if meta:
                record["_meta"] = meta
            self._metrics.record(record)
        if self._console is not None and new:
            line = console_line(step, values)
            self._console.write(line)
            print(line, flush=True)
        if self._ranks is not None:
            self._rank_log(step, values, dict(data), meta, again)
        fingerprint = self._pending.pop(step, None)
        if fingerprint and self._fingerprints is not None:
            self._print_log(step, fingerprint)
        self._steps.add(step)
        self._keys = (self._keys if again else set()) | set(values)
        self.last_step = step

    def _check(self, step: int, values: Mapping[str, Any], again: bool) -> None:
        if again:
            twice = [k for k in values if k in self._keys]
            if twice:
                raise ValueError(f"rec.log: step {step} already logged {twice[0]!r}")
        elif step in self._steps:
            raise ValueError(
                f"rec.log: step {step} logged again after step {self.last_step}: log a step's "
                "metrics before the next step's"
            )

    def _rank_log(
        self,
        step: int,
        values: dict[str, Any],
        data: dict[str, Any],
        meta: Mapping[str, Any] | None,
        again: bool,
    ) -> None:
        """This rank's record of the step: a new line, or the step's line rewritten with this
        call's metrics and digests merged in (one record a step, as parity.judge.diagnose reads)."""
        assert self._ranks is not None
        previous = self._rank_record if again else None
        extra: dict[str, Any] = dict(previous["_meta"]) if previous else {}
        extra["data"] = _merged_data(extra.get("data", {}), data)
        if meta and "epoch" in meta:
            extra["epoch"] = meta["epoch"]
        kept = {k: v for k, v in previous.items() if k not in ("step", "_meta")} if previous else {}
        record = {"step": step, **kept, **values, "_meta": extra}
        if previous is None:
            self._ranks.record(record)
        else:
            self._ranks.replace_last(record)
        self._rank_record = record

    def _print_log(self, step: int, fingerprint: dict[str, dict]) -> None:
        """The step's fingerprint record, merged into the step's line if it has one."""
        assert self._fingerprints is not None
        previous = self._printed if self._printed and self._printed["step"] == step else None
        if previous is None:
            record = {"step": step, **fingerprint}
            self._fingerprints.record(record)
        else:
            record = {k: dict(v) if isinstance(v, dict) else v for k, v in previous.items()}
            for key, table in fingerprint.items():
                record.setdefault(key, {}).update(table)
            self._fingerprints.replace_last(record)
        self._printed = record

    def resume_at(self, step: int) -> None:
        """Drop what a resumed run will log again (records from `step` on, the end records), so
        a run resumed into its own folder (append=True) reads as one clean run."""
        for log, step_of in (
            (self._metrics, jsonl_step),
            (self._console, console_step),
            (self._ranks, jsonl_step),
            (self._fingerprints, jsonl_step),
        ):
            if log is not None:
                log.keep_before(step, step_of)
        self._steps = {s for s in self._steps if s < step}
        if self.last_step is not None and self.last_step >= step:
            self.last_step, self._keys = None, set()
        self._rank_record = self._printed = None

    def finish(self, steps: int | None = None) -> None:
        """The end records (steps: default the last logged step), metrics.jsonl's last of all,
        then close: the run is complete."""
        if self.finished:
            return
        if self._ranks is not None and not self._steps and self.digest.pending():
            # its digests are written by rec.log only: a rank that never logs loses them, and
            # the diagnosis then compares no batches at all
            print(
                f"parity.record: rank {self.rank} recorded batches but logged no step: call "
                "rec.log(step, {}) on every rank once a step to keep its batch digests",
                file=sys.stderr,
                flush=True,
            )
        end = {"event": END, "steps": steps if steps is not None else (self.last_step or 0)}
        for log in (self._ranks, self._fingerprints, self._metrics):
            if log is not None:
                log.record(end)
        self.finished = True
        self.close()

    def close(self) -> None:
        """Close the files without an end record (a run that stops here reads as incomplete)."""
        for log in (self._metrics, self._console, self._ranks, self._fingerprints):
            if log is not None:
                log.close()

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finish()
        else:
            self.close()


def record_run(
    out: str | Path,
    config: Any = None,
    *,
    rank: int | None = None,
    fingerprint_steps: str | Iterable[int] | None = None,
    console: bool = False,
    **manifest: Any,
) -> Recorder:
    """A Recorder for a new run with its manifest written (rank 0); use it in a `with` block.

        with record_run("runs/a", config=vars(args), fingerprint_steps="1,5") as rec:
            ...
    manifest: device, backend, world_size, determinism, code_dir and extra fields, as
    Recorder.manifest takes them.
    """
    rec = Recorder(out, rank=rank, fingerprint_steps=fingerprint_steps, console=console)
    try:
        rec.manifest(config, **manifest)
    except BaseException:
        rec.close()
        raise
    return rec
