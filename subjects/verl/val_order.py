"""Why verl 0.6.1's and 0.7.0's val/loss agree bitwise on AVX-512 hosts and by 1 ULP on AVX2 ones.

    python -m subjects.verl.val_order [--json]

With one val micro-batch per rank (``tests/subjects/test_subject_verl.py``'s single pair: 2
ranks, 3 val batches of 8 samples each) both releases compute the same number: the mean of the six
micro-batch losses L[r][b] (rank r, batch b), each already divided by its batch's global token
count. Every op of the val forward and loss is the same in both, and so are the six losses, bit
for bit (traced with ``parity.record.optrace``). Only the order of the last float32 mean differs:

- 0.6.1 (``sft_trainer.py``: ``val_losses.extend`` per micro-batch, then ``torch.mean`` and an
  ``all_reduce(AVG)``): each rank's mean over its batches, then the ranks' average.
- 0.7.0 (``TrainingWorker._postprocess_output``: ``torch.sum`` of the batch's micro-batch losses
  and an ``all_reduce(AVG)`` per batch; then ``sft_trainer.py``'s ``torch.mean``): each batch's
  ranks' average, then the mean over batches.

Each order rounds several times in float32, so the two may land on neighbouring floats; which
they do depends on the six values. Those differ between hosts in one op:
``aten._scaled_dot_product_flash_attention_for_cpu`` (the SDPA attention of every layer), whose
kernel ATen builds once per CPU capability and picks at run time: its softmax
(``_exp_reduce_sum_fusion_kernel``) sums each row's exponentials in 8-float (AVX2) or 16-float
(AVX-512) lanes, with the vectorized ``exp_u20`` on whole vectors and libm's ``exp`` on the
tail, so its output's last bits differ, and one of the six losses (rank 1's third batch) ends
1 ULP lower with the AVX2 kernels. With the AVX-512 values both orders round to
4.684879302978516; with the AVX2 ones 0.6.1's order still does and 0.7.0's gives
4.684878826141357, 1 float32 ULP below (the float64 mean, 4.6848789453, lies between the two).
``LOSSES`` holds the six losses of step 1 as the engine's ``forward_step`` returned them with
each kernel set (the same in both releases); ``orders`` recomputes both releases' val/loss from
them; ``attention_ulps`` runs the attention kernel with each capability
(``ATEN_CPU_CAPABILITY``) on the same inputs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]

# step 1's val micro-batch losses of the single pair, [rank][batch], as float32 bits: the same in
# 0.6.1 and 0.7.0; rank 1's third batch is the one the attention kernel moves by 1 ULP
_RANK0 = ("0x1.18adc8p+2", "0x1.5c993cp+2", "0x1.28f18cp+2")
LOSSES = {
    "AVX512": (_RANK0, ("0x1.3f4186p+2", "0x1.f886c6p+1", "0x1.2d40e0p+2")),
    "AVX2": (_RANK0, ("0x1.3f4186p+2", "0x1.f886c6p+1", "0x1.2d40dep+2")),
}


def _all_reduce_avg(values: list[torch.Tensor]) -> torch.Tensor:
    """gloo's AVG over ranks: the float32 sum, then divided by the world size."""
    return torch.stack(values).sum() / len(values)


def old_order(losses: list[list[float]]) -> float:
    """verl 0.6.1: each rank's mean of its micro-batch losses, then the ranks' average."""
    return _all_reduce_avg([torch.mean(torch.tensor(rank)) for rank in losses]).item()


def new_order(losses: list[list[float]]) -> float:
    """verl 0.7.0: each batch's (one) micro-batch loss averaged over the ranks, then the mean of
    those over batches (averaged over ranks again: all hold the same value)."""
    per_batch = [
        _all_reduce_avg([torch.sum(torch.tensor([rank[b]])) for rank in losses]).item()
        for b in range(len(losses[0]))
    ]
    mean = torch.mean(torch.tensor(per_batch))
    return _all_reduce_avg([mean] * len(losses)).item()


def float32_ulps(a: float, b: float) -> int:
    """How many float32 values apart two float32 numbers are (both finite, same sign)."""
    x, y = (torch.tensor(v, dtype=torch.float32).view(torch.int32).item() for v in (a, b))
    return abs(x - y)


def orders(kernels: str) -> dict[str, float | int]:
    """Both releases' val/loss from the six losses logged with ``kernels`` ("AVX512", "AVX2")."""
    losses = [[float.fromhex(h) for h in rank] for rank in LOSSES[kernels]]
    old, new = old_order(losses), new_order(losses)
    exact = sum(map(float, (x for rank in losses for x in rank))) / 6
    return {"0.6.1": old, "0.7.0": new, "float64": exact, "ulps": float32_ulps(old, new)}


_ATTENTION = """
import sys, torch, torch.nn.functional as F
g = torch.Generator().manual_seed(0)
# the tiny Qwen2's attention: 4 heads of 16, a padded batch of causal sequences
q, k, v = (torch.randn(8, 4, 200, 16, generator=g) for _ in range(3))
out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
torch.save({"capability": torch.backends.cpu.get_cpu_capability(), "out": out}, sys.argv[1])
"""


def attention_output(capability: str, python: str = sys.executable) -> dict:
    """SDPA's output on fixed inputs, computed in a fresh process with ATen's kernels capped at
    ``capability`` ("avx2", "avx512"); with the capability torch actually used."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "out.pt"
        subprocess.run(
            [python, "-c", _ATTENTION, str(path)], env=env, check=True, timeout=300, cwd=REPO
        )
        return torch.load(path, weights_only=True)


def attention_ulps(python: str = sys.executable) -> dict:
    """The capabilities used and how far apart the AVX2 and AVX-512 attention outputs are."""
    a, b = attention_output("avx512", python), attention_output("avx2", python)
    d = (a["out"].view(torch.int32).long() - b["out"].view(torch.int32).long()).abs()
    return {
        "capabilities": [a["capability"], b["capability"]],
        "elements": d.numel(),
        "differ": int((d > 0).sum()),
        "max_ulps": int(d.max()),
        "max_abs": float((a["out"] - b["out"]).abs().max()),
        "max_ulps_above_0.1": int(d[a["out"].abs() > 0.1].max()),  # the ULPs of the large ones
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m subjects.verl.val_order")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    out = {"orders": {k: orders(k) for k in LOSSES}, "attention": attention_ulps()}
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    for kernels, r in out["orders"].items():
        print(
            f"{kernels} losses: 0.6.1 {r['0.6.1']!r}, 0.7.0 {r['0.7.0']!r} ({r['ulps']} float32 "
            f"ULP apart; float64 mean {r['float64']!r})"
        )
    a = out["attention"]
    print(
        f"SDPA with {a['capabilities'][0]} vs {a['capabilities'][1]} kernels: {a['differ']} of "
        f"{a['elements']} elements differ, by up to {a['max_abs']:.1e} (up to "
        f"{a['max_ulps_above_0.1']} ULP where |x| > 0.1)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
