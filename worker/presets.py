"""The charcount presets: how the harness starts this subject's SFT and PPO jobs.

Registered in the ``llm_parity.tasks`` entry points (worker/pyproject.toml), so a spec may say
``task = "charcount-sft"`` and give these keys beside the ones every job has:

    task = "charcount-sft"
    trainer = "legacy"          # legacy, worker or tinker (the pair's side key: --a legacy)
    world_size = 2
    engine = "ddp"
    overrides = { val_samples = 16 }   # any other job flag: --val-samples 16
"""

from __future__ import annotations

from pathlib import Path

from parity.spec import (
    JobSpec,
    SpecError,
    format_scalar,
    require_choice,
    require_flags,
    require_int,
)
from parity.tasks import Task

ENGINES = ("fsdp2", "ddp")
VAL_LOSSES = ("fixed", "legacy")

#: the presets' own keys and their defaults
KEYS = {
    "trainer": "worker",
    "engine": "fsdp2",
    "global_batch_size": 16,
    "micro_batch_size": 4,
    "dynamic_bsz": False,
    "max_tokens_per_rank": None,
    "model": None,  # a local HF model folder; None: the committed fixture
    "val_loss": "fixed",
    "overrides": {},  # more job flags: {"val_samples": 16} -> --val-samples 16
}


def check(spec: JobSpec) -> None:
    """What the job would refuse, refused before anything starts, in one line."""
    if not isinstance(spec.trainer, str) or not spec.trainer:
        raise SpecError(f"trainer must be a non-empty string, got {spec.trainer!r}")
    require_choice("engine", spec.engine, ENGINES)
    require_choice("val_loss", spec.val_loss, VAL_LOSSES)
    require_int("global_batch_size", spec.global_batch_size, minimum=1)
    require_int("micro_batch_size", spec.micro_batch_size, minimum=1, optional=True)
    require_int("max_tokens_per_rank", spec.max_tokens_per_rank, minimum=1, optional=True)
    if not isinstance(spec.dynamic_bsz, bool):
        raise SpecError(f"dynamic_bsz must be true or false, got {spec.dynamic_bsz!r}")
    if spec.model is not None and not isinstance(spec.model, str):
        raise SpecError(f"model must be a path string, got {spec.model!r}")
    require_flags(spec.overrides)
    _check_batch(spec)


def _check_batch(spec: JobSpec) -> None:
    ws, gbs = spec.world_size, spec.global_batch_size
    if ws > gbs:
        raise SpecError(f"world_size {ws} is larger than the global batch {gbs}")
    if gbs % ws:
        raise SpecError(f"global_batch_size {gbs} is not divisible by world_size {ws}")
    if spec.dynamic_bsz:
        return
    mbs, per_rank = spec.micro_batch_size, gbs // ws
    if mbs is None:
        raise SpecError("micro_batch_size is required unless dynamic_bsz is true")
    if per_rank % mbs:
        raise SpecError(
            f"micro_batch_size {mbs} does not divide the per-rank batch {per_rank} "
            f"(global_batch_size {gbs} / world_size {ws})"
        )


def job_args(module: str):
    """The job's command line for one run folder: ``-m worker.sft --trainer ... --out OUT``."""

    def args(spec: JobSpec, out: Path) -> list[str]:
        a = ["-m", module, "--trainer", spec.trainer, "--out", str(out)]
        a += ["--steps", str(spec.steps), "--seed", str(spec.seed), "--engine", spec.engine]
        a += ["--global-batch-size", str(spec.global_batch_size)]
        if spec.dynamic_bsz:
            a.append("--dynamic-bsz")
        else:
            a += ["--micro-batch-size", str(spec.micro_batch_size)]
        if spec.max_tokens_per_rank is not None:
            a += ["--max-tokens-per-rank", str(spec.max_tokens_per_rank)]
        if spec.model is not None:
            a += ["--model", spec.model]
        a += ["--val-loss", spec.val_loss]
        for key, value in spec.overrides.items():  # extra job flags: {"val_samples": 16}
            flag = "--" + key.replace("_", "-")
            if value is True:
                a.append(flag)
            elif value is not False:
                a += [flag, format_scalar(value)]
        return a

    return args


def traced(spec: JobSpec, step: int, resume: Path | None) -> JobSpec:
    """The job rerun with ``step`` traced (--trace-step) and ended after it (--stop-after),
    from the state it saved before that step when ``resume`` is given."""
    if spec.task == "charcount-ppo" and "resume" in spec.overrides:
        raise SpecError("PPO jobs do not resume")
    overrides = {k: v for k, v in spec.overrides.items() if k not in ("save_state_at", "resume")}
    overrides.update(trace_step=step, stop_after=step)
    if resume is not None:
        overrides["resume"] = str(resume)
    return spec.replace(overrides=overrides)


#: what both jobs import first (worker.entry's first line): the fast paths import it once per
#: warm rank, before forking the jobs (parity.rank.warm)
PRELOAD = ("worker.boot",)


def _preset(name: str, summary: str, module: str) -> Task:
    return Task(name, summary, KEYS, job_args(module), check, side_key="trainer", traced=traced,
                preload=PRELOAD)  # fmt: skip


SFT = _preset("charcount-sft", "fine-tuning of the tiny Qwen2 (worker.sft)", "worker.sft")
PPO = _preset("charcount-ppo", "PPO from the SFT-warmed actor (worker.ppo)", "worker.ppo")
