"""Both sides of a pair in one torchrun launch: half the start-up, the same bits.

Each rank runs the job modules one after the other, calling each module's `train(argv)` (the
function its `__main__` hands to the lifecycle), and resets the process between them as a fresh
launch would find it:

    torchrun ... -m parity.run.inprocess [--mutants A,B] [--timing FILE] \\
        -m worker.sft --trainer legacy --out runs/a --then -m worker.sft --trainer worker ...

Reset between sides (`SideRunner`): the models of the side before are freed while the process
group still exists (the group is kept and reused), modules of the job's packages imported by the
side before are dropped so the next side imports them fresh (no module-level cache survives), and
os.environ, sys.argv, the RNG states, torch's global flags and whether the garbage collector
runs are restored to what they were before the first side. The job build re-applies
determinism itself (worker.determinism.set_determinism). The same runner serves a warm pool
(parity.run.pool).

Mutants: a side written `-m parity.run.mutants --mutants A -m MODULE ...` gets them applied to its
fresh modules, and every function, method or class they replaced outside the job's packages is
put back after it (`Patches`), so the two sides may carry different mutants. `--mutants` applies
a list to every side.
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
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from parity.run.job import Run
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
    for label, spec in (("a", spec_a), ("b", spec_b)):
        if spec.env:
            return f"in-process mode shares one environment; side {label} sets env of its own"
        if not spec.distributed:
            return f"in-process mode runs distributed jobs; side {label} is distributed = false"
        args = dataclasses.replace(spec, inject=[]).to_args(Path("{out}"))
        if len(args) < 2 or args[0] != "-m":
            return f"in-process mode runs job modules (-m MODULE); side {label} runs a script"
    return None


def command(specs: Sequence[JobSpec], outs: Sequence[Path], timing: Path) -> list[str]:
    """Module args for torchrun that run every spec, in order, in one launch (a side with
    mutants keeps its parity.run.mutants wrapper: they are applied to that side only)."""
    args = ["-m", "parity.run.inprocess", "--timing", str(timing)]
    for i, (spec, out) in enumerate(zip(specs, outs, strict=True)):
        args += ([SEPARATOR] if i else []) + spec.to_args(out)
    return args


def run_pair_in_process(
    pair: PairSpec, out: Path, *, allow_teardown_failure: bool = False
) -> tuple[Run, Run]:
    """Run both sides in one launch; raise SpecError (refusal) or LaunchError (it failed).

    Writes the same a/ and b/ run folders as two launches, plus a launcher.log in each one's
    launch folder (a.launch/) whose first line is the separate launch that reproduces that side
    alone. A launch that fails only
    at teardown (both sides' metrics complete) is returned with allow_teardown_failure, as
    run_job does.
    """
    from parity.files import launch_dir
    from parity.outdir import OutDir
    from parity.run.job import Progress, Run, mark_teardown, read_output
    from parity.run.launch import LaunchError, launch
    from parity.spec import SpecError

    spec_a, spec_b = pair.sides()
    reason = refusal(spec_a, spec_b)
    if reason:
        raise SpecError(reason)
    out = Path(out).resolve()
    dirs = [out / "a", out / "b"]
    with OutDir.open(out) as held:
        for d in dirs:
            held.make_dir(d.name)
            held.make_dir(launch_dir(d).name)
        here = held.make_dir(FOLDER)
        timing = here / "timing.json"
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
                expect_world=spec_a.world_size,
            )
        except BaseException:
            progress.close(interrupted=True)
            raise
        progress.close()
    frames = [None, None]
    if not result.ok:
        frames = [mark_teardown(result, d / "metrics.jsonl", since) for d in dirs]
        if not allow_teardown_failure or any(f is None for f in frames):
            raise LaunchError(result, "in-process pair")
    split = _split_seconds(timing, result.duration_s)
    runs = []
    for spec, d, seconds, frame in zip((spec_a, spec_b), dirs, split, frames, strict=True):
        note = f"# ran in-process with the other side in one launch: {here / 'launcher.log'}\n"
        _write_text(launch_dir(d) / "launcher.log", f"{alone_line(spec, d)}\n{note}")
        side = dataclasses.replace(result, duration_s=seconds)
        metrics = frame if frame is not None else read_output(side, d, f"side {d.name}")
        runs.append(Run(spec, d, side, metrics, in_process=True))
    return runs[0], runs[1]


def alone_line(spec: JobSpec, out: Path) -> str:
    """`# torchrun ...`: the launch that reproduces this job on its own (a launcher.log's head)."""
    import shlex

    alone = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    alone += ["--nproc-per-node", str(spec.nproc_per_node), *spec.to_args(out)]
    return f"# {shlex.join(alone)}"


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
    gc_enabled: bool  # a job may turn the collector off for its start-up (worker.entry)

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
            gc.isenabled(),
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
        (gc.enable if self.gc_enabled else gc.disable)()
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
        "usage: python -m parity.run.inprocess [--mutants A,B] [--catalogue M] [--timing FILE] "
        f"-m MODULE ARGS... {SEPARATOR} -m MODULE ARGS..."
    )
    if "-m" not in argv:
        raise SystemExit(usage)
    split = argv.index("-m")
    parser = argparse.ArgumentParser(prog="python -m parity.run.inprocess", usage=usage)
    parser.add_argument("--mutants", default="")
    parser.add_argument("--catalogue", default=None)  # default: every registered catalogue
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


def _unwrap_mutants(module: str, args: list[str]) -> tuple[str, list[str], list[str], str | None]:
    """(module, args, mutants, catalogue) of a side, `-m parity.run.mutants ... -m M ARGS` unwrapped
    (catalogue None: the mutants are looked up in every registered one)."""
    if module != "parity.run.mutants":
        return module, args, [], None
    if "-m" not in args or args.index("-m") + 1 >= len(args):
        raise SystemExit(f"error: parity.run.mutants needs -m MODULE; got {args}")
    split = args.index("-m")
    parser = argparse.ArgumentParser(prog="python -m parity.run.mutants")
    parser.add_argument("--mutants", default="")
    parser.add_argument("--catalogue", default=None)
    opts = parser.parse_args(args[:split])
    mutants = [n for n in opts.mutants.split(",") if n]
    return args[split + 1], args[split + 2 :], mutants, opts.catalogue


def _catalogues_of(mutants: list[str], catalogue: str | None) -> set[str]:
    """The catalogue modules the mutants come from (an unknown one: SystemExit, as the job's)."""
    from parity.tasks import TaskError, find_mutants

    try:
        return {home for home, _ in find_mutants(mutants, catalogue).values()} if mutants else set()
    except TaskError as e:
        raise SystemExit(f"error: {e}") from None


def _is_code(value: Any) -> bool:
    """What a monkeypatch replaces: functions, methods, classes and their descriptors.

    Data (counters, registries, the process group's own state) is left alone, since jobs change
    it legitimately and putting it back would break the process group.
    """
    import functools
    import inspect

    kinds = (type, staticmethod, classmethod, property, functools.partial)
    return inspect.isroutine(value) or isinstance(value, kinds)


def _defined_in(value: Any) -> str:
    """The module that defined a function, method or class (through its descriptor)."""
    import functools

    for attr in ("__func__", "fget", "func"):  # staticmethod/classmethod, property, partial
        if isinstance(value, staticmethod | classmethod | property | functools.partial):
            value = getattr(value, attr, value)
    return str(getattr(value, "__module__", "") or "")


class Patches:
    """The code attributes of every loaded module and its classes, to undo a side's mutants.

    A mutant is a monkeypatch; the modules of the job's own packages are dropped after the side
    anyway, so this covers what a mutant replaces elsewhere (torch's DistributedSampler, for
    one). `undo(catalogue)` puts back every function, method or class that now holds code defined
    in the catalogue module, and names it. Only those: a module imported during the side may
    rightly change an older class (torch does at import), and that must stay.
    """

    def __init__(self, skip: set[str]):
        self.skip = skip
        self.modules: list[tuple[str, dict[str, Any], dict[str, Any]]] = []
        self.classes: list[tuple[type, dict[str, Any]]] = []
        with warnings.catch_warnings():  # touching deprecated module attributes warns
            warnings.simplefilter("ignore")
            for name, mod in list(sys.modules.items()):
                namespace = getattr(mod, "__dict__", None)
                if name.partition(".")[0] in skip or not isinstance(namespace, dict):
                    continue
                self.modules.append((name, namespace, self._code(namespace)))
                for value in list(namespace.values()):
                    if isinstance(value, type) and value.__module__ == name:
                        self.classes.append((value, self._code(value.__dict__)))

    @staticmethod
    def _code(namespace) -> dict[str, Any]:
        return {k: v for k, v in list(namespace.items()) if _is_code(v)}

    def undo(self, catalogue: str) -> list[str]:
        """Restore what now holds code from `catalogue`; the dotted names put back."""
        undone = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for name, namespace, before in self.modules:
                for key in self._patched(namespace, before, catalogue):
                    undone.append(f"{name}.{key}")
                    if key in before:
                        namespace[key] = before[key]
                    else:
                        del namespace[key]
            for cls, before in self.classes:
                for key in self._patched(cls.__dict__, before, catalogue):
                    undone.append(f"{cls.__module__}.{cls.__qualname__}.{key}")
                    if key in before:
                        setattr(cls, key, before[key])
                    else:
                        delattr(cls, key)
        return undone

    def _patched(self, namespace, before: dict[str, Any], catalogue: str) -> list[str]:
        now = self._code(namespace)
        return [k for k, v in now.items() if v is not before.get(k) and _defined_in(v) == catalogue]


class SideRunner:
    """Runs job sides one after another in this rank process, each as a fresh launch finds it.

    Before every side but the first: the job packages' modules are dropped and the baseline
    (environment, argv, RNG states, torch's flags, the collector on or off) restored. A side's
    mutants are applied to the fresh modules and undone after it (`Patches`), so sides may
    carry different mutants.
    """

    def __init__(self) -> None:
        self.baseline = _Baseline.take()
        self.keep = set(sys.modules)
        self.packages: set[str] = set()
        self.sides = 0

    def run(self, module: str, args: list[str]) -> dict[str, Any]:
        """Run one side (`-m MODULE ARGS`, or parity.run.mutants wrapping it); its timing record."""
        from parity.run.mutants import apply_mutants

        module, args, mutants, catalogue = _unwrap_mutants(module, args)
        homes = _catalogues_of(mutants, catalogue)
        self.packages |= {name.partition(".")[0] for name in (module, *homes)}
        if self.sides:
            _purge(self.packages, self.keep)
            self.baseline.restore()
        self.sides += 1
        patches = Patches(skip=self.packages) if mutants else None
        start = time.monotonic()
        if mutants:
            apply_mutants(mutants, catalogue)
        train, file = _train_function(module)
        sys.argv[:] = [file, *args]  # what runpy gives a `-m MODULE` run
        train(args)
        del train
        # free this side's models while the process group exists; a job may have frozen them
        # (worker.entry freezes its start-up's objects), and frozen objects are never collected
        gc.unfreeze()
        gc.collect()
        _barrier()
        seconds = time.monotonic() - start
        undone = [name for home in sorted(homes) for name in patches.undo(home)] if patches else []
        return {"module": module, "args": args, "mutants": mutants, "seconds": seconds,
                "undone": undone}  # fmt: skip


def finish_distributed() -> None:
    """Barrier, then destroy the process group the sides shared (a bare destroy aborts some
    multi-rank runs on CPU at exit)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _run(argv: list[str]) -> int:
    opts, sides = _parse(argv)
    if opts.mutants:  # applies to every side: wrap each in parity.run.mutants
        wrap = ["--mutants", opts.mutants]
        wrap += ["--catalogue", opts.catalogue] if opts.catalogue else []
        sides = [("parity.run.mutants", [*wrap, "-m", m, *a]) for m, a in sides]
    runner = SideRunner()
    timings = [runner.run(module, args) for module, args in sides]
    if opts.timing is not None and int(os.environ.get("RANK", "0")) == 0:
        from parity.files import write_json_atomic

        write_json_atomic(opts.timing, {"sides": timings})
    finish_distributed()
    return 0


def run_as_rank(fn: Callable[[list[str]], int], argv: list[str] | None) -> NoReturn:
    """`fn(argv)` as a torchrun rank (its traceback reaches torchrun's summary through
    `record`), then exit without interpreter teardown, as a job does."""
    from torch.distributed.elastic.multiprocessing.errors import record

    code = record(fn)(list(sys.argv[1:] if argv is None else argv))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def main(argv: list[str] | None = None) -> NoReturn:
    """Run every side as a torchrun rank."""
    run_as_rank(_run, argv)


if __name__ == "__main__":
    main()
