"""What the PPO job's `--batch-invariant` mode costs against the default mode, rollout and training.

    python benchmarks/onpolicy_cost.py [--steps 6] [--repeats 2] [--keep DIR] [--json]

Why: `--batch-invariant` makes the rollout's log-probs (KV-cache `generate`) equal, bit for bit,
to the trainer's full forward, so PPO is exactly on-policy; it pays with a slower forward. The
goal (issue) is at most 1.5x per PPO step. Each run is the 2-rank charcount-ppo job (global batch
8, micro-batch 1); the modes alternate, default then batch-invariant, `--repeats` rounds, so both
see the same machine. Step 1 of each run is warm-up and dropped; the figures are medians per mode
over every other step of its runs, from `metrics.jsonl`: rollout `timing_s/rollout`, training
`timing_s/step - timing_s/rollout`, step `timing_s/step`. The rollout-vs-trainer mismatch
(`rollout/logprob_diff_max`, `_frac`) must be exactly 0 on every batch-invariant step.
Exit code 1 if a goal is not met.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parity.run.job import run_job  # noqa: E402
from parity.spec import JobSpec  # noqa: E402

MODES = {"default": False, "batch-invariant": True}
STEP_GOAL = 1.5


def read_steps(path: Path) -> list[dict]:
    """The step records of a metrics.jsonl (the end record has no "step")."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if "step" in r]


def phases(row: dict) -> dict[str, float]:
    step, rollout = row["timing_s/step"], row["timing_s/rollout"]
    return {"rollout": rollout, "training": step - rollout, "step": step}


def measure(root: Path, steps: int, repeats: int) -> dict[str, list[dict]]:
    """Every kept step record of each mode, the modes interleaved run by run."""
    rows: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for r in range(repeats):
        for mode, invariant in MODES.items():
            spec = JobSpec(
                task="charcount-ppo",
                trainer="worker",
                world_size=2,
                steps=steps,
                global_batch_size=8,
                micro_batch_size=1,
                overrides={"batch_invariant": invariant},
            )
            out = root / f"{mode}-{r + 1}"
            run_job(spec, out, label=f"{mode} {r + 1}/{repeats}")
            kept = [row for row in read_steps(out / "metrics.jsonl") if row["step"] != 1]
            if len(kept) != steps - 1:
                raise SystemExit(f"{out}: {len(kept)} steps after warm-up, expected {steps - 1}")
            rows[mode] += kept
    return rows


def summarize(rows: dict[str, list[dict]]) -> dict:
    med = {
        mode: {
            phase: statistics.median(phases(row)[phase] for row in mode_rows)
            for phase in ("rollout", "training", "step")
        }
        for mode, mode_rows in rows.items()
    }
    mismatch = {
        mode: {
            key: statistics.median(row[f"rollout/logprob_diff_{key}"] for row in mode_rows)
            for key in ("max", "frac")
        }
        for mode, mode_rows in rows.items()
    }
    bi = rows["batch-invariant"]
    exact = all(
        r["rollout/logprob_diff_max"] == 0 and r["rollout/logprob_diff_frac"] == 0 for r in bi
    )
    ratio = {p: med["batch-invariant"][p] / med["default"][p] for p in med["default"]}
    ok = ratio["step"] <= STEP_GOAL and exact
    steps = {mode: len(mode_rows) for mode, mode_rows in rows.items()}
    return {
        "median_s": med,
        "ratio": ratio,
        "mismatch_median": mismatch,
        "bi_exact_every_step": exact,
        "steps_measured": steps,
        "goal_step_ratio": STEP_GOAL,
        "ok": ok,
    }


def table(s: dict) -> str:
    med, ratio = s["median_s"], s["ratio"]
    lines = [
        "| phase | default median s | batch-invariant median s | ratio | goal |",
        "|---|---|---|---|---|",
    ]
    for phase in ("rollout", "training", "step"):
        goal = f"<= {STEP_GOAL}x" if phase == "step" else "-"
        if phase == "step":
            goal += " met" if ratio[phase] <= STEP_GOAL else " NOT met"
        d, b = med["default"][phase], med["batch-invariant"][phase]
        lines.append(f"| {phase} | {d:.3f} | {b:.3f} | {ratio[phase]:.2f}x | {goal} |")
    mm = s["mismatch_median"]
    lines.append("")
    for mode in MODES:
        lines.append(
            f"{mode}: median mismatch max |Δ| {mm[mode]['max']:.3g}, "
            f"differing tokens {mm[mode]['frac']:.3g} ({s['steps_measured'][mode]} steps)"
        )
    exact = "met" if s["bi_exact_every_step"] else "NOT met"
    lines.append(f"batch-invariant mismatch exactly 0 on every step (goal): {exact}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--keep", type=Path, help="keep the runs under this folder")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = ap.parse_args()
    if args.steps < 2:
        ap.error("--steps must be >= 2 (step 1 is dropped as warm-up)")
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
        if any(args.keep.iterdir()):
            ap.error(f"--keep {args.keep}: not empty")
        rows = measure(args.keep, args.steps, args.repeats)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            rows = measure(Path(tmp), args.steps, args.repeats)
    summary = summarize(rows)
    print(json.dumps(summary) if args.json else table(summary))
    sys.exit(0 if summary["ok"] else 1)


if __name__ == "__main__":
    main()
