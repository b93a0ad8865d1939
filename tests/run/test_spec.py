"""Unit tests of parity.spec: validation messages, to_args, pairs, and loading TOML/YAML."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from parity.spec import JobSpec, PairSpec, SpecError, load_spec


def test_defaults_are_valid_and_to_dict_is_json() -> None:
    spec = JobSpec(task="charcount-sft")
    assert spec.nproc_per_node == 1
    assert json.loads(json.dumps(spec.to_dict()))["steps"] == 20


def test_sft_args(tmp_path: Path) -> None:
    spec = JobSpec(
        task="charcount-sft",
        trainer="legacy", world_size=2, steps=5, seed=3, engine="ddp", model="/m",
        val_loss="legacy", max_tokens_per_rank=512, overrides={"lr": 0.01, "padded": True},
        inject=["no_clip", "bad_scale"],
    )  # fmt: skip
    assert spec.to_args(tmp_path) == [
        "-m", "parity.rank.mutants", "--mutants", "no_clip,bad_scale",
        "-m", "worker.sft", "--trainer", "legacy", "--out", str(tmp_path),
        "--steps", "5", "--seed", "3", "--engine", "ddp", "--global-batch-size", "16",
        "--micro-batch-size", "4", "--max-tokens-per-rank", "512", "--model", "/m",
        "--val-loss", "legacy", "--lr", "0.01", "--padded",
    ]  # fmt: skip


def test_ppo_dynamic_args_omit_micro_batch(tmp_path: Path) -> None:
    args = JobSpec(task="charcount-ppo", dynamic_bsz=True, micro_batch_size=None).to_args(tmp_path)
    assert args[:2] == ["-m", "worker.ppo"]
    assert "--dynamic-bsz" in args
    assert "--micro-batch-size" not in args and "--model" not in args


def test_custom_command_substitutes_out(tmp_path: Path) -> None:
    spec = JobSpec(task="custom", command=["script.py", "--out", "{out}", "--log={out}/x"])
    assert spec.to_args(tmp_path) == ["script.py", "--out", str(tmp_path), f"--log={tmp_path}/x"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"steps": 0}, "steps must be >= 1, got 0"),
        ({"world_size": 0}, "world_size must be >= 1, got 0"),
        (
            {"world_size": 8, "global_batch_size": 4},
            "world_size 8 is larger than the global batch 4",
        ),
        ({"world_size": 3}, "global_batch_size 16 is not divisible by world_size 3"),
        ({"world_size": 2, "micro_batch_size": 3}, "micro_batch_size 3 does not divide"),
        ({"micro_batch_size": None}, "micro_batch_size is required unless dynamic_bsz"),
        ({"task": "custom"}, "task 'custom' needs a command"),
        ({"command": ["x.py"]}, "command is only used by task 'custom'"),
        (
            {"task": "pretrain"},
            "task 'pretrain' is not known; known: custom, charcount-ppo, charcount-sft",
        ),
        ({"engine": "deepspeed"}, "engine must be one of fsdp2, ddp"),
        ({"val_loss": "mean"}, "val_loss must be one of fixed, legacy"),
        ({"steps": "3"}, "steps must be an integer, got '3'"),
        ({"seed": True}, "seed must be an integer"),
        ({"trainer": ""}, "trainer must be a non-empty string"),
        ({"timeout_s": 0}, "timeout_s must be > 0"),
        ({"world_size": 2, "nnodes": 4}, "world_size 2 is not divisible by nnodes 4"),
        ({"overrides": {"a=b": 1}}, "overrides key must be a non-empty string without '='"),
        ({"overrides": {"lr": [1]}}, "overrides['lr'] must be a string, number or bool"),
        ({"inject": "no_clip"}, "inject must be a list of strings"),
    ],
)
def test_validation_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(SpecError) as info:
        JobSpec(**{"task": "charcount-sft", **kwargs})
    text = str(info.value)
    assert message in text and "\n" not in text


def test_dynamic_bsz_skips_micro_batch_check() -> None:
    JobSpec(task="charcount-sft", world_size=2, micro_batch_size=3, dynamic_bsz=True)


def test_unknown_key_names_source() -> None:
    with pytest.raises(SpecError, match="unknown key 'stepz' in spec.toml \\(did you mean 'steps'"):
        JobSpec.from_dict({"stepz": 3}, "spec.toml")
    with pytest.raises(SpecError, match="^spec.toml: steps must be >= 1, got 0$"):
        JobSpec.from_dict({"steps": 0}, "spec.toml")


def test_pair_sides_and_from_variants() -> None:
    base = JobSpec(task="charcount-sft", world_size=2, steps=4)
    a, b = PairSpec.from_variants(base, "legacy", "worker").sides()
    assert (a.trainer, b.trainer) == ("legacy", "worker")
    assert a.steps == b.steps == 4
    _, b = PairSpec(base, {}, {"inject": ["no_clip"]}).sides()
    assert b.inject == ["no_clip"] and base.inject == []
    with pytest.raises(SpecError, match="unknown key 'trainr' in \\[a\\]"):
        PairSpec(base, {"trainr": "legacy"}, {})
    with pytest.raises(SpecError, match="^\\[b\\]: world_size 32 is larger"):
        PairSpec(base, {}, {"world_size": 32})


def test_load_toml_job_and_pair(tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text('task = "charcount-sft"\nworld_size = 2\nsteps = 3\n[overrides]\nlr = 0.5\n')
    spec = load_spec(job)
    assert isinstance(spec, JobSpec)
    assert (spec.world_size, spec.steps, spec.overrides) == (2, 3, {"lr": 0.5})

    pair = tmp_path / "pair.toml"
    pair.write_text(
        'task = "charcount-sft"\nworld_size = 2\n[a]\ntrainer = "legacy"\n[b]\nengine = "ddp"\n'
    )
    spec = load_spec(pair)
    assert isinstance(spec, PairSpec)
    a, b = spec.sides()
    assert (a.trainer, a.engine, b.trainer, b.engine) == ("legacy", "fsdp2", "worker", "ddp")


def test_load_yaml_pair(tmp_path: Path) -> None:
    path = tmp_path / "pair.yaml"
    path.write_text(
        "task: custom\ncommand: [tests/jobs/dummy_job.py, '{out}']\nworld_size: 2\n"
        "torchrun_args: [--max-restarts, '0']\nb:\n  inject: [no_clip]\n"
    )
    spec = load_spec(path)
    assert isinstance(spec, PairSpec)
    a, b = spec.sides()
    assert a.inject == [] and b.inject == ["no_clip"]
    assert a.command == ["tests/jobs/dummy_job.py", "{out}"]
    assert a.torchrun_args == ["--max-restarts", "0"]


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("spec.toml", "stepz = 3\n", "unknown key 'stepz' in {path}"),
        ("spec.toml", "steps = 0\n", "{path}: steps must be >= 1, got 0"),
        ("spec.toml", "steps = \n", "{path}: cannot read spec"),
        ("spec.yaml", "- 1\n- 2\n", "{path}: spec must be a table"),
        (
            "spec.yml",
            "task: charcount-sft\nb:\n  stepz: 1\n",
            "unknown key 'stepz' in [b] of {path}",
        ),
        ("spec.yaml", "task: charcount-sft\na: 3\n", "{path}: [a] must be a table"),
        ("spec.toml", 'task = "charcount-sft"\ntrainr = "x"\n', "unknown key 'trainr' in {path}"),
        ("spec.toml", 'trainer = "x"\n', "unknown key 'trainer' in {path}"),
        ("spec.json", "{}", "{path}: unsupported spec format '.json'"),
    ],
)
def test_load_errors_name_the_file(tmp_path: Path, name: str, text: str, message: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert message.format(path=path) in str(info.value)


def test_load_missing_file(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="cannot read spec"):
        load_spec(tmp_path / "nope.toml")


# --- the documented spec ---------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]


def _spec_doc() -> str:
    """docs/spec.md up to its section on other packages' tasks: the job spec's own keys."""
    text = (ROOT / "docs" / "spec.md").read_text()
    assert text.startswith("# The job spec\n"), "docs/spec.md: no '# The job spec' title"
    end = text.find("\n## Tasks, mutants and readers")
    return text[: end if end > 0 else None]


def test_every_example_in_the_spec_docs_loads(tmp_path: Path) -> None:
    import re

    from parity.spec import load_policies, load_read_options

    blocks = re.findall(r"```toml\n(.*?)```", _spec_doc(), re.S)
    assert len(blocks) >= 2
    for i, block in enumerate(blocks):
        path = tmp_path / f"example{i}.toml"
        path.write_text(block)
        load_spec(path)
        load_policies(path)
        load_read_options(path)


def test_the_example_spec_has_every_key(tmp_path: Path, capsys) -> None:
    import dataclasses

    from parity.cli import main
    from parity.spec import EXAMPLE, READ_OPTIONS

    assert main(["spec", "--example"]) == 0
    text = capsys.readouterr().out
    assert text == EXAMPLE
    from parity.spec import LauncherSpec

    keys = [f.name for f in dataclasses.fields(JobSpec) if f.name != "options"]
    keys += [f.name for f in dataclasses.fields(LauncherSpec)]
    for name in keys + list(READ_OPTIONS):
        assert re.search(rf"\b{name}\b", text), name
    path = tmp_path / "example.toml"
    path.write_text(text)
    assert main(["spec", str(path)]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["b"]["env"] == {"ACCELERATE_USE_CPU": "true", "MY_FLAG": "new"}


def test_every_key_is_in_the_spec_docs_table() -> None:
    import dataclasses

    section = _spec_doc()
    for f in dataclasses.fields(JobSpec):
        if f.name == "options":  # a preset's own keys: `parity tasks` lists them
            continue
        assert f"`{f.name}`" in section or f"`[{f.name}]`" in section, f.name


def test_unknown_keys_are_answered_with_the_valid_ones(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_text("wrld_size = 2\n")
    with pytest.raises(SpecError, match="did you mean 'world_size'.*valid keys: task, command"):
        load_spec(path)
    path.write_text('[read]\nduplicate = "last"\n')
    from parity.spec import load_read_options

    with pytest.raises(SpecError, match="unknown key 'duplicate' in \\[read\\]; valid keys"):
        load_read_options(path)
    path.write_text('[read]\nduplicates = "sometimes"\n')
    with pytest.raises(SpecError, match="read.duplicates = 'sometimes' is not valid"):
        load_read_options(path)


def test_env_is_strings_by_name() -> None:
    spec = JobSpec(task="charcount-sft", env={"OMP_NUM_THREADS": 1, "USE_CPU": True, "NAME": "x"})
    assert spec.env == {"OMP_NUM_THREADS": "1", "USE_CPU": "true", "NAME": "x"}
    for bad in ({"A=B": "1"}, {"": "1"}, {"A": [1]}, ["A"]):
        with pytest.raises(SpecError, match="env"):
            JobSpec(task="charcount-sft", env=bad)


def test_the_reproduce_line_masks_secrets() -> None:
    from parity.run.launch import reproduce_line

    line = reproduce_line(
        ["python", "train.py"], {"HF_TOKEN": "hf_abc", "api_key": "k", "MODE": "a b"}
    )
    assert line == "HF_TOKEN='***' api_key='***' MODE='a b' python train.py"


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('command = ["train.py", "--tag", "a\\u0000b"]\n', "command[2]"),
        ('command = ["train.py"]\n[env]\nMY_FLAG = "on\\u0000off"\n', "env['MY_FLAG']"),
        ('command = ["train.py"]\ntorchrun_args = ["--master-port\\u0000"]\n', "torchrun_args[0]"),
        ('command = ["train.py"]\n[b]\nenv = { X = "\\u0000" }\n', "env['X']"),
        ('task = "charcount-sft"\noverrides = { tag = "a\\u0000" }\n', "overrides['tag']"),
        (
            'command = ["t.py"]\n[launcher]\nkind = "slurm"\nsbatch_args = ["\\u0000"]\n',
            "launcher.sbatch_args[0]",
        ),  # fmt: skip
    ],
    ids=["command", "env", "torchrun_args", "side-env", "overrides", "sbatch_args"],
)
def test_a_nul_in_a_string_that_reaches_exec_is_refused_by_parity_spec(
    tmp_path: Path, capsys, text: str, key: str
) -> None:
    """exec and the environment cannot carry a NUL: refused when the spec is checked (exit 2,
    naming the key), not at launch as an internal error."""
    from parity.cli import main

    path = tmp_path / "spec.toml"
    path.write_text(text)
    assert main(["spec", str(path)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("parity: error: ") and f"{key} holds a NUL character" in line
    assert str(path) in line


def test_preload_defaults_to_the_presets_and_takes_module_names_only() -> None:
    """What the fast paths import before forking a job: the preset's list (the charcount presets:
    worker.boot), none for a custom command, the spec's own where given (none: [])."""
    assert JobSpec(task="charcount-sft").preload == ["worker.boot"]
    assert JobSpec(task="charcount-sft", preload=[]).preload == []
    custom = JobSpec(command=["-m", "job"], preload=("transformers", "my.boot"))
    assert custom.preload == ["transformers", "my.boot"] and JobSpec(command=["x"]).preload == []
    assert JobSpec.from_dict(custom.to_dict()).preload == ["transformers", "my.boot"]
    to_preset = {"task": "charcount-sft", "command": None}
    switched = PairSpec(JobSpec(command=["-m", "job"]), {}, to_preset)
    assert [side.preload for side in switched.sides()] == [[], ["worker.boot"]]  # the side's task's
    own = JobSpec(command=["-m", "job"], preload=["my.boot"])
    kept = PairSpec(own, {}, to_preset).sides()[1].preload
    assert kept == ["my.boot"]  # the spec's own list is kept for both sides
    bad_lists = {"transformers": "must be a list", ("a..b",): "not a module name",
                 ("my boot",): "not a module name", ("a", "a"): "listed twice"}  # fmt: skip
    for bad, message in bad_lists.items():
        with pytest.raises(SpecError, match=f"^preload.*{message}"):
            JobSpec(command=["-m", "job"], preload=bad)
