#!/usr/bin/env python3
"""The GPU check: the nccl/CUDA path of the harness and its jobs, on one machine, in one run.

    python ci/gpu_check.py OUT [--device cuda|cpu] [--steps N] [--ppo-steps N] [--budget-s S]
    bash ci/gpu-check.sh OUT ...          # the same, with the venv's python if there is one

Each check runs in a child process of its own under a timeout (its own, cut to what is left of
``--budget-s``); a check that fails, errs or hangs is recorded and the next one runs. Every figure
and verdict lands in OUT/summary.json and OUT/summary.md, rewritten after each check (a run
killed halfway leaves what it had); the runs in OUT/runs/, each check's log in OUT/checks/.

Checks, in order (verdict pass / fail / error each):

- environment: python, torch, CUDA, cuDNN, NCCL, GPU, driver, package versions; the determinism
  settings as ``worker.determinism`` sets them; a matmul repeated (bitwise) and against float64
  (TF32 off: fp32's error, not TF32's 1e-3).
- imports: every module of worker/ and parity/ imports with this machine's packages; the
  installed versions against pyproject's pins.
- sft-pair: the SFT pair legacy vs worker at world size 1 (nccl on CUDA, gloo on CPU).
- noise-floor: side A run again (A vs A'): the floor per metric, zero or not.
- in-process: the same pair in one launch; aligned, and bitwise the separate launches.
- ppo-pair: the PPO pair legacy vs worker at world size 1.
- bf16: the SFT pair under bf16 autocast (PARITY_AUTOCAST=bf16), and its floor against fp32.
- two-ranks-one-device: 2 ranks on the one device: nccl (which refuses two ranks on one GPU),
  gloo with CUDA tensors under DDP, then FSDP2; says which backend ran and whether the pair
  aligned.

``--device cpu`` runs the same checks on the CPU with gloo (tests/project/test_gpu_check.py
dry-runs it with tiny sizes so that it cannot rot). Exit 0 when every check passed, 1 otherwise,
2 on bad usage.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import signal
import subprocess
import sys
import time
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# the charcount presets by import path: a GPU machine runs the tree as it is, with no
# installed package registering them
SFT_TASK, PPO_TASK = "worker.presets:SFT", "worker.presets:PPO"
CHECK_ID_ENV = "PARITY_GPU_CHECK_ID"  # carried by every process a check starts: the cleanup's key
MARKER = "gpu-check.json"  # in OUT: the folder is ours, and may be cleared on a new run
VERDICTS = ("pass", "fail", "error")


def pinned() -> dict[str, str]:
    """The reference subject's dependencies (worker/pyproject.toml), name -> requirement
    (``==2.13.0``): what a machine has instead is reported against them. Read as text: tomllib
    may be missing (Python 3.10)."""
    import re

    text = (ROOT / "worker" / "pyproject.toml").read_text(encoding="utf-8")
    block = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M)
    out = {}
    for m in re.finditer(r'"([A-Za-z0-9_.-]+)\s*([^"]*)"', block.group(1) if block else ""):
        out[m.group(1).lower()] = m.group(2).strip()
    return out


# --- one check's context and result ---------------------------------------------------------


@dataclasses.dataclass
class Context:
    """What every check knows: the device, the sizes, where to write, and its own deadline."""

    device: str
    out: Path
    steps: int
    ppo_steps: int
    val_samples: int
    max_new_tokens: int
    deadline: float
    attn: str = "sdpa"

    @property
    def runs(self) -> Path:
        return self.out / "runs"

    @property
    def backend(self) -> str:
        """The backend a world-size-1 job must have chosen on this device."""
        return "nccl" if self.device == "cuda" else "gloo"

    def timeout(self) -> float:
        """A launch's timeout: what is left of the check (the parent kills the rest anyway)."""
        return max(10.0, self.deadline - time.time())

    def sft(self, **changes: Any):
        from parity.spec import JobSpec

        overrides: dict[str, Any] = {"val_samples": self.val_samples} if self.val_samples else {}
        if self.attn != "sdpa":
            overrides["attn"] = self.attn
        base = dict(task=SFT_TASK, world_size=1, steps=self.steps, global_batch_size=16,
                    micro_batch_size=4)  # fmt: skip
        return JobSpec(**{**base, "overrides": overrides, "timeout_s": self.timeout(), **changes})

    def ppo(self):
        from parity.spec import JobSpec

        return JobSpec(
            task=PPO_TASK,
            world_size=1,
            steps=self.ppo_steps,
            global_batch_size=8,
            micro_batch_size=1,
            overrides={
                "ppo_mini_batch_size": 4,
                "max_new_tokens": self.max_new_tokens,
                **({"attn": self.attn} if self.attn != "sdpa" else {}),
            },
            timeout_s=self.timeout(),
        )


@dataclasses.dataclass
class Result:
    verdict: str  # pass, fail or error
    summary: str  # one line
    figures: dict[str, Any] = dataclasses.field(default_factory=dict)


# --- helpers the checks share ---------------------------------------------------------------


def _complete_metrics(run_dir: Path):
    """The metrics of a finished run folder (an earlier check's), or None."""
    from parity.readers import MetricsError, read_metrics

    try:
        frame = read_metrics(run_dir / "metrics.jsonl")
    except (OSError, MetricsError):
        return None
    return frame if frame.attrs.get("complete") is True else None


def _manifest(run_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((run_dir / "manifest.json").read_text())
    except (OSError, ValueError):
        return {}


def _where(run_dir: Path) -> dict[str, Any]:
    """Backend, device, world size and the autocast a run's manifest records."""
    m = _manifest(run_dir)
    det = m.get("determinism") or {}
    return {
        "backend": m.get("backend"),
        "device": m.get("device"),
        "world_size": m.get("world_size"),
        "autocast": det.get("autocast"),
    }


def _device_ok(ctx: Context, where: dict[str, Any], backend: str | None = None) -> str | None:
    """Why a run did not run where it should have (None when it did)."""
    want = backend or ctx.backend
    if where.get("backend") != want:
        return f"backend {where.get('backend')!r}, expected {want!r}"
    if not str(where.get("device") or "").startswith(ctx.device):
        return f"device {where.get('device')!r}, expected {ctx.device}"
    return None


def _floor(a, b) -> tuple[bool, dict[str, Any]]:
    """(bitwise equal, per metric max abs / rel / ULP difference) of two runs' metrics."""
    from parity.judge.noise import floor_from_frames

    floor = floor_from_frames(a, b)
    return floor.deterministic, floor.to_dict()["metrics"]


def _first_divergence(comparison) -> dict[str, Any] | None:
    fails = sorted(
        comparison.failures,
        key=lambda m: (m.first_divergent_step is None, m.first_divergent_step or 0, m.name),
    )
    if not fails:
        return None
    m = fails[0]
    return {
        "metric": m.name,
        "step": m.first_divergent_step,
        "status": m.status,
        "a": _num(m.a_value),
        "b": _num(m.b_value),
        "diverged_metrics": [f.name for f in fails],
    }


def _as_float(v: Any) -> float:
    """A floor figure as a float (non-finite ones are written as strings: 'inf', 'nan')."""
    try:
        return float(v) if v is not None else 0.0
    except (TypeError, ValueError):
        return math.nan


def _num(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return repr(v)
    return v


def _pair_figures(result) -> dict[str, Any]:
    return {
        "verdict": result.verdict,
        "metrics_verdict": result.comparison.verdict,
        "first_divergence": _first_divergence(result.comparison),
        "a": _where(result.a.dir),
        "b": _where(result.b.dir),
        "seconds": {
            "a": round(result.a.launch.duration_s, 1),
            "b": round(result.b.launch.duration_s, 1),
        },
        "steps": len(result.a.metrics.index),
        "dir": str(result.dir),
    }


def _pair_verdict(ctx: Context, result, what: str, backend: str | None = None) -> Result:
    figures = _pair_figures(result)
    for side in ("a", "b"):
        wrong = _device_ok(ctx, figures[side], backend)
        if wrong:
            return Result("fail", f"{what}: side {side.upper()} ran with {wrong}", figures)
    where = f"{figures['a']['backend']} on {figures['a']['device']}"
    if result.verdict != "aligned":
        first = figures["first_divergence"] or {}
        at = f": {first.get('metric')} at step {first.get('step')}" if first else ""
        return Result("fail", f"{what} {result.verdict}{at} ({where})", figures)
    return Result("pass", f"{what} aligned over {figures['steps']} steps ({where})", figures)


# --- the checks -----------------------------------------------------------------------------


def check_environment(ctx: Context) -> Result:
    import torch
    import torch.distributed as dist

    from worker.determinism import set_determinism

    info = environment_facts()
    info["determinism"] = set_determinism(0)
    print(json.dumps(info, indent=2, default=str), flush=True)
    if ctx.device == "cuda" and not info["cuda_available"]:
        return Result("fail", "CUDA is not available to torch", info)
    if ctx.device == "cuda" and not dist.is_nccl_available():
        return Result("fail", "torch.distributed has no NCCL", info)
    # the settings in effect: a matmul repeats bit for bit, and its error against float64 is
    # fp32's (TF32 would round the inputs to 10 mantissa bits: ~1e-3 relative)
    device = torch.device(ctx.device)
    n = 1024 if ctx.device == "cuda" else 256
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=gen, dtype=torch.float32) for _ in range(2))
    a, b = a.to(device), b.to(device)
    c1, c2 = a @ b, a @ b
    ref = a.double() @ b.double()
    err = float(((c1.double() - ref).abs().max() / ref.abs().max()).item())
    repeat = bool(torch.equal(c1, c2))
    info["matmul"] = {"n": n, "bitwise_repeat": repeat, "max_rel_err_vs_fp64": err}
    facts = f"torch {info['torch']}, " + (
        f"CUDA {info['cuda']}, {info['gpus'][0]['name'] if info['gpus'] else '?'}, "
        f"driver {info['driver']}"
        if ctx.device == "cuda"
        else "CPU"
    )
    if not repeat:
        return Result("fail", f"{facts}: a matmul repeated gave other bits", info)
    if err > 1e-4:
        return Result("fail", f"{facts}: fp32 matmul error {err:.1e} (TF32 on?)", info)
    return Result("pass", f"{facts}; matmul repeats bitwise, error {err:.1e} vs fp64", info)


def environment_facts() -> dict[str, Any]:
    """What decides whether this machine can run the jobs, and gives which bits."""
    import torch
    import torch.distributed as dist

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "nccl": None,
        "nccl_available": dist.is_nccl_available(),
        "gloo_available": dist.is_gloo_available(),
        "device_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "gpus": [],
        "driver": None,
        "packages": package_versions(),
    }
    if torch.cuda.is_available():
        try:
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as e:  # noqa: BLE001 - a fact we report, not one we need
            info["nccl"] = f"unknown ({type(e).__name__})"
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            info["gpus"].append(
                {
                    "name": p.name,
                    "capability": f"{p.major}.{p.minor}",
                    "memory_gib": round(p.total_memory / 2**30, 1),
                }
            )
        info["driver"] = _nvidia_smi("driver_version")
    return info


def _nvidia_smi(field: str) -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.strip().splitlines()
    return lines[0].strip() if out.returncode == 0 and lines else None


def package_versions() -> dict[str, dict[str, str | None]]:
    from importlib import metadata

    out = {}
    for name, pin in pinned().items():
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            version = None
        out[name] = {"installed": version, "pinned": pin}
    return out


def check_imports(ctx: Context) -> Result:
    """Every module of worker/ and parity/ imported in this process, as the jobs import them."""
    import importlib
    import pkgutil

    failed: dict[str, str] = {}
    count = 0
    for package in ("worker", "parity"):
        root = importlib.import_module(package)
        walked = pkgutil.walk_packages(root.__path__, prefix=f"{package}.")
        # a __main__ module runs its program when imported (python -m parity.cli)
        names = [package] + [m.name for m in walked if not m.name.endswith(".__main__")]
        for name in names:
            count += 1
            try:
                importlib.import_module(name)
            except Exception as e:  # noqa: BLE001 - each failure is a finding
                failed[name] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
    packages = package_versions()
    off_pin = {
        n: p["installed"]
        for n, p in packages.items()
        if p["pinned"].startswith("==") and (p["installed"] or "").split("+")[0] != p["pinned"][2:]
    }
    missing = sorted(n for n, p in packages.items() if p["installed"] is None)
    figures = {"modules": count, "failed": failed, "packages": packages, "off_pin": off_pin}
    figures["missing_packages"] = missing
    note = ""
    if off_pin:
        note += f"; not the pinned {', '.join(f'{n} {v}' for n, v in off_pin.items())}"
    if missing:
        note += f"; missing (unused by the jobs if the imports pass): {', '.join(missing)}"
    if failed:
        name, why = next(iter(failed.items()))
        return Result(
            "fail", f"{len(failed)} of {count} modules fail: {name}: {why}{note}", figures
        )
    return Result("pass", f"all {count} modules of worker/ and parity/ import{note}", figures)


def check_sft_pair(ctx: Context) -> Result:
    from parity.pair import run_pair
    from parity.spec import PairSpec

    pair = PairSpec.from_variants(ctx.sft(), "legacy", "worker")
    # trace=False everywhere: device time is budgeted; a divergence is diagnosed again on a CPU
    result = run_pair(pair, ctx.runs / "sft-pair", allow_teardown_failure=False, trace=False)
    return _pair_verdict(ctx, result, "SFT legacy vs worker, 1 rank,")


def check_noise_floor(ctx: Context) -> Result:
    """Side A of the SFT pair run again: A vs A' bit for bit, else the floor per metric."""
    from parity.run.job import run_job

    spec = ctx.sft(trainer="legacy")
    a_dir = ctx.runs / "sft-pair" / "a"
    a = _complete_metrics(a_dir)
    if a is None:  # the pair did not get that far: A here, then A'
        a_dir = ctx.runs / "noise-floor" / "a"
        a = run_job(spec, a_dir, label="A").metrics
    repeat = run_job(spec, ctx.runs / "noise-floor" / "a-repeat", label="A'")
    equal, floor = _floor(a, repeat.metrics)
    figures = {"deterministic": equal, "floor": floor, "a": str(a_dir), "a_repeat": str(repeat.dir)}
    figures["where"] = _where(repeat.dir)
    wrong = _device_ok(ctx, figures["where"])
    if wrong:
        return Result("fail", f"A' ran with {wrong}", figures)
    if equal:
        return Result(
            "pass", f"noise floor zero: A and A' bitwise equal ({len(floor)} metrics)", figures
        )
    noisy = {n: f for n, f in floor.items() if f["status"] != "match"}
    worst = max(noisy.items(), key=lambda kv: _as_float(kv[1]["max_rel_diff"]))
    return Result(
        "fail",
        f"not deterministic: {len(noisy)} metric(s) differ between A and A', worst "
        f"{worst[0]} rel {_as_float(worst[1]['max_rel_diff']):.2e} from step "
        f"{worst[1]['first_step']}",
        figures,
    )


def check_in_process(ctx: Context) -> Result:
    """The pair in one launch: aligned, and each side bitwise its separate launch."""
    from parity.pair import run_pair
    from parity.spec import PairSpec

    pair = PairSpec.from_variants(ctx.sft(), "legacy", "worker")
    result = run_pair(pair, ctx.runs / "in-process", in_process=True, trace=False)
    verdict = _pair_verdict(ctx, result, "in-process SFT legacy vs worker")
    same: dict[str, Any] = {}
    for side, run in (("a", result.a), ("b", result.b)):
        separate = _complete_metrics(ctx.runs / "sft-pair" / side)
        if separate is None:
            same[side] = None  # nothing to hold it against
            continue
        equal, floor = _floor(separate, run.metrics)
        same[side] = {"bitwise_equal": equal, "floor": floor}
    verdict.figures["same_as_separate_launches"] = same
    if verdict.verdict != "pass":
        return verdict
    differ = [s for s, v in same.items() if v is not None and not v["bitwise_equal"]]
    if differ:
        return Result(
            "fail",
            f"in-process side(s) {', '.join(differ)} differ from their separate launches",
            verdict.figures,
        )
    held = [s for s, v in same.items() if v is not None]
    note = (
        f"; sides {'/'.join(held)} bitwise their separate launches"
        if held
        else "; no separate launches to hold them against"
    )
    return Result("pass", verdict.summary + note, verdict.figures)


def check_ppo_pair(ctx: Context) -> Result:
    from parity.pair import run_pair
    from parity.spec import PairSpec

    pair = PairSpec.from_variants(ctx.ppo(), "legacy", "worker")
    result = run_pair(pair, ctx.runs / "ppo-pair", trace=False)
    return _pair_verdict(ctx, result, "PPO legacy vs worker, 1 rank,")


def check_bf16(ctx: Context) -> Result:
    """The SFT pair under bf16 autocast (one launch), and the bf16 run's floor against fp32."""
    from parity.pair import run_pair
    from parity.run.job import run_job
    from parity.spec import PairSpec

    fp32_dir = ctx.runs / "sft-pair" / "b"
    fp32 = _complete_metrics(fp32_dir)
    if fp32 is None:  # the fp32 reference first, before the autocast is switched on
        fp32_dir = ctx.runs / "bf16" / "fp32-worker"
        fp32 = run_job(ctx.sft(trainer="worker"), fp32_dir, label="fp32").metrics
    os.environ["PARITY_AUTOCAST"] = "bf16"
    try:
        pair = PairSpec.from_variants(ctx.sft(), "legacy", "worker")
        result = run_pair(pair, ctx.runs / "bf16", in_process=True, trace=False)
    finally:
        del os.environ["PARITY_AUTOCAST"]
    verdict = _pair_verdict(ctx, result, "bf16 SFT legacy vs worker")
    equal, floor = _floor(fp32, result.b.metrics)
    figures = verdict.figures
    figures["fp32_reference"] = str(fp32_dir)
    figures["floor_vs_fp32"] = floor
    if verdict.verdict != "pass":
        return verdict
    autocast = {figures[s]["autocast"] for s in ("a", "b")}
    if autocast != {"bfloat16"}:
        return Result(
            "fail",
            f"the manifests record autocast {sorted(map(str, autocast))}, not bfloat16",
            figures,
        )
    loss = floor.get("train/loss", {})
    if equal or not loss.get("max_abs_diff"):
        return Result("fail", "bf16 gave fp32's bits: autocast not in effect", figures)
    nonfinite = [n for n, f in floor.items() if isinstance(f["max_abs_diff"], str)]
    if nonfinite:
        return Result("fail", f"bf16 gave non-finite values in {', '.join(nonfinite)}", figures)
    return Result(
        "pass",
        f"{verdict.summary}; floor vs fp32: train/loss max rel {loss['max_rel_diff']:.2e} "
        f"(max abs {loss['max_abs_diff']:.2e})",
        figures,
    )


def check_two_ranks(ctx: Context) -> Result:
    """Two ranks on the one device, with each backend/engine that might allow it."""
    from parity.pair import run_pair
    from parity.run.launch import LaunchError
    from parity.spec import PairSpec

    if ctx.device == "cuda":
        attempts = [("gloo", "ddp"), ("nccl", "fsdp2"), ("gloo", "fsdp2")]
    else:
        attempts = [("gloo", "ddp")]  # CPU: every other check's gloo is already shown
    results: dict[str, Any] = {}
    for i, (backend, engine) in enumerate(attempts):
        name = f"{backend}+{engine}"
        left = ctx.deadline - time.time()
        if left < 20:
            results[name] = {"ran": False, "verdict": None, "error": "no time left in this check"}
            continue
        share = min(left / (len(attempts) - i), 90.0)  # a hang leaves time for the next one
        # an in-process launch may take both sides' timeouts
        spec = ctx.sft(world_size=2, engine=engine, timeout_s=share / 2)
        pair = PairSpec.from_variants(spec, "legacy", "worker")
        os.environ["PARITY_BACKEND"] = backend
        start = time.time()
        try:
            result = run_pair(pair, ctx.runs / "two-ranks" / name, in_process=True, trace=False)
        except LaunchError as e:
            results[name] = {"ran": False, "verdict": None, "error": _error_text(e, 60)}
            results[name]["first_failure"] = _first_failure_line(e)
        except Exception as e:  # noqa: BLE001 - recorded, and the next attempt runs
            results[name] = {"ran": False, "verdict": None, "error": _error_text(e, 60)}
            results[name]["first_failure"] = _first_failure_line(e)
        else:
            v = _pair_verdict(ctx, result, name, backend=backend)
            results[name] = {
                "ran": True,
                "verdict": result.verdict,
                "check": v.verdict,
                "summary": v.summary,
                **v.figures,
            }
        finally:
            del os.environ["PARITY_BACKEND"]
        results[name]["seconds"] = round(time.time() - start, 1)
    ran = [n for n, r in results.items() if r["ran"]]
    aligned = [n for n in ran if results[n].get("check") == "pass"]
    refused = [n for n, r in results.items() if not r["ran"]]
    said = []
    if aligned:
        said.append(f"2 ranks on one {ctx.device} device run and align with {', '.join(aligned)}")
    for n in ran:
        if n not in aligned:
            said.append(f"{n} ran but: {results[n]['summary']}")
    for n in refused:
        said.append(f"{n} did not run ({results[n].get('first_failure') or 'see figures'})")
    figures = {"attempts": results, "works": aligned}
    verdict = "pass" if aligned else "fail"
    return Result(verdict, "; ".join(said), figures)


def _error_text(e: BaseException, lines: int) -> str:
    text = str(e).strip() or type(e).__name__
    return "\n".join(text.splitlines()[:lines])[:4000]


def _first_failure_line(e: BaseException) -> str:
    """The line of a failed launch that says why (an NCCL or CUDA error), else its first line."""
    text = str(e)
    keys = ("Duplicate GPU", "ncclInvalidUsage", "NCCL error", "CUDA error", "Error:", "error:")
    for key in keys:
        for line in text.splitlines():
            if key in line:
                return line.strip()[:300]
    return text.strip().splitlines()[0][:300] if text.strip() else type(e).__name__


# name, title, its timeout on a GPU (s), the function
CHECKS: list[tuple[str, str, float, Callable[[Context], Result]]] = [
    ("environment", "torch, CUDA, GPU, driver; determinism settings", 60, check_environment),
    ("imports", "every module imports with this machine's packages", 90, check_imports),
    ("sft-pair", "SFT legacy vs worker, world size 1", 120, check_sft_pair),
    ("noise-floor", "A vs A' (side A run twice)", 75, check_noise_floor),
    ("in-process", "the SFT pair in one launch", 90, check_in_process),
    ("ppo-pair", "PPO legacy vs worker, world size 1", 150, check_ppo_pair),
    ("bf16", "SFT pair under bf16 autocast; floor vs fp32", 90, check_bf16),
    ("two-ranks-one-device", "2 ranks on one device: which backend", 180, check_two_ranks),
]


# --- the child: one check --------------------------------------------------------------------


def run_child(args: argparse.Namespace) -> int:
    from parity.run.signals import Interrupted, cancellable

    fn = {name: f for name, _, _, f in CHECKS}[args.child]
    ctx = Context(
        device=args.device,
        out=args.out,
        steps=args.steps,
        ppo_steps=args.ppo_steps,
        val_samples=args.val_samples,
        max_new_tokens=args.max_new_tokens,
        deadline=time.time() + args.child_timeout,
        attn=args.attn,
    )
    start = time.time()
    record: dict[str, Any]
    with cancellable():
        try:
            r = fn(ctx)
            record = {"verdict": r.verdict, "summary": r.summary, "figures": r.figures}
        except Interrupted as e:  # the parent's SIGTERM at the timeout: launches are stopped
            record = {
                "verdict": "error",
                "summary": f"timed out ({e.signame})",
                "figures": {},
                "timed_out": True,
            }
        except BaseException as e:  # noqa: BLE001 - every failure is recorded, never raised
            traceback.print_exc()
            record = {
                "verdict": "error",
                "summary": f"{type(e).__name__}: {_error_text(e, 1)}",
                "figures": {},
                "error": _error_text(e, 60),
                "traceback": traceback.format_exc()[-6000:],
            }
    record["seconds"] = round(time.time() - start, 1)
    _write_json(args.out / "checks" / f"{args.child}.json", record)
    return 0


# --- the parent: every check, each in a child under its timeout -------------------------------


def run_all(args: argparse.Namespace) -> int:
    out: Path = args.out
    only = set(args.only.split(",")) if args.only else None
    unknown = (only or set()) - {name for name, *_ in CHECKS}
    if unknown:
        print(f"error: unknown check(s) {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    if out.exists() and any(out.iterdir()) and not (out / MARKER).exists():
        print(f"error: {out} is not empty and not a gpu-check folder", file=sys.stderr)
        return 2
    for sub in ("runs", "checks"):  # an earlier check run's: its runs must not be reused
        _remove_tree(out / sub)
    for name in ("summary.json", "summary.md"):
        (out / name).unlink(missing_ok=True)
    (out / "checks").mkdir(parents=True, exist_ok=True)
    _write_json(out / MARKER, {"argv": sys.argv})

    start = time.time()
    summary: dict[str, Any] = {
        "device": args.device,
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "budget_s": args.budget_s,
        "checks": [],
    }
    print(
        f"gpu check on {args.device}: {len(CHECKS)} checks, budget {args.budget_s:g} s, "
        f"results in {out}",
        flush=True,
    )
    for name, title, gpu_timeout, _ in CHECKS:
        timeout = args.check_timeout_s or gpu_timeout * (args.timeout_scale or 1.0)
        left = args.budget_s - (time.time() - start)
        record: dict[str, Any] = {"name": name, "title": title}
        if only is not None and name not in only:
            record.update(verdict="error", summary="not run (--only)", seconds=0.0)
        elif left < 15:
            spent = f"not run: the budget of {args.budget_s:g} s was spent"
            record.update(verdict="error", seconds=0.0, summary=spent)
        else:
            record.update(_run_check(args, name, min(timeout, left - 5)))
        summary["checks"].append(record)
        summary["seconds"] = round(time.time() - start, 1)
        _finish_summary(summary)
        _write_json(out / "summary.json", summary)
        (out / "summary.md").write_text(summary_markdown(summary), encoding="utf-8")
        print(
            f"[{record['verdict'].upper():5}] {name} ({record['seconds']:.1f} s): "
            f"{record['summary']}",
            flush=True,
        )
        if name == "environment" and record.get("figures"):
            print(_environment_lines(record["figures"]), flush=True)
    counts = summary["counts"]
    print(
        f"gpu check: {counts['pass']} pass, {counts['fail']} fail, {counts['error']} error in "
        f"{summary['seconds']:.0f} s; {out / 'summary.md'}",
        flush=True,
    )
    return 0 if summary["verdict"] == "pass" else 1


def _finish_summary(summary: dict[str, Any]) -> None:
    counts = {v: sum(c["verdict"] == v for c in summary["checks"]) for v in VERDICTS}
    summary["counts"] = counts
    summary["verdict"] = "pass" if counts["pass"] == len(CHECKS) else "fail"
    env = next((c for c in summary["checks"] if c["name"] == "environment"), None)
    if env and env.get("figures"):
        f = env["figures"]
        summary["environment"] = {
            k: f.get(k)
            for k in (
                "python",
                "torch",
                "cuda",
                "cudnn",
                "nccl",
                "driver",
                "gpus",
                "device_count",
            )
        }
        summary["environment"]["transformers"] = (
            (f.get("packages") or {}).get("transformers", {}).get("installed")
        )


def _run_check(args: argparse.Namespace, name: str, timeout: float) -> dict[str, Any]:
    """One check in a child process (its own session) under `timeout`; its record."""
    out: Path = args.out
    record_path = out / "checks" / f"{name}.json"
    log_path = out / "checks" / f"{name}.log"
    check_id = uuid.uuid4().hex
    env = {**os.environ, CHECK_ID_ENV: check_id, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.pop("PARITY_AUTOCAST", None)
    env.pop("PARITY_BACKEND", None)
    if args.device == "cpu":
        env["PARITY_FORCE_CPU"] = "1"
    else:
        env.pop("PARITY_FORCE_CPU", None)
    cmd = [sys.executable, str(Path(__file__).resolve()), str(out), "--child", name]
    cmd += ["--child-timeout", f"{timeout:.1f}", "--device", args.device, "--attn", args.attn]
    for flag in ("steps", "ppo_steps", "val_samples", "max_new_tokens"):
        cmd += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    start = time.time()
    timed_out = False
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=ROOT,
            start_new_session=True,
        )
        try:
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                _signal_group(proc.pid, signal.SIGTERM)  # the child stops its launches itself
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    pass
        finally:  # also on an interruption of this process: nothing of the check is left
            _kill_check(proc, check_id)
    seconds = round(time.time() - start, 1)
    try:
        record = json.loads(record_path.read_text())
    except (OSError, ValueError):
        record = {"verdict": "error", "figures": {}}
        if timed_out:
            record["summary"] = f"timed out after {timeout:.0f} s (killed)"
        else:
            record["summary"] = f"the check's process exited {proc.returncode} without a result"
        record["log_tail"] = _tail(log_path, 40)
    if timed_out:
        record["timed_out"] = True
        record["summary"] = f"timed out after {timeout:.0f} s (stopped with its launches)"
        record["verdict"] = "error"
    elif record["verdict"] != "pass":
        record.setdefault("log_tail", _tail(log_path, 40))
    record["seconds"] = seconds
    record["timeout_s"] = round(timeout, 1)
    record["log"] = str(log_path.relative_to(out))
    return record


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_check(proc: subprocess.Popen, check_id: str) -> None:
    """SIGKILL the child and everything still carrying its check id (torchrun, the ranks)."""
    from parity.run.launch import kill_carrying

    kill_carrying(CHECK_ID_ENV, check_id, proc, rounds=50)


# --- output -------------------------------------------------------------------------------------


def _write_json(path: Path, obj: Any) -> None:
    from parity.record.files import write_text_atomic

    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def _remove_tree(path: Path) -> None:
    import shutil

    if path.exists():
        shutil.rmtree(path)


def _tail(path: Path, n: int) -> str:
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n:])


def _environment_lines(f: dict[str, Any]) -> str:
    gpus = (
        ", ".join(
            f"{g['name']} (sm {g['capability']}, {g['memory_gib']} GiB)"
            for g in f.get("gpus") or []
        )
        or "none"
    )
    pk = f.get("packages") or {}
    versions = ", ".join(f"{n} {p['installed']}" for n, p in pk.items() if p.get("installed"))
    missing = ", ".join(n for n, p in pk.items() if not p.get("installed"))
    lines = [
        f"    python {f.get('python')}, torch {f.get('torch')}, CUDA {f.get('cuda')}, "
        f"cuDNN {f.get('cudnn')}, NCCL {f.get('nccl')}, driver {f.get('driver')}",
        f"    GPUs: {gpus}",
        f"    packages: {versions}" + (f"; missing: {missing}" if missing else ""),
        f"    determinism: {json.dumps(f.get('determinism'), sort_keys=True)}",
    ]
    return "\n".join(lines)


def _floor_table(floor: dict[str, Any]) -> list[str]:
    rows = [
        "| metric | status | max abs | max rel | max ULP | first step |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, f in sorted(floor.items()):
        cells = [
            name,
            f.get("status"),
            f.get("max_abs_diff"),
            f.get("max_rel_diff"),
            f.get("max_ulp"),
            f.get("first_step"),
        ]
        rows.append("| " + " | ".join("-" if c is None else f"{c}" for c in cells) + " |")
    return rows


def summary_markdown(summary: dict[str, Any]) -> str:
    """summary.md: the verdict table, the environment, then each check's figures."""
    c = summary["counts"]
    lines = [
        f"# GPU check on {summary['device']}: {summary['verdict']}",
        "",
        f"{c['pass']} pass, {c['fail']} fail, {c['error']} error of {len(CHECKS)} checks in "
        f"{summary.get('seconds', 0):.0f} s (budget {summary['budget_s']:g} s), started "
        f"{summary['started']}.",
        "",
        "| check | verdict | seconds | summary |",
        "| --- | --- | --- | --- |",
    ]
    for r in summary["checks"]:
        text = str(r["summary"]).replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {r['name']} | **{r['verdict']}** | {r['seconds']:.1f} | {text} |")
    env = summary.get("environment")
    if env:
        lines += ["", "## Environment", "", "```json", json.dumps(env, indent=2), "```"]
    for r in summary["checks"]:
        f = r.get("figures") or {}
        lines += ["", f"## {r['name']}: {r['verdict']}", "", r.get("title", ""), ""]
        for key, title in (("floor", "A vs A'"), ("floor_vs_fp32", "bf16 vs fp32 (worker)")):
            if isinstance(f.get(key), dict) and f[key]:
                lines += [f"Floor, {title}:", "", *_floor_table(f[key]), ""]
        rest = {k: v for k, v in f.items() if k not in ("floor", "floor_vs_fp32", "packages")}
        if rest:
            text = json.dumps(rest, indent=1, default=str)
            if len(text) > 6000:
                text = text[:6000] + "\n... (summary.json has it all)"
            lines += ["```json", text, "```"]
        tail = r.get("log_tail")
        if tail and r["verdict"] != "pass":
            lines += ["", f"Log tail ({r.get('log')}):", "", "```", tail[-4000:], "```"]
    return "\n".join(lines) + "\n"


# --- command line -------------------------------------------------------------------------------


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="ci/gpu_check.py",
        description="The nccl/CUDA path, checked: every check's verdict and figures in "
        "OUT/summary.json and OUT/summary.md.",
        allow_abbrev=False,
    )
    p.add_argument("out", type=Path, help="folder for summary.json, summary.md, runs/, checks/")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--steps", type=int, default=10, help="SFT steps (default 10)")
    p.add_argument("--ppo-steps", type=int, default=4, help="PPO steps (default 4)")
    p.add_argument("--val-samples", type=int, default=0, help="SFT val samples (0: all 48)")
    p.add_argument("--max-new-tokens", type=int, default=96, help="PPO response length")
    p.add_argument("--attn", default="sdpa", help="the jobs' attention (sdpa, eager, ...)")
    p.add_argument(
        "--budget-s",
        type=float,
        default=450.0,
        help="wall time for all checks (default 450: under 8 minutes)",
    )
    p.add_argument(
        "--check-timeout-s",
        type=float,
        default=None,
        help="every check's timeout (default: its own, cut to the budget)",
    )
    p.add_argument(
        "--timeout-scale",
        type=float,
        default=None,
        help="multiply each check's own timeout (a slow CPU)",
    )
    p.add_argument("--only", default="", help="run only these checks (comma-separated)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-timeout", type=float, default=600.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.out = args.out.resolve()
    for name in ("steps", "ppo_steps", "max_new_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.child:
        return run_child(args)
    from parity.run.signals import Interrupted, cancellable

    with cancellable():  # SIGINT, SIGTERM, SIGHUP: the running check is stopped with its launches
        try:
            return run_all(args)
        except Interrupted as e:
            print(
                f"gpu check: interrupted by {e.signame}; what finished is in {args.out}",
                file=sys.stderr,
            )
            return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
