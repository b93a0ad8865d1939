"""Run verl 0.6/0.7's engine SFT trainer on CPU ranks with gloo: a few patches, no edits to verl.

Loaded ONLY through verl's own hook: ``VERL_USE_EXTERNAL_MODULES=subjects.verl.cpu_shim`` makes
``verl/__init__.py`` import this module (``import_external_libs``) right after ``verl.protocol``
and ``verl.utils.device`` are imported and before any trainer, engine or distributed module is.
The repository root must be on ``PYTHONPATH`` (``subjects.verl.run_sft`` sets both).

verl 0.6.1 and 0.7.0 have no platform registry (that came later): on a machine without CUDA,
``verl.utils.device.get_device_name()`` already answers "cpu" and ``get_torch_device()`` is
``torch.cpu``. What then fails, and what each patch does:

1. ``backend``: ``initialize_global_process_group`` passes ``get_nccl_backend()`` ("nccl") to
   ``init_process_group``, and NCCL needs CUDA. The patch returns "gloo" when the device is cpu
   (else verl's answer), in ``verl.utils.device`` and in every verl module already holding it.
2. ``engine``: the FSDP engines register for ``device=["cuda", "npu"]`` only, and
   ``EngineRegistry.get_engine_cls`` looks the class up by ``get_device_name()`` ("cpu"), so it
   asserts "Unknown device: cpu". The patch makes a cpu lookup find the class registered for
   cuda (the same FSDP code, which runs on a CPU device mesh). Applied when
   ``verl.workers.engine.base`` is imported (``subjects.verl.hooks``), since importing the engine
   package from here would load it half-way through ``verl/__init__``.
3. ``memory``: ``log_gpu_memory_usage`` (called while the engine is built) and the memory
   helpers call ``torch.cpu.memory_allocated``, ``memory_reserved``, ``max_memory_allocated``,
   ``max_memory_reserved``, ``mem_get_info``, ``empty_cache``, ``reset_peak_memory_stats``,
   which torch.cpu lacks. The patch adds them: the allocator figures are 0 (there is no device
   allocator), ``mem_get_info`` gives the machine's free and total RAM, the rest do nothing.
   Only added where missing, so a torch that has one keeps its own.
4. ``autocast``: ``FSDPEngineWithLMHead.forward_step`` runs the model under
   ``torch.autocast(device_type=get_device_name(), dtype=torch.bfloat16)``, hard-coded. On GPU
   that is verl's usual bf16 compute; on CPU it makes every matmul bf16, so the loss comes out
   rounded to bf16 (about 3 significant digits) whatever the FSDP mixed precision says. The patch
   makes CPU autocast a no-op (``torch.autocast``/``torch.amp.autocast`` with device_type "cpu"
   enter disabled), so the run computes in float32 as its ``mixed_precision`` (fp32) asks.
   ``PARITY_VERL_CPU_AUTOCAST=keep`` leaves autocast as verl has it.
5. ``vision``: verl 0.7's ``verl.utils.dataset.vision_utils`` (imported by the multi-turn SFT
   dataset even for text) does ``from qwen_vl_utils import fetch_image, fetch_video``, and
   qwen_vl_utils imports torchvision, whose PyPI wheels are CUDA builds that cannot load against
   the CPU torch (``libtorch_cuda.so`` missing). Where qwen_vl_utils is not installed, the patch
   puts a stand-in module in ``sys.modules`` whose functions raise if a run ever calls them (a
   text-only run never does). Not applied to 0.6, which does not import it.
6. ``workers``: the SFT trainer builds its train and val ``StatefulDataLoader`` with
   ``num_workers=8``, hard-coded, so each rank forks 8 workers per epoch and per validation while
   its gloo and tokenizer threads run. On CPython before 3.11.8 such a fork can leave a worker
   deadlocked in ``PyOS_AfterFork_Child`` on a lock another thread held (CPython gh-112275; seen
   here: rank 0 then waits on that worker for ever), and on a small CPU machine 16 workers only
   contend for the cores the ranks need. The patch makes a ``StatefulDataLoader`` load in the
   rank itself (``num_workers=0``): the same sampler, collate function and seed draw, so the same
   batches. ``PARITY_VERL_CPU_WORKERS=keep`` leaves verl's workers.

Settings the command line must give as well (``subjects.verl.run_sft`` does):
``trainer.device=cpu``, ``model.use_remove_padding=False`` (the packed path needs flash-attn's
varlen kernels; without them samples attend to each other),
``+model.override_config.attn_implementation=sdpa``, ``engine.mixed_precision`` fp32 for params,
reductions and buffers, ``engine.use_torch_compile=False``.

``applied()`` lists the patches in force; ``subjects.verl.run_sft`` prints it into the log.
"""

from __future__ import annotations

import os
import sys

import torch

from subjects.verl.hooks import after_import

_APPLIED: list[str] = []


def applied() -> list[str]:
    """The patches in force in this process, in the order they were applied."""
    return list(_APPLIED)


def _note(what: str) -> None:
    """Record a patch and say so once per job (rank 0, or a process outside torchrun)."""
    _APPLIED.append(what)
    if os.environ.get("RANK", "0") == "0":
        print(f"[subjects.verl.cpu_shim] {what}", file=sys.stderr, flush=True)


# -- 1. gloo instead of nccl ---------------------------------------------------------------------


def _patch_backend() -> None:
    import verl.utils.device as device

    original = device.get_nccl_backend
    if getattr(original, "_parity_shim", False):
        return

    def get_nccl_backend() -> str:
        if device.get_device_name() == "cpu":
            return "gloo"
        return original()

    get_nccl_backend._parity_shim = True
    device.get_nccl_backend = get_nccl_backend
    # modules that did `from verl.utils.device import get_nccl_backend` before this ran
    for name, module in list(sys.modules.items()):
        if name.startswith("verl.") and getattr(module, "get_nccl_backend", None) is original:
            module.get_nccl_backend = get_nccl_backend
    _note("backend: get_nccl_backend() -> 'gloo' on cpu")


# -- 2. the FSDP engine found for cpu ------------------------------------------------------------


def _patch_engine_registry(base) -> None:
    registry = base.EngineRegistry
    original = registry.get_engine_cls.__func__

    def get_engine_cls(cls, model_type: str, backend: str):
        by_device = cls._engines.get(model_type, {}).get(backend, {})
        if "cpu" not in by_device and "cuda" in by_device:
            by_device["cpu"] = by_device["cuda"]
        return original(cls, model_type, backend)

    get_engine_cls.__wrapped__ = original
    registry.get_engine_cls = classmethod(get_engine_cls)
    _note("engine: EngineRegistry cpu lookup -> the class registered for cuda")


# -- 3. torch.cpu memory calls -------------------------------------------------------------------


def _mem_get_info(device=None) -> tuple[int, int]:
    page = os.sysconf("SC_PAGE_SIZE")
    return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


def _zero(device=None) -> int:
    return 0


def _nothing(*args, **kwargs) -> None:
    return None


def _patch_memory() -> None:
    stubs = {
        "memory_allocated": _zero,
        "memory_reserved": _zero,
        "max_memory_allocated": _zero,
        "max_memory_reserved": _zero,
        "mem_get_info": _mem_get_info,
        "empty_cache": _nothing,
        "reset_peak_memory_stats": _nothing,
    }
    added = [name for name, fn in stubs.items() if not hasattr(torch.cpu, name)]
    for name in added:
        setattr(torch.cpu, name, stubs[name])
    if added:
        _note("memory: torch.cpu." + ", ".join(added) + " stubbed")


# -- 4. no bf16 autocast on cpu ------------------------------------------------------------------


def _patch_autocast() -> None:
    if os.environ.get("PARITY_VERL_CPU_AUTOCAST", "off") == "keep":
        return
    base = torch.amp.autocast_mode.autocast
    if getattr(base, "_parity_shim", False):
        return

    class autocast(base):  # noqa: N801 - the name torch gives it
        """torch.autocast, except that device_type "cpu" enters disabled (see the module doc)."""

        _parity_shim = True

        def __init__(self, device_type, dtype=None, enabled=True, cache_enabled=None):
            if device_type == "cpu":
                enabled = False
            super().__init__(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)

    torch.autocast = autocast
    torch.amp.autocast = autocast
    _note("autocast: torch.autocast(device_type='cpu') disabled (fp32 compute)")


# -- 5. qwen_vl_utils stand-in -------------------------------------------------------------------


def _patch_vision() -> None:
    import importlib.util
    import types

    import verl

    if not verl.__version__.startswith("0.7") or "qwen_vl_utils" in sys.modules:
        return
    if importlib.util.find_spec("qwen_vl_utils") is not None:
        return

    def _unavailable(name):
        def call(*args, **kwargs):
            raise RuntimeError(
                f"qwen_vl_utils.{name}: not installed in this CPU environment (it needs "
                "torchvision, whose PyPI wheels are CUDA builds); subjects.verl.cpu_shim put "
                "a stand-in here for text-only runs"
            )

        call.__name__ = name
        return call

    module = types.ModuleType("qwen_vl_utils")
    module.__doc__ = "stand-in from subjects.verl.cpu_shim: every function raises"
    for name in ("fetch_image", "fetch_video", "process_vision_info"):
        setattr(module, name, _unavailable(name))
    sys.modules["qwen_vl_utils"] = module
    _note("vision: qwen_vl_utils stand-in (its functions raise if called)")


# -- 6. data loading in the rank -----------------------------------------------------------------


def _patch_workers() -> None:
    if os.environ.get("PARITY_VERL_CPU_WORKERS", "off") == "keep":
        return
    import torchdata.stateful_dataloader as stateful

    base = stateful.StatefulDataLoader
    if getattr(base, "_parity_shim", False):
        return

    class StatefulDataLoader(base):
        """torchdata's StatefulDataLoader, loading in the calling process (see the module doc)."""

        _parity_shim = True

        def __init__(self, *args, **kwargs):
            if len(args) > 5:  # num_workers given by position
                args = (*args[:5], 0, *args[6:])
            kwargs["num_workers"] = 0
            for only_with_workers in ("prefetch_factor", "persistent_workers"):
                kwargs.pop(only_with_workers, None)
            super().__init__(*args, **kwargs)

    stateful.StatefulDataLoader = StatefulDataLoader
    _note("workers: StatefulDataLoader loads in the rank (num_workers=0)")


def install() -> None:
    _patch_backend()
    after_import("verl.workers.engine.base", _patch_engine_registry)
    _patch_memory()
    _patch_autocast()
    _patch_vision()
    _patch_workers()


install()
