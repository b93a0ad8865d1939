"""What both PPO trainers share: config, the job (actor, critic, reference engines), the prompt
order, the seeded rollout, advantages (KL-penalized rewards, GAE, global whitening) and the
mini-batch shuffles. This is the driver side of PPO; the parity claim is about the actor and
critic workers in legacy_ppo.py and ppo.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from parity.record.digest import DataDigest
from worker.data.batching import BatchingConfig, MicroBatch, step_order
from worker.data.charcount import DATA_DIR, TOKENIZER_DIR, Encoded, load_tokenizer, read_jsonl
from worker.determinism import set_determinism
from worker.distributed import Dist, all_reduce_sum, init_distributed
from worker.engine import Engine, OptimConfig
from worker.entry import check_step_flags, config_from_args, job_arg_parser
from worker.losses import token_log_probs
from worker.metrics_log import JobLog, write_manifest
from worker.model import load_model, load_value_model
from worker.warm_start import WARM_MODEL_DIR


@dataclass
class PPOConfig:
    out: Path
    trainer: str = "worker"
    engine: str = "fsdp2"
    steps: int = 10
    seed: int = 0
    global_batch_size: int = 8  # prompts per PPO step
    micro_batch_size: int = 1  # sequences per micro-batch and rank
    dynamic_bsz: bool = False
    max_tokens_per_rank: int = 2048
    packed: bool = True
    ppo_mini_batch_size: int = 0  # prompts per optimizer step; 0: half the global batch
    ppo_epochs: int = 2
    max_new_tokens: int = 96  # also selects the prompts: those whose answer fits
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    lr: float = 1e-4  # the actor starts from an SFT model: a gentler step than the critic's
    critic_lr: float = 1e-3
    warmup_ratio: float = 0.1
    min_lr_ratio: float = 0.1
    clip_grad: float = 1.0
    loss_agg_mode: str = "token-mean"
    clip_ratio: float = 0.2
    cliprange_value: float = 0.5
    kl_coef: float = 0.01
    gamma: float = 1.0
    lam: float = 0.95
    reward_model: str = "rule"
    model: Path = WARM_MODEL_DIR  # the SFT-warmed actor: rewards are not all zero
    tokenizer: Path = TOKENIZER_DIR
    data: Path = DATA_DIR
    attn: str = "sdpa"
    val_loss: str = "fixed"  # accepted for the harness's common flags; PPO has no val loss
    fingerprint_steps: list[int] | str = field(default_factory=list)  # or "all"
    trace_step: int = 0  # trace the actor's first update of this step into ops/; 0: off
    stop_after: int = 0  # end after this step (the schedule stays that of `steps`); 0: every step
    batch_invariant: bool = False  # worker.batch_invariant's forward in every model
    logprob_chain: bool = False  # write the on-policy chain's log-probs (worker.onpolicy)

    @property
    def mini_batch_size(self) -> int:
        return self.ppo_mini_batch_size or max(1, self.global_batch_size // 2)

    @property
    def last_step(self) -> int:
        return self.stop_after or self.steps

    @property
    def updates_per_step(self) -> int:
        return self.ppo_epochs * (self.global_batch_size // self.mini_batch_size)

    def batching(self) -> BatchingConfig:
        return BatchingConfig.of(self, self.max_new_tokens)

    def optim(self, lr: float) -> OptimConfig:
        return OptimConfig(
            lr=lr,
            warmup_ratio=self.warmup_ratio,
            min_lr_ratio=self.min_lr_ratio,
            clip_grad=self.clip_grad,
            total_steps=self.steps * self.updates_per_step,  # the scheduler steps per update
        )


def parse_config(argv: list[str] | None = None) -> PPOConfig:
    p = job_arg_parser("python -m worker.ppo", "charcount PPO job", PPOConfig)
    own = ("ppo_mini_batch_size", "ppo_epochs", "max_new_tokens", "temperature", "top_k",
           "top_p", "critic_lr", "clip_ratio", "cliprange_value", "kl_coef", "gamma", "lam",
           "reward_model")  # fmt: skip
    for name in own:  # defaults (and types) from PPOConfig: one place for each
        default = getattr(PPOConfig, name)
        p.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)
    p.add_argument(
        "--batch-invariant", action="store_true",
        help="every model's forward gives a token the same bits whatever the batch, and in KV-"
        "cache decode as in a prefill (worker.batch_invariant; CPU, one thread per rank)",
    )  # fmt: skip
    p.add_argument(
        "--logprob-chain", action="store_true",
        help="write each step's rollout decode, rollout prefill and trainer log-probs at two "
        "micro-batch sizes to onpolicy/ for `parity onpolicy`",
    )  # fmt: skip
    cfg = config_from_args(PPOConfig, p.parse_args(argv))
    validate(cfg)
    return cfg


def validate(cfg: PPOConfig) -> None:
    """Impossible settings fail before any rank starts, in one line."""
    for name in ("steps", "global_batch_size", "ppo_epochs", "max_new_tokens", "micro_batch_size"):
        if getattr(cfg, name) < 1:
            raise SystemExit(f"error: --{name.replace('_', '-')} must be >= 1")
    check_step_flags(cfg)
    if not 0.0 < cfg.top_p <= 1.0 or cfg.top_k < 0 or not cfg.temperature > 0.0:
        raise SystemExit("error: --top-p must be in (0, 1], --top-k >= 0, --temperature > 0")
    if cfg.global_batch_size % cfg.mini_batch_size:
        raise SystemExit(
            f"error: --ppo-mini-batch-size {cfg.mini_batch_size} does not divide the global "
            f"batch {cfg.global_batch_size}"
        )
    if not (cfg.model / "config.json").exists():
        raise SystemExit(f"error: {cfg.model}: not a model folder (no config.json)")
    if not (cfg.data / "train.jsonl").exists():
        raise SystemExit(f"error: {cfg.data / 'train.jsonl'}: no such data file")


@dataclass(frozen=True, eq=False)
class RolloutSample(Encoded):
    """Prompt + response ids (loss on the response) and label-aligned per-token extras."""

    prompt: dict = field(default_factory=dict)
    response: str = ""
    response_length: int = 0
    extras: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class PPOJob:
    """Everything both trainers need, built in one order: determinism, then the models."""

    cfg: PPOConfig
    dist: Dist
    tokenizer: object
    prompts: list[dict]
    actor: Engine
    critic: Engine
    ref: Engine  # a frozen copy of the initial actor; its optimizer never steps
    log: JobLog

    @classmethod
    def build(cls, cfg: PPOConfig) -> PPOJob:
        d = init_distributed()
        mini = cfg.mini_batch_size
        if cfg.global_batch_size % d.world or mini % d.world:
            raise SystemExit(
                f"error: global batch {cfg.global_batch_size} and mini-batch {mini} must both be "
                f"divisible by world size {d.world}"
            )
        if cfg.batch_invariant:  # more threads split a matmul's rows: see worker.batch_invariant
            torch.set_num_threads(1)
        determinism = set_determinism(cfg.seed)
        tokenizer = load_tokenizer(cfg.tokenizer)
        prompts = answerable_prompts(read_jsonl(cfg.data / "train.jsonl"), tokenizer, cfg)
        if len(prompts) < cfg.global_batch_size:
            raise SystemExit(
                f"error: {cfg.data / 'train.jsonl'}: {len(prompts)} prompts whose reference answer "
                f"fits in --max-new-tokens {cfg.max_new_tokens}, fewer than one global batch of "
                f"{cfg.global_batch_size}"
            )
        invariant = cfg.batch_invariant
        actor_model = load_model(cfg.model, cfg.attn, invariant)
        actor = Engine(actor_model, cfg.engine, cfg.optim(cfg.lr), d)
        critic_model = load_value_model(cfg.model, cfg.attn, cfg.seed, invariant)
        critic = Engine(critic_model, cfg.engine, cfg.optim(cfg.critic_lr), d)
        ref = Engine(load_model(cfg.model, cfg.attn, invariant), cfg.engine, cfg.optim(0.0), d)
        # what parity.judge.diagnose reads: each step's prompts, the rollout's scoring forwards and
        # the
        # update micro-batches of every rank; actor and critic fingerprints at the chosen steps
        digest = DataDigest()
        for engine in (actor, critic, ref):
            engine.data_digest, engine.digest_kinds = digest, ("train", "rollout")
        actor.fingerprint_steps = critic.fingerprint_steps = cfg.fingerprint_steps
        actor.trace_step, actor.trace_out = cfg.trace_step, cfg.out
        log = JobLog(cfg.out, d.rank, {"actor.": actor, "critic.": critic})
        job = cls(cfg, d, tokenizer, prompts, actor, critic, ref, log)
        if d.rank == 0:
            job.write_manifest(determinism)
        return job

    def write_manifest(self, determinism: dict) -> None:
        files = {"train": self.cfg.data / "train.jsonl"}
        write_manifest(
            self.cfg, self.dist, determinism, files,
            num_params=self.actor.num_params, critic_num_params=self.critic.num_params,
        )  # fmt: skip

    def rank_prompts(self):
        """(step, epoch, this rank's prompts): the same data order as SFT."""
        d, cfg = self.dist, self.cfg
        steps = range(1, cfg.last_step + 1)
        order = step_order(
            len(self.prompts), cfg.global_batch_size, d.rank, d.world, cfg.seed, steps
        )
        for step, epoch, chosen in order:
            self.actor.current_step = self.critic.current_step = step  # for the fingerprints
            yield step, epoch, [self.prompts[i] for i in chosen]


def answerable_prompts(samples: list[dict], tokenizer, cfg: PPOConfig) -> list[dict]:
    """The samples whose reference answer (plus eos) fits in max_new_tokens, in file order.

    A response cut before its `\\boxed{k}` can never earn a reward, so a prompt whose answer
    cannot fit only adds zeros to `reward/mean`.
    """
    answers = [s["messages"][1]["content"] for s in samples]
    lengths = tokenizer(answers, add_special_tokens=False)["input_ids"]
    fits = [len(ids) + 1 <= cfg.max_new_tokens for ids in lengths]  # + 1: the eos token
    return [s for s, ok in zip(samples, fits, strict=True) if ok]


# --- rollout ------------------------------------------------------------------------------------


def _seed(*parts: int) -> int:
    value = 0
    for p in parts:
        value = (value * 1_000_003 + p) % (2**63 - 1)
    return value


@torch.no_grad()
def rollout(job: PPOJob, prompts: list[dict], step: int) -> list[RolloutSample]:
    """Sample one response per prompt from the current actor, seeded by (seed, step, rank).

    Every rank generates its own share with the actor, its FSDP2 layers gathered once for the
    whole generation (`Engine.gathered`: not once per generated token). Early stopping is off, so
    all ranks run exactly max_new_tokens forwards; the response is cut after its first eos
    afterwards.
    """
    cfg, d, tok = job.cfg, job.dist, job.tokenizer
    ids = [
        list(tok.apply_chat_template(p["messages"][:1], add_generation_prompt=True,
                                     tokenize=True, return_dict=False))
        for p in prompts
    ]  # fmt: skip
    if job.actor.data_digest is not None:
        job.actor.data_digest.add_prompts(ids)
    width = max(len(x) for x in ids)
    pad = tok.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids], device=d.device)
    attention = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device=d.device)
    devices = [d.device] if d.device.type == "cuda" else []
    with job.actor.gathered(), torch.random.fork_rng(devices=devices):
        torch.manual_seed(_seed(cfg.seed, step, d.rank))
        out = job.actor.model.generate(
            input_ids=input_ids, attention_mask=attention, do_sample=True,
            max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_k=cfg.top_k,
            top_p=cfg.top_p, eos_token_id=None, pad_token_id=pad, use_cache=True,
            synced_gpus=False,  # every rank runs max_new_tokens forwards: no per-token all-reduce
            return_dict_in_generate=True, output_logits=True, output_scores=True,
        )  # fmt: skip
    generated = out.sequences[:, width:]
    raw, processed = sampler_log_probs(
        torch.stack(out.logits, 1), torch.stack(out.scores, 1), generated, cfg.temperature
    )
    samples = []
    for i, (prompt, prompt_ids) in enumerate(zip(prompts, ids, strict=True)):
        response = generated[i].tolist()
        if tok.eos_token_id in response:
            response = response[: response.index(tok.eos_token_id) + 1]
        full = torch.tensor(prompt_ids + response, dtype=torch.int64)
        mask = torch.zeros_like(full)
        mask[len(prompt_ids) :] = 1
        text = tok.decode(response, skip_special_tokens=True)
        extras = {"index": torch.full_like(full, i)}
        where = slice(len(prompt_ids) - 1, len(full) - 1)  # label-aligned: the response tokens
        for key, values in (("rollout_log_probs", raw), ("rollout_processed_log_probs", processed)):
            extras[key] = torch.zeros(len(full))
            extras[key][where] = values[i, : len(response)].cpu()
        samples.append(RolloutSample(full, mask, prompt, text, len(response), extras))
    return samples


def sampler_log_probs(
    logits: torch.Tensor, scores: torch.Tensor, tokens: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rollout's own log-probs of the tokens it sampled, [B, T] each, two ways:

    raw: the log-softmax of the logits the sampler used at the sampling temperature, before
    top-k/top-p: what the trainer computes (`token_log_probs`), so this is the one the trainer
    must reproduce. processed: after temperature, top-k and top-p (transformers' processed
    scores), the distribution the token was actually drawn from; top-k/top-p renormalize it over
    the kept tokens, which adds -log(kept mass) to every log-prob. With top_k 0 and top_p 1 the
    two are the same.
    """
    shape = tokens.shape
    raw = token_log_probs(logits, tokens, temperature).reshape(shape)
    processed = token_log_probs(scores, tokens, 1.0).reshape(shape)
    return raw, processed


# --- per-token outputs back to samples ----------------------------------------------------------


def token_outputs(mb: MicroBatch, values: torch.Tensor) -> dict[str, torch.Tensor]:
    """One micro-batch's per-token values with each position's sample index (real tokens only)."""
    flat = values.detach().reshape(-1).float().cpu()
    if mb.extras is None:  # an empty dummy micro-batch
        return {"values": flat[:0], "index": torch.zeros(0, dtype=torch.int64)}
    valid = torch.ones_like(flat, dtype=torch.bool)
    if mb.attention_mask is not None:
        valid = mb.attention_mask.reshape(-1).bool()
    return {"values": flat[valid], "index": mb.extras["index"].reshape(-1)[valid]}


def to_samples(samples: list[RolloutSample], outputs: list[dict], key: str) -> None:
    """Store the outputs of every micro-batch as each sample's label-aligned extra `key`."""
    values = torch.cat([o["values"] for o in outputs])
    index = torch.cat([o["index"] for o in outputs])
    for i, s in enumerate(samples):
        s.extras[key] = values[index == i]
        assert len(s.extras[key]) == len(s), (key, i)


# --- advantages ---------------------------------------------------------------------------------


def response_positions(s: Encoded) -> torch.Tensor:
    """Label-aligned positions of the response tokens (the ones that predict them)."""
    shifted = torch.roll(s.loss_mask, -1)
    shifted[-1] = 0
    return shifted.nonzero().flatten()


def _global_sum(values: list[float], device: torch.device) -> list[float]:
    return all_reduce_sum(torch.tensor(values, dtype=torch.float64), device).tolist()


def token_rewards(kl: torch.Tensor, score: float, kl_coef: float) -> torch.Tensor:
    """Per response token: the KL penalty, plus the sequence's score on its last token."""
    rewards = -kl_coef * kl
    rewards[-1] += score
    return rewards


def compute_advantages(
    job: PPOJob, samples: list[RolloutSample], scores: list[float]
) -> dict[str, float]:
    """Token rewards (score at the last response token minus kl_coef * KL to the reference),
    GAE, advantages whitened over the global batch; returns the rollout metrics."""
    cfg, device = job.cfg, job.dist.device
    all_adv, all_values = [], []
    for s, score in zip(samples, scores, strict=True):
        pos = response_positions(s)
        values = s.extras["values"][pos]
        kl = s.extras["old_log_probs"][pos] - s.extras["ref_log_probs"][pos]
        rewards = token_rewards(kl, score, cfg.kl_coef)
        adv = torch.zeros_like(values)
        last = torch.zeros(())
        for t in range(len(pos) - 1, -1, -1):
            next_value = values[t + 1] if t + 1 < len(pos) else torch.zeros(())
            delta = rewards[t] + cfg.gamma * next_value - values[t]
            last = delta + cfg.gamma * cfg.lam * last
            adv[t] = last
        s.extras["returns"] = torch.zeros(len(s)).index_put_((pos,), adv + values)
        s.extras["old_values"] = s.extras["values"]
        all_adv.append(adv)
        all_values.append(values)
    adv_cat = torch.cat(all_adv).double()
    total, count = _global_sum([float(adv_cat.sum()), float(adv_cat.numel())], device)
    mean = total / count
    (sq,) = _global_sum([float(((adv_cat - mean) ** 2).sum())], device)
    inv_std = (sq / max(count - 1.0, 1.0) + 1e-8) ** -0.5
    for s, adv in zip(samples, all_adv, strict=True):
        whitened = ((adv.double() - mean) * inv_std).float()
        s.extras["advantages"] = torch.zeros(len(s)).index_put_((response_positions(s),), whitened)
    values_cat = torch.cat(all_values).double()
    n_seqs, reward_sum, length_sum, value_sum, value_count = _global_sum(
        [
            float(len(samples)),
            float(sum(scores)),
            float(sum(s.response_length for s in samples)),
            float(values_cat.sum()),
            float(values_cat.numel()),
        ],
        device,
    )
    return {
        "reward/mean": reward_sum / n_seqs,
        "response_length/mean": length_sum / n_seqs,
        "critic/values_mean": value_sum / value_count,
    }


def mini_batches(job: PPOJob, samples: list, step: int, epoch: int) -> list[list]:
    """This rank's share of each mini-batch of a PPO epoch, in a seeded shuffle."""
    gen = torch.Generator().manual_seed(_seed(job.cfg.seed, step, epoch, 7))
    order = torch.randperm(len(samples), generator=gen).tolist()
    size = job.cfg.mini_batch_size // job.dist.world
    return [[samples[i] for i in order[j : j + size]] for j in range(0, len(order), size)]
