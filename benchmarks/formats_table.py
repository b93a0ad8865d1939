"""Every reader end to end: runs written by each format's real writer, compared by `parity`.

    python benchmarks/formats_table.py              # prints the markdown table; exit 1 on a miss
    python benchmarks/formats_table.py --keep DIR   # keep the written runs in DIR

For every format of `parity.readers.REGISTRY` (the MLflow reader twice: its file store and its
SQLite store; torchtitan's loss file twice: `f"{step} {loss}"` and the console's 5-decimal cut)
three runs of 8 steps are written, each with the format's own metric names: a loss, grad_norm,
lr, a counter (tokens or samples seen) and a memory or throughput metric:

- A;
- A', A written again: only its noise metric (and whatever else a rerun changes by itself: run
  ids, wall clock, HF's `train_runtime`) differs, as in a rerun;
- B, A with the loss at step 5 moved by the smallest change the format holds: one ULP of what
  the source holds (float32 for TensorBoard's `simple_value`, float64 for text and JSON written
  with the shortest repr), one unit of the last decimal for a format that rounds (Megatron's
  golden values, torchtitan's console cut).

The writers are the real libraries where the tests use one: torch's `SummaryWriter`, wandb
(offline), mlflow-skinny (file and SQLite stores), transformers' `Trainer` (three real CPU
trainings of a tiny model; B's loss is moved in `Trainer.log`, the hook HF documents for it),
pytorch_lightning's `CSVLogger`, orjson as verl's file logger uses it, tqdm and
`pprint.pformat` as verl's console, our `worker.metrics_log.MetricsLog`, pandas' `to_csv`;
NeMo's DLLogger lines, Megatron's golden values and torchtitan's loss files as their (unpackaged)
generators write them. The heavy writers run in three subprocesses at once (wandb; mlflow; torch,
transformers and lightning) while this process writes the rest.

Then `parity compare X Y --json` (through `parity.cli.main`) for A vs A, A vs A' and A vs B, and
one markdown table. Exit 1 when an A vs A or A vs A' is not aligned, or A vs B does not diverge
on the loss at step 5, and only there.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import pprint
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STEPS = 8
PLANT = 5  # the step whose loss B moves
SIDES = ("A", "A2", "B")
JITTER = {"A": 0.0, "A2": 0.0371, "B": 0.0813}  # the noise metric: never the same twice


# --- the values, and the smallest change a source holds -----------------------------------------


def ulp64(x: float) -> float:
    return math.nextafter(x, math.inf)


def f32(x: float) -> float:
    return float(np.float32(x))


def ulp32(x: float) -> float:
    return float(np.nextafter(np.float32(x), np.float32(np.inf)))


def decimal_unit(places: int) -> Callable[[float], float]:
    """One unit in the last of ``places`` decimals, added to a value already rounded to them."""

    def plant(x: float) -> float:
        return float(Decimal(repr(x)) + Decimal(1).scaleb(-places))

    return plant


def rows(
    side: str,
    plant: Callable[[float], float] = ulp64,
    held: Callable[[float], float] = float,
) -> Iterator[tuple[int, dict[str, float]]]:
    """(step, values) of one run: ``held`` is what the source keeps of a value (float32, a
    rounding), ``plant`` B's change of the loss at PLANT."""
    for step in range(1, STEPS + 1):
        r = {
            "loss": held(2.5 / (step + 1) + 0.01 * math.sin(step)),
            "grad_norm": held(1.7 / (step + 3)),
            "lr": held(3e-4 * step / STEPS),
            "tokens": 4096 * step,
            "noise": held(3.25 + 0.001 * step + JITTER[side]),
        }
        if side == "B" and step == PLANT:
            r["loss"] = plant(r["loss"])
        yield step, r


# --- the writers: each writes one side into an empty folder, returns the path to compare --------


def write_tensorboard(folder: Path, side: str) -> Path:
    """torchtitan's tags through torch's SummaryWriter: `simple_value` (float32) for the loss,
    grad_norm and memory, DT_DOUBLE tensors for lr and the token counter."""
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(folder)) as w:
        for step, r in rows(side, ulp32, f32):
            w.add_scalar("loss_metrics/global_avg_loss", r["loss"], step)
            w.add_scalar("grad_norm", r["grad_norm"], step)
            w.add_scalar("lr", r["lr"], step, new_style=True, double_precision=True)
            w.add_scalar("ntokens_seen", r["tokens"], step, new_style=True, double_precision=True)
            w.add_scalar("memory/max_reserved(GiB)", r["noise"], step)
    return folder


def write_lightning(folder: Path, side: str) -> Path:
    """pytorch_lightning's CSVLogger, logged as its Trainer logs (with ThroughputMonitor's mfu)."""
    from pytorch_lightning.loggers import CSVLogger

    logger = CSVLogger(str(folder))
    logger.log_hyperparams({"lr": 3e-4})
    for step, r in rows(side):
        logger.log_metrics(
            {
                "train_loss": r["loss"],
                "grad_norm": r["grad_norm"],
                "lr-AdamW": r["lr"],
                "tokens_seen": r["tokens"],
                "train/device/mfu": r["noise"] / 10,
                "epoch": 0,
            },
            step=step,
        )
    logger.finalize("success")
    return folder / "lightning_logs" / "version_0"


def write_hf(folder: Path, side: str) -> Path:
    """A real transformers Trainer run (8 steps, CPU, a tiny model), `trainer_state.json` by
    `save_state`; B's loss at step 5 moved one float64 ULP in `Trainer.log` before HF records
    it. Its noise is HF's own `train_runtime` and `train_tokens_per_second` in every row."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()

    class Tiny(torch.nn.Module):
        main_input_name = "x"  # what HF's num_input_tokens_seen counts

        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def forward(self, x, labels=None):
            out = self.lin(x).squeeze(-1)
            return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}

    class Planted(transformers.Trainer):
        def log(self, logs, start_time=None):
            if side == "B" and self.state.global_step == PLANT and "loss" in logs:
                logs["loss"] = ulp64(logs["loss"])
            super().log(logs, start_time)

    torch.manual_seed(0)
    data = [{"x": torch.randn(4), "labels": torch.randn(())} for _ in range(2 * STEPS)]
    args = transformers.TrainingArguments(
        output_dir=str(folder),
        use_cpu=True,
        logging_steps=1,
        report_to=[],
        max_steps=STEPS,
        per_device_train_batch_size=2,
        learning_rate=3e-3,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
        include_num_input_tokens_seen=True,
    )
    trainer = Planted(model=Tiny(), args=args, train_dataset=data)
    trainer.train()
    trainer.save_state()
    return folder / "trainer_state.json"


def _wandb_env() -> None:
    os.environ.update(
        WANDB_MODE="offline",
        WANDB_SILENT="true",
        WANDB_DISABLE_GIT="true",
        WANDB_DISABLE_CODE="true",
        WANDB_API_KEY="",
    )


def write_wandb(folder: Path, side: str) -> Path:
    """An offline W&B run: `run.log(..., step=step)`, read from its `.wandb` log."""
    import wandb

    run = wandb.init(project="formats", mode="offline", dir=str(folder), id=f"run{side}")
    for step, r in rows(side):
        run.log(
            {
                "train/loss": r["loss"],
                "train/grad_norm": r["grad_norm"],
                "train/lr": r["lr"],
                "train/global_tokens": r["tokens"],
                "perf/max_memory_allocated_gb": r["noise"],
            },
            step=step,
        )
    run.finish()
    (found,) = (folder / "wandb").glob("offline-run-*")
    return found


def _mlflow_env() -> None:
    os.environ.update(
        MLFLOW_ALLOW_FILE_STORE="true",
        MLFLOW_DISABLE_TELEMETRY="true",
        DO_NOT_TRACK="true",
        GIT_PYTHON_REFRESH="quiet",
    )


def _mlflow_log(uri: str, side: str) -> None:
    import mlflow

    mlflow.set_tracking_uri(uri)
    with mlflow.start_run(run_name=f"run-{side}"):
        for step, r in rows(side):
            mlflow.log_metrics(
                {
                    "loss": r["loss"],
                    "grad_norm": r["grad_norm"],
                    "learning_rate": r["lr"],
                    "tokens_seen": r["tokens"],
                    "system/system_memory_usage_megabytes": r["noise"] * 1024,
                },
                step=step,
            )


def write_mlflow_files(folder: Path, side: str) -> Path:
    """MLflow's file store (`mlruns/`), by mlflow.log_metrics."""
    _mlflow_log(f"file:{folder}/mlruns", side)
    return folder / "mlruns"


_EMPTY_DB: dict[str, Path] = {}


def write_mlflow_sqlite(folder: Path, side: str) -> Path:
    """MLflow's SQLite store (`mlflow.db`): an empty database built once by MLflow (its
    migrations take seconds), copied per side, then logged into by mlflow.log_metrics."""
    from mlflow import MlflowClient, set_tracking_uri

    if "db" not in _EMPTY_DB:
        empty = folder.parent / "empty.db"
        set_tracking_uri(f"sqlite:///{empty}")
        MlflowClient().search_experiments()
        _EMPTY_DB["db"] = empty
    shutil.copy(_EMPTY_DB["db"], folder / "mlflow.db")
    _mlflow_log(f"sqlite:///{folder}/mlflow.db", side)
    return folder / "mlflow.db"


def _dll(step, data, i: int) -> str:
    """A line as dllogger's JSONStreamBackend writes it (dllogger/logger.py)."""
    ts = datetime(2025, 3, 1, 12, 0, 0) + timedelta(seconds=1.25 * i)
    rec = dict(
        timestamp=str(ts.timestamp()),
        datetime=str(ts),
        elapsedtime=str(1.25 * i),
        type="LOG",
        step=step,
        data=data,
    )
    return f"DLLL {json.dumps(rec)}\n"


def write_nemo(folder: Path, side: str) -> Path:
    """NeMo's DLLogger: hyperparameters, then Lightning's log_metrics per step (dllogger is not
    on PyPI; its JSON backend's lines as in tests/readers/test_reader_nemo.py)."""
    lines = [_dll("PARAMETER", {"model.hidden_size": 64, "trainer.precision": "bf16"}, 0)]
    for step, r in rows(side):
        data = {
            "reduced_train_loss": r["loss"],
            "grad_norm": r["grad_norm"],
            "lr": r["lr"],
            "consumed_samples": r["tokens"] // 512,
            "train_step_timing in s": r["noise"] / 10,
            "epoch": 0,
        }
        lines.append(_dll(step, data, step))
    path = folder / "dllogger.json"
    path.write_text("".join(lines))
    return path


def write_megatron(folder: Path, side: str) -> Path:
    """Megatron-LM's golden values: TensorBoard scalars (float32) at `round(value, 5)`, every
    step (step_interval 1), `json.dump(indent=4)`; B's loss one unit in the 5th decimal."""
    metrics: dict[str, dict] = {}
    names = {
        "loss": "lm loss",
        "grad_norm": "grad-norm",
        "lr": "learning-rate",
        "tokens": "num-zeros",
        "noise": "mem-allocated-bytes",
    }
    for step, r in rows(side, decimal_unit(5), lambda x: round(f32(x), 5)):
        for key, name in names.items():
            value = round(r[key] * 2**28) if key == "noise" else r[key]  # bytes
            m = metrics.setdefault(
                name, {"start_step": 1, "end_step": STEPS, "step_interval": 1, "values": {}}
            )
            m["values"][str(step)] = round(float(value), 5)
    path = folder / "golden_values_dev_dgx_h100.json"
    path.write_text(json.dumps(metrics, indent=4))
    return path


def write_torchtitan(folder: Path, side: str) -> Path:
    """torchtitan's loss reference with its `# step loss grad_norm` header (scripts/
    loss_compare.py: `f"{step} {loss}"`, the loss a float32 `.item()`); the format holds only
    the loss and grad_norm."""
    lines = ["# config: llama3_debugmodel\n", "# step loss grad_norm\n"]
    for step, r in rows(side, ulp64, f32):
        lines.append(f"{step} {r['loss']} {r['grad_norm']}\n")
    path = folder / "llama3.txt"
    path.write_text("".join(lines))
    return path


def write_torchtitan_cut(folder: Path, side: str) -> Path:
    """torchtitan's loss reference cut from its console (`loss: {:8.5f}`): 5 decimals."""
    lines = [
        f"{step} {r['loss']:.5f}\n"
        for step, r in rows(side, decimal_unit(5), lambda x: round(f32(x), 5))
    ]
    path = folder / "baseline_losses.txt"
    path.write_text("".join(lines))
    return path


def _verl_metrics(r: dict[str, float], step: int) -> dict:
    return {
        "train/loss": np.float64(r["loss"]),
        "train/grad_norm": float(r["grad_norm"]),
        "train/lr": r["lr"],
        "train/global_tokens": np.int64(r["tokens"]),
        "actor/entropy": np.float32(0.1) * np.float32(step),
        "perf/max_memory_allocated_gb": r["noise"],
    }


def write_verl_jsonl(folder: Path, side: str) -> Path:
    """verl's FileLogger (0.9: `orjson.dumps({"step", "data"}, OPT_SERIALIZE_NUMPY)`)."""
    import orjson

    path = folder / "formats.jsonl"
    with open(path, "wb", buffering=0) as fp:
        for step, r in rows(side):
            data = _verl_metrics(r, step)
            data.pop("actor/entropy")  # orjson writes a float32 in float32's shortest repr
            fp.write(orjson.dumps({"step": step, "data": data}, option=orjson.OPT_SERIALIZE_NUMPY))
            fp.write(b"\n")
    return path


def write_jsonl(folder: Path, side: str) -> Path:
    """Our run folder, by worker.metrics_log.MetricsLog (metrics.jsonl and its end record)."""
    from worker.metrics_log import MetricsLog

    log = MetricsLog(folder, enabled=True)
    with redirect_stdout(io.StringIO()):  # it echoes each line, as a job's console does
        for step, r in rows(side):
            log.log(
                step,
                {
                    "train/loss": r["loss"],
                    "train/grad_norm": r["grad_norm"],
                    "train/lr": r["lr"],
                    "train/tokens": float(r["tokens"]),
                    "perf/step_time_s": r["noise"],
                },
                meta={"epoch": 0},
            )
        log.finish(STEPS)
    return folder


def write_csv(folder: Path, side: str) -> Path:
    """A `.csv` with a step column, by pandas' `DataFrame.to_csv`."""
    import pandas as pd

    table = pd.DataFrame(
        [
            {
                "step": step,
                "loss": r["loss"],
                "grad_norm": r["grad_norm"],
                "lr": r["lr"],
                "tokens": r["tokens"],
                "tokens_per_s": r["noise"] * 1e4,
            }
            for step, r in rows(side)
        ]
    ).set_index("step")
    path = folder / "metrics.csv"
    table.to_csv(path)
    return path


def write_verl_console(folder: Path, side: str) -> Path:
    """verl's console: a real tqdm bar and LocalLogger's `step:N - key:pformat(value)` lines in
    one stream, as `2>&1` gives (one metric a np.float32)."""
    from tqdm import tqdm

    buf = io.StringIO()
    with redirect_stdout(buf):
        print("INFO: starting the trainer, config:", {"lr": 3e-4})
        bar = tqdm(total=STEPS, desc="Training Progress", file=buf, mininterval=0)
        for step, r in rows(side):
            bar.update(1)
            items = _verl_metrics(r, step).items()
            line = " - ".join([f"step:{step}"] + [f"{k}:{pprint.pformat(v)}" for k, v in items])
            print(line, flush=True)
        bar.close()
    path = folder / "train.log"
    path.write_text(buf.getvalue())
    return path


# --- the rows of the table ----------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    label: str  # the table's first column
    fmt: str  # the registry's name: what detection must give
    loss: str  # the loss metric's name in this format
    writer: Callable[[Path, str], Path]
    group: str  # "main", or the subprocess that writes it


CASES = (
    Case("hf-trainer-state", "hf-trainer-state", "train/loss", write_hf, "torch"),
    Case("tensorboard", "tensorboard", "loss_metrics/global_avg_loss", write_tensorboard, "torch"),
    Case("wandb", "wandb", "train/loss", write_wandb, "wandb"),
    Case("mlflow (file store)", "mlflow", "loss", write_mlflow_files, "mlflow"),
    Case("mlflow (SQLite)", "mlflow", "loss", write_mlflow_sqlite, "mlflow"),
    Case("lightning-csv", "lightning-csv", "train_loss", write_lightning, "torch"),
    Case("nemo-dllogger", "nemo-dllogger", "reduced_train_loss", write_nemo, "main"),
    Case("megatron-golden", "megatron-golden", "lm loss", write_megatron, "main"),
    Case("torchtitan-loss", "torchtitan-loss", "loss_metrics/global_avg_loss", write_torchtitan,
         "main"),
    Case("torchtitan-loss (cut)", "torchtitan-loss", "loss_metrics/global_avg_loss",
         write_torchtitan_cut, "main"),
    Case("verl-jsonl", "verl-jsonl", "train/loss", write_verl_jsonl, "main"),
    Case("jsonl", "jsonl", "train/loss", write_jsonl, "main"),
    Case("csv", "csv", "loss", write_csv, "main"),
    Case("verl-console", "verl-console", "train/loss", write_verl_console, "main"),
)  # fmt: skip

_ENV = {"wandb": _wandb_env, "mlflow": _mlflow_env}


def write_group(group: str, root: Path) -> dict[str, dict[str, str]]:
    """Write every case of ``group``, each side in ROOT/label/side; {label: {side: path}}."""
    if group in _ENV:
        _ENV[group]()
    out: dict[str, dict[str, str]] = {}
    for case in CASES:
        if case.group != group:
            continue
        out[case.label] = {}
        for side in SIDES:
            folder = root / _slug(case.label) / side
            folder.mkdir(parents=True)
            out[case.label][side] = str(case.writer(folder, side))
    return out


def _slug(label: str) -> str:
    return "".join(c if c.isalnum() or c == "-" else "_" for c in label)


def _subprocess(group: str, root: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, __file__, "--write-group", group, str(root)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=root,
        env={**os.environ, "PYTHONWARNINGS": "ignore", "TOKENIZERS_PARALLELISM": "false"},
    )


def compare(a: str, b: str) -> tuple[int, dict]:
    """`parity compare A B --json` through the command line's main: (exit code, its JSON, or
    {"error": stderr} when it gave none)."""
    from parity.cli import main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(["compare", a, b, "--json"])
    if not out.getvalue().strip():
        return code, {"error": err.getvalue().strip() or f"exit {code}, no output"}
    return code, json.loads(out.getvalue())


def _words(p: str) -> str:
    return " and ".join(
        f"{x.split(':')[1]} decimals" if x.startswith("decimals:") else x for x in p.split(",")
    )


def _precision(result: dict) -> str:
    judged = {n: m["precision"] for n, m in result["metrics"].items() if m["status"] != "ignored"}
    if not judged:
        return "-"
    common, _ = Counter(judged.values()).most_common(1)[0]
    others = sorted((n, p) for n, p in judged.items() if p != common)
    return _words(common) + "".join(f"; `{n}` {_words(p)}" for n, p in others)


def _failing(result: dict) -> list[tuple[str, dict]]:
    return sorted(
        ((n, m) for n, m in result.get("metrics", {}).items() if not m["ok"]),
        key=lambda nm: (nm[1]["first_divergent_step"] or 0, nm[0]),
    )


def _verdict(code: int, result: dict) -> str:
    if "error" in result:
        return f"exit {code}: {result['error'].splitlines()[-1]}"
    fails = _failing(result)
    if not fails:
        return result["verdict"]
    name, m = fails[0]
    step = m["first_divergent_step"]
    if m["status"] != "diverged" or m["max_ulp"] is None:
        how = m["status"]
    elif "decimals" in m["precision"]:  # a rounded source: the difference, not float64 ULPs
        how = f"Δ {m['max_abs_diff']:.0e}"
    else:
        how = f"{m['max_ulp']} ulp" + (" float32" if "float32" in m["precision"] else "")
    where = "" if step is None else f" @ step {step}"
    text = f"{result['verdict']}: `{name}`{where} ({how})"
    if len(fails) > 1:
        text += f"; also {', '.join(f'`{n}`' for n, _ in fails[1:])}"
    return text


def judge(case: Case, paths: dict[str, str]) -> tuple[list[str], list[str]]:
    """The case's table row and what went wrong (empty: as required)."""
    problems = []
    runs = {"A" + side: compare(paths["A"], paths[side]) for side in SIDES}
    for pair in ("AA", "AA2"):
        code, res = runs[pair]
        if code != 0 or res.get("verdict") != "aligned":
            other = {"A": "A", "A2": "A'"}[pair[1:]]
            problems.append(f"A vs {other}: {_verdict(code, res)}")
    code, res = runs["AB"]
    fails = _failing(res)
    if code != 1 or [(n, m["first_divergent_step"]) for n, m in fails] != [(case.loss, PLANT)]:
        problems.append(f"A vs B: {_verdict(code, res)} (want `{case.loss}` @ step {PLANT} only)")
    if "error" in res:
        return [case.label, "-", "-", "-", _verdict(code, res), "-"], problems
    reads = res["reads"]
    formats = {reads[s]["format"] for s in "ab"}
    if formats != {case.fmt}:
        problems.append(f"read as {sorted(formats)}, not {case.fmt}")
    skipped = sum(s["count"] for side in "ab" for s in reads[side]["skipped"])
    n = len(res["metrics"])
    what = f"{reads['a']['steps']} steps, {skipped} skipped, {n} metric" + "s" * (n != 1)
    same = [_verdict(*runs[p]) for p in ("AA", "AA2")]
    a_vs_a = same[0] if same[0] == same[1] else f"{same[0]} / A': {same[1]}"
    _, res_rerun = runs["AA2"]
    noise = sorted(n for n, m in res_rerun.get("metrics", {}).items() if m["status"] == "ignored")
    row = [
        case.label,
        what,
        _precision(res),
        a_vs_a,
        _verdict(code, res),
        ", ".join(f"`{n}`" for n in noise) or "-",
    ]
    return row, problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=Path, help="write the runs here and keep them")
    parser.add_argument("--write-group", nargs=2, metavar=("GROUP", "ROOT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.write_group:  # a subprocess: write one group, print where
        group, root = args.write_group
        start = time.perf_counter()
        with redirect_stdout(sys.stderr):
            paths = write_group(group, Path(root))
        print(json.dumps({"paths": paths, "seconds": time.perf_counter() - start}))
        return 0

    from parity.readers import REGISTRY

    missing = set(REGISTRY) - {c.fmt for c in CASES}
    if missing:
        print(f"formats without a case: {', '.join(sorted(missing))}", file=sys.stderr)
        return 1
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="formats-table-") as tmp:
        root = args.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        groups = [g for g in dict.fromkeys(c.group for c in CASES) if g != "main"]
        procs = {g: _subprocess(g, root) for g in groups}
        paths = write_group("main", root)
        seconds = {"main": time.perf_counter() - t0}
        for group, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=300)
            if proc.returncode != 0:
                print(f"writer group {group!r} failed:\n{stderr[-3000:]}", file=sys.stderr)
                return 1
            done = json.loads(stdout.strip().splitlines()[-1])
            paths.update(done["paths"])
            seconds[group] = done["seconds"]
        t_write = time.perf_counter() - t0
        table, problems = [], []
        for case in CASES:
            row, wrong = judge(case, paths[case.label])
            table.append(row)
            problems += [f"{case.label}: {w}" for w in wrong]
        t_all = time.perf_counter() - t0
    header = [
        "format",
        "what was read (steps, skipped)",
        "precision",
        "A vs A",
        "A vs B",
        "noise keys ignored",
    ]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in table:
        print("| " + " | ".join(row) + " |")
    print()
    print(
        f"A vs A: each run against itself and against A' (A written again, its noise "
        f"metric changed); B: the loss at step {PLANT} moved by the smallest change the format "
        f"holds. {len(CASES)} cases, {len(REGISTRY)} formats; wall {t_all:.1f} s "
        f"(writing {t_write:.1f} s, comparing {t_all - t_write:.1f} s); writers, concurrently: "
        + ", ".join(f"{g} {s:.1f} s" for g, s in seconds.items())
        + "."
    )
    for p in problems:
        print(f"FAIL {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
