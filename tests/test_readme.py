"""The README teaches the harness, not its reference subject, and only commands the CLI takes.

The reference subject (worker/, the charcount presets) is documented in one section of its own;
everywhere else the examples are generic, so a reader never mistakes the subject's flags for the
harness's. Every `parity ...` line shown parses with the real parser, so a removed flag cannot
linger in the documentation.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from parity.cli import build_parser

README = Path(__file__).resolve().parent.parent / "README.md"
REFERENCE = "The reference subject (`worker/`, charcount)"
FRESH_MACHINE = "Two commands on a fresh machine"
#: the one mention allowed outside the reference section: the fresh-machine install command
#: runs the subject's pair, named by this exact preset flag and nothing else
ALLOWED_MENTION = "--task charcount-sft"


def _sections() -> dict[str, str]:
    """Title -> text of each `## ` section (the text before the first one under "")."""
    parts = re.split(r"^## (.*)\n", README.read_text(), flags=re.M)
    return {"": parts[0], **dict(zip(parts[1::2], parts[2::2], strict=True))}


def _bash_lines(text: str) -> list[str]:
    """The lines of every ```bash block in ``text``."""
    return [line for block in re.findall(r"```bash\n(.*?)```", text, re.S)
            for line in block.splitlines()]  # fmt: skip


def test_charcount_is_taught_only_in_the_reference_section() -> None:
    sections = _sections()
    assert REFERENCE in sections, f"no section '## {REFERENCE}'"
    found = []
    for title, text in sections.items():
        if title == REFERENCE:
            continue
        commands = set(_bash_lines(text)) if title == FRESH_MACHINE else set()
        for line in text.splitlines():
            allowed = line in commands and line.startswith("python3 -m venv ")
            rest = line.replace(ALLOWED_MENTION, "") if allowed else line
            if "charcount" in rest.lower():
                found.append(f"{title or '(top)'}: {line.strip()[:120]}")
    assert not found, "charcount outside the reference section:\n" + "\n".join(found)


def test_the_fresh_machine_command_installs_the_subject_and_runs_its_pair() -> None:
    (install,) = [line for line in _bash_lines(_sections()[FRESH_MACHINE]) if "pip" in line]
    assert "pip install -e . -e ./worker" in install
    assert ALLOWED_MENTION in install


def test_the_top_links_the_reference_section() -> None:
    sections = _sections()
    assert "](#reference-subject)" in sections[""]
    assert '<a id="reference-subject"></a>' in sections[REFERENCE]


def _parity_commands() -> list[tuple[str, list[str]]]:
    """(line, argv) of every `parity` command in a ```bash block, `&&` chains split; lines with
    `...` placeholders skipped, optional groups `[--flag ARG]` unbracketed (their flags are
    checked too), trailing comments dropped."""
    out = []
    for line in _bash_lines(README.read_text()):
        if "..." in line:
            continue
        words = shlex.split(re.sub(r"\s\[(-[^\]]*)\]", r" \1", line), comments=True)
        chain: list[list[str]] = [[]]
        for word in words:
            chain.append([]) if word == "&&" else chain[-1].append(word)
        for argv in chain:
            if argv and (argv[0] == "parity" or argv[0].endswith("/parity")):
                out.append((line, argv[1:]))
    return out


def test_every_parity_command_in_the_readme_parses() -> None:
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


def test_pair_help_names_no_reference_subject(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["pair", "--help"])
    text = capsys.readouterr().out.lower()
    assert "--task" in text
    for word in ("charcount", "legacy", "worker", "trainer"):
        assert word not in text, word
