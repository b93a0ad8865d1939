"""Op-level traces of one step (parity.record.optrace) and the first op that differs
(parity.judge.opdiff): fast tests on a toy loop, `parity` tests on worker vs worker + a mutant."""

from __future__ import annotations

import json
import os

import pytest

from parity.judge.opdiff import compare_ops, ulp_distance
from parity.spec import JobSpec
from tests.specs import SEQ_MEAN

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from parity.record import OpTracer, trace_ops  # noqa: E402


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
        ('{"i": 0, "phase": "f", "module": "", "op": "o", "n": 0, "out": [], "in": [], '
         '"shapes": [[1.5]]}', "not an op record ('shapes' must be a list of lists of integers)"),
        ('{"i": 0, "phase": "f", "module": "", "op": "o", "n": 0, "out": [], "in": [], '
         '"later": [1]}', "not an op record ('later' must be a list of strings or nulls)"),
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


# --- two implementations of one step: scopes, values undone, ops only one side runs ----------


class Mlp(torch.nn.Module):
    def __init__(self, scale: float = 1.0):
        super().__init__()
        torch.manual_seed(2)
        self.inp, self.out, self.scale = torch.nn.Linear(4, 8), torch.nn.Linear(8, 1), scale

    def forward(self, x):
        return self.out(torch.relu(self.inp(x)) * self.scale)


def test_a_step_of_two_models_is_one_trace_each_model_in_its_scope(tmp_path):
    """An RL step's calls (the critic's, then the actor's) traced inside `within`, written once:
    modules carry the scope, and the first differing op is named in the model that differs."""
    for side, actor_scale in (("a", 1.0), ("b", 1.0000001)):
        critic, actor = Mlp(), Mlp(actor_scale)
        tracer = OpTracer()
        x = torch.ones(3, 4)
        with tracer.within("critic", critic):
            critic(x).sum().backward()
        with tracer.within("actor", actor):
            actor(x).sum().backward()
        tracer.write(tmp_path / side, 1, rank=0)
    records = [json.loads(line) for line in
               (tmp_path / "a" / "ops" / "rank0.jsonl").read_text().splitlines()[:-1]]  # fmt: skip
    modules = {r["module"] for r in records}
    assert {"critic:inp", "actor:inp", "critic:", "actor:"} <= modules, modules
    assert all(m.split(":")[0] in ("critic", "actor") for m in modules), modules
    assert records[0]["module"].startswith("critic:") and records[-1]["module"].startswith("actor")
    d = compare_ops(tmp_path / "a", tmp_path / "b")
    assert (d.first["module"], d.first["op"], d.origin) == (
        "actor:", "aten.mul.Tensor", "scalar argument"), d.line()  # fmt: skip


def _loss_step(out, *, factor: int, lr: float = 0.1) -> None:
    """One step whose loss is scaled by `factor` and divided by 64 * factor (powers of two: the
    same loss either way, as verl's legacy and engine actors' token means), then SGD at `lr`."""
    model = Mlp()
    with trace_ops(out, 1, model, rank=0):
        loss = model(torch.ones(3, 4)).pow(2).sum() * factor / (64 * factor)
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-lr)


def test_a_difference_undone_later_is_not_the_first(tmp_path):
    _loss_step(tmp_path / "a", factor=1)
    _loss_step(tmp_path / "b", factor=2)
    d = compare_ops(tmp_path / "a", tmp_path / "b")
    assert d.status == "structural" and d.first is None, d.line()
    # the loss's own mul (the model's root-level mul by its scale is #0)
    assert d.undone_count >= 1 and d.undone[0]["where"] == "step (top level) aten.mul.Tensor #1"
    assert d.line().startswith("no difference lasts at step 1 (rank 0)"), d.line()
    # a difference that lasts after it (the learning rate) is the first
    _loss_step(tmp_path / "c", factor=2, lr=0.125)
    d = compare_ops(tmp_path / "a", tmp_path / "c")
    assert (d.first["phase"], d.first["module"], d.origin) == (
        "step", "inp.weight", "scalar argument"), d.line()  # fmt: skip
    assert "earlier ops differ without lasting (undone later)" in d.line()


def test_a_loop_with_no_module_on_other_data_is_named_at_its_first_op(tmp_path):
    """The step's own ops on other tensors are compared where nothing else differs: a loop with
    no module fed other data differs at its first op, its inputs already different, and is
    never called identical."""
    for side, seed in (("a", 0), ("b", 1)):
        x = torch.randn(4, 3, generator=torch.Generator().manual_seed(seed))
        w = torch.ones(3, 2, requires_grad=True)
        with trace_ops(tmp_path / side, 1, rank=0):
            (x @ w).pow(2).sum().backward()
    d = compare_ops(tmp_path / "a", tmp_path / "b")
    assert (d.status, d.first["op"], d.origin) == ("differ", "aten.mm.default", "inputs"), d.line()
    assert "its inputs already differ: weights, data or code outside the trace" in d.line()


def test_a_scalar_made_in_the_step_is_named_where_it_was_made(tmp_path):
    """A parameter's op whose one-element input differs, made by the step's own code on other
    data (not paired): the op that made it is named, not "outside the trace"."""
    for side, seed in (("a", 0), ("b", 1)):
        x = torch.randn(4, 3, generator=torch.Generator().manual_seed(seed))
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        with trace_ops(tmp_path / side, 1, model, rank=0):
            scale = x.pow(2).sum()
            with torch.no_grad():
                model.weight.mul_(scale)
    d = compare_ops(tmp_path / "a", tmp_path / "b")
    assert (d.first["module"], d.first["op"], d.origin) == ("weight", "aten.mul_.Tensor", "inputs")
    assert d.first["via"]["where"] == "step (top level) aten.sum.default #0", d.line()
    assert "made by step (top level) aten.sum.default #0 at tests/record/" in d.line(), d.line()
    assert "outside the trace" not in d.line()


def _norms(out, dim: int) -> None:
    """A gradient's per-shard norms, the shards cut along `dim` (FSDP's Shard(0) or Shard(1))."""
    grad = torch.arange(24.0).reshape(6, 4)
    with trace_ops(out, 1, rank=0):
        shards = [s.contiguous() for s in grad.chunk(2, dim=dim)]  # views, then copies
        torch.stack(torch._foreach_norm(shards))


def test_a_difference_from_another_shard_layout_names_the_op_only_one_side_runs(tmp_path):
    """The norms of shards cut on other dimensions differ: the stack of them is the first op to
    differ, and what it takes comes from the op that only one side runs (the cut into shards of
    another shape): never the foreach norm of other tensors under the same name."""
    _norms(tmp_path / "a", 0)
    _norms(tmp_path / "b", 1)
    d = compare_ops(tmp_path / "a", tmp_path / "b")
    assert (d.first["op"], d.origin) == ("aten.stack.default", "structural"), d.line()
    source = d.first["source"]
    assert source["side"] == "a" and source["shapes"] == [[3, 4], [3, 4]], source
    assert "from an op only a runs: step (top level) aten.split.Tensor #0" in d.line(), d.line()
    assert "making [3, 4], [3, 4] at tests/record/test_optrace.py:" in d.line(), d.line()


def _two_cuts(out, dim: int) -> None:
    """Two gradients cut into shards along `dim`, the first shard's norms of both stacked."""
    grads = [torch.arange(24.0).reshape(6, 4), torch.arange(24.0, 48.0).reshape(6, 4)]
    with trace_ops(out, 1, rank=0):
        firsts = [g.chunk(2, dim=dim)[0].contiguous() for g in grads]
        torch.stack([f.norm() for f in firsts])


def test_the_op_only_one_side_runs_is_the_same_on_every_run(tmp_path):
    """Where two ops only one side runs feed the first difference, the latest is named, the
    same whatever order Python's hash seed gives a set (each answer from a process of its own)."""
    import subprocess
    import sys

    _two_cuts(tmp_path / "a", 0)
    _two_cuts(tmp_path / "b", 1)
    code = ("import sys; from pathlib import Path; from parity.judge.opdiff import compare_ops; "
            "d = compare_ops(Path(sys.argv[1]), Path(sys.argv[2])); "
            "print(d.first['source']['where'])")  # fmt: skip
    answers = {
        subprocess.run([sys.executable, "-c", code, str(tmp_path / "a"), str(tmp_path / "b")],
                       env={**os.environ, "PYTHONHASHSEED": str(seed)}, capture_output=True,
                       text=True, check=True).stdout.strip()
        for seed in range(4)
    }  # fmt: skip
    assert answers == {"step (top level) aten.split.Tensor #1"}, answers


def test_a_view_s_value_is_linked_to_the_op_that_takes_it(tmp_path):
    """An output recorded without a hash (a view) learns what the first op taking it saw."""
    w = torch.ones(3, 2)
    with trace_ops(tmp_path, 1, rank=0):
        torch.mm(w.t(), w)
    view, mm = [json.loads(line) for line in
                (tmp_path / "ops" / "rank0.jsonl").read_text().splitlines()[:2]]  # fmt: skip
    assert view["op"] == "aten.t.default" and view["out"] == [None], view
    assert view["later"] == [mm["in"][0]] and mm["shapes"] == [[2, 2]], (view, mm)


def test_sparse_tensors_are_traced_not_a_crash_of_the_step(tmp_path):
    """A sparse tensor has no strided memory to hash or point at: its values are hashed as the
    dense tensor holds them, and the traced step runs as it would untraced."""
    indices, values = torch.tensor([[0, 1], [1, 0]]), torch.tensor([1.0, 2.0])
    with trace_ops(tmp_path, 1, rank=0):
        sparse = torch.sparse_coo_tensor(indices, values, (2, 2), check_invariants=True)
        (sparse * 3).coalesce().to_dense()
    records = (tmp_path / "ops" / "rank0.jsonl").read_text().splitlines()
    assert json.loads(records[-1])["event"] == "end" and len(records) > 3


def test_a_collective_s_result_is_linked_past_its_wait(tmp_path):
    """A functional all-reduce's result reaches the trace after its wait: the collective's
    record holds it (``later``), what the diagnosis follows to see whether a difference lasts."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with trace_ops(tmp_path, 1, rank=0):
            reduced = funcol.all_reduce(torch.full((3,), 2.0), "sum", dist.group.WORLD)
            reduced * 3
    finally:
        dist.destroy_process_group()
    records = [json.loads(line) for line in
               (tmp_path / "ops" / "rank0.jsonl").read_text().splitlines()[:-1]]  # fmt: skip
    (collective,) = [r for r in records if r["op"] == "_c10d_functional.all_reduce.default"]
    (mul,) = [r for r in records if r["op"] == "aten.mul.Tensor"]
    assert collective["out"] == [None] and collective["later"] == [mul["in"][0]], records


def _ddp_traces(tmp_path, differ: int, *mode: str):
    """Both sides of one DDP step on 2 ranks (tests/jobs/ddp_rank_data.py): rank `differ`'s
    batch differs in b (``gather``: every rank's shard, all-gathered)."""
    import subprocess
    import sys

    job = os.path.join(os.path.dirname(__file__), "..", "jobs", "ddp_rank_data.py")
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         job, str(tmp_path), str(differ), *mode],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, timeout=120, check=True,
    )  # fmt: skip
    return tmp_path / "a", tmp_path / "b"


@pytest.mark.parity
@pytest.mark.parametrize("differ", [0, 1])
def test_a_rank_s_own_data_is_named_on_that_rank_not_where_the_all_reduce_took_it(tmp_path, differ):
    """One rank's batch differs: every rank's gradients differ after DDP's all-reduce, but only
    that rank's own ops differ before it. That rank is named, a lower one as differing only
    through a collective; with the other rank's trace alone, the collective is named."""
    a, b = _ddp_traces(tmp_path, differ)
    d = compare_ops(a, b)
    other = 1 - differ
    assert (d.rank, d.origin, d.first["phase"]) == (differ, "inputs", "forward"), d.line()
    if other < differ:  # the ranks after the one named are not compared
        assert d.through_collective == [other], d.line()
        assert d.line().endswith(f"; rank {other} differs only through a collective"), d.line()
    else:
        assert d.through_collective == [] and "through a collective" not in d.line(), d.line()
    for side in (a, b):  # the other rank's trace alone
        for path in (side / "ops").glob(f"rank{differ}.*"):
            path.unlink()
    d = compare_ops(a, b)
    assert (d.rank, d.origin, d.through_collective) == (other, "collective", [other]), d.line()
    assert d.first["via"]["where"].endswith("c10d.allreduce_.default #0"), d.line()
    assert "so the collective itself does (its reduction order or algorithm)" in d.line()


@pytest.mark.parity
def test_a_shard_that_differs_on_every_rank_is_not_blamed_on_the_all_gather(tmp_path):
    """Every rank's own shard differs (side b's weights), then is all-gathered: each rank's
    input to the collective already differs, so the collective only carries it. Rank 0 is
    named with its inputs differing, never "the collective itself"."""
    a, b = _ddp_traces(tmp_path, -1, "gather")
    d = compare_ops(a, b)
    assert (d.rank, d.origin, d.through_collective) == (0, "inputs", []), d.line()
    assert "returned them from this rank's own, which differ already" in d.line(), d.line()
    assert "the collective itself" not in d.line(), d.line()


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
