"""Our catalogue of realistic bugs, each a small monkeypatch of the worker-side code.

Applied with `parity.rank.mutants` in every rank before training (see `parity mutants`). Each entry
names the check that must catch it; a parity check that passes on one of these is a defect.
"""

from __future__ import annotations


def old_val_loss() -> None:
    """val/loss as the mean of micro-batch losses: too small by the micro-batch count."""
    from worker.trainers.sft import SFTTrainer

    def validate(self) -> float:
        d = self.job.dist
        out = self.worker.forward(self.job.val[d.rank :: d.world], self.loss_fn)
        return out["loss"] / out["per_rank"]["num_micro_batches"][d.rank]

    SFTTrainer.validate = validate


def lr_before_step() -> None:
    """train/lr read before the scheduler steps: the classic off-by-one."""
    from worker.training_worker import TrainingWorker

    correct = TrainingWorker.optim_step

    def optim_step(self, params=None) -> dict:
        lr = self.engine.current_lr()
        return {**correct(self, params), "lr": lr}

    TrainingWorker.optim_step = optim_step


def micro_batch_token_mean() -> None:
    """Each micro-batch's own token-mean, weighted by its share of sequences.

    The gradient-accumulation bug transformers fixed in 2024: equal to the global token-mean only
    when every micro-batch has the same number of loss tokens.
    """
    import worker.trainers.sft as sft
    from worker.losses import LossScale

    correct = sft.sft_loss

    def per_micro_batch_mean(logits, mb, scale: LossScale, mode: str = "token-mean"):
        local = LossScale(float(max(mb.num_loss_tokens, 1)), scale.global_seqs, 1, scale.horizon)
        loss, metrics = correct(logits, mb, local, mode)
        return loss * (mb.num_seqs / scale.global_seqs) * scale.dp, metrics

    sft.sft_loss = per_micro_batch_mean


def chunk_token_mean() -> None:
    """Each forward_backward call normalized by its own token count, not the step's declared one.

    A step split into k calls then sums k token-means: about k times the loss. Invisible in the
    fused step (one call: its own count is the step's); the client-driven side shows it.
    """
    from worker.training_worker import TrainingWorker

    TrainingWorker._call_scale = lambda self, own, declared: own


def grad_norm_after_clip() -> None:
    """train/grad_norm measured after clipping (capped at the clip value)."""
    from worker.training_worker import TrainingWorker

    def clip_grad_norm(self, max_norm):
        self.engine.clip_grad_norm(max_norm)
        return self.engine.clip_grad_norm(max_norm)  # the norm of the already clipped gradients

    TrainingWorker._clip_grad_norm = clip_grad_norm


def loss_summed_over_ranks() -> None:
    """train/loss summed over ranks instead of averaged: off by a factor dp."""
    from worker.distributed import all_reduce_sum
    from worker.training_worker import TrainingWorker

    def reduce(self, value: float) -> float:
        return float(all_reduce_sum(value, self.dist.device))

    TrainingWorker.reduce_mean_over_ranks = reduce


def sampler_without_set_epoch() -> None:
    """Every epoch repeats the first epoch's order: data order diverges from epoch 2."""
    from torch.utils.data import DistributedSampler

    DistributedSampler.set_epoch = lambda self, epoch: None


def resume_without_optimizer() -> None:
    """load_state restores the weights but not the AdamW moments."""
    from worker.engine import Engine

    original = Engine.load

    def load(self, path):
        extra = original(self, path)
        self.optimizer.state.clear()
        return extra

    Engine.load = load


def seq_mean_dp_scaling() -> None:
    """Sequence-mean losses normalized by N_seqs * dp instead of N_seqs / dp: off by dp^2.

    Multiplying and dividing by dp = 1 are both exact, so the bug is invisible at one rank.
    """
    import dataclasses

    import worker.losses as losses

    correct = losses.agg_loss

    def agg_loss(values, mask, seq_ids, num_seqs, mode, scale):
        if mode.startswith("seq-mean"):
            scale = dataclasses.replace(scale, global_seqs=scale.global_seqs * scale.dp * scale.dp)
        return correct(values, mask, seq_ids, num_seqs, mode, scale)

    losses.agg_loss = agg_loss


def missing_dp_factor() -> None:
    """The micro-batch loss without `* dp`: DDP/FSDP averaging then shrinks every gradient by dp."""
    import dataclasses

    import worker.losses as losses

    correct = losses.agg_loss

    def agg_loss(values, mask, seq_ids, num_seqs, mode, scale):
        return correct(values, mask, seq_ids, num_seqs, mode, dataclasses.replace(scale, dp=1))

    losses.agg_loss = agg_loss


def val_drop_last() -> None:
    """The last, incomplete val micro-batch of each rank is dropped (drop_last on the loader)."""
    from worker.trainers.sft import SFTTrainer

    def validate(self) -> float:
        d, size = self.job.dist, self.job.cfg.micro_batch_size
        share = self.job.val[d.rank :: d.world]
        return self.worker.forward(share[: len(share) - len(share) % size], self.loss_fn)["loss"]

    SFTTrainer.validate = validate


def critic_never_stepped() -> None:
    """The engine PPO builds its critic, but the critic's optimizer never steps."""
    from worker.trainers.ppo import PPOTrainer

    original = PPOTrainer.__init__

    def __init__(self, job, reward_model):
        original(self, job, reward_model)
        self.critic.engine.optimizer.step = lambda *args, **kwargs: None

    PPOTrainer.__init__ = __init__


def reward_missing_engine() -> None:
    """The engine PPO's reward slot wired to an engine-only name that no registry has."""
    from worker.trainers.ppo import PPOTrainer

    PPOTrainer.reward_slot = staticmethod(lambda cfg: f"{cfg.reward_model}-engine")


def scheduler_on_rank_zero_only() -> None:
    """The lr scheduler stepped inside a rank-0-only branch: other ranks keep the first lr.

    Rank 0's own metrics stay right until the other ranks' updates drift; rank agreement names
    rank 1 at step 1 (its lr never moves).
    """
    from worker.engine import Engine

    original = Engine.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if self.dist.rank != 0:
            self.scheduler.step = lambda *a, **k: None

    Engine.__init__ = __init__


def layer_grad_halved() -> None:
    """A per-layer gradient multiplier (layer-wise decay done on the gradients) applied to
    model.layers.1 by mistake: that layer's gradients are halved before clipping."""
    from worker.engine import Engine

    original = Engine.clip_grad_norm

    def clip_grad_norm(self, *args, **kwargs):
        for name, p in self.model.named_parameters():
            if name.startswith("model.layers.1.") and p.grad is not None:
                p.grad.mul_(0.5)
        return original(self, *args, **kwargs)

    Engine.clip_grad_norm = clip_grad_norm


def sampler_seed_from_time() -> None:
    """The shuffle seed taken from the clock instead of --seed: every run sees another order.

    Nothing about A vs B is wrong here; the noise floor (A run twice) is what must catch it.
    """
    import time

    from torch.utils.data import DistributedSampler

    original = DistributedSampler.__init__

    def __init__(self, *args, **kwargs):
        kwargs["seed"] = time.time_ns() % 2**31
        original(self, *args, **kwargs)

    DistributedSampler.__init__ = __init__


def reward_at_first_token() -> None:
    """The sequence score added to the first response token's reward instead of the last.

    Invisible while every score is 0 (an untrained actor never answers): only a PPO run whose
    rewards vary can catch it.
    """
    import worker.trainers.ppo_common as ppo_common

    def token_rewards(kl, score, kl_coef):
        rewards = -kl_coef * kl
        rewards[0] += score
        return rewards

    ppo_common.token_rewards = token_rewards


# --- on-policy chain: each caught by `parity onpolicy` at its link -------------------


def _trainer_log_probs(wrap) -> None:
    """Replace the log-prob function both PPO trainers compute old_log_probs with (the rollout's
    and the prefill's are left alone: the bug is on the trainer's side)."""
    import worker.trainers.legacy_ppo as legacy
    import worker.trainers.ppo as worker_ppo

    for module in (legacy, worker_ppo):
        module.token_log_probs = wrap(module.token_log_probs)


def trainer_without_temperature() -> None:
    """The sampler divides the logits by the temperature, the trainer does not (link 2)."""
    _trainer_log_probs(lambda f: lambda logits, labels, temperature=1.0: f(logits, labels, 1.0))


def log_probs_shifted() -> None:
    """The trainer's log-probs one position late: token t gets token t-1's (link 2)."""
    import torch

    _trainer_log_probs(lambda f: lambda *a, **k: torch.roll(f(*a, **k), 1))


def batch_dependent_log_softmax() -> None:
    """The trainer centres the logits on the whole micro-batch's max before the log-softmax: the
    same number in exact arithmetic, other bits for another batch (link 1)."""
    _trainer_log_probs(lambda f: lambda logits, *a, **k: f(logits - logits.max(), *a, **k))


def processed_log_probs() -> None:
    """The rollout records its log-probs after top-k/top-p (renormalized) where the trainer
    computes the raw ones (link 3; needs top-p < 1 or top-k > 0 to show)."""
    import worker.trainers.ppo_common as common

    correct = common.sampler_log_probs

    def both_processed(logits, scores, tokens, temperature):
        _, processed = correct(logits, scores, tokens, temperature)
        return processed, processed

    common.sampler_log_probs = both_processed


MUTANTS = {
    "old-val-loss": ("val/loss as the mean of micro-batch losses", old_val_loss),
    "lr-before-step": ("train/lr logged before the scheduler step", lr_before_step),
    "micro-batch-token-mean": (
        "loss normalized per micro-batch instead of by the global token count",
        micro_batch_token_mean,
    ),
    "chunk-token-mean": (
        "each forward_backward call of a split step normalized by its own token count",
        chunk_token_mean,
    ),
    "grad-norm-after-clip": ("train/grad_norm read after clipping", grad_norm_after_clip),
    "loss-summed-over-ranks": (
        "train/loss summed instead of averaged over ranks",
        loss_summed_over_ranks,
    ),
    "sampler-without-set-epoch": (
        "DistributedSampler.set_epoch never called",
        sampler_without_set_epoch,
    ),
    "resume-without-optimizer": ("load_state drops the optimizer state", resume_without_optimizer),
    "missing-dp-factor": ("micro-batch loss not multiplied by dp", missing_dp_factor),
    "val-drop-last": ("the last incomplete val micro-batch dropped", val_drop_last),
    "seq-mean-dp-scaling": (
        "PPO seq-mean loss normalizer scaled by dp instead of divided by it (dp > 1 only)",
        seq_mean_dp_scaling,
    ),
    "critic-never-stepped": (
        "PPO critic built but its optimizer never steps",
        critic_never_stepped,
    ),
    "reward-at-first-token": (
        "PPO score placed on the first response token instead of the last",
        reward_at_first_token,
    ),
    "reward-missing-engine": (
        "PPO reward slot wired to a reward model with no implementation",
        reward_missing_engine,
    ),
    "scheduler-on-rank-0-only": (
        "lr scheduler stepped on rank 0 only: the other ranks keep the first lr",
        scheduler_on_rank_zero_only,
    ),
    "layer-grad-halved": (
        "gradients of model.layers.1 halved before clipping (a misplaced per-layer multiplier)",
        layer_grad_halved,
    ),
    "trainer-without-temperature": (
        "PPO trainer log-probs at temperature 1 while the sampler uses the temperature",
        trainer_without_temperature,
    ),
    "log-probs-shifted": ("PPO trainer log-probs shifted one position", log_probs_shifted),
    "batch-dependent-log-softmax": (
        "PPO trainer log-softmax centred on the micro-batch's max: bits depend on the batch",
        batch_dependent_log_softmax,
    ),
    "processed-log-probs": (
        "PPO rollout records its log-probs after top-p where the trainer's are raw",
        processed_log_probs,
    ),
    "sampler-seed-from-time": (
        "data shuffle seeded from the clock: no two runs alike (caught by the noise floor)",
        sampler_seed_from_time,
    ),
}
