"""The one function that makes a run reproducible; call it before the model is built.

On CUDA that takes more than seeds: cuBLAS needs a fixed workspace (CUBLAS_WORKSPACE_CONFIG, set
before its first handle, so `worker.boot` sets it at import too), kernels without a
deterministic implementation must fail instead of running (deterministic algorithms), TF32 must
be off for matmuls and cuDNN (it rounds fp32 inputs to 10 bits of mantissa: other numbers than a
CPU's, and not what the job asked for), and cuDNN must not benchmark (it may pick another
algorithm each run). Every setting lands in the manifest, read back from torch after it was set.

Precision: `PARITY_AUTOCAST=bf16` runs every engine forward under bf16 autocast (fp32 weights,
optimizer and loss; `worker.engine`), the job's usual fp32 when unset. It is an environment
variable, not a flag, so that every job and trainer takes it without a flag of its own; the
manifest records it here (`autocast`).
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch

from parity.record.env import determinism_flags

CUBLAS_WORKSPACE_CONFIG = ":4096:8"  # the value torch's reproducibility notes give
AUTOCAST_ENV = "PARITY_AUTOCAST"
AUTOCAST_DTYPES = {"bf16": torch.bfloat16}  # fp16 would need a loss scaler: not offered


def set_cuda_env() -> None:
    """CUBLAS_WORKSPACE_CONFIG unless the user set one: cuBLAS reads it when it makes its first
    handle, so it must be there before the first CUDA matmul (harmless without CUDA)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE_CONFIG)


def autocast_dtype() -> torch.dtype | None:
    """The autocast dtype `PARITY_AUTOCAST` asks for (bf16), None when unset, empty or fp32."""
    value = os.environ.get(AUTOCAST_ENV, "").strip().lower()
    if value in ("", "fp32", "off", "none"):
        return None
    if value not in AUTOCAST_DTYPES:
        choices = ", ".join(["fp32", *AUTOCAST_DTYPES])
        raise ValueError(f"{AUTOCAST_ENV}={value!r}: expected one of {choices}")
    return AUTOCAST_DTYPES[value]


def set_determinism(seed: int) -> dict:
    """Seed every RNG and force deterministic kernels; returns the flags for the run manifest."""
    set_cuda_env()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # seeds every CUDA device too
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    # TF32 off through the API every torch 2.x has (torch >= 2.9 maps it onto fp32_precision;
    # mixing the two APIs makes torch's own getters raise)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    dtype = autocast_dtype()
    return {
        "seed": seed,
        **determinism_flags(),  # read back from torch, as any recorded run records them
        "autocast": None if dtype is None else str(dtype).removeprefix("torch."),
    }
