"""Nothing of the user's is ever deleted or overwritten (parity.outdir), as a property: random
files, folders and symlinks of the user's around and inside ``--out`` (in the harness's own
folders too, its files edited in place or deleted and written anew), between random cheap
commands (`parity report`, `parity compare`, and the library's claim and make_dir with a stub job
writing in the folders it gets); after every command each of the user's files holds what the
user wrote, each symlink points where it did, and the exit is 0 or 2, never an internal error."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from parity.cli import main
from parity.outdir import OutDir, OutputError
from parity.report import Report

COMPLETE = '{"step": 1, "a": 1.0}\n{"event": "end", "steps": 1}\n'
HARNESS = ["a", "a.launch", "b", "in-process", "trace-a", "allocation", "summary.md"]
NAMES = [*HARNESS, "report.md", "report.html", "rep", ".parity-out", "lock", "made.json", "out"]

user_step = st.tuples(
    st.sampled_from(["file", "folder", "link", "edit", "replace"]),
    st.integers(0, 99),  # which folder (or which of the harness's files)
    st.sampled_from(NAMES),
    st.binary(min_size=1, max_size=6),
)
command_step = st.tuples(
    st.sampled_from(["report", "report-sub", "compare", "stub-job"]),
    st.lists(st.sampled_from(HARNESS), max_size=3),
)
steps = st.lists(st.one_of(user_step, command_step), min_size=1, max_size=10)


class World:
    """A scratch root: ``out`` (the --out), ``outside`` (the user's, linked to), ``inputs``
    (two tiny metric files), and what the user made: file contents and symlink targets."""

    def __init__(self, root: Path):
        self.root, self.out = root, root / "out"
        self.outside, self.inputs = root / "outside", root / "inputs"
        self.outside.mkdir()
        self.inputs.mkdir()
        self.files: dict[Path, bytes] = {self.outside / "keep.txt": b"outside"}
        self.links: dict[Path, str] = {}
        for p in (*self.files, self.inputs / "a.jsonl", self.inputs / "b.jsonl"):
            p.write_bytes(self.files.setdefault(p, COMPLETE.encode()))

    def folders(self) -> list[Path]:
        """Every real folder under root but the inputs and outside (symlinks not followed)."""
        found = []
        for top, dirs, _ in os.walk(self.root):
            dirs[:] = sorted(d for d in dirs if Path(top, d) not in (self.inputs, self.outside))
            found.append(Path(top))
        return found

    def harness_files(self) -> list[Path]:
        """Regular files under out the user did not write."""
        if not self.out.is_dir() or self.out.is_symlink():
            return []
        return sorted(
            Path(top, f)
            for top, _, names in os.walk(self.out)
            for f in names
            if Path(top, f) not in self.files and not Path(top, f).is_symlink()
        )

    def user(self, kind: str, pick: int, name: str, data: bytes) -> None:
        if kind in ("edit", "replace"):
            theirs = self.harness_files()
            if not theirs:
                return
            path = theirs[pick % len(theirs)]
            if kind == "replace":
                path.unlink()  # its inode number is free for the file written next
            with open(path, "ab") as f:
                f.write(data)
            self.files[path] = path.read_bytes()
            return
        folders = self.folders()
        path = folders[pick % len(folders)] / name
        if os.path.lexists(path):
            return
        if kind == "file":
            path.write_bytes(data)
            self.files[path] = data
        elif kind == "folder":
            path.mkdir()
            (path / "x").write_bytes(data)
            self.files[path / "x"] = data
        else:
            target = [self.outside, self.outside / "keep.txt", self.root / "nowhere"]
            path.symlink_to(target[data[0] % 3])
            self.links[path] = os.readlink(path)

    def command(self, kind: str, names: list[str]) -> int:
        a, b = str(self.inputs / "a.jsonl"), str(self.inputs / "b.jsonl")
        if kind == "report":
            return main(["report", a, b, "-o", str(self.out)])
        if kind == "report-sub":
            return main(["report", a, b, "-o", str(self.out / "rep")])
        if kind == "compare":
            return main(["compare", a, b])
        try:  # as pair and check do: claim every name first, then make them; the job writes
            with OutDir.open(self.out) as held:
                held.claim(*names)
                for name in names:
                    (held.make_dir(name) / "metrics.jsonl").write_text(COMPLETE)
        except OutputError:
            return 2
        return 0

    def check(self) -> None:
        for path, data in self.files.items():
            assert not path.is_symlink() and path.read_bytes() == data, path
        for path, target in self.links.items():
            assert path.is_symlink() and os.readlink(path) == target, path


@settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(plan=steps)
def test_no_user_file_is_lost_between_commands(plan, monkeypatch) -> None:
    monkeypatch.setattr(Report, "html", lambda self: "<html></html>\n")  # the plots take 1 s
    with tempfile.TemporaryDirectory() as tmp:
        world = World(Path(tmp))
        for step in plan:
            if len(step) == 4:
                world.user(*step)
            else:
                assert world.command(*step) in (0, 2), step
            world.check()
