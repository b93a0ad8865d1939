"""Legacy vs engine PPO on charcount RL, 2 ranks under torchrun: every update metric bitwise equal.

Each claim is paired with a mutant (applied to side B by parity.rank.mutants) that the check must
catch.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from parity import assert_parity
from parity.run.launch import LaunchError
from tests.specs import PPO, PPO_SHORT, legacy_vs_worker

pytestmark = pytest.mark.parity

METRICS = [
    "actor/pg_loss",
    "actor/pg_clipfrac",
    "actor/ppo_kl",
    "actor/entropy",
    "actor/grad_norm",
    "actor/lr",
    "critic/vf_loss",
    "critic/vf_clipfrac",
    "critic/grad_norm",
    "critic/lr",
    "critic/values_mean",
    "reward/mean",
    "response_length/mean",
]
BASE = PPO  # 2 ranks, 10 steps, 4 optimizer steps each (tests/specs.py)
SHORT = PPO_SHORT  # the same in 4 steps: the variants, the mutants, the launch-mode check
SEQ_MEAN = dataclasses.replace(
    SHORT,
    overrides={"ppo_mini_batch_size": 4, "loss_agg_mode": "seq-mean-token-mean"},
)
# DDP engines and padded batches (generation then runs on the unwrapped replica)
DDP_PADDED = dataclasses.replace(
    SHORT,
    engine="ddp",
    overrides={"ppo_mini_batch_size": 4, "padded": True},
)
# dynamic batch size: micro-batches packed up to a token budget, every rank the same count
DYNAMIC = dataclasses.replace(
    SHORT,
    micro_batch_size=None,
    dynamic_bsz=True,
    max_tokens_per_rank=160,
)


@pytest.mark.parametrize(
    "base",
    [BASE, SEQ_MEAN, DDP_PADDED, DYNAMIC],
    ids=["token-mean", "seq-mean-token-mean", "ddp-padded", "dynamic-bsz"],
)
def test_legacy_and_engine_ppo_are_bitwise_equal(parity_runner, base):
    assert BASE.steps >= 10  # the claim: >= 10 PPO steps; its variants may train fewer
    pair = legacy_vs_worker(parity_runner, base)
    comparison = assert_parity(pair.a, pair.b)
    for metric in METRICS:
        result = comparison.metrics[metric]
        assert result.status == "match" and result.policy == "exact", metric
        assert result.steps_compared == base.steps, metric
    lines = (pair.b.dir / "metrics.jsonl").read_text().splitlines()
    meta = [json.loads(x)["_meta"] for x in lines if '"_meta"' in x]
    assert len(meta) == base.steps
    assert all(m["updates"] == 4 for m in meta)  # >= 2 optimizer steps per PPO step
    micro_batches = [m["per_rank"]["num_micro_batches"] for m in meta]
    if base.dynamic_bsz:  # ranks agree on the count, and the budget really splits the batch
        assert all(a == b for a, b in micro_batches) and max(a for a, _ in micro_batches) >= 2
    else:
        assert all(n == [2, 2] for n in micro_batches), micro_batches
    assert any(v > 0 for v in pair.b.metrics["actor/pg_clipfrac"])  # clipping really happens
    # the SFT-warmed actor answers some prompts right: reward/mean is compared on real values
    rewards = pair.b.metrics["reward/mean"].tolist()
    assert len(set(rewards)) >= 2 and max(rewards) > 0, rewards


def test_in_process_ppo_pair_is_bitwise_two_launches(parity_runner):
    """Clean pairs share processes (a warm pool, or one in-process launch); a PPO side launched
    alone gives the same bits (on the 4-step pair that test_diagnose.py diagnoses too)."""
    pair = legacy_vs_worker(parity_runner, SHORT)
    alone = parity_runner.job(pair.b.spec, separate=True)
    assert pair.b.in_process and not alone.in_process
    comparison = assert_parity(pair.b, alone)
    assert all(comparison.metrics[m].status == "match" for m in METRICS)


def _first_divergences(comparison) -> dict[str, int | None]:
    return {m: comparison.metrics[m].first_divergent_step for m in METRICS}


def test_seq_mean_dp_scaling_is_caught_at_two_ranks(parity_runner, parity_mutant_score):
    comparison = legacy_vs_worker(parity_runner, SEQ_MEAN, ["seq-mean-dp-scaling"]).comparison
    parity_mutant_score("seq-mean-dp-scaling (PPO)", comparison.verdict == "diverged")
    assert comparison.verdict == "diverged"
    first = _first_divergences(comparison)
    for metric in ("actor/pg_loss", "actor/entropy", "critic/vf_loss", "critic/grad_norm"):
        assert first[metric] == 1, (metric, first)
    assert first["critic/values_mean"] == 2  # the critic saw the wrong gradients at step 1
    # step 1's rollout is the same on both sides; later ones come from actors that already differ
    assert (first["reward/mean"] or 2) >= 2 and first["actor/lr"] is None


def test_seq_mean_dp_scaling_is_invisible_at_one_rank(parity_runner):
    one_rank = dataclasses.replace(SEQ_MEAN, world_size=1)
    pair = legacy_vs_worker(parity_runner, one_rank, ["seq-mean-dp-scaling"])
    assert_parity(pair.a, pair.b)  # x * 1 and x / 1 are the same float: a dp=1 check cannot see it


def test_critic_never_stepped_is_caught(parity_runner, parity_mutant_score):
    comparison = legacy_vs_worker(parity_runner, SHORT, ["critic-never-stepped"]).comparison
    parity_mutant_score("critic-never-stepped", comparison.verdict == "diverged")
    assert comparison.verdict == "diverged"
    first = _first_divergences(comparison)
    # the second mini-batch of step 1 already sees an unchanged critic
    assert first["critic/vf_loss"] == 1 and first["critic/grad_norm"] == 1
    # step 1's advantages came from the initial critic on both sides; step 2's did not
    assert first["critic/values_mean"] == 2 and first["actor/pg_loss"] == 2
    assert first["critic/lr"] is None  # the scheduler still steps: lr alone would not show it


def test_reward_at_first_token_is_caught(parity_runner, parity_mutant_score):
    pair = legacy_vs_worker(parity_runner, SHORT, ["reward-at-first-token"])
    comparison = pair.comparison
    parity_mutant_score("reward-at-first-token", comparison.verdict == "diverged")
    assert comparison.verdict == "diverged"
    first = _first_divergences(comparison)
    rewards = pair.a.metrics["reward/mean"]
    step = int(rewards[rewards > 0].index[0])  # the mutant changes nothing while all scores are 0
    # same rollouts and scores up to that step; the advantages built from the score differ there
    assert all(s is None or s >= step for s in first.values()), (step, first)
    assert first["critic/vf_loss"] == step and first["actor/pg_loss"] == step, (step, first)
    assert first["reward/mean"] != step and first["response_length/mean"] != step, first


def test_reward_missing_engine_fails_early_with_one_line(parity_runner, parity_mutant_score):
    spec = dataclasses.replace(SHORT, trainer="worker", inject=["reward-missing-engine"])
    with pytest.raises(LaunchError) as info:
        parity_runner.job(spec, separate=True)  # a failure would end a warm pool: launch alone
    parity_mutant_score("reward-missing-engine", True)  # the run failed, loudly
    line = "error: reward model 'rule-engine' has no engine or legacy implementation"
    assert line in str(info.value)
    result = info.value.result
    assert result.duration_s < 60  # before any model is built or step is run
    tails = [result.tail(rank) for rank in (0, 1)]
    assert any(line in tail for tail in tails), tails
    # a rank may be stopped by torchrun (the first to fail ends the job) before it writes
    assert all(line in tail or not tail for tail in tails) and "Traceback" not in "".join(tails)
