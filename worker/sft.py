"""charcount SFT job, run under torchrun (or accelerate launch):

torchrun --nproc-per-node 2 -m worker.sft --trainer legacy --out runs/a
torchrun --nproc-per-node 2 -m worker.sft --trainer worker --out runs/b
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(_run)(argv)  # torchrun then reports the failing rank's own traceback


def _run(argv: list[str] | None) -> int:
    from worker.distributed import shutdown_distributed
    from worker.trainers.common import SFTJob, parse_config
    from worker.trainers.legacy_sft import LegacySFTTrainer
    from worker.trainers.sft import SFTTrainer

    cfg = parse_config(argv)
    job = SFTJob.build(cfg)
    trainer = LegacySFTTrainer(job) if cfg.trainer == "legacy" else SFTTrainer(job)
    try:
        trainer.fit()
        if cfg.save_final:
            job.save_final()
        job.log.finish(cfg.steps)
    finally:
        job.log.close()
    shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
