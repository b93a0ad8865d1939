"""charcount PPO job, run under torchrun:

torchrun --nproc-per-node 2 -m worker.ppo --trainer legacy --out runs/a
torchrun --nproc-per-node 2 -m worker.ppo --trainer worker --out runs/b
"""

from __future__ import annotations

from worker.entry import fit_and_finish, pause_gc_until_training, run_job


def train(argv: list[str] | None = None) -> None:
    pause_gc_until_training()  # the imports and the build; fit_and_finish turns it back on
    from worker.trainers.legacy_ppo import LegacyPPOTrainer
    from worker.trainers.ppo import PPOTrainer
    from worker.trainers.ppo_common import PPOJob, parse_config

    cfg = parse_config(argv)
    trainer_cls = LegacyPPOTrainer if cfg.trainer == "legacy" else PPOTrainer
    reward_model = trainer_cls.build_reward_model(cfg)  # a bad slot fails here, on every rank
    job = PPOJob.build(cfg)
    fit_and_finish(job, trainer_cls(job, reward_model).fit)


if __name__ == "__main__":
    run_job(train)
