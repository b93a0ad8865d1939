"""Run verl's engine SFT trainer (``verl.trainer.sft_trainer``) of one release on CPU ranks.

    python -m subjects.verl.run_sft --verl 0.6.1 --out runs/verl-a [--steps 6] [--test-freq 2]
    python -m subjects.verl.run_sft --verl 0.7.0 --out runs/verl-b
    parity compare runs/verl-a/console.log runs/verl-b/console.log

Runs under the main venv with the standard library only: it gets the release's own environment
(``subjects.verl.env``: built and cached on first use), makes the inputs there
(``subjects.verl.prepare``: the charcount fixtures as parquet, the tiny Qwen2 and its tokenizer),
then launches ``python -m torch.distributed.run --standalone --nproc-per-node WORLD -m
verl.trainer.sft_trainer`` of that environment with the CPU shim loaded through verl's own hook
(``VERL_USE_EXTERNAL_MODULES=subjects.verl.cpu_shim``) and these settings:

- CPU and gloo: ``trainer.device=cpu`` (the shim gives gloo), fp32 everywhere (model, FSDP2 mixed
  precision for params, reductions and buffers; the shim turns verl's hard-coded bf16 autocast
  off on CPU), ``attn_implementation=sdpa``, ``model.use_remove_padding=False`` (packing needs
  flash-attn), ``engine.use_torch_compile=False``, no gradient checkpointing.
- Data: global batch ``--batch-size`` (16), ``pad_mode=no_padding``, dynamic batch size with
  ``--max-tokens-per-rank`` (1000) tokens per micro-batch. verl's fixed micro-batch path cannot run
  here: ``TensorDict.split`` of jagged (no-padding) tensors fails in torch ("split_with_sizes():
  not supported for NestedTensor on dim=0"). The val loader uses the train batch size per rank
  and the same token budget: 1000 gives 2 micro-batches per val batch on each rank for the 48
  charcount val samples (3 batches of 8 per rank), 4096 gives 1.
- AdamW lr ``--lr`` (1e-3), cosine with 2 warmup steps to 0.1 * lr, clip 1.0; ``--steps``
  steps, validation every ``--test-freq`` steps and at the last.
- The harness's diagnosis files, unless ``--no-record``: ``subjects.verl.recorder`` is loaded
  by the same hook after the shim and writes ``ranks/rank{r}.jsonl`` (each rank's batch digests
  and reduced metrics), ``manifest.json`` and, at ``--fingerprint-steps``, ``fingerprints.jsonl``
  into OUT, so ``parity compare``/``report`` on the two console logs print their diagnosis.
  ``--plant repeat-batch@K`` plants a data-order bug (step K trains on step K-1's batch again).
- ``--oracle-checkpoints``: save the model shards (``checkpoint.save_contents=[model]``) at every
  validation step, so a float64 oracle can recompute the val loss at the weights it was computed
  with (``subjects.verl.oracle``); otherwise ``save_contents=[]``. verl saves at the last step
  whatever this says, and 0.6.1 ignores ``save_contents`` (it always writes model, optimizer and
  extra shards): a bug of that release, fixed in 0.7.0.

OUT gets ``console.log`` (everything the launch printed, stdout and stderr as one stream, as a
user's ``2>&1`` log), ``verl_file_logger.jsonl`` (verl's FileLogger: ``trainer.logger`` is
``[console,file]``, supported by both releases), ``inputs/``, ``ckpt/``, ``hydra/`` and
``run.json`` (the settings, the command, the environment variables set, wall time, exit code, and
``finished``: whether rank 0 printed verl's closing "Final validation metrics:" line, so that a
launch that fails after it, in ``destroy_process_group``, is told from a failed run). The exit
code is the launch's. Extra Hydra overrides go after ``--``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHIM = "subjects.verl.cpu_shim"
RECORDER = "subjects.verl.recorder"
CONSOLE = "console.log"
FILE_LOGGER = "verl_file_logger.jsonl"
FINISHED = b"Final validation metrics:"
RECORDS = ("ranks", "fingerprints.jsonl", "manifest.json")  # what the recorder writes


def overrides(args: argparse.Namespace, out: Path) -> list[str]:
    inputs = out / "inputs"
    save = "[model]" if args.oracle_checkpoints else "[]"
    return [
        f"data.train_files={inputs / 'train.parquet'}",
        f"data.val_files={inputs / 'val.parquet'}",
        f"data.train_batch_size={args.batch_size}",
        "data.use_dynamic_bsz=True",
        f"data.max_token_len_per_gpu={args.max_tokens_per_rank}",
        "data.max_length=512",
        "data.pad_mode=no_padding",
        f"model.path={inputs / 'model'}",
        "model.use_remove_padding=False",
        "+model.override_config.attn_implementation=sdpa",
        "model.enable_gradient_checkpointing=False",
        "engine.strategy=fsdp2",
        "engine.use_torch_compile=False",
        "engine.model_dtype=fp32",
        "+engine.mixed_precision={param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}",
        f"optim.lr={args.lr}",
        "optim.lr_scheduler_type=cosine",
        "optim.lr_warmup_steps=2",
        "optim.min_lr_ratio=0.1",
        "optim.clip_grad=1.0",
        "trainer.device=cpu",
        f"trainer.total_training_steps={args.steps}",
        f"trainer.test_freq={args.test_freq}",
        f"trainer.save_freq={args.test_freq if args.oracle_checkpoints else -1}",
        f"checkpoint.save_contents={save}",
        "trainer.logger=[console,file]",
        "trainer.project_name=llm-parity",
        f"trainer.experiment_name=verl-{args.verl}",
        f"trainer.default_local_dir={out / 'ckpt'}",
        "trainer.resume_mode=disable",
        f"hydra.run.dir={out / 'hydra'}",
        *args.extra,
    ]


def _clear_records(out: Path) -> None:
    """No earlier run's diagnosis files in a reused folder (a rank file of a larger world, the
    fingerprints of a run that took them)."""
    for name in RECORDS:
        path = out / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def launch(command: list[str], cwd: Path, environ: dict, log, timeout_s: float) -> int:
    """Run the launch in a session of its own; past the timeout, end that session (the launcher
    and its ranks, nothing else) and answer 124."""
    proc = subprocess.Popen(
        command, cwd=cwd, env=environ, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                continue
        return 124


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m subjects.verl.run_sft", allow_abbrev=False)
    p.add_argument("--verl", required=True, help="release: 0.6.1 (before) or 0.7.0 (after)")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--test-freq", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-tokens-per-rank", type=int, default=1000)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--oracle-checkpoints", action="store_true")
    p.add_argument(
        "--fingerprint-steps",
        default="",
        help='steps whose weights and pre-clip gradients are hashed ("2,4,6", "all"; none)',
    )
    p.add_argument("--no-record", action="store_true", help="no diagnosis files (the shim only)")
    p.add_argument(
        "--plant", default="", help="a planted bug for tests: repeat-batch@K (see the recorder)"
    )
    p.add_argument("--timeout-s", type=float, default=1200)
    p.add_argument("--python", type=Path, help="the verl environment's python (default: built)")
    p.add_argument("extra", nargs="*", help="more Hydra overrides (after --)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from subjects.verl import VERSIONS, env

    if args.verl not in VERSIONS:
        print(f"run_sft: --verl {args.verl}: not one of {', '.join(VERSIONS)}", file=sys.stderr)
        return 2
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.no_record and (args.fingerprint_steps or args.plant):
        print("run_sft: --fingerprint-steps and --plant need the recorder", file=sys.stderr)
        return 2
    python = args.python or env(args.verl)
    _clear_records(out)
    variables = {
        "PYTHONPATH": str(REPO),
        "VERL_USE_EXTERNAL_MODULES": SHIM if args.no_record else f"{SHIM},{RECORDER}",
        "VERL_FILE_LOGGER_PATH": str(out / FILE_LOGGER),
        "HYDRA_FULL_ERROR": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    if not args.no_record:
        variables["PARITY_VERL_RECORD"] = str(out)
        variables["PARITY_VERL_FINGERPRINT_STEPS"] = args.fingerprint_steps
        if args.plant:
            variables["PARITY_VERL_PLANT"] = args.plant
    environ = {**os.environ, **variables}
    subprocess.run(
        [str(python), "-m", "subjects.verl.prepare", str(out / "inputs")],
        cwd=REPO,
        env=environ,
        check=True,
        timeout=300,
    )
    command = [
        str(python),
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={args.world}",
        "-m",
        "verl.trainer.sft_trainer",
        *overrides(args, out),
    ]
    started = time.monotonic()
    with (out / CONSOLE).open("wb") as log:
        rc = launch(command, out, environ, log, args.timeout_s)
    # verl prints this on rank 0 after the last step, before destroy_process_group(): a launch
    # that fails after it failed in teardown, with every metric written
    finished = FINISHED in (out / CONSOLE).read_bytes()
    record = {
        "verl": args.verl,
        "settings": {
            "world": args.world,
            "steps": args.steps,
            "test_freq": args.test_freq,
            "batch_size": args.batch_size,
            "max_tokens_per_rank": args.max_tokens_per_rank,
            "lr": args.lr,
            "oracle_checkpoints": args.oracle_checkpoints,
            "record": not args.no_record,
            "fingerprint_steps": args.fingerprint_steps,
            "plant": args.plant or None,
        },
        "python": str(python),
        "command": command,
        "cwd": str(out),
        "environment": variables,
        "wall_s": round(time.monotonic() - started, 1),
        "exit_code": rc,
        "finished": finished,
        "console": CONSOLE,
        "file_logger": FILE_LOGGER,
    }
    (out / "run.json").write_text(json.dumps(record, indent=2) + "\n")
    if rc != 0:
        when = "after training finished (teardown)" if finished else "before finishing"
        print(f"run_sft: verl {args.verl} exited {rc} {when}; see {out / CONSOLE}", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
