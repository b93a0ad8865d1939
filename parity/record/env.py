"""The environment a run was made in, and the manifest that carries it.

Bitwise equality is only promised within one environment: the keys `parity.judge.golden`
fingerprints
(`environment.python`, `.torch`, `.transformers`, `.machine`, `.cpu_isa`, `.cpu_vendor`, `.cuda`,
`.gpu`, then `backend`, `device`, `world_size`, `determinism.num_threads`) are all written here.
Only torch and the standard library are imported; transformers' version is read without
importing it.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

# instruction sets the BLAS dispatches on: x86, then arm (32-bit `neon`, 64-bit `asimd` on)
CPU_ISA = ("avx512f", "avx512_bf16", "amx_tile", "avx2", "fma")
CPU_ISA += ("neon", "asimd", "sve", "sve2", "bf16", "i8mm")


def cpu_facts(cpuinfo: str) -> dict[str, Any]:
    """`cpu_isa`, `cpu_vendor` and `cpu_model` from /proc/cpuinfo's first processor (x86 or arm):
    the BLAS picks its kernels by them, so two hosts apart in them may sum in other orders."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if not key.strip():
            break  # the end of the first processor's block
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", fields.get("Features", "")).split())
    return {
        "cpu_isa": [f for f in CPU_ISA if f in flags],
        "cpu_vendor": fields.get("vendor_id") or fields.get("CPU implementer"),
        "cpu_model": fields.get("model name") or fields.get("CPU part"),
    }


def package_version(name: str) -> str | None:
    """A package's version: the loaded module's own `__version__`, else its installed metadata
    (no import), else None."""
    module = sys.modules.get(name)
    version = getattr(module, "__version__", None)
    if isinstance(version, str):
        return version
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def environment() -> dict[str, Any]:
    """Versions and machine facts that decide whether two runs can be bitwise equal."""
    import torch

    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = cpu_facts(f.read())
    except OSError:
        cpu = cpu_facts("")
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": package_version("transformers"),
        "platform": platform.platform(),
        "machine": platform.machine(),
        **cpu,
        "aten_cpu_capability": _aten_capability(torch),
        "cuda": torch.version.cuda if torch.cuda.is_available() else None,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "argv": sys.argv,
    }


def _aten_capability(torch: Any) -> str | None:
    """The vector kernels ATen dispatches to (AVX512, AVX2, ...: what the CPU offers, capped by
    ATEN_CPU_CAPABILITY). ATen's own vectorized kernels (CPU flash attention's softmax sums in
    16 or 8 lanes) round differently with each, apart from the BLAS."""
    get = getattr(getattr(torch.backends, "cpu", None), "get_cpu_capability", None)
    return get() if callable(get) else None


def determinism_flags() -> dict[str, Any]:
    """torch's settings that decide whether a run repeats itself bit for bit, read back from
    torch (the keys worker.determinism records, less its seed and autocast)."""
    import torch

    return {
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "fp32_precision": _fp32_precision(),
        "num_threads": torch.get_num_threads(),
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    }


def _fp32_precision() -> dict[str, Any] | None:
    """torch >= 2.9's per-backend fp32 precision ("ieee": no TF32), None before it."""
    import torch

    out: dict[str, Any] = {}
    for name, obj in (
        ("cuda.matmul", torch.backends.cuda.matmul),
        ("cudnn.conv", getattr(torch.backends.cudnn, "conv", None)),
        ("cudnn.rnn", getattr(torch.backends.cudnn, "rnn", None)),
    ):
        try:
            value = getattr(obj, "fp32_precision", None) if obj is not None else None
        except RuntimeError:  # torch refuses to read a mix of the old and new APIs
            value = "mixed"
        if value is not None:
            out[name] = value
    return out or None


#: git's repository variables (``git rev-parse --local-env-vars``, git 2.39): set by a hook
#: (GIT_INDEX_FILE in pre-commit: the commit's index) or by a user's shell (GIT_DIR), they point
#: every git command at that repository, its index and work tree, whatever folder it is run in
GIT_LOCAL_ENV = (
    "GIT_ALTERNATE_OBJECT_DIRECTORIES", "GIT_CONFIG", "GIT_CONFIG_PARAMETERS", "GIT_CONFIG_COUNT",
    "GIT_OBJECT_DIRECTORY", "GIT_DIR", "GIT_WORK_TREE", "GIT_IMPLICIT_WORK_TREE", "GIT_GRAFT_FILE",
    "GIT_INDEX_FILE", "GIT_NO_REPLACE_OBJECTS", "GIT_REPLACE_REF_BASE", "GIT_PREFIX",
    "GIT_INTERNAL_SUPER_PREFIX", "GIT_SHALLOW_FILE", "GIT_COMMON_DIR",
)  # fmt: skip


def without_git_repository(env: dict[str, str] | os._Environ) -> dict[str, str]:
    """`env` without git's repository variables (GIT_LOCAL_ENV) and the numbered config pairs
    GIT_CONFIG_COUNT announces: a git command then finds its repository from the folder it runs
    in. What the harness's own git commands and the jobs it launches get, so that a hook's
    GIT_INDEX_FILE or a shell's GIT_DIR never lets them write the user's index or HEAD."""
    return {
        k: v
        for k, v in env.items()
        if k not in GIT_LOCAL_ENV and not k.startswith(("GIT_CONFIG_KEY_", "GIT_CONFIG_VALUE_"))
    }


def git_revision(path: Path) -> str | None:
    """HEAD of the repository holding `path`, `+dirty` with uncommitted changes; None outside
    one (or without git). Found from `path`, never from git's variables of a caller."""
    env = without_git_repository(os.environ)
    try:
        out = subprocess.run(
            ["git", "-C", str(path), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            env=env,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    dirty = subprocess.run(
        ["git", "-C", str(path), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
        timeout=10,
        env=env,
    ).stdout.strip()
    return out.stdout.strip() + ("+dirty" if dirty else "")


def dist_facts() -> tuple[int, int, str | None]:
    """(rank, world size, backend): from torch.distributed when it is initialized, else from
    torchrun's RANK and WORLD_SIZE (backend None), else a single process."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), str(dist.get_backend())
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")), None


def default_device(backend: str | None) -> str:
    """ "cuda:N" when the run uses CUDA (an NCCL group, or CUDA already in use), else "cpu"."""
    import torch

    if torch.cuda.is_available() and ("nccl" in (backend or "") or torch.cuda.is_initialized()):
        return f"cuda:{torch.cuda.current_device()}"
    return "cpu"


def run_manifest(
    *,
    config: Any,
    device: str,
    backend: str | None,
    world_size: int,
    determinism: dict[str, Any],
    code_dir: Path | None,
    **extra: Any,
) -> dict[str, Any]:
    """A run's manifest: its config, the environment, device, backend, world size, determinism
    flags, anything `extra`, and the git revision of the code (`code_dir`'s repository)."""
    return {
        "config": config,
        "environment": environment(),
        "device": device,
        "backend": backend,
        "world_size": world_size,
        "determinism": determinism,
        **extra,
        "git_revision": git_revision(code_dir) if code_dir is not None else None,
    }
