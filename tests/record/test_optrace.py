"""Op-level traces of one step (parity.record.optrace) and the first op that differs
(parity.judge.opdiff): fast tests on a toy loop, `parity` tests on worker vs worker + a mutant."""

from __future__ import annotations

import json

import pytest

from parity.judge.opdiff import compare_ops, ulp_distance
from parity.spec import JobSpec
from tests.specs import SEQ_MEAN

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from parity.record import trace_ops  # noqa: E402


class Block(torch.nn.Module):
    def __init__(self, fused: bool = True, scale: float = 1.0):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.fused, self.scale = fused, scale

    def forward(self, x):
        if self.fused:
            h = F.linear(x, self.proj.weight, self.proj.bias)
        else:  # the same linear as matmul + add: other ops, maybe other bits
            h = x @ self.proj.weight.t() + self.proj.bias
        return self.norm(torch.relu(h) * self.scale)


def _step(out, model: torch.nn.Module, loss_scale: float = 1.0) -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with trace_ops(out, 1, model, rank=0):
        loss = model(x).pow(2).mean() * loss_scale
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()


def _model(**kw) -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(Block(**kw), Block())


def test_same_step_traces_identical(tmp_path):
    _step(tmp_path / "a", _model())
    _step(tmp_path / "b", _model())
    d = compare_ops(tmp_path / "a", tmp_path / "b")
    assert d.status == "same" and d.ops_compared > 50 and d.structural_count == 0, d.line()
    assert d.cost["a"]["ops"] == d.ops_compared and d.cost["a"]["bytes"] > 0


def test_scaled_activation_is_born_in_its_module(tmp_path):
    _step(tmp_path / "a", _model())
    _step(tmp_path / "b", _model(scale=1.0000001))
    d = compare_ops(tmp_path / "a", tmp_path / "b")
    f = d.first
    assert (d.status, d.origin, f["phase"], f["module"], f["op"]) == (
        "differ",
        "scalar argument",
        "forward",
        "0",
        "aten.mul.Tensor",
    ), d.line()
    line = Block.forward.__code__.co_firstlineno + 5  # `return self.norm(... * self.scale)`
    assert f["src"].endswith(f"test_optrace.py:{line}") and f["ulp"] >= 1
    assert "first differing op at step 1 (rank 0): forward 0 aten.mul.Tensor #0" in d.line()


def test_fused_linear_is_structural_not_a_false_first_op(tmp_path):
    _step(tmp_path / "a", _model(fused=True))
    _step(tmp_path / "b", _model(fused=False))
    d = compare_ops(tmp_path / "a", tmp_path / "b")
    ops = {(s["side"], s["op"]) for s in d.structural if s["module"] == "0"}
    assert ("a", "aten.addmm.default") in ops and ("b", "aten.mm.default") in ops, d.structural
    # bitwise the same: only structure differs; otherwise the first common op that differs is
    # carried, never "born here"
    assert d.status == "structural" or d.origin == "structural", d.line()
    assert "only one side runs, first" in d.line()


class GatedMLP(torch.nn.Module):
    """gate and up read the same input (as in Llama's MLP): siblings whose backwards interleave."""

    def __init__(self, hook_gate: bool = False):
        super().__init__()
        self.gate, self.up, self.down = (torch.nn.Linear(8, 16), torch.nn.Linear(8, 16),
                                         torch.nn.Linear(16, 8))  # fmt: skip
        self.hook_gate = hook_gate

    def forward(self, x):
        g = self.gate(x)
        if self.hook_gate:  # a gradient hook: scales gate's output gradient in backward only
            g.register_hook(lambda grad: grad * 1.0000001)
        return self.down(F.silu(g) * self.up(x))


def test_backward_ops_of_sibling_modules_are_told_apart(tmp_path):
    """Both siblings are open in backward at once (ModTracker's view); the autograd node that
    runs names the module, so gate's gradient ops are gate's, not up's."""
    for name, hook in (("a", False), ("b", True)):
        torch.manual_seed(0)
        model = torch.nn.Sequential(GatedMLP(hook))
        with trace_ops(tmp_path / name, 1, model, rank=0):
            model(torch.randn(4, 8)).pow(2).mean().backward()
    lines = (tmp_path / "a" / "ops" / "rank0.jsonl").read_text().splitlines()[:-1]
    records = [json.loads(line) for line in lines]
    mms = [
        r["module"] for r in records if r["phase"] == "backward" and r["op"] == "aten.mm.default"
    ]
    assert sorted(mms) == ["0.down", "0.down", "0.gate", "0.up"], mms
    d = compare_ops(tmp_path / "a", tmp_path / "b")
    assert (d.first["phase"], d.first["module"]) == ("backward", "0.gate"), d.line()
    assert d.structural[0]["module"] == "0.gate"  # the hook's mul, only B runs it


def test_ulp_distance():
    a = torch.tensor([1.0, -0.0, 2.0])
    b = torch.tensor([torch.nextafter(torch.tensor(1.0), torch.tensor(2.0)).item(), 0.0, 2.0])
    assert ulp_distance(a, b) == 1 and ulp_distance(a, a) == 0
    assert ulp_distance(a.bfloat16(), a.bfloat16()) == 0 and ulp_distance(a, a[:2]) is None

    assert ulp_distance([1.0], [1.0]) is None  # a values file may hold what is no tensor
    eight = torch.ones(2).to(torch.float8_e4m3fn)
    assert ulp_distance(eight, eight) is None  # no integer view of one byte's float here


@pytest.mark.parametrize(
    ("line", "why"),
    [
        ("[1, 2]", "not an op record (not a JSON object)"),
        ('{"i": 0}', "not an op record (no 'phase', 'module', 'op', 'n', 'out', 'in')"),
        ('{"i": 0, "phase": "f", "module": "", "op": "o", "n": 0, "out": "h", "in": []}',
         "not an op record ('out' must be a list of hashes)"),
        ('{"i": true, "phase": "f", "module": "", "op": "o", "n": 0, "out": [], "in": []}',
         "not an op record ('i' and 'n' must be integers)"),
        ('{"event": "end", "step": "1"}', "bad end record ('step' must be an integer)"),
        ("[" * 5000 + "]" * 5000, "not valid JSON: nested too deeply"),
    ],
)  # fmt: skip
def test_read_ops_names_the_line_it_cannot_use(tmp_path, line, why):
    from parity.judge.opdiff import OpTraceError, read_ops

    path = tmp_path / "rank0.jsonl"
    path.write_text('{"i": 0, "phase": "step", "module": "", "op": "o", "n": 0, "out": [], '
                    f'"in": []}}\n{line}\n')  # fmt: skip
    with pytest.raises(OpTraceError) as e:
        read_ops(path)
    assert str(e.value) == f"{path}:2: {why}"


# --- multi-rank: worker vs worker + mutant, both traced at step 1 (the first divergent step) ----

TRACED = {"trace_step": 1}
# mutant -> (spec overrides, phase, module, op, source file, origin)
NAMED = {
    "missing-dp-factor": ({}, "step", "", "aten.mul.Tensor", "worker/losses.py", "scalar argument"),
    "micro-batch-token-mean": (
        {},
        "step",
        "",
        "aten.div.Tensor",
        "worker/losses.py",
        "scalar argument",
    ),
    "seq-mean-dp-scaling": (
        SEQ_MEAN,
        "step",
        "",
        "aten.div.Tensor",
        "worker/losses.py",
        "scalar argument",
    ),
}


def _traced(runner, overrides: dict, mutant: str | None = None):
    spec = JobSpec(task="charcount-sft", world_size=2, steps=1, overrides={**overrides, **TRACED})
    if mutant:
        spec = JobSpec(
            task="charcount-sft",
            world_size=2,
            steps=1,
            overrides={**overrides, **TRACED},
            inject=[mutant],
        )
    return runner.job(spec).dir


@pytest.mark.parity
@pytest.mark.parametrize("mutant", sorted(NAMED))
def test_mutant_first_op_is_named(parity_runner, mutant):
    overrides, phase, module, op, src, origin = NAMED[mutant]
    a, b = _traced(parity_runner, overrides), _traced(parity_runner, overrides, mutant)
    d = compare_ops(a, b)
    f = d.first
    assert d.status == "differ" and d.step == 1, d.line()
    assert (f["phase"], f["module"], f["op"], d.origin) == (phase, module, op, origin), d.line()
    assert f["src"].startswith(src) and f["ulp"] is not None and f["ulp"] > 0, d.line()


@pytest.mark.parity
def test_layer_grad_halved_is_named_at_the_layer(parity_runner):
    """The mutant adds ops (the halving): structural, on model.layers.1's gradients, and the
    first common op that differs (the norm of the gradients) only carries it."""
    a, b = _traced(parity_runner, {}), _traced(parity_runner, {}, "layer-grad-halved")
    d = compare_ops(a, b)
    assert d.status == "differ" and d.origin == "structural", d.line()
    halved = [s for s in d.structural if (s["side"], s["op"]) == ("b", "aten.mul_.Tensor")]
    assert halved and all(s["phase"] == "step" for s in halved), d.structural
    assert {s["module"].rsplit(".", 2)[0][:15] for s in halved} == {"model.layers.1."}, halved
    assert all(s["module"].endswith(".grad") for s in halved), halved
    assert d.cost["a"]["seconds"] < 30  # the traced step's own cost is reported
