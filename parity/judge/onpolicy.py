"""`parity onpolicy`: is RL training on-policy? torchtitan's chain of three equalities, judged link
by link on what a PPO job wrote with --logprob-chain (`worker/onpolicy.py`):

    1  trainer, micro-batch size m  ==  trainer, micro-batch size n
    2  trainer                      ==  rollout engine, prefill of prompt + response
    3  rollout decode (KV cache)    ==  rollout engine, prefill

If all three hold bit for bit, the trainer's log-probs are the rollout's: training is exactly
on-policy. The first link that breaks is named with where: step, rank, sequence (the rank's
index), response token, both values and their distance in float32 ULPs, and, from the per-layer
fingerprints the job writes, the first decoder layer whose output differs there. Two more rows
are shown but not judged: the end-to-end gap (trainer vs decode, what the job's rollout/* metrics
measure) and the top-k/top-p term (the sampler's processed log-probs vs the raw ones).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from parity.judge.compare import ulp_distance
from parity.readers import MetricsError
from parity.readers.frame import steps_text

CHAIN_DIR = "onpolicy"
KINDS = ("decode", "processed", "prefill", "trainer_m", "trainer_n", "tokens")
LINKS = (
    ("1", "trainer m vs n", "trainer_m", "trainer_n"),
    ("2", "trainer vs rollout prefill", "trainer_m", "prefill"),
    ("3", "rollout decode vs prefill", "decode", "prefill"),
)
SHOWN = (
    ("e2e", "trainer vs rollout decode (end to end)", "trainer_m", "decode"),
    ("top-p", "processed vs raw decode (top-k/top-p term)", "processed", "decode"),
)
_FILE = re.compile(r"step(\d+)-rank(\d+)\.safetensors$")


class ChainError(MetricsError):
    """Chain files that cannot be judged (none, a rank missing, a sequence incomplete)."""


@dataclass
class Sequence:
    step: int
    rank: int
    index: int
    values: dict[str, np.ndarray]  # kind -> per response token (tokens: the token ids)
    layer_names: list[str] = field(default_factory=list)  # of the "layers:KIND" fingerprints


@dataclass
class Chain:
    folder: Path
    sequences: list[Sequence]
    meta: dict  # of the first file: m, n, temperature, top_k, top_p, batch_invariant, ...
    steps: list[int]


def load_chain(run_dir: str | Path) -> Chain:
    """Every step's and rank's chain file of a run folder; refuses a partial set."""
    from safetensors import safe_open

    folder = Path(run_dir) / CHAIN_DIR
    files = sorted(folder.glob("step*-rank*.safetensors")) if folder.is_dir() else []
    if not files:
        raise ChainError(
            f"{folder}: no chain files; run the job with its chain written (charcount-ppo: "
            "`parity onpolicy --task charcount-ppo --set 'overrides={logprob_chain: true}'`)"
        )
    found: dict[int, dict[int, Path]] = {}
    for f in files:
        m = _FILE.search(f.name)
        if m:
            found.setdefault(int(m.group(1)), {})[int(m.group(2))] = f
    sequences, meta = [], {}
    for step in sorted(found):
        for rank, path in sorted(found[step].items()):
            try:
                with safe_open(str(path), "np") as h:
                    file_meta = _meta((h.metadata() or {})["meta"])
                    tensors = {k: h.get_tensor(k) for k in h.keys()}  # noqa: SIM118
            except Exception as e:  # a cut or foreign file: say which
                raise ChainError(f"{path}: not a chain file ({type(e).__name__}: {e})") from None
            meta = meta or file_meta
            sequences += _sequences(path, step, rank, file_meta, tensors)
        world = int(meta.get("world", 1))
        missing = sorted(set(range(world)) - set(found[step]))
        if missing:
            raise ChainError(
                f"{folder}: step {step} has no file of rank(s) {missing} (world {world}); "
                "no verdict from a partial read"
            )
    steps = sorted(found)
    gaps = sorted(set(range(steps[0], steps[-1] + 1)) - set(steps))
    if gaps:
        raise ChainError(f"{folder}: no file of step(s) {gaps}; no verdict from a partial read")
    return Chain(folder, sequences, meta, steps)


def _meta(text: str) -> dict[str, Any]:
    """A chain file's meta: a JSON object whose counts are integers, or the file is none of
    worker/onpolicy.py's (a ValueError, which load_chain names as such)."""
    meta = json.loads(text)
    if not isinstance(meta, dict):
        raise ValueError(f"its meta is a JSON {type(meta).__name__}, not an object")
    if "sequences" not in meta:
        raise ValueError("its meta has no 'sequences'")
    for key, least in (("sequences", 0), ("world", 1)):
        v = meta.get(key, least)
        if isinstance(v, bool) or not isinstance(v, int) or v < least:
            raise ValueError(f"its meta's {key!r} is {v!r}, not an integer >= {least}")
    if not isinstance(meta.get("layers", []), list):
        raise ValueError("its meta's 'layers' is no list")
    return meta


def _sequences(path: Path, step: int, rank: int, meta: dict, tensors: dict) -> list[Sequence]:
    out = []
    for i in range(int(meta["sequences"])):
        values = {}
        for kind in KINDS:
            key = f"{kind}/{i}"
            if key not in tensors:
                raise ChainError(f"{path}: sequence {i} has no {kind!r} log-probs")
            values[kind] = tensors[key]
        for kind in KINDS[:-1]:  # per-layer fingerprints, where the job wrote them
            key = f"layers/{kind}/{i}"
            if key in tensors:
                values[f"layers:{kind}"] = tensors[key]
        if any(np.ndim(v) == 0 for v in values.values()):
            raise ChainError(f"{path}: sequence {i}: a kind holds a scalar, not one per token")
        lengths = {len(v) for v in values.values()}
        if len(lengths) != 1:
            raise ChainError(f"{path}: sequence {i}: the kinds differ in length {sorted(lengths)}")
        out.append(Sequence(step, rank, i, values, list(meta.get("layers", []))))
    return out


@dataclass
class LinkResult:
    key: str
    name: str
    a: str
    b: str
    tokens: int = 0
    differing: int = 0
    max_abs: float = 0.0
    max_ulp: int = 0
    first: dict | None = None  # where the first token beyond the allowed ULPs is
    judged: bool = True
    allowed_ulp: int = 0

    @property
    def ok(self) -> bool:
        return self.first is None

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in (
            "key", "name", "a", "b", "tokens", "differing", "max_abs", "max_ulp", "first",
            "judged", "ok")}  # fmt: skip


@dataclass
class ChainResult:
    chain: Chain
    links: list[LinkResult] = field(default_factory=list)

    @property
    def broken(self) -> LinkResult | None:
        """The first judged link that breaks, in the chain's order."""
        return next((r for r in self.links if r.judged and not r.ok), None)

    @property
    def ok(self) -> bool:
        return self.broken is None

    def verdict(self) -> str:
        judged = [r for r in self.links if r.judged]
        if self.ok:
            tokens = judged[0].tokens if judged else 0
            tol = "bit for bit" if not judged or not judged[0].allowed_ulp else (
                f"within {judged[0].allowed_ulp} ULP")  # fmt: skip
            return f"on-policy: every link holds {tol} on {tokens} response tokens"
        r = self.broken
        f = r.first
        return (
            f"first broken link: {r.key} ({r.name}) at step {f['step']}, rank {f['rank']}, "
            f"sequence {f['sequence']}, response token {f['token']} (id {f['token_id']}): "
            f"{r.a} {f['a']!r} vs {r.b} {f['b']!r} ({f['ulp']} ULP)"
            + (f"; first differing layer: {f['layer']}" if "layer" in f else "")
        )

    def table(self) -> str:
        m = self.chain.meta
        mode = "batch-invariant" if m.get("batch_invariant") else "default"
        head = (
            f"on-policy chain of {self.chain.folder.parent} ({mode} mode, trainer "
            f"{m.get('trainer')}, m={m.get('m')} n={m.get('n')}, temperature "
            f"{m.get('temperature')}, top-k {m.get('top_k')}, top-p {m.get('top_p')}; steps "
            f"{steps_text(self.chain.steps)}, world {m.get('world')})"
        )
        rows = [("link", "tokens", "differ", "frac", "max |diff|", "max ULP", "first difference")]
        for r in self.links:
            frac = r.differing / r.tokens if r.tokens else 0.0
            where = "-" if r.first is None else (
                f"step {r.first['step']} rank {r.first['rank']} seq {r.first['sequence']} "
                f"token {r.first['token']}")  # fmt: skip
            if r.first is not None and "layer" in r.first:
                where += " " + r.first["layer"].split(":")[0]
            label = f"{r.key} {r.name}" + ("" if r.judged else " (shown)")
            rows.append((label, str(r.tokens), str(r.differing), f"{frac:.4f}",
                         f"{r.max_abs:.3g}", str(r.max_ulp), where))  # fmt: skip
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines = [head] + ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
                          for row in rows]  # fmt: skip
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "ok": self.ok,
            "verdict": self.verdict(),
            "meta": self.chain.meta,
            "steps": self.chain.steps,
            "links": [r.to_dict() for r in self.links],
        }


def judge_chain(chain: Chain, max_ulp: int = 0) -> ChainResult:
    """Each link over every response token; a token breaks a link when its float32 log-probs are
    more than max_ulp ULPs apart (0: any bit)."""
    result = ChainResult(chain)
    for judged, specs in ((True, LINKS), (False, SHOWN)):
        for key, name, a, b in specs:
            r = LinkResult(key, name, a, b, judged=judged, allowed_ulp=max_ulp)
            for s in chain.sequences:
                _judge_sequence(r, s, max_ulp)
            result.links.append(r)
    return result


def _judge_sequence(r: LinkResult, s: Sequence, max_ulp: int) -> None:
    va = s.values[r.a].astype(np.float32)
    vb = s.values[r.b].astype(np.float32)
    ulp = ulp_distance(va, vb, np.float32)
    r.tokens += len(va)
    r.differing += int((ulp > 0).sum())
    if len(va):
        diff = np.abs(va.astype(np.float64) - vb.astype(np.float64))
        r.max_abs = max(r.max_abs, float(np.nan_to_num(diff, nan=np.inf).max()))
        r.max_ulp = max(r.max_ulp, int(ulp.max()))
    beyond = np.flatnonzero(ulp > max_ulp)
    if r.first is None and len(beyond):
        t = int(beyond[0])
        r.first = {
            "step": s.step, "rank": s.rank, "sequence": s.index, "token": t,
            "token_id": int(s.values["tokens"][t]), "a": float(va[t]), "b": float(vb[t]),
            "ulp": int(ulp[t]),
        }  # fmt: skip
        layer = _first_layer(s, r.a, r.b, t)
        if layer is not None:
            r.first["layer"] = layer


def _first_layer(s: Sequence, a: str, b: str, token: int) -> str | None:
    """The first layer whose output (fingerprinted at the position predicting `token`) differs
    between kinds a and b; None without fingerprints (the processed log-probs have none)."""
    fa, fb = s.values.get(f"layers:{a}"), s.values.get(f"layers:{b}")
    if fa is None or fb is None:
        return None
    differ = np.flatnonzero(fa[token] != fb[token])
    if not len(differ):
        return "none: every layer's output is equal, so the lm_head or the log-softmax"
    k = int(differ[0])
    return s.layer_names[k] if k < len(s.layer_names) else f"layer {k}"
