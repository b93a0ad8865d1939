"""The one loss-aggregation function: micro-batch and rank shares sum to the full batch."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.losses import AGG_MODES, LossScale, agg_loss


def ulp_distance(a: float, b: float) -> int:
    ia, ib = np.array([a, b], dtype=np.float64).view(np.int64)
    ia = ia if ia >= 0 else -(ia & 0x7FFFFFFFFFFFFFFF)
    ib = ib if ib >= 0 else -(ib & 0x7FFFFFFFFFFFFFFF)
    return abs(int(ia) - int(ib))


def _loss(seqs, mode, scale):
    values = torch.cat([v for v, _ in seqs]) if seqs else torch.zeros(0, dtype=torch.float64)
    mask = torch.cat([m for _, m in seqs]) if seqs else torch.zeros(0, dtype=torch.int64)
    ids = torch.cat([torch.full((len(v),), i) for i, (v, _) in enumerate(seqs)]) if seqs else mask
    return agg_loss(values, mask, ids, len(seqs), mode, scale)


@st.composite
def batches(draw):
    n = draw(st.integers(1, 12))
    seqs = []
    for _ in range(n):
        length = draw(st.integers(1, 30))
        vals = draw(st.lists(st.floats(0.0, 20.0), min_size=length, max_size=length))
        mask = draw(st.lists(st.integers(0, 1), min_size=length, max_size=length))
        mask[draw(st.integers(0, length - 1))] = 1  # at least one loss token per sequence
        seqs.append((torch.tensor(vals, dtype=torch.float64), torch.tensor(mask)))
    dp = draw(st.sampled_from([1, 2, 4]))
    mbs_per_rank = draw(st.integers(1, 4))
    return seqs, dp, mbs_per_rank


@pytest.mark.parametrize("mode", AGG_MODES)
@settings(max_examples=60, deadline=None)
@given(batch=batches())
def test_micro_batch_losses_sum_to_full_batch(mode, batch):
    seqs, dp, mbs_per_rank = batch
    tokens = float(sum(int(m.sum()) for _, m in seqs))
    horizon = 30.0
    full = _loss(seqs, mode, LossScale(tokens, float(len(seqs)), 1, horizon)).item()
    scale = LossScale(tokens, float(len(seqs)), dp, horizon)
    total = 0.0
    for r in range(dp):
        share = seqs[r::dp]
        size = max(1, -(-len(share) // mbs_per_rank))
        for i in range(0, max(len(share), 1), size):
            total += _loss(share[i : i + size], mode, scale).item()
    assert ulp_distance(total / dp, full) <= 8, (total / dp, full)


def test_modes_differ_and_unknown_mode_fails():
    seqs = [
        (torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1, 1, 0])),
        (torch.tensor([4.0]), torch.tensor([1])),
    ]
    scale = LossScale(3.0, 2.0, 1, 10.0)
    got = {m: _loss(seqs, m, scale).item() for m in AGG_MODES}
    assert got["token-mean"] == pytest.approx(7 / 3)
    assert got["seq-mean-token-sum"] == pytest.approx((3 + 4) / 2)
    assert got["seq-mean-token-mean"] == pytest.approx((1.5 + 4) / 2)
    assert got["seq-mean-token-sum-norm"] == pytest.approx((3 + 4) / 20)
    with pytest.raises(ValueError, match="unknown loss aggregation mode"):
        _loss(seqs, "token-sum", scale)
