"""The pytest plugin: marker registered, assert_parity fails with a readable table."""

from __future__ import annotations

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
