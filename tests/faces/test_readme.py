"""The README and docs/ teach the harness, not its reference subject, and only what the CLI takes.

The README is the front door; docs/ holds one file per concern. The reference subject (worker/,
the charcount presets) is documented in docs/reference-subject.md alone; everywhere else the
examples are generic, so a reader never mistakes the subject's flags for the harness's. Every
`parity ...` line shown parses with the real parser, so a removed flag cannot linger in the
documentation, and every command and flag the parser has is documented, so a new one cannot go
unmentioned.
"""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from parity.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
REFERENCE = DOCS / "reference-subject.md"
FRESH_MACHINE = "Two commands on a fresh machine"
#: the one mention allowed outside the reference doc: the README's fresh-machine install command
#: runs the subject's pair, named by this exact preset flag and nothing else
ALLOWED_MENTION = "--task charcount-sft"


def _documents() -> list[Path]:
    """README.md and every docs/*.md: the documentation the checks below run over."""
    return [README, *sorted(DOCS.glob("*.md"))]


def _name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _sections() -> dict[str, str]:
    """Title -> text of each `## ` section of the README (the text before the first under "")."""
    parts = re.split(r"^## (.*)\n", README.read_text(), flags=re.M)
    return {"": parts[0], **dict(zip(parts[1::2], parts[2::2], strict=True))}


def _bash_lines(text: str) -> list[str]:
    """The lines of every ```bash block in ``text``."""
    return [line for block in re.findall(r"```bash\n(.*?)```", text, re.S)
            for line in block.splitlines()]  # fmt: skip


def test_docs_exist_and_each_starts_with_a_title() -> None:
    docs = sorted(DOCS.glob("*.md"))
    assert REFERENCE in docs, f"no {_name(REFERENCE)}"
    untitled = [_name(p) for p in docs if not p.read_text().startswith("# ")]
    assert not untitled, f"docs without a '# Title' first line: {untitled}"


def test_charcount_is_taught_only_in_the_reference_doc() -> None:
    found = []
    for path in _documents():
        if path == REFERENCE:
            continue
        if path == README:
            fresh = set(_bash_lines(_sections().get(FRESH_MACHINE, "")))
            allowed = {line for line in fresh if line.startswith("python3 -m venv ")}
        else:
            allowed = set()
        for line in path.read_text().splitlines():
            rest = line.replace(ALLOWED_MENTION, "") if line in allowed else line
            if "charcount" in rest.lower():
                found.append(f"{_name(path)}: {line.strip()[:120]}")
    assert not found, f"charcount outside {_name(REFERENCE)}:\n" + "\n".join(found)


def test_the_fresh_machine_command_installs_the_subject_and_runs_its_pair() -> None:
    (install,) = [line for line in _bash_lines(_sections()[FRESH_MACHINE]) if "pip" in line]
    assert "pip install -e . -e ./worker" in install
    assert ALLOWED_MENTION in install


def test_the_top_links_the_reference_doc() -> None:
    assert "](docs/reference-subject.md" in _sections()[""]
    assert '<a id="reference-subject"></a>' in REFERENCE.read_text()


def test_the_readme_links_every_doc() -> None:
    documentation = _sections()["Documentation"]
    missing = [_name(p) for p in DOCS.glob("*.md") if f"]({_name(p)})" not in documentation]
    assert not missing, f"not in the README's Documentation list: {missing}"


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a markdown file, and its explicit `<a id="...">` ones."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    found = set(re.findall(r'<a id="([^"]+)"></a>', text))
    for title in re.findall(r"^#+ (.*)$", text, flags=re.M):
        found.add(re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-"))
    return found


def test_every_relative_link_reaches_its_file_and_anchor() -> None:
    broken = []
    for path in _documents():
        text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists() or (anchor and anchor not in _anchors(dest)):
                broken.append(f"{_name(path)}: ({target})")
    assert not broken, "broken links:\n" + "\n".join(broken)


def _parity_commands() -> list[tuple[str, list[str]]]:
    """(line, argv) of every `parity` command in a ```bash block of the README or docs/, `&&`
    chains split; lines with `...` placeholders skipped, optional groups `[--flag ARG]`
    unbracketed (their flags are checked too), trailing comments dropped."""
    out = []
    for path in _documents():
        for line in _bash_lines(path.read_text()):
            if "..." in line:
                continue
            words = shlex.split(re.sub(r"\s\[(-[^\]]*)\]", r" \1", line), comments=True)
            chain: list[list[str]] = [[]]
            for word in words:
                chain.append([]) if word == "&&" else chain[-1].append(word)
            chain = [argv[: argv.index(">")] if ">" in argv else argv for argv in chain]  # > FILE
            for argv in chain:
                if argv and (argv[0] == "parity" or argv[0].endswith("/parity")):
                    out.append((f"{_name(path)}: {line}", argv[1:]))
    return out


def test_every_parity_command_in_the_docs_parses() -> None:
    commands = _parity_commands()
    assert len(commands) >= 20, commands  # the blocks are found at all
    parser = build_parser()
    refused = []
    for line, argv in commands:
        try:
            parser.parse_args(argv)
        except SystemExit:
            refused.append(line)
    assert not refused, "the CLI refuses:\n" + "\n".join(refused)


def _subcommands() -> tuple[argparse._SubParsersAction, dict[str, argparse.ArgumentParser]]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub, dict(sub.choices)


def test_every_command_and_flag_is_in_the_docs() -> None:
    text = "\n".join(path.read_text() for path in _documents())
    _, commands = _subcommands()
    missing = [f"parity {name}" for name in commands if f"parity {name}" not in text]
    for name, sub in commands.items():
        for action in sub._actions:
            for flag in action.option_strings:
                if flag in ("-h", "--help"):
                    continue
                if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text):
                    missing.append(f"parity {name} {flag}")
    assert not missing, "not in README.md or docs/*.md:\n" + "\n".join(missing)


def test_every_command_and_argument_has_help() -> None:
    sub, commands = _subcommands()
    helps = {choice.dest: choice.help for choice in sub._choices_actions}
    missing = [f"parity {name}" for name in commands if not (helps.get(name) or "").strip()]
    for name, parser in commands.items():
        for action in parser._actions:
            if not (action.help or "").strip():
                missing.append(f"parity {name} {'/'.join(action.option_strings) or action.dest}")
    assert not missing, "no help text:\n" + "\n".join(missing)


def test_pair_help_names_no_reference_subject(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["pair", "--help"])
    text = capsys.readouterr().out.lower()
    assert "--task" in text
    for word in ("charcount", "legacy", "worker", "trainer"):
        assert word not in text, word
