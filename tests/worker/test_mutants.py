"""The mutant catalogue: every injected bug must be caught by the check that guards it.

Each entry names the check, the metric that must diverge first and the step where it does; the
session prints the mutation score (caught / total), which must be 100%.
"""

from __future__ import annotations

import dataclasses

import pytest

from parity.judge.compare import Comparison, compare_frames
from parity.judge.diagnose import rank_agreement
from parity.run.early import EarlyStop, judge_stopped
from parity.spec import PairSpec
from tests.run.test_early import replay
from tests.specs import (
    EPOCHS,
    FINGERPRINTED,
    FIXED,
    INVARIANCE,
    LAUNCH_MODES,
    SEQ_MEAN,
    VAL46,
    legacy_vs_worker,
    plain,
)
from worker.mutants import MUTANTS

pytestmark = pytest.mark.parity

# name -> (check, base spec, first divergent metric, its step)
CHECKS = {
    "old-val-loss": ("pair", FIXED, "val/loss", 0),
    "lr-before-step": ("pair", FIXED, "train/lr", 1),
    "micro-batch-token-mean": ("pair", plain(), "train/loss", 1),
    "grad-norm-after-clip": ("pair", FIXED, "train/grad_norm", 1),
    "loss-summed-over-ranks": ("pair", plain(), "train/loss", 1),
    "missing-dp-factor": ("pair", plain(), "train/loss", 1),
    "sampler-without-set-epoch": ("pair", EPOCHS, "train/global_tokens", 3),
    "val-drop-last": ("pair", VAL46, "val/loss", 2),
    "seq-mean-dp-scaling": ("invariance", plain(overrides=SEQ_MEAN), "train/loss", 1),
    "resume-without-optimizer": ("resume", plain(), "train/loss", 12),
    # test_diagnose.py also traces it to model.layers.1's gradients through the fingerprints
    "layer-grad-halved": ("pair", FINGERPRINTED, "train/grad_norm", 1),
    "scheduler-on-rank-0-only": ("ranks", FINGERPRINTED, "train/lr", 1),
    # invisible in the fused step (one call); the Tinker-driven side splits each step in 2 calls
    "chunk-token-mean": ("tinker", LAUNCH_MODES, "train/loss", 1),
}
# checked in test_ppo_parity.py
PPO_CHECKED = {"critic-never-stepped", "reward-missing-engine", "reward-at-first-token"}
NOISE_CHECKED = {"sampler-seed-from-time"}  # in test_noise_floor.py (A vs A, not A vs B)
# in test_onpolicy.py: `parity onpolicy` names the link each breaks
ONPOLICY_CHECKED = {
    "batch-dependent-log-softmax", "trainer-without-temperature", "log-probs-shifted",
    "processed-log-probs",
}  # fmt: skip


def test_every_mutant_has_a_check():
    assert set(MUTANTS) == set(CHECKS) | PPO_CHECKED | NOISE_CHECKED | ONPOLICY_CHECKED


def _check(runner, mutant: str) -> Comparison:
    kind, base, _, _ = CHECKS[mutant]
    if kind == "pair":
        return legacy_vs_worker(runner, base, [mutant]).comparison
    if kind == "tinker":  # legacy against the Tinker-driven trainer carrying the mutant
        b = {"trainer": "tinker", "inject": [mutant]}
        return runner.pair(PairSpec(base, {"trainer": "legacy"}, b), in_process=True).comparison
    if kind == "invariance":  # one rank against two: the policy of test_invariance.py
        one = runner.job(plain(world_size=1, overrides=base.overrides))
        two = runner.job(plain(world_size=2, overrides=base.overrides, inject=[mutant]))
        return compare_frames(one.metrics, two.metrics, INVARIANCE)
    if kind == "resume":
        full = runner.job(plain(overrides={"save_state_at": 10}))
        state = str(full.dir / "state_step10")
        resumed = runner.job(plain(overrides={"resume": state}, inject=[mutant]))
        return compare_frames(full.metrics.loc[11:], resumed.metrics)
    if kind == "ranks":  # one job: each rank's own record of the reduced metrics vs rank 0's
        agreement = rank_agreement(runner.job(dataclasses.replace(base, inject=[mutant])).dir)
        first = agreement.disagreements[0].rank if agreement.disagreements else 1
        return agreement.comparisons[first]
    raise AssertionError(kind)


@pytest.mark.parametrize("mutant", sorted(CHECKS))
def test_mutant_is_caught_where_expected(parity_runner, parity_mutant_score, mutant, tmp_path):
    _, _, metric, step = CHECKS[mutant]
    comparison = _check(parity_runner, mutant)
    parity_mutant_score(mutant, comparison.verdict == "diverged")
    assert comparison.verdict == "diverged", comparison.table()
    result = comparison.metrics[metric]
    assert result.status == "diverged" and result.first_divergent_step == step, comparison.table()
    first = min(r.first_divergent_step for r in comparison.failures)
    assert first == step, comparison.table()  # nothing diverges earlier than the named metric
    if CHECKS[mutant][0] == "pair":
        _stops_early_alike(legacy_vs_worker(parity_runner, CHECKS[mutant][1], [mutant]), tmp_path)


def _stops_early_alike(pair, folder) -> None:
    """Side B's metrics.jsonl replayed line by line through the early stop (parity.run.early)
    against side A's numbers, as `check` judges a head while it runs: stopped, with the whole
    pair's verdict and first divergence (metric, step, values). A divergence at the last step
    stops nothing: the run has ended by the time that step is known to be whole."""
    early = EarlyStop(pair.a.metrics, folder / "metrics.jsonl")
    lines = pair.b.dir.joinpath("metrics.jsonl").read_text().splitlines()
    whole = pair.comparison
    stopped_after = replay(early, lines)
    if whole.first_divergence().first_divergent_step == pair.b.metrics.index.max():
        assert stopped_after is None and early.step is None
        return
    assert stopped_after is not None, "the early stop never stopped"
    stopped = judge_stopped(pair.a.metrics, early.frame, early.step)
    assert stopped.verdict == whole.verdict
    s, w = stopped.first_divergence(), whole.first_divergence()
    assert (s.name, s.first_divergent_step, s.a_value, s.b_value) == (
        w.name, w.first_divergent_step, w.a_value, w.b_value
    )  # fmt: skip


def test_seq_mean_dp_scaling_is_invisible_at_one_rank(parity_runner):
    """Why its check must run at dp = 2: at one rank the bug changes no bit."""
    clean = parity_runner.job(plain(world_size=1, overrides=SEQ_MEAN))
    broken = parity_runner.job(
        plain(world_size=1, overrides=SEQ_MEAN, inject=["seq-mean-dp-scaling"])
    )
    assert compare_frames(clean.metrics, broken.metrics).verdict == "aligned"
