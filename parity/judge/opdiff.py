"""The first operation where two traced steps differ (ops/rank{r}.jsonl, parity.record.optrace).

Both run folders traced the same step (a job's ``--trace-step K``, a loop's ``trace_ops``). The two
op streams are aligned per phase and module path: within one (phase, module) the sequences of op
names are matched with difflib (longest common runs), so an op only one side runs (a refactor that
adds, splits or fuses ops) is a *structural* difference and does not shift the ops after it; the
matched pairs are compared by output hash in A's order (a pair whose outputs differ in shape is
two structural ops: other computations under one op name). The first pair whose outputs differ is
named with the max ULP distance over its output's elements (when both sides kept the values) and
whether its inputs were equal:

- inputs equal (or only a one-element input, a scalar, differs): the difference is born in this op
  (or in the scalar it was given: both values are quoted);
- other inputs differ and ops only one side has come before it: the difference comes from those
  ops (structural), this op only carries it on;
- other inputs differ and nothing structural before: they were already different when the step
  began (weights, data) or came from code the trace did not see.

torch is imported only to read the kept values (the ULP distance).
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from parity.readers import MetricsError
from parity.record.runfolder import (
    OP_VALUES_SUFFIX,
    OPS_DIR,
    is_collective,
    numbered_files,
    ops_dir,
)

_TENSOR = re.compile(r"^[0-9a-f]{16}$")  # a tensor input's hash; else a scalar ("float32=0.5",
# a one-element tensor) or another argument's repr
_ONE_ELEMENT = re.compile(r"^[a-z0-9_]+=")  # a one-element tensor ("float32=0.5")
_TO_PYTHON = (["aten", "_local_scalar_dense"], ["aten", "item"], ["aten", "is_nonzero"],
              ["aten", "equal"])  # fmt: skip
MAX_STRUCTURAL = 20  # ops only one side has, kept in the result


class OpTraceError(MetricsError):
    """An ops/ file that cannot be read; the message names the file and line."""


def _first_line(e: BaseException) -> str:
    """An error's first line, without the terminal colours torch's loader puts in it."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e)).strip()
    return text.splitlines()[0].strip() if text else type(e).__name__


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _op_problem(rec: dict[str, Any]) -> str:
    """What makes a record no op record ("" for a good one): the fields the diff reads, with
    the types the tracer writes them in."""
    missing = [k for k in ("i", "phase", "module", "op", "n", "out", "in") if k not in rec]
    if missing:
        return f"no {', '.join(map(repr, missing))}"
    if not (_is_int(rec["i"]) and _is_int(rec["n"])):
        return "'i' and 'n' must be integers"
    if not all(isinstance(rec[k], str) for k in ("phase", "module", "op")):
        return "'phase', 'module' and 'op' must be strings"
    if not isinstance(rec["out"], list) or not all(
        h is None or isinstance(h, str) for h in rec["out"]
    ):
        return "'out' must be a list of hashes"
    if not isinstance(rec["in"], list) or not all(isinstance(x, str) for x in rec["in"]):
        return "'in' must be a list of strings"
    for key in ("scalars", "later"):
        listed = rec.get(key)
        if listed is not None and not (
            isinstance(listed, list) and all(v is None or isinstance(v, str) for v in listed)
        ):
            return f"{key!r} must be a list of strings or nulls"
    shapes = rec.get("shapes")
    if shapes is not None and not (
        isinstance(shapes, list)
        and all(isinstance(s, list) and all(_is_int(d) for d in s) for s in shapes)
    ):
        return "'shapes' must be a list of lists of integers"
    if rec.get("src") is not None and not isinstance(rec["src"], str):
        return "'src' must be a string"
    return ""


def _end_problem(rec: dict[str, Any]) -> str:
    """What makes an end record unusable ("" for a good one)."""
    if not _is_int(rec.get("step")):
        return "'step' must be an integer"
    seconds, ops = rec.get("seconds"), rec.get("ops")
    if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, (int, float))):
        return "'seconds' must be a number"
    if ops is not None and not _is_int(ops):
        return "'ops' must be an integer"
    return ""


def read_ops(path: Path) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """The op records of one rank's trace and its end record (None: the trace was cut off).

    OpTraceError, one line naming the file and line, for anything the tracer does not write."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise OpTraceError(f"{path}: cannot read: {e}") from None
    out, end = [], None
    for lineno, line in enumerate(lines, 1):
        try:
            rec = json.loads(line)
        except RecursionError:
            raise OpTraceError(f"{path}:{lineno}: not valid JSON: nested too deeply") from None
        except ValueError as e:
            raise OpTraceError(f"{path}:{lineno}: not valid JSON: {e}") from None
        if not isinstance(rec, dict):
            raise OpTraceError(f"{path}:{lineno}: not an op record (not a JSON object)")
        if rec.get("event") == "end":
            problem = _end_problem(rec)
            if problem:
                raise OpTraceError(f"{path}:{lineno}: bad end record ({problem})")
            end = rec
            continue
        problem = _op_problem(rec)
        if problem:
            raise OpTraceError(f"{path}:{lineno}: not an op record ({problem})")
        out.append(rec)
    return out, end


def trace_ranks(run_dir: Path | None) -> dict[int, Path]:
    return {} if run_dir is None else numbered_files(ops_dir(run_dir))


def where(rec: dict[str, Any]) -> str:
    """'backward model.layers.1.mlp aten.mm.default #2' (#n: the op's occurrence there)."""
    module = rec["module"] or "(top level)"
    return f"{rec['phase']} {module} {rec['op']} #{rec['n']}"


def _at(op: dict[str, Any]) -> str:
    """' at FILE:LINE' where an op (a record, or what the diff keeps of one) has its source."""
    return f" at {op['src']}" if op.get("src") else ""


def _shapes(shapes: list[list[int]]) -> str:
    return ", ".join("[" + ", ".join(map(str, shape)) + "]" for shape in shapes)


def ulp_distance(a, b) -> int | None:
    """Max ULP distance over the elements of two float tensors of one shape and dtype."""
    import torch

    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return None  # a values file holds what torch.load gives, not always tensors
    if a.shape != b.shape or a.dtype != b.dtype or not a.is_floating_point():
        return None
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}.get(a.element_size())
    if ints is None or a.layout != torch.strided or b.layout != torch.strided:
        return None  # float8, sparse: no ULP line here
    bits = a.element_size() * 8

    def ordered(t):  # two's complement bits -> a monotonic integer line (-0.0 == +0.0)
        i = t.contiguous().view(ints).to(torch.int64)
        if bits == 64:
            return torch.where(i < 0, -(i & 0x7FFFFFFFFFFFFFFF), i)
        return torch.where(i < 0, -(i & ((1 << (bits - 1)) - 1)), i)

    if a.numel() == 0:
        return 0
    return int((ordered(a) - ordered(b)).abs().max())


@dataclass
class OpDiff:
    """Where A's and B's traces of one step first differ: an op, or ops only one side has."""

    status: Literal["same", "differ", "structural", "unavailable"] = "unavailable"
    step: int | None = None
    rank: int | None = None
    ops_compared: int = 0
    first: dict[str, Any] | None = None  # the first matched op whose output differs
    origin: Literal["born here", "scalar argument", "structural", "collective", "inputs", None] = (
        None
    )
    structural: list[dict[str, Any]] = field(default_factory=list)  # first MAX_STRUCTURAL
    structural_count: int = 0
    # ops whose outputs differ where the difference does not last (every op taking it makes
    # values the other side holds) or each value is the other side's elsewhere: not the first
    undone: list[dict[str, Any]] = field(default_factory=list)  # first MAX_STRUCTURAL
    undone_count: int = 0
    # ranks whose first difference came through a collective from another rank (rank order)
    through_collective: list[int] = field(default_factory=list)
    cost: dict[str, dict[str, Any]] = field(default_factory=dict)  # side -> trace time, size
    detail: str = ""
    errors: list[str] = field(default_factory=list)  # a values file that could not be read

    def line(self) -> str:
        if self.status == "unavailable":
            return f"op trace: {self.detail}" if self.detail else ""
        at = f"step {self.step} (rank {self.rank})"
        extra = ""
        if self.structural_count:
            first = self.structural[0]
            extra = (
                f"; {self.structural_count} ops only one side runs, first {first['side']} only: "
                f"{where(first)}"
            )
        if self.undone_count:
            extra += (
                f"; {self.undone_count} earlier ops differ without lasting (undone later), "
                f"first {self.undone[0]['where']}"
            )
        others = [r for r in self.through_collective if r != self.rank]
        if others:
            ranks = f"rank {others[0]} differs" if len(others) == 1 else (
                f"ranks {', '.join(map(str, others))} differ")  # fmt: skip
            extra += f"; {ranks} only through a collective"
        if self.status == "same":
            return f"every op of {at} identical ({self.ops_compared} ops compared){extra}"
        if self.status == "structural" and self.undone_count:
            return f"no difference lasts at {at} ({self.ops_compared} ops compared){extra}"
        if self.status == "structural":
            return f"ops of {at} differ only in structure, no common op's output differs{extra}"
        f = self.first
        assert f is not None
        ulp = f"max {f['ulp']} ULP" if f["ulp"] is not None else "ULP not kept"
        text = f"first differing op at {at}: {f['where']}{_at(f)} ({ulp}"
        if self.origin == "born here":
            return text + "; inputs equal: the difference is born here)" + extra
        if self.origin == "scalar argument":
            return text + f"; only a scalar input differs: {f['scalar']})" + extra
        differ = (
            f"; its inputs differ ({f['scalar']})" if f.get("scalar") else "; its inputs differ"
        )
        source, via = f.get("source"), f.get("via")
        if source:
            made = f" making {_shapes(source['shapes'])}" if source.get("shapes") else ""
            text += f"{differ}, from an op only {source['side']} runs: {source['where']}"
            text += f"{made}{_at(source)})"
        elif self.origin == "structural":
            text += f"{differ}, after ops only one side runs: the difference comes from those)"
        elif self.origin == "collective":
            text += f"{differ} as the collective {via['where']}{_at(via)} returned them: "
            text += (
                "another rank sent other values)"
                if self.rank not in self.through_collective
                else "no traced rank's own ops differ before it, so the collective itself does "
                "(its reduction order or algorithm), or a rank not traced)"
            )
        elif via and via.get("collective"):  # fed this rank's own differing values
            text += f"{differ} as the collective {via['where']}{_at(via)} returned them from this "
            text += "rank's own, which differ already: weights, data or code outside the trace)"
        elif via:
            text += (
                f"{differ}, made by {via['where']}{_at(via)}, an op the comparison did not pair)"
            )
        else:
            text += "; its inputs already differ: weights, data or code outside the trace)"
        return text + extra

    def cost_line(self) -> str:
        """What tracing the step cost each side (rank shown): seconds inside it, ops, bytes."""
        parts = [
            f"{side} {c['seconds']:.1f} s, {c['ops']} ops, {c['bytes'] / 2**20:.1f} MiB"
            for side, c in sorted(self.cost.items())
            if c.get("seconds") is not None
        ]
        return f"op trace cost (rank {self.rank}): " + "; ".join(parts) if parts else ""

    def to_dict(self) -> dict[str, Any]:
        return {**vars(self), "line": self.line(), "cost_line": self.cost_line()}


def _load_values(path: Path) -> dict:
    """The kept output values beside a trace ({} when there are none); OpTraceError naming the
    file when it cannot be read."""
    import torch

    pt = path.with_suffix(OP_VALUES_SUFFIX)
    if not pt.is_file():
        return {}
    try:
        values = torch.load(pt, weights_only=True)
    except Exception as e:  # a damaged file fails anywhere in torch's loader, in any class
        raise OpTraceError(f"{pt}: unreadable ({type(e).__name__}: {_first_line(e)})") from None
    if not isinstance(values, dict):
        raise OpTraceError(f"{pt}: unreadable (not a dict of tensors)")
    return values


def _tensor_inputs(rec: dict[str, Any]) -> list[str]:
    """Its inputs of more than one element, by hash."""
    return [x for x in rec["in"] if _TENSOR.match(x)]


def _top_level(rec: dict[str, Any]) -> bool:
    """An op of the step's own code: in no module and on no one parameter (a loss, a batch's
    packing, a foreach over every gradient), ``scope:`` alone inside a scoped trace."""
    return not rec["module"].rpartition(":")[2]


def _keys(rec: dict[str, Any], j: int) -> set[str]:
    """How later ops' inputs show output j: its hash, a one-element output's dtype=value, what
    the first op to take an output recorded without hash saw."""
    keys = {rec["out"][j]} if rec["out"][j] else set()
    for listed in (rec.get("scalars"), rec.get("later")):
        if listed and j < len(listed) and listed[j]:
            keys.add(listed[j])
    return keys


class _Flow:
    """One side's trace as values flowing from op to op (inputs and outputs matched by hash,
    one-element tensors by dtype=value), against what the other side holds (`both`)."""

    def __init__(self, records: list[dict[str, Any]]):
        self.records = records
        self.position = {id(r): k for k, r in enumerate(records)}
        self.takers: dict[str, list[int]] = {}
        self.makers: dict[str, list[int]] = {}
        for k, r in enumerate(records):
            for x in set(r["in"]):
                self.takers.setdefault(x, []).append(k)
            for j in range(len(r["out"])):
                for key in _keys(r, j):
                    self.makers.setdefault(key, []).append(k)
        # every value this side holds: what its ops made and the tensors they took
        self.held = set(self.makers) | {
            x for x in self.takers if _TENSOR.match(x) or _ONE_ELEMENT.match(x)
        }
        self.other: set[str] = set()  # what the other side holds

    @staticmethod
    def both(ra: list[dict[str, Any]], rb: list[dict[str, Any]]) -> tuple[_Flow, _Flow]:
        """A's and B's flows, each against what the other holds."""
        a, b = _Flow(ra), _Flow(rb)
        a.other, b.other = b.held, a.held
        return a, b

    def made(self, key: str, before: int) -> int | None:
        """The position of the last op before `before` that made the value `key`."""
        found = [k for k in self.makers.get(key, ()) if k < before]
        return found[-1] if found else None

    def source(self, rec: dict[str, Any], keys: set[str], only: set[int]):
        """The latest op only this side runs (positions `only`) that the values `keys` taken
        by `rec` come from; None when they come from outside the trace."""
        return self.back(rec, keys, only.__contains__)

    def collective(self, rec: dict[str, Any], keys: set[str]):
        """The latest collective that the values `keys` taken by `rec` come from, whose own
        tensor inputs on this rank the other side holds too: what another rank sent; None when
        none is on their path (a collective fed this rank's own differing values, an FSDP
        all-gather of a differing shard, only carries them: the walk goes on past it)."""

        def sent(k: int) -> bool:
            rec = self.records[k]
            own = [x for x in rec["in"] if _TENSOR.match(x) or _ONE_ELEMENT.match(x)]
            return is_collective(rec["op"]) and all(x in self.other for x in own)

        return self.back(rec, keys, sent)

    def back(self, rec: dict[str, Any], keys: set[str], wanted, limit: int = 5000):
        """The latest op at a position `wanted` holds for that the values `keys` taken by
        `rec` come from, following back the ops that made them through values the other side
        does not hold, the latest first (the same answer on every run, whatever the order of a
        set); None when no such op is on their path."""
        at = self.position[id(rec)]
        todo = {k for key in keys if (k := self.made(key, at)) is not None}
        seen: set[int] = set()
        while todo and len(seen) < limit:
            k = max(todo)
            todo.discard(k)
            if wanted(k):
                return self.records[k]
            seen.add(k)
            for x in self.records[k]["in"]:
                if (_TENSOR.match(x) or _ONE_ELEMENT.match(x)) and x not in self.other:
                    maker = self.made(x, k)
                    if maker is not None and maker not in seen:
                        todo.add(maker)
        return None

    def lasting(self, rec: dict[str, Any], j: int, scalars: set[str] = frozenset(),
                limit: int = 5000) -> bool:  # fmt: skip
        """Whether output j of `rec`, a value the other side does not hold, reaches the step's
        end as a difference: an op that takes it later makes a value the other side does not
        hold (followed; a collective's or a view's result through what the op after it took),
        or one the trace cannot follow, or no op takes it (it leaves the step). False when
        every op that takes it makes only values the other side holds (the difference is
        undone: a loss gradient scaled by 2 and divided by 128 where the other side divides by
        64) or turns it into a Python number (a logged value, which the metrics judge, or a
        later op's scalar input, where that op differs).

        `scalars`: the scalar inputs in which `rec` differs from its counterpart. Autograd takes
        a forward op's scalar into its backward, not the forward's output: a one-element
        tensor is followed to every op that takes it, a Python number (which many ops take as
        a size or a dimension) to the later ops of the same name that take it (the backward of
        ``x * 2`` is ``grad * 2``)."""
        start = self.position[id(rec)]
        users = {k for key in _keys(rec, j) for k in self.takers.get(key, ()) if k > start}
        for u in scalars:
            same_op = not _ONE_ELEMENT.match(u)
            users |= {k for k in self.takers.get(u, ()) if k > start and
                      (not same_op or self.records[k]["op"] == rec["op"])}  # fmt: skip
        if not users:
            return True  # it leaves the step
        seen: set[int] = set()
        while users:
            if len(seen) > limit:
                return True  # too far to follow: kept
            k = min(users)
            users.discard(k)
            if k in seen:
                continue
            seen.add(k)
            user = self.records[k]
            if user["op"].split(".")[:2] in _TO_PYTHON:
                continue  # a Python number: a metric, or a later op's scalar input
            if not user["out"]:
                return True  # changed in place (a foreach op), not followed
            collective = is_collective(user["op"])
            for i in range(len(user["out"])):
                keys = _keys(user, i)
                if not keys and collective:
                    continue  # a wait, a wrapper: the result goes on through one's `later`
                if not keys:
                    return True  # an output the trace cannot follow
                if keys & self.other:
                    continue
                takers = {t for key in keys for t in self.takers.get(key, ()) if t > k}
                if not takers:
                    return True  # a value the other side does not hold leaves the step
                users |= takers
        return False


def _same_computation(x: dict[str, Any], y: dict[str, Any]) -> bool:
    """Whether two ops aligned by name compute one thing, so that their outputs are compared.
    Not when their outputs differ in shape (traces that record it: zeros of another size, a
    gradient shard laid out on another dimension). Nor, for top-level code, when their tensor
    inputs differ: two implementations of a step share op names, not positions (a module's
    ops come from the module's code, a top-level op from whichever code the side runs), so a
    top-level op is compared only on the same tensors, where a difference is born or comes
    from a scalar; one that carries a difference from elsewhere is not compared."""
    sx, sy = x.get("shapes"), y.get("shapes")
    if sx is not None and sy is not None and sx != sy:
        return False
    return not _top_level(x) or _tensor_inputs(x) == _tensor_inputs(y)


def _compare_rank(pa: Path, pb: Path, out: OpDiff) -> bool:
    """Compare one rank's traces into `out`; True when something differs."""
    ra, ea = read_ops(pa)
    rb, eb = read_ops(pb)
    for side, end, path in (("a", ea, pa), ("b", eb, pb)):
        if end is None:
            raise OpTraceError(f"{path}: no end record (the traced step did not finish)")
        values = path.with_suffix(OP_VALUES_SUFFIX)
        size = path.stat().st_size + (values.stat().st_size if values.is_file() else 0)
        out.cost[side] = {"seconds": end.get("seconds"), "ops": end.get("ops"), "bytes": size}
    if ea.get("step") != eb.get("step"):
        out.detail = f"a traced step {ea.get('step')}, b step {eb.get('step')}: not comparable"
        return False
    out.step = ea.get("step")
    groups: dict[tuple[str, str], tuple[list, list]] = {}
    for side, recs in ((0, ra), (1, rb)):
        for r in recs:
            groups.setdefault((r["phase"], r["module"]), ([], []))[side].append(r)
    pairs, only = [], []
    carried = []  # the step's own ops aligned by name whose tensor inputs differ
    for ga, gb in groups.values():
        sm = difflib.SequenceMatcher(None, [r["op"] for r in ga], [r["op"] for r in gb], False)
        for tag, i1, i2, j1, j2 in sm.get_opcodes():
            if tag == "equal":
                for x, y in zip(ga[i1:i2], gb[j1:j2], strict=True):
                    if _same_computation(x, y):
                        pairs.append((x, y))
                    elif x.get("shapes") != y.get("shapes"):  # other computations
                        only += [("a", x), ("b", y)]
                    else:
                        carried.append((x, y))
            else:
                only += [("a", r) for r in ga[i1:i2]] + [("b", r) for r in gb[j1:j2]]
    pairs.sort(key=lambda p: p[0]["i"])
    carried.sort(key=lambda p: p[0]["i"])
    out.ops_compared = len(pairs)
    flow_a, flow_b = _Flow.both(ra, rb)

    def first_lasting(candidates: list[tuple[dict, dict]]) -> tuple[dict, dict, int] | None:
        """The first pair whose outputs differ and the difference lasts; the others counted."""
        for x, y in candidates:
            if len(x["out"]) != len(y["out"]):
                return x, y, 0
            for j, (hx, hy) in enumerate(zip(x["out"], y["out"], strict=True)):
                if hx is None or hy is None or hx == hy:
                    continue
                scalars = [
                    (u, v)
                    for u, v in zip(x["in"], y["in"], strict=False)
                    if u != v and not (_TENSOR.match(u) or _TENSOR.match(v))
                ]
                kept = (
                    hx not in flow_a.other and flow_a.lasting(x, j, {u for u, _ in scalars})
                ) or (hy not in flow_b.other and flow_b.lasting(y, j, {v for _, v in scalars}))
                if kept:
                    return x, y, j
                out.undone_count += 1  # undone later, or each value is the other's elsewhere
                if len(out.undone) < MAX_STRUCTURAL:
                    out.undone.append({"where": where(x), "a_index": x["i"], "b_index": y["i"]})
        return None

    # the step's own ops on other tensors only where nothing else differs: a loop with no
    # module (its data differs from the start), never before a difference the model shows
    first = first_lasting(pairs) or first_lasting(carried)
    # structural ops in stream order (each side's own index)
    only.sort(key=lambda s: s[1]["i"])
    out.structural_count = len(only)
    out.structural = [
        {"side": s, **{k: r[k] for k in ("phase", "module", "op", "n", "i")}, "src": r.get("src")}
        for s, r in only[:MAX_STRUCTURAL]
    ]
    if first is None:
        out.status = "structural" if only or out.undone_count else "same"
        return bool(only)
    x, y, j = first
    ulp = None
    try:
        va, vb = _load_values(pa), _load_values(pb)
    except OpTraceError as e:  # the op is still named, without its ULP distance
        va, vb = {}, {}
        out.errors.append(str(e))
    key_a, key_b = f"{x['i']}.{j}", f"{y['i']}.{j}"
    if key_a in va and key_b in vb:
        try:
            ulp = ulp_distance(va[key_a], vb[key_b])
        except RuntimeError:  # a tensor torch cannot view as integers (meta, quantized)
            ulp = None
    src = (
        x.get("src")
        if x.get("src") == y.get("src")
        else (f"{x.get('src')} vs {y.get('src')}" if x.get("src") or y.get("src") else None)
    )
    out.first = {
        "where": where(x),
        "phase": x["phase"],
        "module": x["module"],
        "op": x["op"],
        "n": x["n"],
        "src": src,
        "ulp": ulp,
        "inputs_equal": x["in"] == y["in"],
        "a_index": x["i"],
        "b_index": y["i"],
        "scalar": None,
    }
    differing = [(u, v) for u, v in zip(x["in"], y["in"], strict=False) if u != v]
    if len(x["in"]) != len(y["in"]):
        differing.append(("?", "?"))
    before = any(r["i"] < (x["i"] if s == "a" else y["i"]) for s, r in only)
    if not any(_TENSOR.match(u) or _TENSOR.match(v) for u, v in differing):
        out.first["scalar"] = ", ".join(f"{u} vs {v}" for u, v in differing[:3]) or None
    # a one-element input some op of the trace made carries a difference from before
    made = any(flow_a.made(u, flow_a.position[id(x)]) is not None for u, _ in differing)
    if not differing:
        out.origin = "born here"
    elif out.first["scalar"] and not made:
        out.origin = "scalar argument"
    else:
        out.origin = "structural" if before else "inputs"
        _trace_back(out, (("a", flow_a, x, {u for u, _ in differing}),
                          ("b", flow_b, y, {v for _, v in differing})), only)  # fmt: skip
    out.status = "differ"
    return True


def _trace_back(out: OpDiff, sides: tuple, only: list[tuple[str, dict[str, Any]]]) -> None:
    """Where the differing inputs of `out.first` come from, into `out`: the latest op only one
    side runs on their path (`source`); else the latest collective on it (origin "collective":
    another rank's values); else the op of the trace that made them, one the comparison did
    not pair (`via`)."""
    for side, flow, rec, keys in sides:
        positions = {flow.position[id(r)] for s, r in only if s == side}
        source = flow.source(rec, keys, positions)
        if source is not None:
            out.first["source"] = {"side": side, "where": where(source), "src": source.get("src"),
                                   "shapes": source.get("shapes")}  # fmt: skip
            return
    for side, flow, rec, keys in sides:
        collective = flow.collective(rec, keys)
        if collective is not None:
            out.origin = "collective"
            out.first["via"] = {"side": side, "where": where(collective),
                                "src": collective.get("src")}  # fmt: skip
            return
    for side, flow, rec, keys in sides:
        at = flow.position[id(rec)]
        makers = [k for key in keys if (k := flow.made(key, at)) is not None]
        if makers:
            maker = flow.records[max(makers)]
            out.first["via"] = {"side": side, "where": where(maker), "src": maker.get("src"),
                                "collective": is_collective(maker["op"])}  # fmt: skip
            return


def compare_ops(a_dir: Path | None, b_dir: Path | None) -> OpDiff:
    """Compare the op traces of two run folders, rank by rank; the lowest rank that differs."""
    out = OpDiff()
    ta, tb = trace_ranks(a_dir), trace_ranks(b_dir)
    if not ta and not tb:
        return out
    if not ta or not tb:
        out.detail = (
            f"no {OPS_DIR}/ trace in {'a' if not ta else 'b'} (the recorder writes it: "
            "with trace_ops(out, step=K, model=model) around step K)"
        )
        return out
    common = sorted(set(ta) & set(tb))
    if not common:
        out.detail = "no rank traced on both sides"
        return out
    through: list[OpDiff] = []  # ranks whose first difference another rank sent them
    for rank in common:
        result = OpDiff(rank=rank)
        try:
            differs = _compare_rank(ta[rank], tb[rank], result)
        except OpTraceError:
            if not through:
                raise
            break  # a lower rank's finding stands; this rank's trace cannot add to it
        if differs and result.origin == "collective":
            through.append(result)
            continue
        if differs or result.detail or (rank == common[-1] and not through):
            result.through_collective = [r.rank for r in through]
            return result
    # every traced rank that differs has it from a collective: the lowest one, named so
    first = through[0]
    first.through_collective = [r.rank for r in through]
    return first
