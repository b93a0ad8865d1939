"""What both SFT trainers share: the job config, data loading, the data order, the manifest.

None of this is what the TrainingWorker refactor changed; the parity claim is about the loops
and metric code in legacy_sft.py and sft.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from parity.record.digest import DataDigest
from worker.data.batching import BatchingConfig, step_order
from worker.data.charcount import (
    DATA_DIR,
    TOKENIZER_DIR,
    Encoded,
    encode,
    load_tokenizer,
    read_jsonl,
)
from worker.determinism import set_determinism
from worker.distributed import Dist, init_distributed
from worker.engine import Engine, OptimConfig
from worker.entry import check_step_flags, config_from_args, job_arg_parser
from worker.metrics_log import JobLog, write_manifest
from worker.model import TINY_MODEL_DIR, load_model

# legacy: the pre-refactor trainer; worker: the TrainingWorker's fused step (train_batch);
# tinker: a client driving the TrainingWorker call by call (worker/trainers/tinker.py)
TRAINERS = ("legacy", "worker", "tinker")


@dataclass
class SFTConfig:
    out: Path
    trainer: str = "worker"
    engine: str = "fsdp2"
    steps: int = 20
    seed: int = 0
    global_batch_size: int = 16
    micro_batch_size: int = 4
    dynamic_bsz: bool = False
    max_tokens_per_rank: int = 2048
    packed: bool = True
    max_length: int = 512
    lr: float = 1e-3
    warmup_ratio: float = 0.1
    min_lr_ratio: float = 0.1
    clip_grad: float = 1.0
    loss_agg_mode: str = "token-mean"
    val_loss: str = "fixed"  # "fixed" (token-weighted, whole set) or "legacy" (the old formula)
    val_every: int = 0  # 0: only after the last step
    val_before_train: bool = False
    val_samples: int = 0  # 0: the whole val set
    model: Path = TINY_MODEL_DIR
    tokenizer: Path = TOKENIZER_DIR
    data: Path = DATA_DIR
    attn: str = "sdpa"
    save_state_at: list[int] = field(default_factory=list)
    resume: Path | None = None
    save_final: bool = False
    fingerprint_steps: list[int] | str = field(default_factory=list)  # or "all"
    trace_step: int = 0  # trace every op of this step into ops/ (parity.record.optrace); 0: off
    stop_after: int = 0  # end after this step (the schedule stays that of `steps`); 0: every step
    chunks: int = 2  # the tinker trainer: forward_backward calls per step (rank share cut in k)

    def batching(self) -> BatchingConfig:
        return BatchingConfig.of(self, self.max_length)

    @property
    def last_step(self) -> int:
        return self.stop_after or self.steps

    def optim(self) -> OptimConfig:
        return OptimConfig(
            lr=self.lr,
            warmup_ratio=self.warmup_ratio,
            min_lr_ratio=self.min_lr_ratio,
            clip_grad=self.clip_grad,
            total_steps=self.steps,
        )


def parse_config(argv: list[str] | None = None) -> SFTConfig:
    p = job_arg_parser("python -m worker.sft", "charcount SFT job", SFTConfig, TRAINERS)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--val-every", type=int, default=0)
    p.add_argument("--val-before-train", action="store_true")
    p.add_argument("--val-samples", type=int, default=0)
    p.add_argument("--save-state-at", type=int, action="append", default=[])
    p.add_argument("--resume", type=Path, default=None)
    p.add_argument("--save-final", action="store_true", help="write final.safetensors (rank 0)")
    p.add_argument(
        "--chunks",
        type=int,
        default=2,
        help="--trainer tinker: forward_backward calls per step (each rank's share cut in K)",
    )
    cfg = config_from_args(SFTConfig, p.parse_args(argv))
    validate(cfg)
    return cfg


def validate(cfg: SFTConfig) -> None:
    """Impossible settings fail before any rank starts training, in one line."""
    if cfg.steps < 1:
        raise SystemExit(f"error: --steps must be >= 1, got {cfg.steps}")
    check_step_flags(cfg)
    if cfg.chunks < 1:
        raise SystemExit(f"error: --chunks must be >= 1, got {cfg.chunks}")
    if cfg.val_samples < 0:  # val[:-1] would silently drop samples
        raise SystemExit(f"error: --val-samples must be >= 0 (0: all), got {cfg.val_samples}")
    if not (cfg.model / "config.json").exists():
        raise SystemExit(f"error: {cfg.model}: not a model folder (no config.json)")
    for split in ("train", "val"):
        if not (cfg.data / f"{split}.jsonl").exists():
            raise SystemExit(f"error: {cfg.data / f'{split}.jsonl'}: no such data file")


@dataclass
class SFTJob:
    """Everything a trainer needs, built in the one right order: determinism before the model."""

    cfg: SFTConfig
    dist: Dist
    engine: Engine
    train: list[Encoded]
    val: list[Encoded]
    log: JobLog

    @classmethod
    def build(cls, cfg: SFTConfig) -> SFTJob:
        d = init_distributed()
        if cfg.global_batch_size < d.world:
            raise SystemExit(
                f"error: world size {d.world} is larger than the global batch "
                f"{cfg.global_batch_size}"
            )
        if cfg.global_batch_size % d.world:
            raise SystemExit(
                f"error: global batch {cfg.global_batch_size} is not divisible "
                f"by world size {d.world}"
            )
        determinism = set_determinism(cfg.seed)
        tokenizer = load_tokenizer(cfg.tokenizer)
        train = [encode(s, tokenizer, cfg.max_length) for s in read_jsonl(cfg.data / "train.jsonl")]
        val = [encode(s, tokenizer, cfg.max_length) for s in read_jsonl(cfg.data / "val.jsonl")]
        if cfg.val_samples:
            val = val[: cfg.val_samples]
        if len(train) < cfg.global_batch_size:
            raise SystemExit(
                f"error: {cfg.data / 'train.jsonl'}: {len(train)} samples, fewer than one global "
                f"batch of {cfg.global_batch_size}"
            )
        if len(val) < d.world:
            raise SystemExit(
                f"error: {cfg.data / 'val.jsonl'}: {len(val)} val samples for {d.world} ranks "
                f"(--val-samples {cfg.val_samples}): every rank needs at least one"
            )
        model = load_model(cfg.model, attn=cfg.attn)
        engine = Engine(model, cfg.engine, cfg.optim(), d)
        engine.data_digest = DataDigest()
        engine.fingerprint_steps = cfg.fingerprint_steps
        engine.trace_step, engine.trace_out = cfg.trace_step, cfg.out
        log = JobLog(cfg.out, d.rank, {"": engine}, append=cfg.resume is not None)
        job = cls(cfg, d, engine, train, val, log)
        if d.rank == 0:
            job.write_manifest(determinism)
        return job

    def write_manifest(self, determinism: dict) -> None:
        files = {split: self.cfg.data / f"{split}.jsonl" for split in ("train", "val")}
        write_manifest(self.cfg, self.dist, determinism, files, num_params=self.engine.num_params)

    def rank_batches(self, start_step: int = 1):
        """(step, epoch, this rank's share) for steps start_step..steps."""
        d, cfg = self.dist, self.cfg
        steps = range(start_step, cfg.last_step + 1)
        order = step_order(len(self.train), cfg.global_batch_size, d.rank, d.world, cfg.seed, steps)
        for step, epoch, chosen in order:
            self.engine.current_step = step  # which step a fingerprint belongs to
            yield step, epoch, [self.train[i] for i in chosen]

    def is_val_step(self, step: int) -> bool:
        every = self.cfg.val_every
        return step == self.cfg.steps or (every > 0 and step % every == 0)

    def save_final(self) -> None:
        from safetensors.torch import save_file

        state = self.engine.full_state_dict()
        if self.dist.rank == 0:
            tmp = self.cfg.out / ".final.safetensors.tmp"
            # clone: tied weights (embeddings = lm_head) share storage at world size 1, which
            # safetensors refuses to write
            save_file({k: v.detach().clone().contiguous() for k, v in state.items()}, str(tmp))
            tmp.replace(self.cfg.out / "final.safetensors")
