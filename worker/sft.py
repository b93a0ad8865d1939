"""charcount SFT job, run under torchrun (or accelerate launch):

torchrun --nproc-per-node 2 -m worker.sft --trainer legacy --out runs/a
torchrun --nproc-per-node 2 -m worker.sft --trainer worker --out runs/b
torchrun --nproc-per-node 2 -m worker.sft --trainer tinker --chunks 2 --out runs/c
"""

from __future__ import annotations

from worker.entry import fit_and_finish, pause_gc_until_training, run_job


def train(argv: list[str] | None = None) -> None:
    pause_gc_until_training()  # the imports and the build; fit_and_finish turns it back on
    from worker.trainers.legacy_sft import LegacySFTTrainer
    from worker.trainers.sft import SFTTrainer
    from worker.trainers.sft_common import SFTJob, parse_config
    from worker.trainers.tinker import TinkerSFTTrainer

    cfg = parse_config(argv)
    job = SFTJob.build(cfg)
    trainers = {"legacy": LegacySFTTrainer, "worker": SFTTrainer, "tinker": TinkerSFTTrainer}
    trainer = trainers[cfg.trainer](job)
    fit_and_finish(job, trainer.fit, job.save_final if cfg.save_final else None)


if __name__ == "__main__":
    run_job(train)
