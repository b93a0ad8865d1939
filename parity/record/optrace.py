"""Op-level tracing of one training step: every aten op's output hash, where it ran, and its value.

    from parity.record import trace_ops

    with trace_ops("runs/a", step=5, model=model):      # forward, loss, backward, clip, optimizer
        loss = loss_fn(model(x), y); loss.backward(); opt.step()

writes, per rank, ``ops/rank{r}.jsonl`` (one record per op, then the end record) and
``ops/rank{r}.pt`` (floating-point outputs up to 64 KiB each, for the ULP distance of the op
that differs; read back with ``torch.load(weights_only=True)``). A record:

    {"i": 17, "phase": "forward", "module": "model.layers.0.mlp.up_proj", "op": "aten.mm.default",
     "n": 0, "out": ["<hash>"], "shapes": [[4, 64]], "in": ["<hash>", "float32=0.5", "[1, 2]"],
     "src": "file.py:12"}

phase: "forward" (inside a module's forward), "backward" (run by autograd's engine) or "step"
(top-level code: the loss, gradient clipping, the optimizer). module: the innermost module
running (forward and backward, from torch's ModTracker), or for a step op on one parameter
or its gradient (clipping, the optimizer; given `model`) that parameter's name (``.grad``
added), else "", with ``scope:`` before it inside ``OpTracer.within(scope)``; n: the
occurrence of this op in this phase and module; out/in: a hash of each output tensor and of each
input (a one-element tensor as its dtype and value; other arguments as their repr); shapes: each
output tensor's shape (two ops whose outputs differ in shape are not one computation); scalars
(where an output has one element): each output as an input shows it, ``dtype=value`` (what links
it to the ops that take it); later (where an output has no hash): what the first op to take it
saw, its hash or dtype=value (the link from a collective's or a view's result on; never
compared); src: the
first caller outside torch (forward and step ops only: backward runs in autograd's engine),
relative to the working folder, or to site-packages for an installed package's code.

Why a TorchDispatchMode of our own, and not torch.utils._debug_mode.DebugMode: DebugMode's
hashes are an L1 norm or torch.hash_tensor's XOR sum, both over a float64 cast (a permutation or
compensating errors collide), where parity needs "equal exactly when the bits are" (the blake2b
of bytes the fingerprints use); it stringifies every call's arguments, tracks modules in forward
only and is a private prototype whose layout moved between releases. The mode here sees the same
aten ops (DTensor ops are left to DTensor, which dispatches their local ops back to us), and
ModTracker (what DebugMode itself uses) gives the module path in backward as well.

Outputs of ops that make uninitialized memory (empty*, resize_), of collectives (their buffers are
written asynchronously) and of views (FSDP2 views its all-gather buffer before filling it) are
recorded with a None hash: never a false difference.
Only the torch and the standard library are imported (the recorder's rule).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from parity.record.digest import DIGEST_SIZE
from parity.record.runfolder import is_collective, op_trace_paths

# outputs kept for the ULP distance of the op that differs: each up to MAX_TENSOR_BYTES, in all
# up to MAX_VALUE_BYTES per rank (a 2-layer, 128-wide model: ~10 MB); hashes of every output
MAX_TENSOR_BYTES = 64 * 2**10
MAX_VALUE_BYTES = 32 * 2**20
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_HERE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_SITE = os.sep + "site-packages" + os.sep
_UNINITIALIZED = ("empty", "resize", "set_.")
#: an input whose memory an op like torch.empty made and no op has written yet (an out= buffer,
#: a collective's output list): recorded as this, not a hash of whatever the allocator left
UNINITIALIZED = "uninitialized"


def _uninitialized(op: str) -> bool:
    return any(s in op for s in _UNINITIALIZED)


# tensor subclasses whose ops are traced as the plain ops they run: DTensor's local ops, and a
# functional collective's result (its wait, then the op on the waited tensor)
_UNWRAPS = ("DTensor", "AsyncCollectiveTensor")


_PLAIN = {torch.Tensor, torch.nn.Parameter}
_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _clean(raw: str) -> str:
    """ModTracker's module name without the root's class name and the wrappers' levels."""
    parts = raw.split(".")[1:]  # the root's class name
    while parts and parts[0] in ("module", "_orig_mod", "_fsdp_wrapped_module"):
        parts = parts[1:]  # DDP's, compile's and FSDP1's wrappers
    return ".".join(parts)


def _hash(t: torch.Tensor) -> str:
    h = hashlib.blake2b(digest_size=DIGEST_SIZE)
    t = t.detach()
    h.update(f"{tuple(t.shape)}:{t.dtype};".encode())
    if t.numel():
        t = t.cpu()
        if t.layout != torch.strided:  # sparse: its values in place, as a dense tensor holds them
            h.update(f"{t.layout};".encode())
            t = t.to_dense()
        as_int = _INTS.get(t.element_size()) if not t.is_complex() else None
        if as_int is None:
            t = t.reshape(-1).clone().view(torch.uint8)
        else:
            t = t.view(as_int).clone()  # never .numpy() the op's own storage (FSDP resizes it)
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def _where(t: torch.Tensor) -> tuple:
    """Where a tensor's elements live (a live parameter's or gradient's memory is its own)."""
    return (t.device, t.data_ptr(), tuple(t.shape), t.dtype)


def _memory(t: torch.Tensor) -> tuple | None:
    """`_where`, or None for a tensor without memory of its own to point at (sparse, nested)."""
    try:
        return _where(t)
    except (RuntimeError, NotImplementedError):
        return None


def _input(x: Any) -> str:
    """An input as compared: a tensor's hash (one element: its dtype and value), else repr."""
    if isinstance(x, torch.Tensor):
        if x.numel() == 1 and not x.is_meta:
            return f"{str(x.dtype)[6:]}={x.detach().cpu().reshape(()).item()!r}"
        return _hash(x)
    text = repr(x)
    return text if len(text) <= 60 else text[:57] + "..."


def _source() -> str | None:
    """file:line of the innermost caller outside torch and this module."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith((_TORCH_DIR, _HERE)):
            if name.startswith("<"):
                return f"{name}:{frame.f_lineno}"
            _, installed, inside = name.rpartition(_SITE)  # an installed package's own path
            return f"{inside if installed else os.path.relpath(name)}:{frame.f_lineno}"
        frame = frame.f_back
    return None


def _module_tracker() -> Any:
    """torch's tracker of the modules running: ModTracker, else (torch 2.4 has none) its
    predecessor ModuleTracker, with the same `parents` and `_get_mod_name`. Backward ops are
    named by `OpTracer._label_graph` either way, the tracker only where no module's forward
    made the node."""
    try:
        from torch.distributed._tools.mod_tracker import ModTracker
    except ImportError:
        from torch.utils.module_tracker import ModuleTracker as ModTracker
    return ModTracker()


class OpTracer(TorchDispatchMode):
    """Records every aten op run on plain tensors while active (see the module docstring)."""

    def __init__(
        self, model: torch.nn.Module | None = None, max_value_bytes: int = MAX_VALUE_BYTES
    ):
        super().__init__()
        self.model = model
        self._names: dict[tuple, str] | None = None  # memory -> parameter (or .grad)
        self.records: list[dict[str, Any]] = []
        self.values: dict[str, torch.Tensor] = {}
        self.value_bytes, self.max_value_bytes = 0, max_value_bytes
        self.values_dropped = 0
        self._counts: dict[tuple[str, str, str], int] = {}
        self.tracker = _module_tracker()
        self._stack: contextlib.ExitStack | None = None
        self._node_module: dict[Any, str] = {}  # autograd node -> the module whose forward made it
        self.scope = ""  # put before every module name (`within`): which of several models ran
        # outputs recorded with no hash (a view's, a collective's, uninitialized memory's), until
        # an op takes their memory (a collective's waited result is another tensor object on the
        # same memory): where -> (the tensor, weakly: while it lives its memory is its own;
        # its record; its output index)
        self._unread: dict[tuple, tuple[weakref.ref, int, int]] = {}
        self.seconds = 0.0  # inside the tracer, over every time it was entered
        self._entered = 0.0

    def _module(self) -> str:
        names = [p for p in self.tracker.parents if p != "Global"]
        if not names:
            return ""
        # innermost; in backward sibling modules can be open together (ModTracker closes a module
        # when its inputs' gradients are done): the name breaks the tie, the same on both sides
        # (backward ops of a node made in a module's forward are labelled exactly: _label_graph)
        return _clean(max(names, key=lambda n: (n.count("."), n)))

    def _label_graph(self, module, inputs, output) -> None:
        """After a module's forward: every autograd node its forward made (from its outputs back
        to its inputs) belongs to it, unless an inner module's forward made it (their hooks run
        first). In backward, the node running names the module: siblings never tie."""
        if not torch.is_grad_enabled():
            return
        name = _clean(self.tracker._get_mod_name(module))
        if not name:
            return  # the root: its own ops keep ModTracker's label
        stop = {t.grad_fn for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)}
        stack = [t.grad_fn for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
        seen: set = set()
        while stack:
            node = stack.pop()
            if node is None or node in stop or node in seen:
                continue
            seen.add(node)
            self._node_module.setdefault(node, name)
            stack.extend(n for n, _ in node.next_functions)

    def _input(self, x: Any, link: bool = True) -> str:
        """An input as recorded (`_input`); the first time an op other than a collective takes
        an output recorded with no hash, its record learns what it held then (``later``): the
        link from a collective's or a view's result to the ops that use it, which the diagnosis
        follows (never compared). A collective's own ops may take its buffer before it is
        written (a wait, an autograd wrapper): they do not link."""
        memory = _memory(x) if isinstance(x, torch.Tensor) and self._unread else None
        unread = self._unread_at(memory)
        if unread is not None and _uninitialized(self.records[unread[1]]["op"]):
            text = UNINITIALIZED  # whatever the allocator left there: no value to compare
        else:
            text = _input(x)
        if link and unread is not None:
            del self._unread[memory]
            rec = self.records[unread[1]]
            rec.setdefault("later", [None] * len(rec["out"]))[unread[2]] = text
        return text

    def _unread_at(self, memory: tuple | None) -> tuple | None:
        """The output recorded with no hash that holds ``memory`` and no op has taken yet, while
        it lives; None for none (one freed is dropped: its memory is another tensor's now)."""
        unread = self._unread.get(memory) if memory is not None else None
        if unread is not None and unread[0]() is None:
            del self._unread[memory]
            return None
        return unread

    def _sent(self, memory: tuple) -> bool:
        """Whether the unread value at ``memory`` is a collective's already (a functional
        collective's result, which its wait hands on: the collective keeps it)."""
        unread = self._unread_at(memory)
        return unread is not None and is_collective(self.records[unread[1]]["op"])

    def _param(self, leaves: list) -> str | None:
        """The parameter (or gradient) a top-level op works on: what names clipping's and the
        optimizer's per-tensor ops (foreach ops take them all: not named)."""
        if self.model is None:
            return None
        if self._names is None:
            self._names = {}
            for name, p in self.model.named_parameters():
                for t, suffix in ((p, ""), (p.grad, ".grad")):
                    if t is not None:
                        self._names[_where(getattr(t, "_local_tensor", t))] = name + suffix
        first = next((x for x in leaves if isinstance(x, torch.Tensor)), None)
        return self._names.get(_where(first)) if first is not None else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves, _ = tree_flatten((args, kwargs))
        kinds = {type(x) for x in leaves if isinstance(x, torch.Tensor)} - _PLAIN
        if any(k.__name__ in _UNWRAPS for k in kinds):
            return NotImplemented  # the subclass runs its own ops, which come back here
        if kinds:  # fake tensors (DTensor's sharding propagation) and other subclasses
            return func(*args, **kwargs)
        name = str(func)
        node = torch._C._current_autograd_node()
        backward = node is not None
        module = self._module()
        if backward:
            module = self._node_module.get(node, module)
        phase = "backward" if backward else ("forward" if module else "step")
        if backward:
            self._names = None  # gradients made since: map again
        elif phase == "step" and "_foreach_" not in name:
            module = self._param(leaves) or ""
        if self.scope:
            module = f"{self.scope}:{module}"
        collective = is_collective(name)
        # before the op: in-place ops change them
        inputs = [self._input(x, link=not collective) for x in leaves]
        out = func(*args, **kwargs)
        key = (phase, module, name)
        n = self._counts.get(key, 0)
        self._counts[key] = n + 1
        i = len(self.records)
        skip = (
            _uninitialized(name)
            or collective
            or getattr(func, "is_view", False)  # may alias a buffer not written yet (FSDP2)
        )
        hashes: list[str | None] = []
        shapes: list[list[int]] = []
        scalars: list[str | None] = []  # a one-element output as later ops' inputs show it
        for j, t in enumerate(x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)):
            shapes.append(list(t.shape))
            if skip or t.is_meta:
                hashes.append(None)
                scalars.append(None)
                memory = None if t.is_meta else _memory(t)
                # its value as the first op to take it sees: `later`; a collective wrote there,
                # so its value is the collective's (not the torch.empty's that made the buffer)
                if memory is not None and (self._unread_at(memory) is None
                                           or collective and not self._sent(memory)):  # fmt: skip
                    self._unread[memory] = (weakref.ref(t), i, j)
                continue
            host = t.detach().cpu()  # one copy off a GPU for its hash, scalar and value
            hashes.append(_hash(host))
            scalars.append(_input(host) if host.numel() == 1 else None)
            if host.is_floating_point():
                size = host.numel() * host.element_size()
                if size <= MAX_TENSOR_BYTES and self.value_bytes + size <= self.max_value_bytes:
                    self.values[f"{i}.{j}"] = host.clone()
                    self.value_bytes += size
                else:
                    self.values_dropped += 1
        rec = {"i": i, "phase": phase, "module": module, "op": name, "n": n, "out": hashes}
        rec["shapes"], rec["in"] = shapes, inputs
        if any(scalars):
            rec["scalars"] = scalars
        if not backward:
            rec["src"] = _source()
        self.records.append(rec)
        return out

    def __enter__(self):
        from torch.nn.modules.module import register_module_forward_hook

        self._stack = contextlib.ExitStack()
        self._stack.enter_context(self.tracker)
        self._stack.callback(register_module_forward_hook(self._label_graph).remove)
        self._entered = time.perf_counter()
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        if self._stack is not None:
            self._stack.close()
        self.seconds += time.perf_counter() - self._entered
        return out

    @contextlib.contextmanager
    def within(self, scope: str, model: torch.nn.Module | None = None) -> Iterator[OpTracer]:
        """Trace the block as part of the same step, its ops' modules named ``scope:module``
        (``scope:`` for top-level ops): for a step that runs several models in separate
        calls (an RL step: the critic's values, the actor's log-probs, both updates), each call
        inside its own ``within``, and the step written once after the last (`write`)."""
        self.scope, self.model, self._names = scope, model, None
        try:
            with self:
                yield self
        finally:
            self.scope = ""

    def write(self, out: str | Path, step: int, rank: int) -> None:
        """ops/rank{r}.jsonl and ops/rank{r}.pt of run folder `out` (each written whole),
        the trace's cost in the end record."""
        from parity.record.files import write_text_atomic

        jsonl, values = op_trace_paths(out, rank)
        jsonl.parent.mkdir(parents=True, exist_ok=True)
        tmp = values.with_name(f".{values.name}.tmp")
        torch.save(self.values, tmp)
        tmp.replace(values)
        lines = [json.dumps(r) for r in self.records]
        end = {
            "event": "end",
            "step": step,
            "ops": len(self.records),
            "seconds": round(self.seconds, 4),
            "values_bytes": self.value_bytes,
            "values_dropped": self.values_dropped,
        }
        lines.append(json.dumps(end))
        write_text_atomic(jsonl, "\n".join(lines) + "\n")


@contextlib.contextmanager
def trace_ops(
    out: str | Path,
    step: int,
    model: torch.nn.Module | None = None,
    *,
    rank: int | None = None,
    max_value_bytes: int = MAX_VALUE_BYTES,
) -> Iterator[OpTracer]:
    """Trace every op run inside the block (one training step, `step`) into the run folder `out`:
    ops/rank{r}.jsonl and ops/rank{r}.pt (see the module docstring). Every rank writes its own.
    The trace's own cost (seconds inside the block, file sizes) is in the end record."""
    if rank is None:
        from parity.record.env import dist_facts

        rank = dist_facts()[0]
    tracer = OpTracer(model, max_value_bytes)
    with tracer:
        yield tracer
    tracer.write(out, step, rank)
