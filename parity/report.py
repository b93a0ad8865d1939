"""Reproducibility reports of two runs: report.md for a PR comment, report.html for a browser.

Both say the verdict, where each metric first diverged, how the two environments differ and how
to rerun each side. Every string from a log, metric file or manifest is untrusted text: its
control characters are shown escaped (compare.printable), in report.md every character that
could make markdown or HTML (a link, an image, a tag, a heading, a table cell) is backslash-
escaped (md_escape; GitHub renders HTML inside markdown), in report.html it is HTML-escaped,
quotes included, and matplotlib never parses it as mathtext. The HTML is self-contained
(inline CSS, plots as PNG data URIs) and carries a content security policy that forbids
scripts, so it can be opened from any CI artifact.
"""

from __future__ import annotations

import base64
import html
import io
import json
import os
import re
import shlex
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from parity.files import REPRODUCE_FILE, launch_dir
from parity.judge.compare import (
    ULP_MAX,
    Comparison,
    MetricResult,
    Policy,
    compare_frames,
    printable,
    ulp_distance,
)
from parity.judge.diagnose import Diagnosis, diagnose
from parity.judge.golden import read_manifest
from parity.outdir import OutDir, write_new
from parity.readers import MetricsError, present_mask, read_metrics
from parity.record.runfolder import MANIFEST, manifest_path

__all__ = ["Report", "Side", "build_report", "load_side", "side_of", "write_report"]

MAX_PLOTS = 30  # metrics plotted in the HTML, failures first: keeps the file and the time small
_ORDER = {"diverged": 0, "missing": 1, "match": 2, "ignored": 3}
# manifest keys shown first, in this order; the rest (but argv) follow, config.* only when differ
_FIRST = (
    "git_revision",
    "environment.python",
    "environment.torch",
    "environment.transformers",
    "environment.cuda",
    "environment.gpu",
    "environment.platform",
    "environment.machine",
    "environment.cpu_isa",
    "environment.cpu_vendor",
    "environment.cpu_model",
    "device",
    "backend",
    "world_size",
)
_ABSENT = "(absent)"


@dataclass
class Side:
    """One side of the report: its metrics and whatever its run folder says about it."""

    label: str
    source: Path
    frame: pd.DataFrame
    run_dir: Path | None = None
    manifest: dict[str, Any] = field(default_factory=dict)
    manifest_error: str = ""
    commands: list[tuple[str, str]] = field(default_factory=list)  # (what, shell command)


def load_side(
    path: str | os.PathLike[str], label: str, fmt: str | None = None, **read: Any
) -> Side:
    """Read a run folder or metrics file; a file's folder counts as its run folder when it has a
    manifest.json or launcher.log (so runs/x/metrics.jsonl finds runs/x/manifest.json).

    read: read_metrics' keywords (run, duplicates)."""
    return side_of(read_metrics(Path(path), fmt, **read), path, label)


def side_of(frame: pd.DataFrame, path: str | os.PathLike[str], label: str) -> Side:
    """A side of metrics already read from ``path`` (a run folder or a metrics file), with what
    its run folder says (manifest, commands): for a caller that compared them already."""
    p = Path(path)
    run_dir: Path | None = p
    if not p.is_dir():
        near = [manifest_path(p.parent), p.parent / "launcher.log"]
        near.append(launch_dir(p.parent) / "launcher.log")
        run_dir = p.parent if any(f.is_file() for f in near) else None
    side = Side(label, Path(frame.attrs.get("source", p)), frame, run_dir)
    if run_dir is None:
        return side
    manifest = manifest_path(run_dir)
    if manifest.is_file():
        try:  # a damaged manifest is a line of the report, never the end of it
            side.manifest = read_manifest(manifest)
        except MetricsError as e:
            side.manifest_error = str(e)
    launcher = launch_dir(run_dir) / "launcher.log"  # beside the run; in it in older runs
    if not launcher.is_file():
        launcher = run_dir / "launcher.log"
    try:
        with open(launcher, encoding="utf-8", errors="replace") as f:
            first = f.readline(1 << 20).rstrip("\n")
    except OSError:  # no launcher.log (or none that can be read): no launcher command
        first = ""
    ran_in = _ran_in(run_dir)
    if first.startswith("# "):
        how = "torchrun" if "torch.distributed.run" in first else "one plain process"
        side.commands += _setup(ran_in)
        side.commands.append((f"launcher ({how})", _moved(first[2:], ran_in)))
    environment = side.manifest.get("environment")
    argv = environment.get("argv") if isinstance(environment, dict) else None
    if isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv):
        side.commands.append((_ARGV, _moved(shlex.join(argv), ran_in)))
    return side


_ARGV = "job sys.argv on rank 0"  # what the job saw, not a command: a comment in report.md


def _ran_in(run_dir: Path) -> dict[str, Any]:
    """Where the launch ran (parity.run.job.launch_spec's reproduce.json): ``cwd``, and for a
    temporary worktree of check or bisect, gone by now, its ``repo``, ``commit`` and ``path``
    (and ``carry``: the inputs copied into it, parity.carry); {} for a run without it (an older
    one, one the harness did not launch) or a damaged one."""
    try:
        found = json.loads((launch_dir(run_dir) / REPRODUCE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return {}
    if not isinstance(found, dict):
        return {}
    tree = found.get("worktree")
    keys = ("repo", "commit", "path")
    if isinstance(tree, dict) and all(isinstance(tree.get(k), str) and tree[k] for k in keys):
        return {**{k: tree[k] for k in keys}, **_carried(tree.get("carry"))}
    cwd = found.get("cwd")
    return {"cwd": cwd} if isinstance(cwd, str) and cwd else {}


def _carried(carry: Any) -> dict[str, Any]:
    """reproduce.json's carried inputs (the checkout they came from, their paths) when they are
    well formed: the rerun copies them into its worktree as check and bisect did."""
    if not isinstance(carry, dict):
        return {}
    root, paths = carry.get("from"), carry.get("paths")
    if not (isinstance(root, str) and root and isinstance(paths, list) and paths):
        return {}
    if not all(isinstance(p, str) and p and ".." not in p.split("/") for p in paths):
        return {}
    return {"carry_from": root, "carry": paths}


def _script_line(what: str, command: str) -> str:
    """A command as a line of report.md's script: the job's argv only as a comment."""
    return f"# {what}: " + command.replace("\n", "\\n") if what == _ARGV else command


def _fresh_tree(ran_in: Mapping[str, str]) -> str:
    """Where the report's commands make the worktree again: beside the system's temp files."""
    return os.path.join(tempfile.gettempdir(), f"parity-{ran_in['commit'][:12]}")


def _setup(ran_in: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The commands before the launcher's: make the revision's worktree again (check's and
    bisect's was removed after the run) and cd into it, or cd into the folder the job ran in."""
    q = shlex.quote
    if "commit" in ran_in:
        tree, repo, commit = _fresh_tree(ran_in), ran_in["repo"], ran_in["commit"]
        return [
            ("make the revision's worktree (the run's own was removed after it)",
             f"git -C {q(repo)} worktree add --detach {q(tree)} {q(commit)}"),
            *_carry_commands(ran_in, tree),
            ("in it", f"cd {q(tree)}"),
        ]  # fmt: skip
    if "cwd" in ran_in:
        return [("in the folder it ran in", f"cd {q(ran_in['cwd'])}")]
    return []


def _carry_commands(ran_in: Mapping[str, Any], tree: str) -> list[tuple[str, str]]:
    """The copies of the carried inputs (paths git ignores) into the remade worktree, from the
    checkout they were carried from, as check and bisect copied them."""
    q, root = shlex.quote, ran_in.get("carry_from", "")
    commands = []
    for path in ran_in.get("carry", []):
        parent = os.path.dirname(path)
        made = f"mkdir -p {q(os.path.join(tree, parent))} && " if parent else ""
        copy = f"cp -R {q(os.path.join(root, path))} {q(os.path.join(tree, path))}"
        commands.append((f"carry {path} (git ignores it; check copied it)", made + copy))
    return commands


def _moved(command: str, ran_in: Mapping[str, str]) -> str:
    """``command`` with the removed worktree's path (its cwd, PYTHONPATH, a script in it) made
    the path ``_setup`` makes it again at."""
    if "commit" not in ran_in:
        return command
    return command.replace(ran_in["path"], _fresh_tree(ran_in))


def _flatten(obj: Any, prefix: str = "") -> dict[str, str]:
    if isinstance(obj, dict):
        out: dict[str, str] = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    text = obj if isinstance(obj, str) else json.dumps(obj, sort_keys=True, default=str)
    return {prefix[:-1]: text}


def fingerprint_rows(
    a: Mapping[str, Any],
    b: Mapping[str, Any],
    run_dirs: Sequence[Path | None] = (None, None),
) -> list[tuple[str, str, str, bool]]:
    """(key, a value, b value, whether they differ) of both manifests, flattened; config keys
    only where they differ (trainer names always differ and are what a reader looks for).

    run_dirs: each side's run folder; a value differs only where it still does once each side's
    own folder is replaced by one placeholder (``config.out_dir`` naming each side's run folder,
    or a file in it, is the same; another path that differs still shows)."""
    fa, fb = _flatten(dict(a)), _flatten(dict(b))
    for f in (fa, fb):
        f.pop("environment.argv", None)
    keys = [k for k in _FIRST if k in fa or k in fb]
    keys += sorted((set(fa) | set(fb)) - set(keys), key=lambda k: (k.startswith("config."), k))
    rows = []
    for k in keys:
        va, vb = fa.get(k, _ABSENT), fb.get(k, _ABSENT)
        differs = _own_folder(va, run_dirs[0]) != _own_folder(vb, run_dirs[1])
        if k.startswith("config.") and not differs:
            continue
        rows.append((k, va, vb, differs))
    return rows


def _own_folder(value: str, run_dir: Path | None) -> str:
    """``value`` with its side's run folder (as given, and resolved) named ``<run folder>``,
    where it is a whole path or a path's start (not ``/runs/a`` in ``/runs/ab``)."""
    if run_dir is None:
        return value
    forms = [str(run_dir), os.path.abspath(run_dir), str(Path(run_dir).resolve())]
    for path in sorted(set(forms), key=len, reverse=True):  # a relative form is in the others
        if len(path) > 1:  # not "/" nor "."
            value = re.sub(re.escape(path) + r"(?![^/\\\s\"',:;)\]}])", "<run folder>", value)
    return value


def _num(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, int) and v == ULP_MAX:
        return "max"
    return repr(v)


def _rows(comparison: Comparison) -> list[MetricResult]:
    """Failures first, then by status and name (the table's order)."""
    return comparison.results.ordered()


_COLUMNS = (
    "metric",
    "status",
    "policy",
    "steps compared",
    "first divergent step",
    "a value there",
    "b value there",
    "max ULP",
    "max abs diff",
    "max rel diff",
    "note",
)


def _cells(m: MetricResult) -> list[str]:
    return [
        m.name,
        m.status,
        m.policy,
        str(m.steps_compared),
        _num(m.first_divergent_step),
        _num(m.a_value),
        _num(m.b_value),
        _num(m.max_ulp),
        _num(m.max_abs_diff),
        _num(m.max_rel_diff),
        m.note,
    ]


def _per_step(
    a: pd.DataFrame, b: pd.DataFrame, name: str, ulp_dtype: str = "float64"
) -> pd.DataFrame:
    """Steps, both values (NaN where absent), abs diff and ULP where both sides have the cell,
    counted in the float type the comparison counted them in (float32 for a float32 loss)."""
    steps = a.index.union(b.index).sort_values()
    cols = {}
    for side, frame in (("a", a), ("b", b)):
        if name in frame.columns:
            vals = frame[name].reindex(steps).to_numpy(dtype=np.float64)
            has = present_mask(frame)[name].reindex(steps, fill_value=False).to_numpy(dtype=bool)
        else:
            vals, has = np.full(len(steps), np.nan), np.zeros(len(steps), dtype=bool)
        cols[side], cols[f"has_{side}"] = vals, has
    both = cols["has_a"] & cols["has_b"]
    with np.errstate(invalid="ignore", over="ignore"):
        absd = np.where(both, np.abs(cols["a"] - cols["b"]), np.nan)
    dist = ulp_distance(cols["a"], cols["b"], np.dtype(ulp_dtype).type)
    ulp = np.where(both, dist.astype(np.float64), np.nan)
    return pd.DataFrame({"a": cols["a"], "b": cols["b"], "abs": absd, "ulp": ulp}, index=steps)


def _plot(a: pd.DataFrame, b: pd.DataFrame, m: MetricResult) -> str:
    """One metric as a PNG data URI: A and B overlaid, and |a-b| and ULP per step (log); a
    metric with no difference at any step gets the curves alone, "bitwise equal at every step"
    in their title (half the axes: the ticks are most of a plot's cost)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    d = _per_step(a, b, m.name, m.ulp_dtype)
    absd, ulp = d["abs"].where(d["abs"] > 0), d["ulp"].where(d["ulp"] > 0)
    differs = bool(absd.notna().any() or ulp.notna().any())
    fig = Figure(figsize=(10, 3), dpi=80)  # fixed margins: a layout engine doubles the cost
    FigureCanvasAgg(fig)
    if differs:
        left, right = fig.subplots(1, 2, sharex=True)
        fig.subplots_adjust(left=0.09, right=0.92, bottom=0.16, top=0.84, wspace=0.34)
    else:
        left, right = fig.subplots(), None
        fig.subplots_adjust(left=0.09, right=0.97, bottom=0.16, top=0.84)
    left.xaxis.set_major_locator(MaxNLocator(integer=True))
    left.plot(d.index, d["a"], "-o", ms=3, label="A")
    left.plot(d.index, d["b"], "--x", ms=4, label="B")
    title = printable(m.name) + ("" if differs else "  (bitwise equal at every step)")
    left.set_title(title, parse_math=False, loc="left", fontsize=10)
    left.set_xlabel("step")
    left.legend(loc="best", fontsize=8)
    if right is not None:  # log axes: exact steps (0) are left out
        right.set_title("per-step difference", loc="left", fontsize=10)
        right.set_xlabel("step")
        twin = right.twinx()
        right.plot(d.index, absd, "-o", ms=3, color="C0")
        twin.plot(d.index, ulp, "--s", ms=3, color="C3")
        right.set_ylabel("|a - b|", color="C0")
        twin.set_ylabel("ULP", color="C3")
        for ax, col in ((right, absd), (twin, ulp)):
            if col.notna().any():
                ax.set_yscale("log")
    if m.first_divergent_step is not None:
        for ax in (left, right) if right is not None else (left,):
            ax.axvline(m.first_divergent_step, color="red", lw=1, alpha=0.6)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


#: the section naming the ignored paths copied, read-only, into each revision (parity.carry)
_CARRIED = "Inputs carried into each revision"


@dataclass
class Report:
    """A comparison of two sides plus everything needed to render it."""

    comparison: Comparison
    a: Side
    b: Side
    notes: list[str] = field(default_factory=list)
    diagnosis: Diagnosis | None = None  # parity.judge.diagnose: batches vs numerics, tensors, ranks
    carried: list[str] = field(default_factory=list)  # check/bisect: inputs copied into each tree

    def headline(self) -> str:
        c = self.comparison
        counts = c.results.counts()
        shown = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
        return f"parity: {c.verdict_text()} ({shown})"

    def first_line(self) -> str:
        first = self.comparison.first_divergence()
        if first is None:
            return ""
        return (
            f"first divergence: step {first.first_divergent_step}, {first.name} "
            f"(a={_num(first.a_value)}, b={_num(first.b_value)}; "
            f"policy {first.first_divergent_policy or first.policy})"
        )

    def _extra_steps(self) -> list[str]:
        c = self.comparison
        return [
            f"steps only in {s}: {', '.join(map(str, steps[:20]))}"
            + (f" ... ({len(steps)} in all)" if len(steps) > 20 else "")
            for s, steps in (("a", c.steps_only_in_a), ("b", c.steps_only_in_b))
            if steps
        ]

    def _run_dirs(self) -> tuple[Path | None, Path | None]:
        """Each side's run folder, which its manifest's paths name (fingerprint_rows)."""
        return self.a.run_dir, self.b.run_dir

    def _sides_info(self) -> list[str]:
        sources = [f"{s.label}: {s.source}" for s in (self.a, self.b)]
        return sources + self.comparison.read_lines()

    def markdown(self) -> str:
        """A PR comment / CI step summary: every untrusted string escaped (md_escape)."""
        md = md_escape
        icon = "✅" if self.comparison.ok else "❌"
        out = [f"## {icon} {md(self.headline())}", ""]
        if self.first_line():
            out += [f"**{md(self.first_line())}**", ""]
        for line in [*self._extra_steps(), *self.notes]:
            out += [_md_paragraph(line), ""]
        if self.diagnosis is not None and self.diagnosis.lines():
            out += ["### Diagnosis", ""]
            out += [f"- {md(line)}" for line in self.diagnosis.lines()] + [""]
        out += [f"- {md(line)}" for line in self._sides_info()] + [""]
        if self.carried:
            out += [f"### {_CARRIED}", ""] + [f"- {md(line)}" for line in self.carried] + [""]
        out += ["| " + " | ".join(_COLUMNS) + " |", "|" + "---|" * len(_COLUMNS)]
        out += ["| " + " | ".join(md(c) for c in _cells(m)) + " |" for m in _rows(self.comparison)]
        out += ["", "### Environment fingerprints", ""]
        rows = fingerprint_rows(self.a.manifest, self.b.manifest, self._run_dirs())
        errors = [s.manifest_error for s in (self.a, self.b) if s.manifest_error]
        out += [_md_paragraph(e) for e in errors] + ([""] if errors else [])
        if rows:
            out += ["| | key | A | B |", "|---|---|---|---|"]
            for key, va, vb, differs in rows:
                mark = "≠" if differs else ""
                out.append(f"| {mark} | {md(key)} | {md(va)} | {md(vb)} |")
        elif not errors:
            out.append(f"no {MANIFEST} on either side")
        out += ["", "### Reproduce", ""]
        for side in (self.a, self.b):
            out.append(f"{_md_paragraph(side.label)}:")
            out.append("")
            text = "\n".join(_script_line(*c) for c in side.commands)
            text = text or "# no launcher.log or manifest"
            fence = "`" * max(3, _longest_run(text, "`") + 1)
            out += [f"{fence}sh", text, fence, ""]
        return "\n".join(out)

    def html(self) -> str:
        """One self-contained page; e() (html.escape with quotes, control characters shown
        escaped) is applied to every string that is not ours; commands keep theirs, in <pre>."""

        def e(text: object) -> str:
            return html.escape(printable(str(text)), quote=True)

        c = self.comparison
        first = c.first_divergence()
        body = [f"<h1 class='{e(c.verdict)}'>{e(self.headline())}</h1>"]
        if first is not None:
            body.append(f"<p class='first'><a href='#first-divergence'>{e(self.first_line())}</a>")
        body += [f"<p>{e(line)}</p>" for line in [*self._extra_steps(), *self.notes]]
        if self.diagnosis is not None and self.diagnosis.lines():
            items = "".join(f"<li>{e(line)}</li>" for line in self.diagnosis.lines())
            body.append(f"<h2>Diagnosis</h2><ul class='diagnosis'>{items}</ul>")
        body.append("<ul>" + "".join(f"<li>{e(x)}</li>" for x in self._sides_info()) + "</ul>")
        if self.carried:
            items = "".join(f"<li>{e(line)}</li>" for line in self.carried)
            body.append(f"<h2>{_CARRIED}</h2><ul class='carried'>{items}</ul>")

        body.append("<h2>Verdict per metric</h2><table class='verdict'><thead><tr>")
        body.append("".join(f"<th>{e(h)}</th>" for h in _COLUMNS) + "</tr></thead><tbody>")
        for m in _rows(c):
            cells = [f"<td>{e(x)}</td>" for x in _cells(m)]
            if m.first_divergent_step is not None:
                cells[4] = f"<td class='hit'>{e(_num(m.first_divergent_step))}</td>"
            anchor = " id='first-divergence'" if m is first else ""
            body.append(f"<tr class='{e(m.status)}'{anchor}>{''.join(cells)}</tr>")
        body.append("</tbody></table>")

        body.append("<h2>Curves</h2>")
        plotted = [m for m in _rows(c) if m.status != "ignored"]
        for m in plotted[:MAX_PLOTS]:
            uri = _plot(self.a.frame, self.b.frame, m)
            body.append(f'<h3>{e(m.name)}</h3><img src="{uri}" alt="{e(m.name)}">')
        if len(plotted) > MAX_PLOTS:
            body.append(f"<p>{len(plotted) - MAX_PLOTS} more metrics not plotted</p>")

        body.append("<h2>Environment fingerprints</h2>")
        body += [f"<p>{e(s.manifest_error)}</p>" for s in (self.a, self.b) if s.manifest_error]
        rows = fingerprint_rows(self.a.manifest, self.b.manifest, self._run_dirs())
        if rows:
            body.append(
                f"<table class='env'><tr><th></th><th>key</th><th>A: {e(self.a.label)}</th>"
                f"<th>B: {e(self.b.label)}</th></tr>"
            )
            for key, va, vb, differs in rows:
                body.append(
                    f"<tr class='{'differs' if differs else 'same'}'><td>{'≠' if differs else ''}"
                    f"</td><td>{e(key)}</td><td>{e(va)}</td><td>{e(vb)}</td></tr>"
                )
            body.append("</table>")
        else:
            body.append(f"<p>no {MANIFEST} on either side</p>")

        body.append("<h2>Reproduce</h2>")
        for side in (self.a, self.b):
            body.append(f"<h3>{e(side.label)}</h3>")
            if not side.commands:
                body.append("<p>no launcher.log or manifest</p>")
            for what, cmd in side.commands:
                body.append(f"<p>{e(what)}</p><pre>{html.escape(cmd, quote=True)}</pre>")
        return _PAGE.format(title=e(self.headline()), body="\n".join(body))

    def write(self, out_dir: str | os.PathLike[str]) -> Path:
        """report.md and report.html into out_dir (atomically; either name already taken, by an
        earlier report or the user, is refused, parity.outdir); returns report.md's path."""
        out = Path(out_dir)
        with OutDir.open(out) as held:
            held.claim("report.html", "report.md")
            write_new(out / "report.html", self.html())
            write_new(out / "report.md", self.markdown())
        return out / "report.md"


# Markdown that text from a log could start: links and images ([x](u), ![x](u)), HTML and
# autolinks (<img>, <a>, <http://..>), code spans, emphasis, strikethrough, table cells, entities.
_MD_SPECIAL = re.compile(r"[\\`*~\[\]<>!#|&]|(?<![0-9A-Za-z])_|_(?![0-9A-Za-z])")
_MD_LINE_START = re.compile(r"^(\s*|\s*\d+)([-+=.)])")  # a list item or setext underline


def md_escape(text: str) -> str:
    """``text`` as one line of inert markdown: control characters shown escaped (printable: a
    ``\\r`` or ``\\n`` cannot start a line of its own, a heading), and every character that
    could make a link, image, HTML, code span, heading, emphasis or table cell backslash-escaped
    (an underscore inside a word stays: it makes nothing). Bare URLs stay text (GFM may still
    underline them, with the URL itself as their text)."""
    return _MD_SPECIAL.sub(lambda m: "\\" + m.group(), printable(text))


def _md_paragraph(text: str) -> str:
    """md_escape for a line of its own, which must not start a list item either."""
    return _MD_LINE_START.sub(lambda m: m.group(1) + "\\" + m.group(2), md_escape(text))


def _longest_run(text: str, ch: str) -> int:
    best = run = 0
    for c in text:
        run = run + 1 if c == ch else 0
        best = max(best, run)
    return best


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy"
 content="default-src 'none'; img-src data:; style-src 'unsafe-inline'">
<title>{title}</title>
<style>
body {{ font-family: sans-serif; margin: 1.5em; color: #222; }}
h1.aligned {{ color: #1a7f37; }} h1.diverged {{ color: #cf222e; }}
table {{ border-collapse: collapse; font-size: 13px; margin-bottom: 1em; }}
th, td {{ border: 1px solid #ccc; padding: 3px 6px; text-align: left; vertical-align: top; }}
td {{ font-family: monospace; overflow-wrap: break-word; }}
tr.diverged td, tr.missing td {{ background: #ffebe9; }}
tr#first-divergence td {{ background: #ffc1ba; font-weight: bold; }}
td.hit {{ outline: 2px solid #cf222e; }}
tr.ignored td {{ color: #888; }}
tr.differs td {{ background: #fff8c5; }}
pre {{ background: #f6f8fa; padding: 8px; white-space: pre-wrap; word-break: break-all; }}
img {{ max-width: 100%; }}
</style></head>
<body>
{body}
</body></html>
"""


def write_failure_report(out_dir: str | os.PathLike[str], headline: str, text: str) -> Path:
    """report.md and report.html for a command whose run failed, so that there is no comparison
    to show: the headline (which side, why) and ``text`` (the launch's account: where each rank
    waited, its log tails) as written; returns report.md's path. Names taken are refused, as
    ``Report.write``."""
    out = Path(out_dir)
    fence = "`" * max(3, _longest_run(text, "`") + 1)
    markdown = f"# parity: failed\n\n{_md_paragraph(headline)}\n\n{fence}text\n{text}\n{fence}\n"
    body = (
        '<h1 class="diverged">parity: failed</h1>'
        f"<p>{html.escape(printable(headline), quote=True)}</p>"
        f"<pre>{html.escape(text, quote=True)}</pre>"
    )
    with OutDir.open(out) as held:
        held.claim("report.html", "report.md")
        write_new(out / "report.html", _PAGE.format(title="parity: failed", body=body))
        write_new(out / "report.md", markdown)
    return out / "report.md"


def build_report(
    a: str | os.PathLike[str],
    b: str | os.PathLike[str],
    policies: Mapping[str, Policy | str] | None = None,
    *,
    labels: Sequence[str] = ("A", "B"),
    notes: Sequence[str] = (),
    fmt: str | None = None,
    run_a: str | None = None,
    run_b: str | None = None,
    duplicates: str = "error",
    allow_missing: bool = False,
    allow_incomplete: bool = False,
    allow_skipped: bool = False,
    at_source_precision: bool = False,
) -> Report:
    """What `parity report` does: both sides read and compared as `compare_runs` takes them
    (raises MetricsError / IncompleteRunError like it), and diagnosed; labels and notes are the
    report's."""
    side_a = load_side(a, labels[0], fmt, run=run_a, duplicates=duplicates)
    side_b = load_side(b, labels[1], fmt, run=run_b, duplicates=duplicates)
    comparison = compare_frames(
        side_a.frame,
        side_b.frame,
        policies,
        allow_missing=allow_missing,
        allow_incomplete=allow_incomplete,
        allow_skipped=allow_skipped,
        at_source_precision=at_source_precision,
    )
    diagnosis = diagnose(side_a.run_dir, side_b.run_dir, comparison)
    return Report(comparison, side_a, side_b, list(notes), diagnosis)


def write_report(
    a_dir_or_file: str | os.PathLike[str],
    b_dir_or_file: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    policies: Mapping[str, Policy | str] | None = None,
    **kwargs: Any,
) -> Path:
    """Compare two runs and write report.md and report.html; returns report.md's path.

    kwargs go to build_report (labels, notes, fmt, allow_missing, allow_incomplete).
    """
    return build_report(a_dir_or_file, b_dir_or_file, policies, **kwargs).write(out_dir)
