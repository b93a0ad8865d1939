"""The training engine: torch.distributed process group, FSDP2 or DDP, AdamW, schedule, clipping,
and sharded state through torch.distributed.checkpoint.

Both the legacy trainers and the TrainingWorker drive this one engine, so the parity claim is
about the code above it: the loops, the loss normalization and the metric code.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from parity.record.digest import DataDigest, model_fingerprint
from worker.data.batching import MicroBatch
from worker.determinism import autocast_dtype
from worker.distributed import Dist


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.1
    warmup_ratio: float = 0.1
    min_lr_ratio: float = 0.1
    clip_grad: float = 1.0
    total_steps: int = 20
    eps: float = 1e-8

    @property
    def warmup_steps(self) -> int:
        return int(self.warmup_ratio * self.total_steps)

    def lr_at(self, scheduler_steps: int) -> float:
        """The scheduler's rate after `scheduler_steps` steps, computed as LambdaLR does (base lr
        times the multiplier): a client driving the lr itself gets the same bits."""
        multiplier = warmup_cosine(
            scheduler_steps, self.warmup_steps, self.total_steps, self.min_lr_ratio
        )
        return self.lr * multiplier


def warmup_cosine(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Multiplier of the base lr: linear warmup, then cosine down to min_ratio."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = (step - warmup) / max(1, total - warmup)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


class Engine:
    """One model on one process group, sharded (FSDP2) or replicated (DDP)."""

    def __init__(self, model: torch.nn.Module, kind: str, optim: OptimConfig, d: Dist):
        self.dist, self.kind, self.optim_config = d, kind, optim
        self.autocast = autocast_dtype()  # PARITY_AUTOCAST=bf16: forwards under bf16 autocast
        model = model.to(d.device)
        if kind == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh(d.device.type, (d.world,))
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            self.module = model
        elif kind == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            ids = [d.device.index] if d.device.type == "cuda" else None
            self.module = DistributedDataParallel(model, device_ids=ids)
        else:
            raise ValueError(f"unknown engine {kind!r}; expected 'fsdp2' or 'ddp'")
        self.model = model  # the unwrapped module (FSDP2 shards in place)
        self.optimizer = torch.optim.AdamW(
            self.module.parameters(),
            lr=optim.lr,
            betas=optim.betas,
            weight_decay=optim.weight_decay,
            eps=optim.eps,
        )
        warmup = optim.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda s: warmup_cosine(s, warmup, optim.total_steps, optim.min_lr_ratio),
        )
        self.num_params = sum(p.numel() for p in model.parameters())
        if kind == "fsdp2":  # parameters are shards; count the full tensors
            self.num_params = sum(p.full_tensor().numel() for p in model.parameters())
        # diagnosis (parity.record.digest), off unless a job turns it on: a digest of the batches
        # each forward runs, and parameter/gradient hashes at the steps a job names
        self.data_digest: DataDigest | None = None
        self.digest_kinds = ("train", "val")  # of a forward with and without grad (PPO: rollout)
        self.fingerprint_steps: list[int] | str = []  # or "all"
        self.current_step: int | None = None  # set by the job before each training step
        self.fingerprints: dict[int, dict] = {}  # step -> model_fingerprint, until the job takes it
        # op-level trace (parity.record.optrace) of one step: from its first forward with grad to
        # the end of its optimizer step, into trace_out/ops/; 0: off
        self.trace_step, self.trace_out = 0, Path(".")
        self._trace: contextlib.ExitStack | None = None

    def forward(self, mb: MicroBatch) -> torch.Tensor:
        """Logits of one micro-batch."""
        if self.trace_step and self.current_step == self.trace_step and self._trace is None:
            if torch.is_grad_enabled():
                from parity.record.optrace import trace_ops

                self._trace = contextlib.ExitStack()
                trace = trace_ops(self.trace_out, self.trace_step, self.model, rank=self.dist.rank)
                self._trace.enter_context(trace)
        if self.data_digest is not None:
            self.data_digest.add(self.digest_kinds[not torch.is_grad_enabled()], mb)
        inputs = mb.model_inputs(self.dist.device)
        if self.autocast is None:
            return self.module(**inputs).logits
        with torch.autocast(self.dist.device.type, dtype=self.autocast):
            logits = self.module(**inputs).logits
        return logits.float()  # losses in fp32, as mixed-precision trainers compute them

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Forwards inside see the FSDP2 layers all-gathered once, not once per forward.

        Generation runs max_new_tokens forwards, and each re-gathered every layer (the root keeps
        its parameters after forward anyway). The forwards see the same gathered values in the same
        layout, so the same bits. The layers are resharded after, as their last forward would have
        left them. DDP: nothing to gather.
        """
        if self.kind != "fsdp2":
            yield
            return
        from torch.distributed.fsdp import FSDPModule

        layers = [m for m in self.model.model.layers if isinstance(m, FSDPModule)]
        for layer in layers:
            layer.set_reshard_after_forward(False, recurse=False)
        try:
            yield
        finally:
            for layer in layers:
                layer.set_reshard_after_forward(True, recurse=False)  # as fully_shard set them
                layer.reshard()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def clip_grad_norm(self, max_norm: float | None = None) -> torch.Tensor:
        """Global pre-clip gradient norm over all shards and ranks; clips in place at max_norm
        (default: the configured clip; inf: the norm only)."""
        self._fingerprint()
        max_norm = self.optim_config.clip_grad if max_norm is None else max_norm
        norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return norm

    def _fingerprint(self) -> None:
        """Hash weights (before this step's update) and pre-clip gradients, once per chosen step.

        Every rank gets here together (clip is collective), as full_tensor() requires.
        """
        step, chosen = self.current_step, self.fingerprint_steps
        if step is None or step in self.fingerprints or (chosen != "all" and step not in chosen):
            return
        self.fingerprints[step] = model_fingerprint(self.model.named_parameters())

    def set_optim_params(
        self, lr: float, betas: tuple[float, float], eps: float, weight_decay: float
    ) -> None:
        """AdamW's settings for the next step, on every parameter group (a client's schedule)."""
        for group in self.optimizer.param_groups:
            group.update(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)

    def step(self, grad_norm: torch.Tensor, schedule: bool = True) -> bool:
        """Optimizer step unless the norm is not finite (then the gradients are dropped).

        The scheduler steps either way, as verl's trainers do, unless schedule is False (the
        caller sets the lr itself). Returns whether the step applied.
        """
        applied = bool(torch.isfinite(grad_norm))
        if applied:
            self.optimizer.step()
        self.zero_grad()
        if schedule:
            self.scheduler.step()
        if self._trace is not None:
            self._trace.close()  # writes ops/rank{r}.jsonl and .pt
            self.trace_step = 0  # once
        return applied

    def current_lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])

    # --- sharded state -------------------------------------------------------------------------
    def save(self, path: Path, extra: dict) -> None:
        """Model and optimizer as a DCP checkpoint, plus per-rank extras (scheduler, RNG, data)."""
        model_sd, optim_sd = get_state_dict(self.module, self.optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path / "dcp"))
        state = {"scheduler": self.scheduler.state_dict(), "rng": torch.get_rng_state(), **extra}
        torch.save(state, path / f"extra_rank{self.dist.rank}.pt")

    def load(self, path: Path) -> dict:
        model_sd, optim_sd = get_state_dict(self.module, self.optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        from worker.safe_checkpoint import SafeFileSystemReader  # metadata: no arbitrary pickle

        dcp.load(state, storage_reader=SafeFileSystemReader(str(path / "dcp")))
        set_state_dict(
            self.module,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )
        extra = torch.load(path / f"extra_rank{self.dist.rank}.pt", weights_only=True)
        self.scheduler.load_state_dict(extra.pop("scheduler"))
        torch.set_rng_state(extra.pop("rng"))
        return extra

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded weights (every rank takes part; use on rank 0 to save)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.module, options=opts)
