"""Micro-batching: packed and padded layouts agree; dynamic batches fit their budget."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.data.batching import collate, dynamic_count, split_dynamic, split_fixed
from worker.data.charcount import Encoded
from worker.engine import warmup_cosine


def _sample(n: int, start: int) -> Encoded:
    ids = torch.arange(start, start + n) % 50 + 4
    mask = (torch.arange(n) >= n // 3).long()
    return Encoded(ids, mask)


def _triples(mb):
    keep = (
        mb.attention_mask if mb.attention_mask is not None else torch.ones_like(mb.input_ids)
    ).bool()
    return list(
        zip(
            mb.input_ids[keep].tolist(),
            mb.labels[keep].tolist(),
            mb.loss_mask[keep].tolist(),
            mb.seq_ids[keep].tolist(),
            strict=True,
        )
    )


def test_packed_and_padded_hold_the_same_tokens():
    samples = [_sample(n, i * 7) for i, n in enumerate([5, 9, 3, 12])]
    packed, padded = collate(samples, packed=True), collate(samples, packed=False)
    assert _triples(packed) == _triples(padded)
    assert packed.num_tokens == padded.num_tokens == 29
    assert packed.num_loss_tokens == padded.num_loss_tokens
    assert packed.position_ids[0, :6].tolist() == [0, 1, 2, 3, 4, 0]
    # the last token of each sequence predicts nothing
    assert packed.loss_mask[0, 4] == 0 and packed.loss_mask[0, 13] == 0


def test_empty_micro_batch_carries_no_loss():
    mb = collate([])
    assert mb.num_loss_tokens == 0 and mb.num_tokens == 0 and mb.input_ids.shape == (1, 1)


@settings(max_examples=100, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=30), budget=st.integers(40, 200))
def test_dynamic_partition_fits_budget_and_keeps_every_sample(lengths, budget):
    samples = [_sample(n, i) for i, n in enumerate(lengths)]
    count = dynamic_count(samples, budget)
    groups = split_dynamic(samples, count)
    assert len(groups) == count
    assert all(sum(len(s) for s in g) <= budget for g in groups)
    assert sorted(id(s) for g in groups for s in g) == sorted(id(s) for s in samples)
    assert split_dynamic(samples, count + 1)  # more groups than needed still works
    # each group keeps the original order
    position = {id(s): i for i, s in enumerate(samples)}
    for g in groups:
        idx = [position[id(s)] for s in g]
        assert idx == sorted(idx)


def test_fixed_split():
    samples = [_sample(3, i) for i in range(10)]
    assert [len(g) for g in split_fixed(samples, 4)] == [4, 4, 2]


def test_schedule_warms_up_then_decays_to_min():
    mult = [warmup_cosine(s, warmup=2, total=10, min_ratio=0.1) for s in range(11)]
    assert mult[0] < mult[1] < mult[2] == 1.0
    assert all(a >= b for a, b in zip(mult[2:], mult[3:], strict=False))
    assert mult[10] == 0.1
