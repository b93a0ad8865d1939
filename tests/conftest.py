"""Fixtures the test folders share. Shared job specs are plain data in specs.py (pytest's
parametrize needs them at import), and the process check the launch tests share in run/procs.py.
Without the reference subject installed, its presets are registered for this process only
(``_register_subject_presets``), and the tests that run its code skip (tests/needs.py)."""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the harness depends on tomli there
    import tomli as tomllib

from tests.needs import subject_installed

ROOT = Path(__file__).resolve().parents[1]


def _register_subject_presets() -> None:
    """Register the reference subject's entry points (its task presets and mutant catalogue, in
    worker/pyproject.toml) as its installed package would, when it is not installed: the modules
    they name (worker/presets.py, worker/mutants.py) import without torch, so the spec and CLI
    tests can name ``charcount-sft``. A distribution folder on sys.path, for this process only."""
    if subject_installed():
        return
    project = tomllib.loads((ROOT / "worker" / "pyproject.toml").read_text())["project"]
    groups = {g: eps for g, eps in project["entry-points"].items() if g.startswith("llm_parity.")}
    home = tempfile.mkdtemp(prefix="parity-test-presets-")
    atexit.register(shutil.rmtree, home, ignore_errors=True)
    info = Path(home) / "llm_parity_test_presets-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: llm-parity-test-presets\nVersion: 0\n"
    )
    text = "".join(
        f"[{group}]\n" + "".join(f"{name} = {value}\n" for name, value in eps.items())
        for group, eps in groups.items()
    )
    (info / "entry_points.txt").write_text(text)
    sys.path.append(home)


_register_subject_presets()

#: `parity check`'s run store off for every test (none reuses another's runs, nor the user's
#: cache); the store's own tests name one (tests/orchestration/test_store.py)
os.environ["PARITY_STORE"] = "off"


#: parity tests that time a job (a stall, a timeout, a signal, a kill): CI runs them with nothing
#: beside them (ci/test.sh: -m serial), the rest two files at a time
SERIAL = (
    "tests/run/test_stall.py",
    "tests/run/test_signals.py",
    "tests/run/test_launch.py",
    "tests/run/test_orphans.py",
    "tests/project/test_gpu_check.py::test_a_hung_check_is_stopped_and_the_next_runs",
    "tests/subjects/test_subject_verl_rl.py::test_sigterm_mid_run_leaves_no_ray_process",
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "serial: a parity test that times a job; CI runs it with nothing beside it"
    )


@pytest.hookimpl(tryfirst=True)  # before -m selects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The parity tests that time a job marked serial (ci/test.sh runs them last, alone)."""
    for item in items:
        if item.get_closest_marker("parity") is not None and item.nodeid.startswith(SERIAL):
            item.add_marker(pytest.mark.serial)


@pytest.fixture
def interruptible() -> Callable[[], None]:
    """Popen(preexec_fn=interruptible): a child that a SIGINT interrupts even when this test run
    ignores SIGINT (a shell's background job does, and a Python started so installs no handler)."""
    return _default_sigint


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture
def oracle_val_loss() -> Callable[..., float]:
    """oracle_val_loss(weights=None, samples=None): the token-weighted mean NLL over the val set
    (or its first `samples`), one sample at a time, in float64: an independent check of the
    trainers' val/loss."""
    return _oracle_val_loss


def _oracle_val_loss(weights: dict | None = None, samples: int | None = None) -> float:
    import torch

    from worker.data.batching import collate
    from worker.data.charcount import DATA_DIR, encode, load_tokenizer, read_jsonl
    from worker.model import load_model

    model = load_model(attn="eager").double()
    if weights is not None:
        model.load_state_dict({k: v.double() for k, v in weights.items()}, strict=False)
    tok = load_tokenizer()
    nll_sum, tokens = 0.0, 0
    with torch.no_grad():
        for sample in read_jsonl(DATA_DIR / "val.jsonl")[:samples]:
            mb = collate([encode(sample, tok, 512)])
            logits = model(input_ids=mb.input_ids, position_ids=mb.position_ids).logits
            nll = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), mb.labels.reshape(-1), reduction="none"
            )
            nll_sum += float((nll * mb.loss_mask.reshape(-1)).sum())
            tokens += mb.num_loss_tokens
    return nll_sum / tokens
