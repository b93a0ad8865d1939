"""Minimal reproduction of TRL's batch-4-GA-1 vs batch-2-GA-2 grad_norm gap: bf16 autocast.

    python subjects/hf/repro_bf16_ga.py [--json]

TRL's SFTConfig defaults to ``bf16=True`` (its docs: "Defaults to True if fp16 is not set"), and
on CPU that makes Trainer run every forward and backward under
``torch.autocast("cpu", dtype=torch.bfloat16)``. There, a Linear layer's weight gradient is a
bf16 GEMM whose output is rounded to bf16 (8 significant bits) before it is added, in float32,
to ``param.grad``. With GA 1 the four rows' contributions are summed inside one GEMM and
rounded once; with GA 2 each half is rounded on its own and the halves are added: every weight
gradient element differs by up to a bf16 rounding (2**-9 relative). No TRL code is needed to see
it: this script shows it on one nn.Linear and on the tiny Qwen2 fixture (one process, no
Trainer), each in float32 (gap at float32 rounding, ~1e-7) and under bf16 autocast (gap ~1e-3 per
weight tensor), with the micro-batches padded to the same length so padding plays no part.
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import nullcontext
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "fixtures"


def _ctx(bf16: bool):
    return torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / a.norm()) if a.norm() > 0 else float((a - b).norm())


def linear_gap(bf16: bool, seed: int = 0) -> float:
    """Relative difference of a Linear's weight gradient: 4 rows at once vs 2 + 2 accumulated."""
    g = torch.Generator().manual_seed(seed)
    layer = torch.nn.Linear(64, 64, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(64, 64, generator=g) * 0.1)
    x = torch.randn(4, 32, 64, generator=g)
    target = torch.randn(4, 32, 64, generator=g)

    def loss_of(rows: slice) -> torch.Tensor:
        with _ctx(bf16):
            y = layer(x[rows])
        return ((y.float() - target[rows]) ** 2).sum() / target.numel()

    layer.weight.grad = None
    loss_of(slice(0, 4)).backward()
    whole = layer.weight.grad.clone()
    layer.weight.grad = None
    loss_of(slice(0, 2)).backward()
    loss_of(slice(2, 4)).backward()
    return _rel(whole, layer.weight.grad)


def _batch(n: int = 4, max_length: int = 512):
    """The first n charcount samples, assistant-only labels, all padded to one length."""
    sys.path.insert(0, str(REPO))
    from worker.data.charcount import encode, load_tokenizer, read_jsonl

    tok = load_tokenizer(FIXTURES / "tokenizer")
    samples = read_jsonl(FIXTURES / "charcount" / "train.jsonl")[:n]
    encs = [encode(s, tok, max_length) for s in samples]
    width = max(len(e) for e in encs)
    ids = torch.full((n, width), tok.pad_token_id, dtype=torch.int64)
    labels = torch.full((n, width), -100, dtype=torch.int64)
    mask = torch.zeros((n, width), dtype=torch.int64)
    for i, e in enumerate(encs):
        k = len(e)
        ids[i, :k], mask[i, :k] = e.input_ids, 1
        labels[i, :k] = e.input_ids.masked_fill(e.loss_mask == 0, -100)
    return ids, labels, mask


def model_gap(bf16: bool) -> dict:
    """Per-tensor relative gradient difference of the tiny Qwen2, 4 rows vs 2 + 2 (the loss is
    summed over tokens and divided by the 4 rows' token count, as Trainer does with
    num_items_in_batch), and the gradient norms."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(
        str(FIXTURES / "tiny-qwen2"), use_safetensors=True, dtype=torch.float32
    )
    model.train()
    ids, labels, mask = _batch()
    n_items = int((labels[:, 1:] != -100).sum())

    def step(parts: list[slice]) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        for rows in parts:
            with _ctx(bf16):
                out = model(
                    input_ids=ids[rows], attention_mask=mask[rows], labels=labels[rows],
                    num_items_in_batch=n_items,
                )  # fmt: skip
            out.loss.backward()
        return {n: p.grad.detach().clone() for n, p in model.named_parameters()}

    whole = step([slice(0, 4)])
    halves = step([slice(0, 2), slice(2, 4)])
    names = list(whole)
    per_tensor = {n: _rel(whole[n], halves[n]) for n in names}
    differ = [n for n in names if not torch.equal(whole[n], halves[n])]

    def norm(g):
        return float(torch.linalg.vector_norm(torch.stack([t.double().norm() for t in g.values()])))

    gn_whole, gn_halves = norm(whole), norm(halves)
    return {
        "first_differing_tensor": differ[0] if differ else None,
        "tensors_differing": f"{len(differ)} of {len(names)}",
        "max_rel_per_tensor": max(per_tensor.values()),
        "grad_norm_rel": abs(gn_whole - gn_halves) / gn_whole,
        "per_tensor": per_tensor,
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    torch.use_deterministic_algorithms(True)
    result = {
        "linear": {"float32": linear_gap(False), "bf16_autocast": linear_gap(True)},
        "tiny_qwen2": {"float32": model_gap(False), "bf16_autocast": model_gap(True)},
    }
    if args.json:
        print(json.dumps(result, indent=1))
        return result
    print("nn.Linear weight grad, 4 rows vs 2+2 accumulated (relative L2 difference):")
    for k, v in result["linear"].items():
        print(f"  {k:14s} {v:.3g}")
    print("tiny Qwen2, batch 4 vs 2+2 (same padding), per tensor:")
    for k, v in result["tiny_qwen2"].items():
        print(
            f"  {k:14s} max rel per tensor {v['max_rel_per_tensor']:.3g}, grad_norm rel "
            f"{v['grad_norm_rel']:.3g}, {v['tensors_differing']} tensors differ, first "
            f"{v['first_differing_tensor']}"
        )
    bf = result["tiny_qwen2"]["bf16_autocast"]["per_tensor"]
    for name in list(bf)[:4] + list(bf)[-2:]:
        print(f"    bf16 {name:48s} {bf[name]:.3g}")
    return result


if __name__ == "__main__":
    main()
