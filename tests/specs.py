"""Job specs shared by the parity tests, so equal specs share one launch (the runner caches)."""

import dataclasses
from pathlib import Path

from parity.spec import JobSpec, PairSpec

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"  # worker.data.charcount's (torch)

# 2 ranks, 8 samples per rank in micro-batches of 4: 2 micro-batches per rank
FIXED = JobSpec(
    task="charcount-sft",
    world_size=2,
    steps=20,
    micro_batch_size=4,
    overrides={"val_before_train": True, "save_final": True},
)
# the harness's launch modes (separate launches, one in-process launch, a warm pool) are shown
# bitwise equal on this: every part of a job a mode could disturb (val before, between and after
# the steps, 2 micro-batches per rank, the final weights) in 4 steps instead of FIXED's 20
LAUNCH_MODES = JobSpec(
    task="charcount-sft",
    world_size=2,
    steps=4,
    micro_batch_size=4,
    overrides={"val_before_train": True, "val_every": 2, "save_final": True},
)
DYNAMIC = JobSpec(
    task="charcount-sft",
    world_size=2,
    steps=20,
    dynamic_bsz=True,
    micro_batch_size=None,
    max_tokens_per_rank=1200,
)
DDP_PADDED = JobSpec(
    task="charcount-sft", world_size=2, steps=20, engine="ddp", overrides={"padded": True}
)


def plain(world_size: int = 2, **changes) -> JobSpec:
    """The worker trainer, 20 steps, global batch 16, default options."""
    return JobSpec(task="charcount-sft", world_size=world_size, steps=20, **changes)


# fixtures/charcount-small: the first 64 train and 8 val samples of fixtures/charcount. With a
# global batch of 32 an epoch is 2 steps, so 3 steps cross into the second epoch (a fifth of the
# training the full set needs to get there)
SMALL_DATA = str(FIXTURES / "charcount-small")
EPOCHS = JobSpec(
    task="charcount-sft",
    world_size=2,
    steps=3,
    global_batch_size=32,
    micro_batch_size=8,
    overrides={"data": SMALL_DATA},
)
# 46 val samples: 23 per rank, so the last val micro-batch of 4 is incomplete
VAL46 = JobSpec(task="charcount-sft", world_size=2, steps=2, overrides={"val_samples": 46})
SEQ_MEAN = {"loss_agg_mode": "seq-mean-token-mean"}
# 3 steps with every parameter and gradient hashed at each (parity.record.digest)
FINGERPRINTED = JobSpec(
    task="charcount-sft", world_size=2, steps=3, overrides={"fingerprint_steps": "all"}
)

# charcount PPO: 8 prompts per step, mini-batches of 4 over 2 epochs: 4 optimizer steps per PPO
# step; at 2 ranks each mini-batch is 2 sequences per rank in micro-batches of 1. 10 steps: the
# PPO parity claim (>= 10 PPO steps, tests/worker/test_ppo_parity.py).
PPO = JobSpec(
    task="charcount-ppo",
    world_size=2,
    steps=10,
    global_batch_size=8,
    micro_batch_size=1,
    overrides={"ppo_mini_batch_size": 4},
)
# the same in 4 steps, for the mutant checks, the claim's variants, the launch-mode check and the
# diagnosis: every PPO mutant is caught by step 2, and reward/mean already varies (0, .375, .25,
# 0 from the SFT-warmed actor)
PPO_SHORT = dataclasses.replace(PPO, steps=4)


def legacy_vs_worker(runner, base: JobSpec, inject_b: list[str] | None = None):
    """The pair every parity check starts from: the legacy trainer (A) against the worker (B,
    carrying the `inject_b` mutants) on `base`. Sides not run yet share processes (a warm pool,
    or one in-process launch without pools), bitwise two launches: tests/run/test_inprocess.py."""
    b = {"trainer": "worker", "inject": inject_b or []}
    return runner.pair(PairSpec(base, {"trainer": "legacy"}, b), in_process=True)


# what one trainer keeps across world size, micro-batch size and batching (test_invariance.py):
# lr and token counts exact; losses and norms sum in another order, so within 1e-6
RTOL = 1e-6
INVARIANCE = {
    "train/lr": "exact",
    "train/global_tokens": "exact",
    "train/total_tokens(B)": "exact",
    "train/loss": f"close:{RTOL},0",
    "train/grad_norm": f"close:{RTOL},0",
    "val/loss": f"close:{RTOL},0",
}
