"""PPO rebuilt on TrainingWorker: actor, reference and critic are workers over their engines.

The critic is a value model (a one-label token-classification head), so its engine's `forward`
already returns per-token values and TrainingWorker needs no critic-specific code. The reward
model slot takes the engine version of the configured reward model and falls back to the legacy
implementation, which is all the rule-based reward has.
"""

from __future__ import annotations

import functools
import time

import torch

from worker.losses import LossScale, ppo_policy_loss, ppo_value_loss, token_log_probs
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
from worker.training_worker import LossFn, TrainingWorker


def _log_prob_outputs(logits: torch.Tensor, mb, scale: LossScale, temperature: float):
    """A forward 'loss' that returns this micro-batch's per-token log-probs as its output."""
    out = token_outputs(mb, token_log_probs(logits, mb.labels, temperature))
    return logits.new_zeros(()), {"outputs": out}


def _value_outputs(values: torch.Tensor, mb, scale: LossScale):
    return values.new_zeros(()), {"outputs": token_outputs(mb, values.reshape(-1))}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


class PPOTrainer:
    @staticmethod
    def reward_slot(cfg: PPOConfig) -> str:
        """The name the reward-model slot is wired to."""
        return cfg.reward_model

    @classmethod
    def build_reward_model(cls, cfg: PPOConfig) -> RewardModel:
        return resolve_reward_model(cls.reward_slot(cfg), prefer_engine=True)

    def __init__(self, job: PPOJob, reward_model: RewardModel):
        cfg = job.cfg
        self.job, self.cfg, self.reward_model = job, cfg, reward_model
        self.actor = TrainingWorker(job.actor, cfg.batching())
        self.ref = TrainingWorker(job.ref, cfg.batching())
        self.critic = TrainingWorker(job.critic, cfg.batching())
        self.chain = ChainRecorder(job)
        self.log_prob_fn = functools.partial(_log_prob_outputs, temperature=cfg.temperature)
        self.policy_loss = functools.partial(
            ppo_policy_loss, mode=cfg.loss_agg_mode, clip=cfg.clip_ratio,
            temperature=cfg.temperature,
        )  # fmt: skip
        self.value_loss = functools.partial(
            ppo_value_loss, mode=cfg.loss_agg_mode, clip=cfg.cliprange_value
        )

    def _infer(self, worker: TrainingWorker, samples: list[RolloutSample], fn, key: str) -> None:
        out = worker.forward(samples, fn)
        to_samples(samples, [m["outputs"] for m in out["micro_batch_metrics"]], key)

    def _update(
        self, worker: TrainingWorker, samples: list[RolloutSample], step: int, loss_fn: LossFn
    ) -> tuple[dict[str, list[float]], dict]:
        """ppo_epochs passes over seeded mini-batches, one optimizer step each."""
        history: dict[str, list[float]] = {"loss": [], "grad_norm": []}
        per_rank: dict = {}
        for epoch in range(self.cfg.ppo_epochs):
            for mini in mini_batches(self.job, samples, step, epoch):
                fb = worker.forward_backward(mini, loss_fn)
                opt = worker.optim_step()
                history["loss"].append(fb["loss"])
                history["grad_norm"].append(opt["grad_norm"])
                for k, v in fb["metrics"].items():
                    history.setdefault(k, []).append(v)
                history["lr"] = [opt["lr"]]
                per_rank = opt["per_rank"]
        return history, per_rank

    def _chain(self, samples: list[RolloutSample], step: int) -> None:
        """--logprob-chain: the actor's log-probs at a second micro-batch size, then the dump."""
        batching = chain_batching(self.cfg, len(samples))
        actor_n = TrainingWorker(self.job.actor, batching)
        with self.chain.capture("trainer_n"):
            self._infer(actor_n, samples, self.log_prob_fn, "chain_log_probs")
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
                self._infer(self.actor, samples, self.log_prob_fn, "old_log_probs")
            if self.cfg.logprob_chain:
                self._chain(samples, step)
            self._infer(self.ref, samples, self.log_prob_fn, "ref_log_probs")
            self._infer(self.critic, samples, _value_outputs, "values")
            metrics = compute_advantages(job, samples, scores)
            metrics.update(mismatch_metrics(job, samples))
            critic, _ = self._update(self.critic, samples, step, self.value_loss)
            actor, per_rank = self._update(self.actor, samples, step, self.policy_loss)
            metrics.update(
                {
                    "critic/vf_loss": _mean(critic["loss"]),
                    "critic/vf_clipfrac": _mean(critic["vf_clipfrac"]),
                    "critic/grad_norm": _mean(critic["grad_norm"]),
                    "critic/lr": critic["lr"][-1],
                    "actor/pg_loss": _mean(actor["loss"]),
                    "actor/pg_clipfrac": _mean(actor["pg_clipfrac"]),
                    "actor/ppo_kl": _mean(actor["ppo_kl"]),
                    "actor/entropy": _mean(actor["entropy"]),
                    "actor/grad_norm": _mean(actor["grad_norm"]),
                    "actor/lr": actor["lr"][-1],
                    "timing_s/rollout": rollout_s,
                    "timing_s/step": time.perf_counter() - start,
                }
            )
            meta = {"epoch": epoch, "per_rank": per_rank, "updates": len(actor["loss"])}
            job.log.log(step, metrics, meta)
