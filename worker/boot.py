"""What every job of this subject runs first: its environment defaults, then the heavy imports.

worker.entry imports this module on its first line, so a launched job runs it before any code
of its own. The charcount presets name it as their `preload` (worker/presets.py): the harness's
fast paths (an in-process pair, a warm pool) import it once in each warm rank, before forking
the jobs, and each job then finds it done, as a launch of its own has by the time it gets past
worker.entry's first line. That holds only while this module reads nothing a job sets: keep
here what every job does before its first import of transformers (the HF_* defaults) and the
imports themselves, and nothing that depends on a job's arguments, its rank or its state.
"""

from __future__ import annotations

import gc
import os

# the objects these imports make live as long as the process: no collection while they pile up
# (worker.entry.pause_gc_until_training says why), the collector as it was after them
_collecting = gc.isenabled()
gc.disable()

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
# cuBLAS reads it at its first handle: set before torch (worker.determinism sets the same, and
# records it in the manifest)
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

# isort: split
# What both trainers of both jobs import on their way to the first step: torch with the parts
# the engine uses, transformers with the Qwen2 model, its masks and tokenizers (about 1.5 s of
# CPU after torch, on this 2-core host)
import torch  # noqa: E402, F401
import torch.distributed.checkpoint  # noqa: E402, F401
import torch.distributed.fsdp  # noqa: E402, F401
import transformers  # noqa: E402, F401
import transformers.models.qwen2.modeling_qwen2  # noqa: E402, F401
from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402, F401
from transformers import (  # noqa: E402, F401
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    AutoTokenizer,
    PreTrainedTokenizerFast,
)

if _collecting:
    gc.enable()
