"""How every job process starts and ends under torchrun (or accelerate launch).

One place for the lifecycle both entry points need: offline Hugging Face settings, torchrun's
`record` (so a failing rank's own traceback reaches the launcher's summary), the timing file the
benchmarks read, and a clean teardown.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from collections.abc import Callable
from typing import NoReturn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def _lifecycle(train: Callable[[list[str] | None], None], argv: list[str] | None) -> int:
    from worker.distributed import shutdown_distributed

    train(argv)
    # Free the wrapped models while the process group still exists: destroyed after it, a DDP
    # or FSDP module's C++ destructor hung a gloo rank at exit in about 1 run in 8 here.
    gc.collect()
    shutdown_distributed()  # barrier first, then destroy
    return 0


def run_job(train: Callable[[list[str] | None], None], argv: list[str] | None = None) -> NoReturn:
    """Run `train(argv)` as a torchrun rank, then exit without interpreter teardown."""
    from torch.distributed.elastic.multiprocessing.errors import record

    code = record(_lifecycle)(train, argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)  # everything the job wrote is closed; skip the remaining destructors


def fit_and_finish(
    job, fit: Callable[[], None], after_fit: Callable[[], None] | None = None
) -> None:
    """Train, write timing.json (rank 0), then the end record that marks the run complete."""
    from worker.metrics_log import write_json_atomic

    try:
        start = time.perf_counter()
        fit()
        if job.dist.rank == 0:  # what a benchmark compares the harness's wall time against
            seconds = time.perf_counter() - start
            write_json_atomic(job.cfg.out / "timing.json", {"train_seconds": seconds})
        if after_fit is not None:
            after_fit()
        job.log.finish(job.cfg.steps)
    finally:
        job.log.close()
