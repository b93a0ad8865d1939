"""Pre-merge checks on a foreign repository: someone else's HF Trainer script, not this harness's.

A temp repo (five commits on main, a side branch) holds its own `train.py`, a self-contained HF
Trainer fine-tune of the tiny Qwen2 on charcount (derived from subjects/hf/train.py; it imports
neither `parity`, `worker` nor `subjects`), its own copies of the model, tokenizer and 16
training samples, and a committed `parity.toml` (`task = "custom"`). Trainer writes
`trainer_state.json` into `{out}`, the run folder, where the harness finds it by format
detection (hf-trainer-state): a custom job needs no metrics.jsonl. History:

1. base: linear schedule, warmup over 1 step;
2. a harmless refactor (functions extracted, names changed): the same numbers, bit for bit;
3. warmup over 2 steps: the lr of step 1 is 0 either way, so the lr first differs at step 2
   and the loss, trained with it, at step 3;
4. a README; 5. a print of the sample count.

`check` base..refactor is aligned, base..HEAD diverged at train/learning_rate step 2, and
`bisect` names commit 3. The user's HEAD, branches, refs, worktree list, index and edits (staged,
unstaged, untracked) are the same after each command. One rank, 4 steps of 2 samples: about 6 s
a launch on 2 busy cores, 8 launches, about 65 s for the file.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import time
from pathlib import Path

import pytest

from parity.cli import main
from tests.orchestration.history import git, repo_state

pytestmark = pytest.mark.parity

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"

TRAIN = '''\
"""Fine-tune a tiny Qwen2 to count letters, with HF Trainer.

    torchrun --nproc-per-node 1 train.py --out runs/x [--steps 4] [--batch 2]
"""

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

HERE = Path(__file__).resolve().parent


class Rows(Dataset):
    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def encode(sample, tokenizer):
    """Token ids of the chat; loss on the assistant's answer only."""
    prompt = tokenizer.apply_chat_template(
        sample["messages"][:-1], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    full = tokenizer.apply_chat_template(sample["messages"], tokenize=True, return_dict=False)
    ids = torch.tensor(list(full), dtype=torch.int64)
    labels = ids.clone()
    labels[: len(prompt)] = -100
    return {"input_ids": ids, "labels": labels}


def collate(rows, pad_id):
    n = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), n), pad_id, dtype=torch.int64)
    labels = torch.full((len(rows), n), -100, dtype=torch.int64)
    mask = torch.zeros((len(rows), n), dtype=torch.int64)
    for i, r in enumerate(rows):
        k = len(r["input_ids"])
        ids[i, :k], labels[i, :k], mask[i, :k] = r["input_ids"], r["labels"], 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=2)
    args = p.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(str(HERE / "tokenizer"))
    model = AutoModelForCausalLM.from_pretrained(str(HERE / "model"), dtype=torch.float32)
    with open(HERE / "data" / "train.jsonl") as f:
        rows = [encode(json.loads(line), tokenizer) for line in f]
    targs = TrainingArguments(
        output_dir=str(args.out),
        per_device_train_batch_size=args.batch,
        max_steps=args.steps,
        learning_rate=1e-3,
        lr_scheduler_type="linear",
        warmup_steps=1,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        ddp_backend="gloo",
        full_determinism=True,
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
        remove_unused_columns=False,
    )
    trainer = Trainer(
        model=model,
        args=targs,
        train_dataset=Rows(rows),
        data_collator=lambda batch: collate(batch, tokenizer.pad_token_id),
    )
    trainer.train()
    trainer.save_state()  # trainer_state.json in the output dir
    if dist.is_initialized():  # gloo may abort a rank in the interpreter's teardown
        dist.barrier()
        dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
'''

SPEC = """\
# parity check / bisect of this repository's training script
task = "custom"
world_size = 1
steps = 4
command = ["train.py", "--out", "{out}", "--steps", "4", "--batch", "2"]
timeout_s = 180
"""

README = "# charcount fine-tune\n\n    torchrun --nproc-per-node 1 train.py --out runs/x\n"


def _refactor(text: str) -> str:
    """The harmless refactor: the training arguments built in a function of their own, the
    dataset class and its rows renamed. The same program, bit for bit the same numbers."""
    start = text.index("    targs = TrainingArguments(")
    end = text.index("    )\n", start) + len("    )\n")
    block = text[start:end]
    fields = block.replace("    targs = TrainingArguments(\n", "").removesuffix("    )\n")
    func = "def training_arguments(args):\n    return TrainingArguments(\n" + fields + "    )\n\n\n"
    text = text[:start] + "    targs = training_arguments(args)\n" + text[end:]
    text = _replaced(text, "def main():", func + "def main():")
    text = _replaced(text, "class Rows(Dataset):", "class ListDataset(Dataset):")
    text = _replaced(text, "train_dataset=Rows(rows)", "train_dataset=ListDataset(examples)")
    return _replaced(text, "    rows = [encode(", "    examples = [encode(")


def _replaced(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, old
    return text.replace(old, new)


def snapshot(repo: Path) -> dict[str, str]:
    """What the checks must leave as it was (``repo_state``), the training script too."""
    return repo_state(repo, "train.py")


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> dict[str, str]:
    """The foreign repository; returns its path and the commit of each step of its history."""
    root = tmp_path_factory.mktemp("foreign")
    git(root, "init", "-q", "-b", "main")
    shutil.copytree(FIXTURES / "tiny-qwen2", root / "model")
    shutil.copytree(FIXTURES / "tokenizer", root / "tokenizer")
    (root / "data").mkdir()
    lines = (FIXTURES / "charcount-small" / "train.jsonl").read_text().splitlines(keepends=True)
    (root / "data" / "train.jsonl").write_text("".join(lines[:16]))
    (root / "parity.toml").write_text(SPEC)
    commits = {}

    def commit(name: str, message: str, train: str | None = None) -> str:
        if train is not None:
            (root / "train.py").write_text(train)
        git(root, "add", "-A")
        git(root, "commit", "-q", "-m", message)
        commits[name] = git(root, "rev-parse", "HEAD").strip()
        return (root / "train.py").read_text()

    text = commit("base", "charcount fine-tune with HF Trainer", TRAIN)
    text = commit("refactor", "refactor: training arguments in a function", _refactor(text))
    warm = _replaced(text, "warmup_steps=1,", "warmup_steps=2,")
    text = commit("warmup", "schedule: warm up over 2 steps", warm)
    (root / "README.md").write_text(README)
    commit("readme", "README: how to run")
    count = "    trainer = Trainer("
    text = _replaced(text, count, '    print(f"{len(examples)} examples")\n' + count)
    commit("print", "train.py: print the sample count", text)
    git(root, "branch", "experiment", commits["refactor"])  # another branch, left alone
    (root / "README.md").write_text(README + "\nwork in progress\n")  # unstaged
    (root / "scratch.txt").write_text("untracked\n")
    (root / "notes.txt").write_text("staged\n")
    git(root, "add", "notes.txt")
    return {"root": str(root), **commits}


def _cli(repo: dict[str, str], out: Path, *args: str) -> tuple[int, dict, dict, dict, float]:
    """Run `parity ARGS --spec parity.toml --out OUT --json` in the repo: exit code, JSON, the
    repository before and after, seconds."""
    root = Path(repo["root"])
    before = snapshot(root)
    mp = pytest.MonkeyPatch()
    start = time.monotonic()
    try:
        mp.chdir(root)
        buf, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err):
            code = main([*args, "--spec", "parity.toml", "--out", str(out), "--json"])
    finally:
        mp.undo()
    seconds = time.monotonic() - start
    print(f"parity {args[0]} {' '.join(args[1:])}: {seconds:.1f} s")
    result = json.loads(buf.getvalue().strip().splitlines()[-1])
    result["_stderr"] = err.getvalue()  # the progress lines
    return code, result, before, snapshot(root), seconds


@pytest.fixture(scope="module")
def refactor_check(repo, tmp_path_factory):
    out = tmp_path_factory.mktemp("check-refactor")
    return (*_cli(repo, out, "check", "--base", repo["base"], "--head", repo["refactor"]), out)


@pytest.fixture(scope="module")
def head_check(repo, tmp_path_factory):
    out = tmp_path_factory.mktemp("check-head")
    return (*_cli(repo, out, "check", "--base", repo["base"], "--head", "HEAD"), out)


@pytest.fixture(scope="module")
def bisected(repo, tmp_path_factory):
    out = tmp_path_factory.mktemp("bisect")
    return (*_cli(repo, out, "bisect", "--good", repo["base"], "--bad", "HEAD"), out)


def test_the_refactor_is_aligned(refactor_check, repo):
    code, result, before, after, _, out = refactor_check
    assert (code, result["verdict"]) == (0, "aligned")
    assert (result["base"]["commit"], result["head"]["commit"]) == (repo["base"], repo["refactor"])
    for side in ("base", "head"):  # read from the Trainer's own file, by format detection
        metrics = result["a" if side == "base" else "b"]["metrics"]
        assert metrics == str(out / side / "trainer_state.json")
        assert not (out / side / "metrics.jsonl").exists()
    metrics = result["metrics"]
    for name in ("train/loss", "train/grad_norm", "train/learning_rate", "train/train_loss"):
        assert metrics[name]["status"] == "match" and metrics[name]["policy"] == "exact", name
    assert metrics["train/train_runtime"]["status"] == "ignored"
    assert after == before
    progress = [line for line in result["_stderr"].splitlines() if line.startswith("parity: ")]
    base = f"parity: base {repo['base']} ({repo['base'][:12]}): "
    head = f"parity: head {repo['refactor']} ({repo['refactor'][:12]}): "
    assert progress[0] == base + "started" and progress[-1].startswith(head + "ended after")
    assert any(line.startswith(head) for line in progress), progress


def test_the_warmup_change_diverges_at_step_2(head_check, repo):
    code, result, before, after, _, out = head_check
    assert (code, result["verdict"]) == (1, "diverged")
    assert (result["base"]["commit"], result["head"]["commit"]) == (repo["base"], repo["print"])
    metrics = result["metrics"]
    lr, loss = metrics["train/learning_rate"], metrics["train/loss"]
    assert lr["status"] == "diverged" and lr["first_divergent_step"] == 2
    assert lr["a_value"] == 1e-3 and lr["b_value"] == 5e-4  # decaying vs still warming up
    assert loss["status"] == "diverged" and loss["first_divergent_step"] == 3
    steps = [m["first_divergent_step"] for m in metrics.values() if m["status"] == "diverged"]
    assert min(steps) == 2
    assert "| train/learning_rate | diverged | exact | 4 | 2 |" in (out / "report.md").read_text()
    assert after == before


def test_bisect_names_the_warmup_commit(bisected, repo):
    code, result, before, after, _, out = bisected
    assert (code, result["verdict"], result["outcome"]) == (1, "diverged", "found")
    first = result["first_bad"]
    assert first["commit"] == repo["warmup"]
    assert first["subject"] == "schedule: warm up over 2 steps"
    assert (first["metric"], first["step"], first["policy"]) == ("train/learning_rate", 2, "exact")
    verdicts = {t["commit"]: t["verdict"] for t in result["tested"]}
    assert verdicts[repo["print"]] == verdicts[repo["warmup"]] == "diverged"
    assert verdicts.get(repo["refactor"], "aligned") == "aligned"
    assert (out / "good" / "trainer_state.json").is_file()
    assert after == before
    assert len(before["worktrees"].strip().split("\n\n")) == 1
    assert "scratch.txt" in before["status"] and "README.md" in before["unstaged"]
    assert "notes.txt" in before["staged"]
