"""verl's own RL refactor as a parity pair: ``verl.trainer.main_ppo`` of verl 0.7.1 with the legacy
FSDP workers (side a, ``trainer.use_legacy_worker_impl=enable``) against the engine workers
(side b, ``disable``), everything else equal, on CPU through ``subjects.verl.rl_shim``: 2 ranks
as 2 logical Ray GPUs, fp32, the tiny Qwen2 actor and a critic with a seeded value head, GAE, no
KL, the seeded rollout of ``subjects.verl.rl_rollout``, 2 PPO steps
(``subjects/verl/ppo_pair.toml``, run by ``parity pair`` as a user runs it).

What the pair shows (docs/subjects.md has the table), asserted below:

- the same samples on both sides: prompt and response lengths, scores, rewards, token counts,
  learning rates, clip fractions and ``actor/ppo_kl``: bitwise equal at both steps;
- the critic's numbers (values, returns, advantages, its loss and grad norm): within a few
  float32 ULPs (the spec's ``close:1e-6,1e-7``), from the two padding layouts;
- ``actor/entropy`` and ``actor/grad_norm``: diverged from step 1, far beyond rounding
  (entropy by about 5e-4 relative before any update), and why, from the tensors both sides dump
  (``--dump``): the same batch and the same initial actor weights, but the engine actor's
  forward (``use_remove_padding=False``) gets an attention mask of ``response_length`` ones per
  sequence, built from the response mask (verl 0.7.1 ``workers/engine/fsdp/transformer_impl.py:967``
  with ``workers/utils/padding.py:71``), so all but each sequence's first 16 tokens are masked;
- each side names metrics the other does not (legacy ``actor/kl_loss``; engine ``actor/loss``,
  ``critic/loss``);
- Ray's processes end with each side: none of the environment's processes is left afterwards.

Skips, with pip's own reason, where the package index cannot be reached to build the verl 0.7.1
environment (``subjects.envs.EnvUnavailable``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from parity.readers import read_metrics
from subjects import envs
from subjects import verl as subject

REPO = Path(__file__).resolve().parents[2]
SPEC = REPO / "subjects" / "verl" / "ppo_pair.toml"
# bitwise equal at every step: what the samples, the reward and the schedules decide
SAME_SAMPLES = (
    "critic/score/mean",
    "critic/score/max",
    "critic/score/min",
    "critic/rewards/mean",
    "critic/rewards/max",
    "critic/rewards/min",
    "response_length/mean",
    "prompt_length/mean",
    "prompt_length/max",
    "prompt_length/min",
    "global_seqlen/mean",
    "global_seqlen/max",
    "actor/lr",
    "critic/lr",
    "actor/pg_clipfrac",
    "actor/ppo_kl",
    "critic/vf_clipfrac",
)
CRITIC = (
    "critic/values/mean",
    "critic/values/max",
    "critic/values/min",
    "critic/vpred_mean",
    "critic/vf_loss",
    "critic/grad_norm",
    "critic/returns/mean",
    "critic/vf_explained_var",
)
DIVERGED = ("actor/entropy", "actor/grad_norm")


def _env_python() -> Path:
    try:
        return subject.rl_env()
    except envs.EnvUnavailable as e:
        pytest.skip(f"verl {subject.RL_VERSION} environment cannot be built here: {e}")


def _left(python: Path) -> list[str]:
    """Processes whose command line names the environment (Ray's daemons and workers run from
    its site-packages): what a side left behind."""
    key = str(python.parent.parent).encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if key in cmdline:
            shown = cmdline.replace(b"\0", b" ")[:200].decode(errors="replace")
            found.append(f"{entry.name}: {shown}")
    return found


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> dict:
    python = _env_python()
    assert not _left(python), "an earlier run of this environment is still running"
    out = tmp_path_factory.mktemp("verl-ppo") / "pair"
    proc = subprocess.run(
        [sys.executable, "-m", "parity.cli", "pair", "--spec", str(SPEC), "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    summary = out / "summary.json"
    if not summary.exists():
        pytest.fail(f"parity pair exited {proc.returncode}:\n{proc.stderr[-4000:]}", pytrace=False)
    runs = {side: json.loads((out / side / "run.json").read_text()) for side in "ab"}
    for side, run in runs.items():
        print(f"side {side} ({run['workers']}): main_ppo {run['wall_s']} s")
    return {
        "out": out,
        "rc": proc.returncode,
        "summary": json.loads(summary.read_text()),
        "runs": runs,
        "left": _left(python),
    }


@pytest.mark.parity
def test_pair_diverges_at_the_actor_only(pair):
    assert pair["rc"] == 1, pair["summary"]["verdict"]
    metrics = pair["summary"]["metrics"]
    failing = sorted(name for name, m in metrics.items() if not m["ok"])
    assert failing == sorted(DIVERGED)
    for name in DIVERGED:
        assert metrics[name]["first_divergent_step"] == 1


@pytest.mark.parity
def test_same_samples_bitwise(pair):
    metrics = pair["summary"]["metrics"]
    for name in SAME_SAMPLES:
        m = metrics[name]
        assert m["policy"] == "exact" and m["exact_matches"] == 2, (name, m)


@pytest.mark.parity
def test_critic_within_rounding(pair):
    metrics = pair["summary"]["metrics"]
    for name in CRITIC:
        m = metrics[name]
        assert m["status"] == "match" and m["steps_compared"] == 2, (name, m)
        assert m["max_rel_diff"] <= 1e-6, (name, m)


@pytest.mark.parity
def test_actor_differs_beyond_rounding(pair):
    """Before any update (step 1) the two actors' entropies differ by far more than float32
    rounding of the same forward would (a few 1e-7)."""
    metrics = pair["summary"]["metrics"]
    entropy = metrics["actor/entropy"]
    assert 1e-5 < entropy["max_rel_diff"] < 1e-2, entropy
    assert metrics["actor/grad_norm"]["max_rel_diff"] < 0.2


@pytest.mark.parity
def test_engine_actor_sees_only_the_first_response_length_tokens(pair):
    """Why the actor differs, from the dumped tensors: the same batch, the same initial actor
    weights on the engine side, and an attention mask as long as the response."""
    import torch
    from safetensors.torch import load_file

    a, b = (pair["out"] / side / "dump" for side in "ab")
    batch_a, batch_b = (torch.load(d / "step1.pt", weights_only=True)["batch"] for d in (a, b))
    for key, tensor in batch_a.items():
        assert torch.equal(tensor, batch_b[key]), key
    initial = load_file(pair["out"] / "b" / "inputs" / "model" / "model.safetensors")
    actor = torch.load(b / "engine_actor1.pt", weights_only=True)
    assert actor.keys() == initial.keys()
    assert all(torch.equal(actor[k], initial[k]) for k in initial)
    inputs = torch.load(b / "engine_actor_inputs1.pt", weights_only=True)
    response = batch_a["response_mask"].shape[1]
    lengths = batch_a["attention_mask"].sum(-1)
    assert lengths.min() > response  # every sequence is longer than its response
    assert inputs["attention_mask"].sum(-1).tolist() == [response] * len(inputs["attention_mask"])


@pytest.mark.parity
def test_metrics_only_one_side_names(pair):
    def names(side: str) -> set[str]:
        columns = read_metrics(pair["out"] / side / "metrics.jsonl").columns
        return {c for c in columns if not c.startswith(("perf/", "timing"))}

    a, b = names("a"), names("b")
    assert a - b == {"actor/kl_loss"}
    assert b - a == {"actor/loss", "critic/loss"}


@pytest.mark.parity
def test_ray_stopped_with_each_side(pair):
    for side, run in pair["runs"].items():
        assert run["exit_code"] == 0, side
        assert run["left_running"] == [], (side, run["left_running"])
    assert pair["left"] == []


@pytest.mark.parity
def test_sigterm_mid_run_leaves_no_ray_process(tmp_path):
    """The harness stops a side with SIGTERM: run_ppo then ends its launch's whole session, Ray's
    daemons and workers included, before it exits."""
    import os
    import signal
    import time

    python = _env_python()
    assert not _left(python), "an earlier run of this environment is still running"
    cmd = [sys.executable, "-m", "subjects.verl.run_ppo", "--workers", "legacy"]
    cmd += ["--out", str(tmp_path / "run"), "--python", str(python)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while len(_left(python)) < 4 and time.monotonic() < deadline:  # Ray is up
            assert proc.poll() is None, "run_ppo ended before Ray started"
            time.sleep(1)
        assert len(_left(python)) >= 4, "Ray did not start within 300 s"
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=120) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
    assert _left(python) == []
