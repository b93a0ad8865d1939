"""Run verl 0.7.1's PPO trainer (``python -m verl.trainer.main_ppo``) on CPU as its users run it.

    python -m subjects.verl.run_ppo --workers legacy|engine --out DIR [--steps 2] [-- OVERRIDES]

One plain process (``main_ppo`` starts Ray itself: a local cluster, the TaskRunner actor, one
worker actor per rank holding actor, rollout and critic, the reward workers). Run by parity
(``ppo_pair.toml``: ``distributed = false``, ``world_size = 2``), the harness's start-up hook
reaches Ray's processes through the inherited PYTHONPATH, and the 2 worker actors (verl gives
each RANK and WORLD_SIZE) must form one process group of 2. Its inputs come
from ``subjects.verl.prepare_rl`` (the charcount prompts as verl's RL parquet, the tiny Qwen2
actor, a critic with a seeded value head); the CPU patches from ``subjects.verl.rl_shim``, loaded
only through ``VERL_USE_EXTERNAL_MODULES``; the rollout from ``subjects.verl.rl_rollout`` (seeded
responses in batch order, verl's reward loop scoring them with ``subjects/verl/rl_reward.py``).

``--workers legacy`` is ``trainer.use_legacy_worker_impl=enable`` (``workers/fsdp_workers.py``:
the dp actor and critic), ``--workers engine`` is ``disable`` (``workers/engine_workers.py``: the
FSDP engine behind ``TrainingWorker``); everything else is the same on both sides, fp32 end to end,
2 ranks as 2 logical Ray GPUs (``+ray_kwargs.ray_init.num_gpus=2``: Ray's GPUs are only counters,
verl's workers find no CUDA and run on cpu; ``num_cpus=16`` lets the placement group schedule on a
machine with fewer cores).

verl's console and file loggers write every metric of every step: ``DIR/console.log`` (the whole
output) and ``DIR/verl_file_logger.jsonl``, both read by the harness at full precision. A run
folder is read through its ``metrics.jsonl`` (``parity pair`` reads ``{out}``), so a run that
finished copies verl's file logger there, record for record: ``{"step": N, **data}`` with the
numbers as verl's ``json.dumps`` wrote them (a float64 round-trips exactly), strings left out as
the harness's verl readers leave them out, then the end record. ``--record`` adds the rollout's
data digests (``DIR/ranks/rank0.jsonl``, what the harness's diagnosis reads), ``--plant
repeat-batch@K`` a data bug for tests (both in ``subjects.verl.rl_rollout``), ``--trace-step K``
every op of step K on every rank (``DIR/ops/``, ``subjects.verl.rl_shim``): what names the first
differing op. The run
is a session of its own; when it ends (or times out) every process of that session still alive,
Ray's daemons and workers included, is ended, and ``DIR/run.json`` records what was left.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHIM = "subjects.verl.rl_shim"
MANAGER = "subjects.verl.rl_rollout.SeededAgentLoopManager"
CONSOLE = "console.log"
FILE_LOGGER = "verl_file_logger.jsonl"
METRICS = "metrics.jsonl"
WORKERS = {"legacy": "enable", "engine": "disable"}
FP32 = "{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}"


def overrides(args: argparse.Namespace, out: Path) -> list[str]:
    inputs = out / "inputs"
    actor, critic, rollout = "actor_rollout_ref.actor", "critic", "actor_rollout_ref.rollout"
    return [
        f"data.train_files={inputs / 'train.parquet'}",
        f"data.val_files={inputs / 'val.parquet'}",
        f"data.train_batch_size={args.batch_size}",
        "data.max_prompt_length=96",
        f"data.max_response_length={args.response_length}",
        "data.dataloader_num_workers=0",
        "data.seed=1",
        "algorithm.adv_estimator=gae",
        "algorithm.use_kl_in_reward=False",
        f"trainer.use_legacy_worker_impl={WORKERS[args.workers]}",
        # the actor (and the rollout stand-in), fp32, no compile, sdpa
        f"actor_rollout_ref.model.path={inputs / 'model'}",
        f"actor_rollout_ref.model.use_remove_padding={args.remove_padding}",
        "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        f"{actor}.strategy=fsdp2",
        f"{actor}.fsdp_config.strategy=fsdp2",
        f"{actor}.fsdp_config.dtype=float32",
        f"+{actor}.fsdp_config.mixed_precision={FP32}",
        f"{actor}.use_torch_compile=False",
        f"{actor}.fsdp_config.use_torch_compile=False",
        f"{actor}.optim.lr={args.lr}",
        f"{actor}.ppo_mini_batch_size={args.batch_size}",
        f"{actor}.ppo_micro_batch_size_per_gpu={args.micro_batch}",
        f"{actor}.use_kl_loss=False",
        f"{actor}.entropy_coeff=0",
        f"{rollout}.name=parity_seeded",
        f"{rollout}.n={args.n}",
        f"{rollout}.tensor_model_parallel_size=1",
        f"{rollout}.log_prob_micro_batch_size_per_gpu={args.micro_batch}",
        f"+{rollout}.agent.agent_loop_manager_class={MANAGER}",
        # the critic: the same body with the seeded value head
        f"{critic}.model.path={inputs / 'critic'}",
        f"{critic}.model.tokenizer_path={inputs / 'model'}",
        f"{critic}.model.use_remove_padding={args.critic_remove_padding or args.remove_padding}",
        f"{critic}.model.enable_gradient_checkpointing=False",
        f"+{critic}.model.override_config.attn_implementation=sdpa",
        f"{critic}.strategy={'fsdp2' if args.workers == 'legacy' else 'fsdp'}",
        f"{critic}.model.fsdp_config.strategy=fsdp2",
        f"{critic}.model.fsdp_config.dtype=float32",
        f"+{critic}.model.fsdp_config.mixed_precision={FP32}",
        f"{critic}.model.fsdp_config.use_torch_compile=False",
        f"{critic}.optim.lr={args.critic_lr}",
        f"{critic}.ppo_micro_batch_size_per_gpu={args.micro_batch}",
        # the reward: verl's reward loop with the charcount score, one worker
        "reward.num_workers=1",
        f"reward.custom_reward_function.path={REPO / 'subjects' / 'verl' / 'rl_reward.py'}",
        "reward.custom_reward_function.name=compute_score",
        # the trainer: 2 logical GPUs on 1 node, no validation, no checkpoints
        "trainer.nnodes=1",
        f"trainer.n_gpus_per_node={args.world}",
        f"trainer.total_training_steps={args.steps}",
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.resume_mode=disable",
        "trainer.logger=[console,file]",
        "trainer.project_name=llm-parity",
        f"trainer.experiment_name=verl-ppo-{args.workers}",
        f"trainer.default_local_dir={out / 'ckpt'}",
        f"+ray_kwargs.ray_init.num_gpus={args.world}",
        "ray_kwargs.ray_init.num_cpus=16",
        "+ray_kwargs.ray_init.include_dashboard=False",
        f"hydra.run.dir={out / 'hydra'}",
        *args.extra,
    ]


def transcribe(verl_log: Path, metrics: Path) -> int:
    """verl's file logger as the harness's metrics.jsonl (module doc); the steps written."""
    steps = 0
    with metrics.open("w") as out:
        for line in verl_log.read_text().splitlines():
            if not line.strip():
                continue
            record = json.loads(line)
            step = int(record["step"])
            data = record.get("data", {})
            numbers = {
                k: v
                for k, v in data.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool)
            }
            out.write(json.dumps({"step": step, **numbers}) + "\n")
            steps = max(steps, step)
        out.write(json.dumps({"event": "end", "steps": steps}) + "\n")
    return steps


def _session_pids(sid: int) -> list[int]:
    """Processes of session ``sid`` still alive (from /proc: no tool needed)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # fields[3]: the session id
            pids.append(int(entry.name))
    return pids


def end_session(sid: int, grace_s: float = 10) -> list[int]:
    """End every process of session ``sid`` by pid, TERM then KILL; the pids found first."""
    found = _session_pids(sid)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in _session_pids(sid):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while _session_pids(sid) and time.monotonic() < deadline:
            time.sleep(0.2)
    return found


def _terminated(signum, frame):
    """SIGTERM (the harness stopping a side) as an exception, so that the launch still ends its
    session: Ray's processes are not in this process's group and would outlive it."""
    raise SystemExit(128 + signum)


def launch(command: list[str], cwd: Path, environ: dict, log, timeout_s: float) -> tuple[int, list]:
    """Run the command in a session of its own; afterwards end whatever of that session is left
    (Ray's daemons outlive a driver killed at the timeout), also when this process is stopped
    (SIGTERM, Ctrl-C). Answers the exit code (124 past the timeout) and the pids that were left."""
    signal.signal(signal.SIGTERM, _terminated)
    proc = subprocess.Popen(
        command, cwd=cwd, env=environ, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        rc = 124
    except BaseException:
        end_session(proc.pid)
        raise
    left = end_session(proc.pid)
    if rc == 124:
        proc.wait()
    return rc, left


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m subjects.verl.run_ppo", allow_abbrev=False)
    p.add_argument("--workers", required=True, choices=sorted(WORKERS))
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=4, help="prompts per step")
    p.add_argument("--n", type=int, default=2, help="responses per prompt")
    p.add_argument("--micro-batch", type=int, default=4, help="per rank")
    p.add_argument("--response-length", type=int, default=16)
    p.add_argument(
        "--remove-padding",
        choices=("True", "False"),
        default="True",
        help="use_remove_padding of the actor and the critic (default True: verl's actor default)",
    )
    p.add_argument(
        "--critic-remove-padding",
        choices=("True", "False"),
        help="the critic's alone (default: --remove-padding); the engine critic ignores it",
    )
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--critic-lr", type=float, default=1e-4)
    p.add_argument(
        "--dump",
        action="store_true",
        help="save the diagnostic tensors into DIR/dump (subjects.verl.rl_shim; numbers unchanged)",
    )
    p.add_argument(
        "--record",
        action="store_true",
        help="the rollout's data digests into DIR/ranks (subjects.verl.rl_rollout)",
    )
    p.add_argument(
        "--trace-step",
        type=int,
        metavar="K",
        help="every op of training step K into DIR/ops, every rank (subjects.verl.rl_shim)",
    )
    p.add_argument(
        "--plant",
        metavar="repeat-batch@K",
        help="a data bug for tests: step K takes step K-1's prompts again (rl_rollout)",
    )
    p.add_argument("--timeout-s", type=float, default=1200)
    p.add_argument("--python", type=Path, help="the verl environment's python (default: built)")
    p.add_argument("extra", nargs="*", help="more Hydra overrides (after --)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.python is None:
        from subjects.verl import rl_env

        python = rl_env()
    else:
        python = args.python
    # REPO before the inherited path, never in its place: a launcher's start-up hook comes on
    # PYTHONPATH (parity's records the process group Ray's workers form, which the harness
    # checks), and a wrapper that replaces PYTHONPATH drops it
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    variables = {
        "PYTHONPATH": os.pathsep.join([str(REPO), *inherited]),
        "VERL_USE_EXTERNAL_MODULES": SHIM,
        "VERL_FILE_LOGGER_PATH": str(out / FILE_LOGGER),
        "HYDRA_FULL_ERROR": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "RAY_DEDUP_LOGS": "0",
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    if args.dump:
        variables["PARITY_VERL_DUMP"] = str(out / "dump")
    if args.record:
        variables["PARITY_VERL_RECORD"] = str(out)
    if args.plant:
        variables["PARITY_VERL_PLANT"] = args.plant
    if args.trace_step:
        variables["PARITY_VERL_TRACE"] = str(args.trace_step)
        variables["PARITY_VERL_TRACE_OUT"] = str(out)
    environ = {**os.environ, **variables}
    unwanted = ["CUDA_VISIBLE_DEVICES", "RAY_ADDRESS"]  # a local cluster, no real GPU
    for flag, name in ((args.dump, "PARITY_VERL_DUMP"), (args.record, "PARITY_VERL_RECORD")):
        if not flag:
            unwanted.append(name)
    if not args.plant:
        unwanted.append("PARITY_VERL_PLANT")
    if not args.trace_step:
        unwanted += ["PARITY_VERL_TRACE", "PARITY_VERL_TRACE_OUT"]
    for name in unwanted:  # a local cluster, no real GPU
        environ.pop(name, None)
    for stale in (FILE_LOGGER, METRICS):  # verl's file logger appends
        if (out / stale).exists():
            (out / stale).unlink()
    subprocess.run(
        [str(python), "-m", "subjects.verl.prepare_rl", str(out / "inputs")],
        cwd=REPO,
        env={**environ, "VERL_USE_EXTERNAL_MODULES": ""},
        check=True,
        timeout=300,
    )
    command = [str(python), "-m", "verl.trainer.main_ppo", *overrides(args, out)]
    started = time.monotonic()
    with (out / CONSOLE).open("wb") as log:
        rc, left = launch(command, out, environ, log, args.timeout_s)
    record = {
        "workers": args.workers,
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "python", "extra")},
        "python": str(python),
        "command": command,
        "cwd": str(out),
        "environment": variables,
        "wall_s": round(time.monotonic() - started, 1),
        "exit_code": rc,
        "left_running": left,
        "console": CONSOLE,
        "file_logger": FILE_LOGGER,
    }
    (out / "run.json").write_text(json.dumps(record, indent=2) + "\n")
    if rc == 0 and (out / FILE_LOGGER).exists():
        transcribe(out / FILE_LOGGER, out / METRICS)
    if rc != 0:
        print(f"run_ppo: {args.workers} exited {rc}; see {out / CONSOLE}", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
