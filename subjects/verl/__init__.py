"""verl as a parity subject: its SFT trainer before (0.6.1) and after (0.7.0) the TrainingWorker PR.

In verl 0.6.1, ``verl/trainer/sft_trainer.py`` drives the FSDP engine itself and computes the old
validation loss (every micro-batch loss of every val batch in one list, averaged); in 0.7.0 the
same file is rebuilt on ``TrainingWorker`` with the fixed one (micro-batch losses summed per
batch, batches averaged). Each version runs from its own environment (``env(version)``), on CPU
through ``subjects.verl.cpu_shim``; ``subjects.verl.run_sft`` is the runner.

What the environments hold, and why (read from the code path of ``python -m
verl.trainer.sft_trainer``; verl itself is installed ``--no-deps`` because its install_requires
pull ``ray[default]``, wandb, tensorboard and more that this path never imports):

- torch 2.13.0 (the constraint: the CPU wheel on disk; nothing may pull another torch)
- transformers 4.57.1: verl 0.6/0.7 are written against 4.x (their patches branch on 4.52-4.57);
  the main venv's 5.x is exactly what a separate environment keeps away
- numpy 1.26.4 (verl: numpy<2), pandas 2.3.3 and pyarrow 21.0.0 (the parquet data; pyarrow 22+
  needs numpy 2)
- tensordict 0.10.0 (verl: >=0.8,<=0.10,!=0.9), torchdata 0.11.0 (StatefulDataLoader)
- ray 2.51.1: ``verl/protocol.py``, imported by ``import verl``, does ``import ray`` (no extras)
- hydra-core 1.3.2 (the trainer's ``@hydra.main``; omegaconf with it), codetiming 1.4.0
- datasets 4.4.1 (``verl.utils.dataset`` imports ``rl_dataset``, which imports it)
- peft 0.17.1 (the FSDP engine imports it at module level), accelerate 1.11.0 (the FSDP
  checkpoint manager imports ``init_empty_weights``)
- 0.7.0 only: pillow 11.3.0 (its ``rl_dataset`` imports PIL). Its ``vision_utils`` also imports
  qwen_vl_utils, which needs torchvision, whose PyPI wheels are CUDA builds that cannot load
  against the CPU torch: not installed; the shim puts a stand-in in its place.
Left out of verl's install_requires: ray's [default] extra, wandb, tensorboard (other loggers),
pylatexenc (math reward scoring), pybind11 (build-time), dill (comes with datasets).
"""

from __future__ import annotations

from pathlib import Path

from subjects.envs import TORCH, TORCH_BASE, EnvSpec, ensure

VERSIONS = ("0.6.1", "0.7.0")
BEFORE, AFTER = VERSIONS

_COMMON = (
    TORCH,
    "transformers==4.57.1",
    "numpy==1.26.4",
    "pandas==2.3.3",
    "pyarrow==21.0.0",
    "tensordict==0.10.0",
    "torchdata==0.11.0",
    "ray==2.51.1",
    "hydra-core==1.3.2",
    "codetiming==1.4.0",
    "datasets==4.4.1",
    "peft==0.17.1",
    "accelerate==1.11.0",
)
_EXTRA = {"0.7.0": ("pillow==11.3.0",)}


#: what verl's environments share (its SFT ones and the PPO one), built once and cloned
COMMON = EnvSpec("verl-common", requirements=_COMMON, base=TORCH_BASE)


def spec(version: str) -> EnvSpec:
    if version not in VERSIONS:
        raise ValueError(f"verl {version}: not one of {', '.join(VERSIONS)}")
    return EnvSpec(
        name=f"verl-{version}",
        requirements=_EXTRA.get(version, ()),
        no_deps=(f"verl=={version}",),
        base=COMMON,
    )


def env(version: str) -> Path:
    """The python of verl ``version``'s environment, built on first use (subjects.envs)."""
    return ensure(spec(version))


# verl 0.7.1's PPO trainer (``verl.trainer.main_ppo``, ``subjects.verl.run_ppo``): the last
# release with both the legacy FSDP workers and the engine workers. Beyond the SFT list it
# imports cachetools, pydantic and PIL (the agent loop module, imported by the trainer) and
# psutil (the legacy workers), einops (verl's flash-attn-free packing helpers, which the CPU
# shim uses in place of flash_attn.bert_padding); ray is the same core package, started
# locally by main_ppo
RL_VERSION = "0.7.1"
_RL_EXTRA = (
    "pillow==11.3.0",
    "cachetools==8.0.3",
    "pydantic==2.14.4",
    "psutil==7.2.2",
    "einops==0.8.1",
)


def rl_spec() -> EnvSpec:
    return EnvSpec(
        name=f"verl-{RL_VERSION}-rl",
        requirements=_RL_EXTRA,
        no_deps=(f"verl=={RL_VERSION}",),
        base=COMMON,
    )


def rl_env() -> Path:
    """The python of the verl 0.7.1 PPO environment, built on first use (subjects.envs)."""
    return ensure(rl_spec())
