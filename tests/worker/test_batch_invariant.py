"""worker.batch_invariant: a token's log-prob has the same bits in every layout the on-policy
chain compares (one process, no torch.distributed: the forward alone).

The default forward is measured too: the test could fail, since on this project's CPUs the
default forward does give other bits across these layouts (the rows below would all be equal
without the batch-invariant mode only by luck).
"""

from __future__ import annotations

import pytest
import torch

from worker import batch_invariant as bi
from worker.data.batching import collate
from worker.data.charcount import DATA_DIR, TOKENIZER_DIR, Encoded, load_tokenizer, read_jsonl
from worker.losses import token_log_probs
from worker.model import load_model
from worker.warm_start import WARM_MODEL_DIR

NEW_TOKENS = 40


def _layouts(batch_invariant: bool) -> dict[str, torch.Tensor]:
    """Response log-probs [4, NEW_TOKENS] of 4 sampled responses, five ways."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = load_model(WARM_MODEL_DIR, batch_invariant=batch_invariant).eval()
        tok = load_tokenizer(TOKENIZER_DIR)
        prompts = read_jsonl(DATA_DIR / "train.jsonl")[:4]
        ids = [
            list(tok.apply_chat_template(p["messages"][:1], add_generation_prompt=True,
                                         tokenize=True, return_dict=False))
            for p in prompts
        ]  # fmt: skip
        width, pad = max(map(len, ids)), tok.pad_token_id
        inp = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
        att = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
        torch.manual_seed(0)
        with torch.no_grad():
            out = model.generate(
                input_ids=inp, attention_mask=att, do_sample=True, max_new_tokens=NEW_TOKENS,
                top_k=0, eos_token_id=None, pad_token_id=pad, use_cache=True,
                return_dict_in_generate=True, output_logits=True,
            )  # fmt: skip
            resp = out.sequences[:, width:]
            decode = token_log_probs(torch.stack(out.logits, 1), resp).reshape(resp.shape)
            full_att = torch.cat([att, torch.ones_like(resp)], 1)
            pos = (full_att.cumsum(-1) - 1).clamp(min=0)
            logits = model(
                input_ids=out.sequences, attention_mask=full_att, position_ids=pos
            ).logits
            prefill = token_log_probs(logits[:, width - 1 : -1], resp).reshape(resp.shape)
            samples = [torch.tensor(x + resp[i].tolist()) for i, x in enumerate(ids)]

            def trainer(groups: list[list[int]], packed: bool = True) -> torch.Tensor:
                rows = {}
                for g in groups:
                    mb = collate([Encoded(samples[i], torch.ones_like(samples[i])) for i in g],
                                 packed=packed)  # fmt: skip
                    lg = model(**mb.model_inputs(torch.device("cpu"))).logits
                    lp = token_log_probs(lg, mb.labels).reshape(mb.labels.shape)
                    offset = 0
                    for j, i in enumerate(g):
                        n, p = len(samples[i]), len(ids[i])
                        row = lp[0, offset : offset + n] if packed else lp[j, :n]
                        rows[i] = row[p - 1 : n - 1]
                        offset += n
                return torch.stack([rows[i] for i in range(len(samples))])

            return {
                "decode": decode,
                "prefill": prefill,
                "trainer_1": trainer([[0], [1], [2], [3]]),
                "trainer_4": trainer([[0, 1, 2, 3]]),
                "trainer_padded": trainer([[0, 1, 2, 3]], packed=False),
            }
    finally:
        torch.set_num_threads(threads)


def test_batch_invariant_forward_is_the_same_in_every_layout():
    got = _layouts(batch_invariant=True)
    for name, values in got.items():
        assert torch.equal(values, got["prefill"]), name


def test_the_default_forward_is_not():
    """What the mode fixes: decode vs prefill and packed batches of 1 vs 4 differ by default."""
    got = _layouts(batch_invariant=False)
    assert not torch.equal(got["decode"], got["prefill"])
    assert not torch.equal(got["trainer_1"], got["trainer_4"])


@pytest.fixture
def one_thread():
    """The mode's condition (the PPO job sets it): one intra-op thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_padded_matmul_rows_do_not_depend_on_the_call(one_thread):
    bi.check_matmul_rows()
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(40, 64, generator=gen), torch.randn(64, 101, generator=gen)
    whole = bi.padded_matmul(a, b)
    for i in range(0, 40, 7):
        assert torch.equal(bi.padded_matmul(a[i : i + 1], b), whole[i : i + 1])


def test_attention_refuses_keys_that_are_not_one_run(one_thread):
    model = load_model(WARM_MODEL_DIR, batch_invariant=True)
    module = model.model.layers[0].self_attn
    q = torch.randn(1, 4, 3, 16)
    k = v = torch.randn(1, 2, 3, 16)
    mask = torch.tensor([[True, False, True]] * 3)[None, None]
    with pytest.raises(ValueError, match="not one contiguous run"):
        bi.attention(module, q, k, v, mask)
