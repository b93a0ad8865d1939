"""PPO pieces without torchrun: the reward, the reward slot, extras in collate, GAE and losses."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from worker.data.batching import collate
from worker.data.charcount import DATA_DIR, Encoded, read_jsonl
from worker.losses import policy_loss_terms, value_loss_terms
from worker.rewards import RuleRewardModel, charcount_score, resolve_reward_model
from worker.trainers.ppo_common import PPOConfig, RolloutSample, compute_advantages, parse_config


def test_gold_answers_score_one_and_wrong_ones_zero():
    samples = read_jsonl(DATA_DIR / "train.jsonl")[:20]
    gold = [s["messages"][1]["content"] for s in samples]
    assert RuleRewardModel()(gold, samples) == [1.0] * 20
    s = samples[0]
    assert charcount_score(f"\\boxed{{{s['count'] + 1}}}", s) == 0.0
    assert charcount_score(f"boxed {s['count']}", s) == 0.0
    assert charcount_score(f"\\boxed{{{s['count']}", s) == 0.0  # not well-formed


def test_reward_slot_falls_back_to_legacy_and_fails_in_one_line():
    assert isinstance(resolve_reward_model("rule", prefer_engine=True), RuleRewardModel)
    with pytest.raises(SystemExit, match=r"^error: reward model 'x' has no engine or legacy"):
        resolve_reward_model("x", prefer_engine=True)


def _rollout(n: int, prompt: int, start: int) -> RolloutSample:
    ids = torch.arange(start, start + n) % 50 + 4
    mask = (torch.arange(n) >= prompt).long()
    extras = {"index": torch.full((n,), start), "v": ids.float() / 10}
    return RolloutSample(ids, mask, {}, "", n - prompt, extras)


def test_collate_carries_extras_in_both_layouts():
    samples = [_rollout(7, 3, 0), _rollout(4, 1, 1), _rollout(9, 5, 2)]
    packed, padded = collate(samples, packed=True), collate(samples, packed=False)
    keep = padded.attention_mask.bool()
    for key in ("index", "v"):
        assert torch.equal(packed.extras[key][0], padded.extras[key][keep])
    assert torch.equal(packed.extras["v"][0], packed.input_ids[0].float() / 10)  # not shifted
    assert collate([Encoded(torch.arange(4), torch.ones(4, dtype=torch.int64))]).extras is None


def _gae_reference(rewards, values, gamma, lam):
    adv, last = np.zeros(len(rewards)), 0.0
    for t in reversed(range(len(rewards))):
        nxt = values[t + 1] if t + 1 < len(values) else 0.0
        last = rewards[t] + gamma * nxt - values[t] + gamma * lam * last
        adv[t] = last
    return adv


def test_advantages_are_gae_of_kl_penalized_rewards_then_whitened(tmp_path):
    from worker.distributed import init_distributed

    d = init_distributed()  # a one-process group for the all-reduces
    cfg = PPOConfig(out=tmp_path, kl_coef=0.1, gamma=1.0, lam=0.95)
    gen = torch.Generator().manual_seed(0)
    samples = [_rollout(10, 4, 0), _rollout(6, 2, 1)]
    for s in samples:
        for key in ("values", "old_log_probs", "ref_log_probs"):
            s.extras[key] = torch.randn(len(s), generator=gen)
    scores = [1.0, 0.0]
    metrics = compute_advantages(SimpleNamespace(cfg=cfg, dist=d), samples, scores)
    raw = []
    for s, score in zip(samples, scores, strict=True):
        pos = np.arange(s.response_length) + (len(s) - s.response_length - 1)
        v = s.extras["values"].numpy()[pos]
        r = -0.1 * (s.extras["old_log_probs"] - s.extras["ref_log_probs"]).numpy()[pos]
        r[-1] += score
        adv = _gae_reference(r, v, 1.0, 0.95)
        raw.append(adv)
        np.testing.assert_allclose(s.extras["returns"].numpy()[pos], adv + v, rtol=1e-5)
        outside = np.setdiff1d(np.arange(len(s)), pos)
        assert not s.extras["advantages"].numpy()[outside].any()  # zero outside the response
    flat = np.concatenate(raw)
    expected = (flat - flat.mean()) / flat.std(ddof=1)
    got = np.concatenate(
        [s.extras["advantages"].numpy()[len(s) - s.response_length - 1 : -1] for s in samples]
    )
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert metrics["reward/mean"] == 0.5
    assert metrics["response_length/mean"] == 5.0


def test_policy_and_value_terms():
    adv = torch.tensor([1.0, -1.0, 2.0])
    logp = torch.log(torch.tensor([0.5, 0.5, 0.9]))
    old = torch.log(torch.tensor([0.5, 0.3, 0.5]))
    pg, clipped = policy_loss_terms(logp, old, adv, 0.2)
    ratio = (logp - old).exp()
    assert torch.allclose(pg, torch.stack([-adv[0], -adv[1] * ratio[1], -adv[2] * 1.2]))
    assert clipped.tolist() == [0.0, 0.0, 1.0]  # a negative advantage with a large ratio: no clip
    vf, vclip = value_loss_terms(torch.tensor([2.0]), torch.tensor([0.0]), torch.tensor([0.0]), 0.5)
    assert vf.item() == 2.0 and vclip.item() == 0.0  # max(4, 0.25) / 2


def test_mini_batch_must_divide_the_global_batch(tmp_path):
    with pytest.raises(SystemExit, match="does not divide the global batch 8"):
        parse_config(["--out", str(tmp_path), "--ppo-mini-batch-size", "3"])


def test_prompts_are_those_whose_answer_fits_the_generation_budget(tmp_path):
    from worker.data.charcount import TOKENIZER_DIR, load_tokenizer
    from worker.trainers.ppo_common import answerable_prompts

    tok = load_tokenizer(TOKENIZER_DIR)
    samples = read_jsonl(DATA_DIR / "train.jsonl")
    cfg = PPOConfig(out=tmp_path)
    kept = answerable_prompts(samples, tok, cfg)
    assert 0 < len(kept) < len(samples)
    for s in samples:
        n = len(tok(s["messages"][1]["content"], add_special_tokens=False)["input_ids"]) + 1
        assert (s in kept) == (n <= cfg.max_new_tokens)
    assert answerable_prompts(samples, tok, PPOConfig(out=tmp_path, max_new_tokens=48)) == []


def test_warm_start_actor_is_the_recorded_sft_of_the_tiny_model():
    import json

    from worker.model import TINY_MODEL_DIR, weights_sha256
    from worker.warm_start import RECIPE, WARM_MODEL_DIR

    recipe = json.loads((WARM_MODEL_DIR / "recipe.json").read_text())
    assert recipe["sft_args"] == RECIPE
    assert recipe["base_model_sha256"] == weights_sha256(TINY_MODEL_DIR)
    assert recipe["weights_sha256"] == weights_sha256(WARM_MODEL_DIR)
    assert PPOConfig(out=None).model == WARM_MODEL_DIR  # PPO starts from it by default
    base = json.loads((TINY_MODEL_DIR / "config.json").read_text())
    warm = json.loads((WARM_MODEL_DIR / "config.json").read_text())
    assert {k: v for k, v in warm.items() if k != "use_cache"} == {
        k: v for k, v in base.items() if k != "use_cache"
    }


def test_gathered_keeps_the_fsdp2_layers_gathered_inside_and_resharded_after():
    """The rollout's generation (`Engine.gathered`): the layers are all-gathered once for all of
    its forwards, not per forward, with the same bits; after it, each forward reshards again as
    fully_shard set it (a one-rank FSDP2 engine, without torchrun)."""
    from torch.distributed.tensor import DTensor

    from worker.determinism import set_determinism
    from worker.distributed import init_distributed
    from worker.engine import Engine, OptimConfig
    from worker.model import load_model

    d = init_distributed()
    set_determinism(0)
    engine = Engine(load_model(), "fsdp2", OptimConfig(), d)
    weight = engine.model.model.layers[0].self_attn.q_proj
    ids = torch.tensor([[5, 6, 7, 8]])

    def forward() -> tuple[torch.Tensor, bool]:
        logits = engine.model(input_ids=ids).logits
        return logits, isinstance(weight.weight, DTensor)  # registered sharded or gathered

    with torch.no_grad():
        before, sharded = forward()
        assert sharded
        with engine.gathered():
            assert forward()[1] is False  # kept gathered for the next forward
            inside, sharded = forward()
            assert not sharded
        assert isinstance(weight.weight, DTensor)  # resharded on the way out
        after, sharded = forward()
        assert sharded  # and the next forward reshards again
    assert torch.equal(before, inside) and torch.equal(inside, after)
