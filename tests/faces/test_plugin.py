"""The pytest plugin: marker registered, assert_parity fails with a readable table."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from parity import assert_parity

pytest_plugins = ["pytester"]


def _frame(values):
    return pd.DataFrame(
        {"train/loss": values, "train/mfu": [0.1] * len(values)},
        index=pd.Index(range(1, len(values) + 1), name="step"),
    )


def test_assert_parity_passes_and_fails_with_a_table():
    a = _frame([3.0, 2.5, 2.0])
    assert assert_parity(a, _frame([3.0, 2.5, 2.0])).verdict == "aligned"
    b = _frame([3.0, float(np.nextafter(2.5, 3.0)), 2.0])
    with pytest.raises(pytest.fail.Exception) as info:
        assert_parity(a, b)
    message = str(info.value)
    assert "diverged" in message and "train/loss" in message
    row = next(line for line in message.splitlines() if line.startswith("train/loss"))
    assert " 2 " in row  # first divergent step


def test_marker_selects_parity_tests(pytester):
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.parity
        def test_slow():
            pass

        def test_fast():
            pass
        """
    )
    result = pytester.runpytest("-m", "parity", "--strict-markers")
    result.assert_outcomes(passed=1, deselected=1)
    result = pytester.runpytest("-m", "not parity", "--strict-markers")
    result.assert_outcomes(passed=1, deselected=1)
    assert "--parity-keep-runs" in "".join(pytester.runpytest("--help").outlines)


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one process", "xdist"])
def test_the_mutation_score_is_printed_with_and_without_xdist(pytester, workers):
    """Each mutant test's result travels on its report, so the session prints the score where
    the tests ran in other processes too (CI's pytest-xdist workers)."""
    pytester.makepyfile(
        """
        def test_caught(parity_mutant_score):
            parity_mutant_score("dropped-factor", True)

        def test_missed(parity_mutant_score):
            parity_mutant_score("shifted-mask", False)

        def test_caught_twice(parity_mutant_score):
            parity_mutant_score("dropped-factor", True)
        """
    )
    result = pytester.runpytest_subprocess(*workers)
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(["*mutation score: 1/2 caught (50%); NOT caught: shifted-mask*"])


def test_an_option_path_that_would_become_the_rootdir_is_refused(pytester, tmp_path_factory):
    """pytest#8846: `--parity-keep-runs DIR` with DIR existing outside the project hid the
    project's ini file (seen: the golden tests then failed); the plugin refuses it in one line."""
    pytester.makepyfile("def test_fast():\n    pass\n")
    pytester.makepyprojecttoml("[tool.pytest.ini_options]\naddopts = '-ra'\n")
    outside = tmp_path_factory.mktemp("kept-runs")
    result = pytester.runpytest("--parity-keep-runs", str(outside))
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--parity-keep-runs*did not read the ini*--parity-keep-runs=*"])
    pytester.runpytest(f"--parity-keep-runs={outside}").assert_outcomes(passed=1)
    pytester.runpytest("--parity-keep-runs", "runs").assert_outcomes(passed=1)  # not there yet


def test_the_keep_runs_folder_is_held_and_owned(pytester, tmp_path_factory):
    """`--parity-keep-runs=DIR` gets the rules of any --out (parity.outdir): held for the
    session (a second command on it is refused, naming the session's pid), and a folder of the
    user's in it is never taken for a run folder."""
    keep = tmp_path_factory.mktemp("keep")
    (keep / "mine").mkdir()
    (keep / "mine" / "notes.txt").write_text("the user's")
    pytester.makepyfile(
        f"""
        import os, subprocess, sys
        import pytest
        from parity.outdir import OutDir, OutputError

        PROBE = "from parity.outdir import OutDir; OutDir.open({str(keep)!r})"

        def test_inner(parity_runner):
            assert str(parity_runner.base_dir) == {str(keep)!r}
            probe = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True)
            assert probe.returncode != 0 and f"in use by pid {{os.getpid()}}" in probe.stderr
            with OutDir.open(parity_runner.base_dir) as held, pytest.raises(OutputError):
                held.claim("mine")
        """
    )
    result = pytester.runpytest(f"--parity-keep-runs={keep}", "--parity-no-pool")
    result.assert_outcomes(passed=1)
    assert (keep / "mine" / "notes.txt").read_text() == "the user's"


def test_a_kept_folder_s_earlier_runs_are_never_reused(tmp_path):
    """A second session into the same `--parity-keep-runs=DIR`: its run folders take names
    nothing has (nor their launch folders), so the first session's runs stay as they were."""
    from parity.plugin import ParityRunner

    (tmp_path / "000-job").mkdir()
    (tmp_path / "000-job" / "metrics.jsonl").write_text("the first session's")
    (tmp_path / "001-job-2.launch").mkdir()
    runner = ParityRunner(tmp_path)
    assert runner._folder("job") == tmp_path / "000-job-2"
    assert runner._folder("job") == tmp_path / "001-job"
    assert runner._folder("job") == tmp_path / "002-job"
    (tmp_path / "003-job-alone").mkdir()  # a pooled job's folder launched alone (ParityRunner.job)
    assert runner._folder("job") == tmp_path / "003-job-2"


def test_the_runner_compares_pairs_as_parity_pair_does(tmp_path, monkeypatch):
    """ParityRunner.pair and .floor build their results with parity.pair's functions (one
    comparison of a pair for `parity pair`, run_pair and the plugin): a noisy side A gives the
    "nondeterministic" result against its repeat, as `parity pair --noise-floor` does."""
    import parity.pair
    import parity.run.job
    from parity.plugin import ParityRunner
    from parity.run.job import Run
    from parity.run.launch import LaunchResult
    from parity.spec import JobSpec, PairSpec

    losses = iter([[3.0, 2.0], [3.0, 2.0], [3.0, 2.5], [3.0, 2.0]])  # A, B; then A, A' differ

    def run_job(spec, out, label=None, **kwargs):
        launch = LaunchResult(returncode=0, timed_out=False, duration_s=1.0, run_dir=Path(out))
        return Run(spec, Path(out), launch, _frame(next(losses)))

    compared = []
    real = parity.pair.compare_frames
    monkeypatch.setattr(parity.run.job, "run_job", run_job)
    monkeypatch.setattr(
        parity.pair, "compare_frames", lambda *a, **k: compared.append(a) or real(*a, **k)
    )
    runner = ParityRunner(tmp_path)
    pair = PairSpec.from_variants(JobSpec(task="charcount-sft", steps=2), "legacy", "worker")
    result = runner.pair(pair)
    assert (result.verdict, result.dir, len(compared)) == ("aligned", tmp_path, 1)
    assert result.diagnose().kind == "aligned"  # on first use; nothing written beside the runs
    assert not (tmp_path / "summary.json").exists()
    noisy = runner.pair(PairSpec.from_variants(pair.base.replace(seed=7), "legacy", "worker"),
                        noise_floor=True)  # fmt: skip
    assert noisy.verdict == "nondeterministic" and noisy.b is noisy.floor.runs[1]
    assert noisy.floor.a_dir == noisy.a.dir and noisy.dir == tmp_path


def test_run_folders_are_named_after_the_test_that_made_them(pytester, tmp_path_factory):
    """`--parity-keep-runs=DIR`: each run folder is named after its test (the node name, made a
    file name), a letter per run of that test: test_my_refactor-a, test_my_refactor-b."""
    keep = tmp_path_factory.mktemp("keep")
    pytester.makepyfile(
        """
        from pathlib import Path

        import pandas as pd
        import pytest
        import parity.run.job
        from parity.run.job import Run
        from parity.run.launch import LaunchResult
        from parity.spec import JobSpec, PairSpec

        def run_job(spec, out, label=None, **kwargs):
            Path(out).mkdir()
            launch = LaunchResult(returncode=0, timed_out=False, duration_s=1.0, run_dir=out)
            frame = pd.DataFrame({"train/loss": [1.0]}, index=pd.Index([1], name="step"))
            return Run(spec, Path(out), launch, frame)

        @pytest.mark.parametrize("n", [2])
        def test_my_refactor(parity_runner, monkeypatch, n):
            monkeypatch.setattr(parity.run.job, "run_job", run_job)
            base = JobSpec(command=["train.py", "--out", "{out}"], world_size=n)
            pair = parity_runner.pair(PairSpec(base, {"env": {"X": "0"}}, {"env": {"X": "1"}}))
            assert [pair.a.dir.name, pair.b.dir.name] == [
                "test_my_refactor-2-a", "test_my_refactor-2-b"
            ]
        """
    )
    result = pytester.runpytest(f"--parity-keep-runs={keep}", "--parity-no-pool")
    result.assert_outcomes(passed=1)
    assert sorted(p.name for p in keep.iterdir() if not p.name.startswith(".")) == [
        "test_my_refactor-2-a",
        "test_my_refactor-2-b",
    ]


def test_run_folder_names_of_a_test_are_file_names_and_never_reused(tmp_path):
    from parity.plugin import ParityRunner

    runner = ParityRunner(tmp_path)
    runner.test_name = "test_x[a/b c]"
    (tmp_path / "test_x-a-b-c-a").mkdir()  # an earlier session's, kept
    assert runner._folder("custom--w2") == tmp_path / "test_x-a-b-c-a-2"
    assert runner._folder("custom--w2", "repeat") == tmp_path / "test_x-a-b-c-b-repeat"
    runner.test_name = None  # outside a test: the session's counter and what the run is
    assert runner._folder("custom--w2") == tmp_path / "000-custom--w2"
