"""The legacy PPO trainer: actor and critic as legacy workers that drive the engine directly.

Each worker has its own micro-batch loop, its own global normalizers (all-reduced by hand) and
its own metric code, as before the TrainingWorker refactor. It is the "before" side of the PPO
parity claim: do not make it share the TrainingWorker's code.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch
import torch.distributed as dist

from worker.data.batching import make_micro_batches
from worker.engine import Engine
from worker.losses import (
    LossScale,
    agg_loss,
    policy_loss_terms,
    token_entropy,
    token_log_probs,
    value_loss_terms,
)
from worker.onpolicy import ChainRecorder, chain_batching, mismatch_metrics
from worker.rewards import RewardModel, resolve_reward_model
from worker.trainers.ppo_common import (
    PPOConfig,
    PPOJob,
    RolloutSample,
    compute_advantages,
    mini_batches,
    rollout,
    to_samples,
    token_outputs,
)


class _LegacyWorker:
    def __init__(self, engine: Engine, cfg: PPOConfig):
        self.engine, self.cfg = engine, cfg
        self.device = engine.dist.device
        self.dp = engine.dist.world

    def _mean_over_ranks(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.item() / self.dp

    def _scale(self, mbs) -> LossScale:
        local = [
            float(sum(int(mb.loss_mask.sum()) for mb in mbs)),
            float(sum(mb.num_seqs for mb in mbs if mb.num_tokens)),
        ]
        t = torch.tensor(local, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        tokens, seqs = t.tolist()
        return LossScale(tokens, seqs, self.dp, float(self.cfg.max_new_tokens))

    @torch.no_grad()
    def _infer(self, samples: list[RolloutSample], key: str, fn) -> None:
        outputs = []
        for mb in make_micro_batches(samples, self.cfg.batching(), self.device):
            outputs.append(token_outputs(mb, fn(self.engine.forward(mb), mb)))
        to_samples(samples, outputs, key)

    def _step(self) -> tuple[float, float]:
        grad_norm = self.engine.clip_grad_norm()
        if not torch.isfinite(grad_norm):
            print(f"WARN: grad_norm is not finite: {grad_norm}")
        self.engine.step(grad_norm)
        return grad_norm.item(), self.engine.optimizer.param_groups[0]["lr"]

    def _update(self, samples: list[RolloutSample], step: int, job: PPOJob):
        """ppo_epochs passes over seeded mini-batches, one optimizer step each.

        Returns, per mini-batch, the micro-batch shares of `_micro_batch` summed and averaged
        over ranks (one list per share), the grad norms, and the last lr.
        """
        cfg = self.cfg
        shares_per_mini: list[list[float]] = []
        grad_norms, lr = [], 0.0
        for epoch in range(cfg.ppo_epochs):
            for mini in mini_batches(job, samples, step, epoch):
                self.engine.zero_grad()
                mbs = make_micro_batches(mini, cfg.batching(), self.device)
                scale = self._scale(mbs)
                shares = [self._micro_batch(mb, scale) for mb in mbs]
                grad_norm, lr = self._step()
                grad_norms.append(grad_norm)
                totals = [sum(column) for column in zip(*shares, strict=True)]
                shares_per_mini.append([self._mean_over_ranks(t) for t in totals])
        return list(map(list, zip(*shares_per_mini, strict=True))), grad_norms, lr


class LegacyActorWorker(_LegacyWorker):
    """Actor (and reference) worker: log-probs, and the PPO policy update."""

    def compute_log_prob(self, samples: list[RolloutSample], key: str) -> None:
        temp = self.cfg.temperature
        self._infer(samples, key, lambda logits, mb: token_log_probs(logits, mb.labels, temp))

    def _micro_batch(self, mb, scale: LossScale) -> tuple[float, float, float, float]:
        """Backward on one micro-batch's policy loss; (loss, clipfrac, kl, entropy) shares."""
        cfg = self.cfg
        logits = self.engine.forward(mb)
        logp = token_log_probs(logits, mb.labels, cfg.temperature)
        old, adv = _extra(mb, "old_log_probs", logp), _extra(mb, "advantages", logp)
        pg, clipped = policy_loss_terms(logp, old, adv, cfg.clip_ratio)
        mask, ids, n = mb.loss_mask.reshape(-1), mb.seq_ids.reshape(-1), mb.num_seqs
        loss = agg_loss(pg, mask, ids, n, cfg.loss_agg_mode, scale)
        loss.backward()
        with torch.no_grad():
            clipfrac = agg_loss(clipped, mask, ids, n, "token-mean", scale).item()
            kl = agg_loss(old - logp, mask, ids, n, "token-mean", scale).item()
            ent = token_entropy(logits / cfg.temperature)
            entropy = agg_loss(ent, mask, ids, n, cfg.loss_agg_mode, scale).item()
        return loss.item(), clipfrac, kl, entropy

    def update_policy(self, samples: list[RolloutSample], step: int, job: PPOJob) -> dict:
        (pg_losses, clipfracs, kls, entropies), grad_norms, lr = self._update(samples, step, job)
        return {
            "actor/pg_loss": _mean(pg_losses),
            "actor/pg_clipfrac": _mean(clipfracs),
            "actor/ppo_kl": _mean(kls),
            "actor/entropy": _mean(entropies),
            "actor/grad_norm": _mean(grad_norms),
            "actor/lr": lr,
        }


class LegacyCriticWorker(_LegacyWorker):
    """Critic worker: values, and the clipped value-loss update."""

    def compute_values(self, samples: list[RolloutSample]) -> None:
        self._infer(samples, "values", lambda out, mb: out.reshape(-1))

    def _micro_batch(self, mb, scale: LossScale) -> tuple[float, float]:
        """Backward on one micro-batch's value loss; (loss, clipfrac) shares."""
        cfg = self.cfg
        v = self.engine.forward(mb).reshape(-1).float()
        old, ret = _extra(mb, "old_values", v), _extra(mb, "returns", v)
        vf, clipped = value_loss_terms(v, old, ret, cfg.cliprange_value)
        mask, ids, n = mb.loss_mask.reshape(-1), mb.seq_ids.reshape(-1), mb.num_seqs
        loss = agg_loss(vf, mask, ids, n, cfg.loss_agg_mode, scale)
        loss.backward()
        with torch.no_grad():
            clipfrac = agg_loss(clipped, mask, ids, n, "token-mean", scale).item()
        return loss.item(), clipfrac

    def update_critic(self, samples: list[RolloutSample], step: int, job: PPOJob) -> dict:
        (vf_losses, clipfracs), grad_norms, lr = self._update(samples, step, job)
        return {
            "critic/vf_loss": _mean(vf_losses),
            "critic/vf_clipfrac": _mean(clipfracs),
            "critic/grad_norm": _mean(grad_norms),
            "critic/lr": lr,
        }


def _extra(mb, key: str, like: torch.Tensor) -> torch.Tensor:
    if mb.extras is None:
        return torch.zeros(mb.labels.numel(), dtype=like.dtype, device=like.device)
    return mb.extras[key].reshape(-1).to(like.device)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


class LegacyPPOTrainer:
    @staticmethod
    def build_reward_model(cfg: PPOConfig) -> RewardModel:
        return resolve_reward_model(cfg.reward_model, prefer_engine=False)

    def __init__(self, job: PPOJob, reward_model: RewardModel):
        self.job, self.reward_model = job, reward_model
        self.actor = LegacyActorWorker(job.actor, job.cfg)
        self.ref = LegacyActorWorker(job.ref, job.cfg)
        self.critic = LegacyCriticWorker(job.critic, job.cfg)
        self.chain = ChainRecorder(job)

    def _chain(self, samples: list[RolloutSample], step: int) -> None:
        """--logprob-chain: the actor's log-probs at a second micro-batch size, then the dump."""
        batching = chain_batching(self.job.cfg, len(samples))
        cfg = replace(self.job.cfg, micro_batch_size=batching.micro_batch_size, dynamic_bsz=False)
        with self.chain.capture("trainer_n"):
            LegacyActorWorker(self.job.actor, cfg).compute_log_prob(samples, "chain_log_probs")
        self.chain.write(step, samples, batching.micro_batch_size)

    def fit(self) -> None:
        job = self.job
        for step, epoch, prompts in job.rank_prompts():
            start = time.perf_counter()
            with self.chain.capture("decode"):
                samples = rollout(job, prompts, step)
            rollout_s = time.perf_counter() - start
            scores = self.reward_model([s.response for s in samples], prompts)
            with self.chain.capture("trainer_m"):
                self.actor.compute_log_prob(samples, "old_log_probs")
            if job.cfg.logprob_chain:
                self._chain(samples, step)
            self.ref.compute_log_prob(samples, "ref_log_probs")
            self.critic.compute_values(samples)
            metrics = compute_advantages(job, samples, scores)
            metrics.update(mismatch_metrics(job, samples))
            metrics.update(self.critic.update_critic(samples, step, job))
            metrics.update(self.actor.update_policy(samples, step, job))
            metrics["timing_s/rollout"] = rollout_s
            metrics["timing_s/step"] = time.perf_counter() - start
            job.log.log(step, metrics, {"epoch": epoch})
