"""The GPU check (ci/gpu_check.py), dry-run on the CPU so that it cannot rot before a GPU runs it.

One run of the whole script with tiny sizes (2 SFT steps, 1 PPO step, gloo): every check must
have its verdict, and on the CPU every one passes. Then what the script promises beyond a
verdict: a hung check is stopped at its timeout with its launches and the next one runs, a
folder that is not the script's is refused, and the determinism settings reach the manifest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.needs import subject

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "ci" / "gpu_check.py"
sys.path.insert(0, str(ROOT / "ci"))

import gpu_check  # noqa: E402

CHECKS = [name for name, *_ in gpu_check.CHECKS]
TINY = ["--steps", "2", "--ppo-steps", "1", "--val-samples", "2", "--max-new-tokens", "64"]


def _run(out: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PARITY_AUTOCAST", None)
    env.pop("PARITY_BACKEND", None)
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(out), "--device", "cpu", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    start = time.monotonic()
    proc = _run(out, *TINY)
    seconds = time.monotonic() - start
    print(proc.stdout[-3000:], proc.stderr[-2000:], f"dry run: {seconds:.0f} s", sep="\n")
    summary = json.loads((out / "summary.json").read_text())
    return out, proc, summary


@pytest.mark.parity
def test_dry_run_gives_every_check_a_verdict(dry_run):
    out, proc, summary = dry_run
    assert [c["name"] for c in summary["checks"]] == CHECKS
    for check in summary["checks"]:
        assert check["verdict"] in ("pass", "fail", "error"), check
        assert check["summary"] and check["seconds"] >= 0 and "figures" in check
        assert (out / "checks" / f"{check['name']}.log").exists()
    md = (out / "summary.md").read_text()
    for name in CHECKS:
        assert f"| {name} | **" in md
    # on the CPU every check passes: one that fails or errs here has rotted
    failing = {c["name"]: c["summary"] for c in summary["checks"] if c["verdict"] != "pass"}
    assert not failing, f"{failing}\n{md[-6000:]}"
    assert proc.returncode == 0 and summary["verdict"] == "pass"
    assert summary["counts"] == {"pass": len(CHECKS), "fail": 0, "error": 0}


@pytest.mark.parity
def test_dry_run_figures(dry_run):
    out, _, summary = dry_run
    checks = {c["name"]: c for c in summary["checks"]}
    env = checks["environment"]["figures"]
    assert env["torch"] and env["cuda_available"] in (True, False)
    assert env["matmul"]["bitwise_repeat"] is True
    assert set(env["packages"]) >= {"torch", "transformers", "tokenizers", "accelerate"}
    assert env["packages"]["torch"]["pinned"].startswith("==")
    sft = checks["sft-pair"]["figures"]
    assert sft["a"]["backend"] == sft["b"]["backend"] == "gloo"
    assert sft["steps"] == 2 and sft["verdict"] == "aligned"
    floor = checks["noise-floor"]["figures"]
    assert floor["deterministic"] is True and "train/loss" in floor["floor"]
    same = checks["in-process"]["figures"]["same_as_separate_launches"]
    assert same["a"]["bitwise_equal"] and same["b"]["bitwise_equal"]
    bf16 = checks["bf16"]["figures"]
    assert bf16["a"]["autocast"] == bf16["b"]["autocast"] == "bfloat16"
    assert 0 < bf16["floor_vs_fp32"]["train/loss"]["max_rel_diff"] < 1e-2
    two = checks["two-ranks-one-device"]["figures"]
    assert two["works"] == ["gloo+ddp"]
    assert two["attempts"]["gloo+ddp"]["a"]["world_size"] == 2
    assert checks["ppo-pair"]["figures"]["verdict"] == "aligned"
    # the manifest records every determinism setting (read back from torch)
    det = json.loads((out / "runs" / "sft-pair" / "a" / "manifest.json").read_text())["determinism"]
    assert det["deterministic_algorithms"] is True and det["cudnn_deterministic"] is True
    assert det["cudnn_benchmark"] is False
    assert det["allow_tf32"] is False and det["cudnn_allow_tf32"] is False
    assert det["float32_matmul_precision"] == "highest"
    assert det["cublas_workspace_config"] == ":4096:8"
    assert det["autocast"] is None


@pytest.mark.parity
def test_a_hung_check_is_stopped_and_the_next_runs(tmp_path):
    """A check past its timeout is an error; its launch is stopped (no process left carrying
    its id), and the checks after it still run."""
    # 500 steps: no machine finishes these checks in 6 s, however idle (2 steps once did)
    long = [*TINY, "--steps", "500"]
    proc = _run(tmp_path, "--only", "sft-pair,noise-floor", "--check-timeout-s", "6", *long)
    summary = json.loads((tmp_path / "summary.json").read_text())
    checks = {c["name"]: c for c in summary["checks"]}
    assert proc.returncode == 1
    assert set(checks) == set(CHECKS)
    for name in ("sft-pair", "noise-floor"):
        assert checks[name]["verdict"] == "error" and checks[name]["timed_out"] is True
        assert checks[name]["summary"].startswith("timed out"), checks[name]["summary"]
        assert checks[name]["seconds"] < 6 + 25
    assert checks["imports"]["summary"] == "not run (--only)"
    leftover = subprocess.run(
        ["grep", "-l", gpu_check.CHECK_ID_ENV, *map(str, Path("/proc").glob("[0-9]*/environ"))],
        capture_output=True,
    ).stdout
    assert not leftover.strip(), leftover


def test_refuses_a_folder_it_did_not_make(tmp_path):
    (tmp_path / "precious.txt").write_text("keep me")
    proc = _run(tmp_path, *TINY)
    assert proc.returncode == 2 and "not a gpu-check folder" in proc.stderr
    assert (tmp_path / "precious.txt").read_text() == "keep me"
    assert _run(tmp_path / "new", "--only", "nothing").returncode == 2


@subject
def test_set_determinism_records_every_setting():
    code = (
        "import json; from worker.determinism import set_determinism; "
        "print(json.dumps(set_determinism(3)))"
    )
    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, check=True
    ).stdout
    det = json.loads(out)
    assert det["seed"] == 3 and det["cublas_workspace_config"] == ":4096:8"
    assert det["deterministic_algorithms"] and not det["deterministic_warn_only"]
    assert det["cudnn_deterministic"] and not det["cudnn_benchmark"]
    assert det["allow_tf32"] is False and det["cudnn_allow_tf32"] is False
    if det["fp32_precision"] is not None:  # torch >= 2.9
        assert det["fp32_precision"]["cuda.matmul"] == "ieee"


@subject
def test_autocast_and_backend_come_from_the_environment(monkeypatch):
    import torch

    from worker.determinism import autocast_dtype
    from worker.distributed import init_distributed

    monkeypatch.delenv("PARITY_AUTOCAST", raising=False)
    assert autocast_dtype() is None
    monkeypatch.setenv("PARITY_AUTOCAST", "bf16")
    assert autocast_dtype() is torch.bfloat16
    monkeypatch.setenv("PARITY_AUTOCAST", "int8")
    with pytest.raises(ValueError, match="PARITY_AUTOCAST='int8'"):
        autocast_dtype()
    monkeypatch.setenv("PARITY_BACKEND", "mpi")
    with pytest.raises(ValueError, match="expected nccl or gloo"):
        init_distributed()


def test_specs_read_without_tomllib(tmp_path, monkeypatch):
    """A GPU machine's Python 3.10 may have neither tomllib nor tomli: the harness still imports,
    YAML specs still load, and a TOML spec is refused in one line that says why."""
    import parity.spec as spec

    monkeypatch.setattr(spec, "tomllib", None)
    (tmp_path / "job.yaml").write_text("task: worker.presets:SFT\nworld_size: 2\nsteps: 3\n")
    assert spec.load_spec(tmp_path / "job.yaml").steps == 3
    (tmp_path / "job.toml").write_text("steps = 3\n")
    with pytest.raises(spec.SpecError, match="needs tomli") as e:
        spec.load_spec(tmp_path / "job.toml")
    assert "\n" not in str(e.value)
