"""Both sides of a pair in one torchrun launch: half the start-up, the same bits.

Each rank runs the job modules one after the other, calling each module's `train(argv)` (the
function its `__main__` hands to the lifecycle), and resets the process between them as a fresh
launch would find it:

    torchrun ... -m parity.inprocess [--mutants A,B] [--timing FILE] \\
        -m worker.sft --trainer legacy --out runs/a --then -m worker.sft --trainer worker ...

Reset between sides: the models of the side before are freed while the process group still exists
(the group is kept and reused), modules of the job's packages imported by the side before are
dropped so the next side imports them fresh (no module-level cache survives), and os.environ,
sys.argv, the RNG states and torch's global flags are restored to what they were before the first
side. The job build re-applies determinism itself (worker.determinism.set_determinism).

Mutants (monkeypatches) cannot be taken back: in-process mode accepts them only when both sides
inject the same list, re-applied to the fresh modules before each side; `refusal` says why not.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib
import json
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from parity.runs import Run
    from parity.spec import JobSpec, PairSpec

SEPARATOR = "--then"
FOLDER = "in-process"  # the launch's own folder in a pair folder: launcher.log, logs/, timing


# --- harness side ---------------------------------------------------------------------------------


def refusal(spec_a: JobSpec, spec_b: JobSpec) -> str | None:
    """Why these two jobs cannot share one launch (one line), or None when they can."""
    for name in ("world_size", "nnodes", "torchrun_args"):
        va, vb = getattr(spec_a, name), getattr(spec_b, name)
        if va != vb:
            return f"in-process mode needs the same {name} on both sides ({va!r} vs {vb!r})"
    if spec_a.nnodes > 1:
        return f"in-process mode runs on one node, not {spec_a.nnodes}"
    if spec_a.inject != spec_b.inject:
        return (
            f"in-process mode needs the same mutants on both sides ({spec_a.inject} vs "
            f"{spec_b.inject}): a monkeypatch cannot be undone in one process"
        )
    for label, spec in (("a", spec_a), ("b", spec_b)):
        args = _job_args(spec, Path("{out}"))
        if len(args) < 2 or args[0] != "-m":
            return f"in-process mode runs job modules (-m MODULE); side {label} runs a script"
    return None


def _job_args(spec: JobSpec, out: Path) -> list[str]:
    """The side's module args without the parity.inject wrapper (mutants go to the runner)."""
    return dataclasses.replace(spec, inject=[]).to_args(out)


def command(specs: Sequence[JobSpec], outs: Sequence[Path], timing: Path) -> list[str]:
    """Module args for torchrun that run every spec, in order, in one launch."""
    args = ["-m", "parity.inprocess", "--timing", str(timing)]
    if specs[0].inject:
        args += ["--mutants", ",".join(specs[0].inject)]
    for i, (spec, out) in enumerate(zip(specs, outs, strict=True)):
        args += ([SEPARATOR] if i else []) + _job_args(spec, out)
    return args


def run_pair_in_process(
    pair: PairSpec, out: Path, *, allow_teardown_failure: bool = False
) -> tuple[Run, Run]:
    """Run both sides in one launch; raise SpecError (refusal) or LaunchError (it failed).

    Writes the same a/ and b/ run folders as two launches, plus a launcher.log in each whose
    first line is the separate launch that reproduces that side alone. A launch that fails only
    at teardown (both sides' metrics complete) is returned with allow_teardown_failure, as
    run_job does.
    """
    import shlex
    import time

    from parity.launch import LaunchError, launch
    from parity.readers import read_metrics
    from parity.runs import Progress, Run, mark_teardown
    from parity.spec import SpecError

    spec_a, spec_b = pair.sides()
    reason = refusal(spec_a, spec_b)
    if reason:
        raise SpecError(reason)
    out = Path(out).resolve()
    dirs = [out / "a", out / "b"]
    here = out / FOLDER
    for d in (*dirs, here):
        d.mkdir(parents=True, exist_ok=True)
    timing = here / "timing.json"
    timing.unlink(missing_ok=True)
    progress = Progress("B (after A, in-process)", spec_b.steps, dirs[1] / "metrics.jsonl")
    since = time.time()
    try:
        result = launch(
            command([spec_a, spec_b], dirs, timing),
            nproc=spec_a.nproc_per_node,
            run_dir=here,
            timeout_s=spec_a.timeout_s + spec_b.timeout_s,
            torchrun_args=spec_a.torchrun_args,
            on_tick=progress.tick,
        )
    finally:
        progress.close()
    frames = [None, None]
    if not result.ok:
        frames = [mark_teardown(result, d / "metrics.jsonl", since) for d in dirs]
        if not allow_teardown_failure or any(f is None for f in frames):
            raise LaunchError(result)
    split = _split_seconds(timing, result.duration_s)
    runs = []
    for spec, d, seconds, frame in zip((spec_a, spec_b), dirs, split, frames, strict=True):
        alone = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        alone += ["--nproc-per-node", str(spec.nproc_per_node), *spec.to_args(d)]
        note = f"# ran in-process with the other side in one launch: {here / 'launcher.log'}\n"
        _write_text(d / "launcher.log", f"# {shlex.join(alone)}\n{note}")
        side = dataclasses.replace(result, duration_s=seconds)
        metrics = frame if frame is not None else read_metrics(d)
        runs.append(Run(spec, d, side, metrics, in_process=True))
    return runs[0], runs[1]


def _split_seconds(timing: Path, total: float) -> tuple[float, float]:
    """The launch's wall time as (A with the start-up, B): what each side added to it."""
    try:
        sides = json.loads(timing.read_text())["sides"]
        b = float(sides[1]["seconds"])
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return total / 2, total / 2
    return max(total - b, 0.0), b


def _write_text(path: Path, text: str) -> None:
    from parity.files import write_text_atomic

    write_text_atomic(path, text)


# --- rank side ------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Baseline:
    """Process-wide state a job may change, as it was before the first side."""

    environ: dict[str, str]
    argv: list[str]
    python_rng: Any
    numpy_rng: Any
    torch_rng: Any
    torch_flags: dict[str, Any]

    @classmethod
    def take(cls) -> _Baseline:
        import numpy as np
        import torch

        return cls(
            dict(os.environ),
            list(sys.argv),
            random.getstate(),
            np.random.get_state(),
            torch.get_rng_state(),
            _torch_flags(),
        )

    def restore(self) -> None:
        import numpy as np
        import torch

        for key in set(os.environ) - set(self.environ):
            del os.environ[key]
        os.environ.update(self.environ)
        sys.argv[:] = self.argv
        random.setstate(self.python_rng)
        np.random.set_state(self.numpy_rng)
        torch.set_rng_state(self.torch_rng)
        _set_torch_flags(self.torch_flags)
        if "torch._dynamo" in sys.modules:
            torch._dynamo.reset()  # compiled graphs hold guards on the freed modules
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


def _torch_flags() -> dict[str, Any]:
    import torch

    return {
        "default_dtype": torch.get_default_dtype(),
        "num_threads": torch.get_num_threads(),
        "grad_enabled": torch.is_grad_enabled(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "anomaly": torch.is_anomaly_enabled(),
        "matmul_precision": torch.get_float32_matmul_precision(),
        "cuda_matmul_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_tf32": torch.backends.cudnn.allow_tf32,
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
    }


def _set_torch_flags(flags: dict[str, Any]) -> None:
    import torch

    torch.set_default_dtype(flags["default_dtype"])
    if torch.get_num_threads() != flags["num_threads"]:
        torch.set_num_threads(flags["num_threads"])
    torch.set_grad_enabled(flags["grad_enabled"])
    torch.use_deterministic_algorithms(
        flags["deterministic"], warn_only=flags["deterministic_warn_only"]
    )
    torch.autograd.set_detect_anomaly(flags["anomaly"])
    torch.set_float32_matmul_precision(flags["matmul_precision"])  # before the tf32 flags
    torch.backends.cuda.matmul.allow_tf32 = flags["cuda_matmul_tf32"]
    torch.backends.cudnn.allow_tf32 = flags["cudnn_tf32"]
    torch.backends.cudnn.deterministic = flags["cudnn_deterministic"]
    torch.backends.cudnn.benchmark = flags["cudnn_benchmark"]


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[tuple[str, list[str]]]]:
    usage = (
        "usage: python -m parity.inprocess [--mutants A,B] [--catalogue M] [--timing FILE] "
        f"-m MODULE ARGS... {SEPARATOR} -m MODULE ARGS..."
    )
    if "-m" not in argv:
        raise SystemExit(usage)
    split = argv.index("-m")
    parser = argparse.ArgumentParser(prog="python -m parity.inprocess", usage=usage)
    parser.add_argument("--mutants", default="")
    parser.add_argument("--catalogue", default="worker.mutants")
    parser.add_argument("--timing", type=Path, default=None)
    opts = parser.parse_args(argv[:split])
    sides: list[tuple[str, list[str]]] = []
    rest = argv[split:]
    while rest:
        end = rest.index(SEPARATOR) if SEPARATOR in rest else len(rest)
        side, rest = rest[:end], rest[end + 1 :]
        if len(side) < 2 or side[0] != "-m":
            raise SystemExit(f"error: each side must be -m MODULE ARGS...; got {side[:2]}")
        sides.append((side[1], side[2:]))
    return opts, sides


def _train_function(module: str) -> tuple[Callable[[list[str]], Any], str]:
    mod = importlib.import_module(module)
    train = getattr(mod, "train", None)
    if not callable(train):
        raise SystemExit(f"error: in-process mode needs {module}.train(argv); run it separately")
    return train, getattr(mod, "__file__", None) or module


def _purge(packages: set[str], keep: set[str]) -> None:
    """Drop the job packages' modules imported since `keep`, so the next side imports them anew."""
    for name in [n for n in sys.modules if n not in keep]:
        if name.partition(".")[0] in packages:
            del sys.modules[name]
    importlib.invalidate_caches()


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _run(argv: list[str]) -> int:
    from parity.inject import apply_mutants

    opts, sides = _parse(argv)
    mutants = [n for n in opts.mutants.split(",") if n]
    packages = {m.partition(".")[0] for m, _ in sides}
    if mutants:
        packages.add(opts.catalogue.partition(".")[0])
    baseline = _Baseline.take()
    keep = set(sys.modules)
    timings = []
    for i, (module, args) in enumerate(sides):
        if i:
            _purge(packages, keep)
            baseline.restore()
        start = time.monotonic()
        if mutants:
            apply_mutants(mutants, opts.catalogue)
        train, file = _train_function(module)
        sys.argv[:] = [file, *args]  # what runpy gives a `-m MODULE` run
        train(args)
        del train
        gc.collect()  # free this side's models while the process group exists
        _barrier()
        timings.append({"module": module, "args": args, "seconds": time.monotonic() - start})
    if opts.timing is not None and int(os.environ.get("RANK", "0")) == 0:
        from parity.files import write_json_atomic

        write_json_atomic(opts.timing, {"sides": timings})
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # a bare destroy aborts some multi-rank runs on CPU at exit
        dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> NoReturn:
    """Run every side as a torchrun rank, then exit without interpreter teardown (as a job does)."""
    from torch.distributed.elastic.multiprocessing.errors import record

    code = record(_run)(list(sys.argv[1:] if argv is None else argv))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


if __name__ == "__main__":
    main()
