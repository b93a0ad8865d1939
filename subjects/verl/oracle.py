"""A float64 oracle of a verl SFT run's val/loss (both formulas) and token counters.

    python -m subjects.verl.oracle RUN_DIR OUT.json     # with the verl env's python

RUN_DIR is a ``subjects.verl.run_sft --oracle-checkpoints`` folder: its ``run.json`` gives the
settings, ``inputs/`` the data, ``ckpt/global_step_K/model_world_size_W_rank_R.pt`` the weights at
each validation step K (saved right after validating at K, before any further update): FSDP2
shards (DTensors, Shard(0)), read with ``torch.load(weights_only=True)`` and joined. (verl 0.6.1
cannot save ``hf_model``: its FSDP engine passes the checkpoint config under a keyword the
checkpoint manager does not take, so ``checkpoint.save_contents`` is ignored there and the
default model/optimizer/extra shards are written; the shards are what both releases write.)

The samples are tokenized by verl's own ``MultiTurnSFTDataset`` of the run's release (so the
oracle sees exactly the token ids and loss masks the run saw), and laid out as the run lays them
out: ``DistributedSampler(shuffle=False, drop_last=True)`` for validation (rank r takes samples
r, r + world, ...), batches of ``batch_size / world`` per rank, and per batch as many
micro-batches as verl's dynamic batching makes: ``min(samples, ceil(tokens / budget))`` on each
rank, the maximum over ranks. Then, with every sample's NLL summed in float64 (the model in
float64, one right-padded batch), where L_b is val batch b's token-mean over all ranks (its loss
tokens N_b all-reduced, as verl's loss divides by them) and M_b its micro-batches per rank:

- ``old`` (verl 0.6.1): every micro-batch loss S/N_b * world in one list, averaged, averaged over
  ranks = sum_b L_b / sum_b M_b
- ``new`` (verl 0.7.0): micro-batch losses summed per batch, averaged over ranks (= L_b), then
  averaged over batches = mean_b L_b
- ``token_weighted``: the whole val set's token-mean (what neither computes with several batches)

and the train steps' ``global_tokens`` (sum of sequence lengths of the global batch: the train
sampler is ``DistributedSampler(shuffle=True, seed=0, drop_last=True)``, epoch 0).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path


def _dataset(inputs: Path, split: str):
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer
    from verl.utils.dataset.multiturn_sft_dataset import MultiTurnSFTDataset

    config = OmegaConf.create({"pad_mode": "no_padding", "max_length": 512, "truncation": "error"})
    tokenizer = AutoTokenizer.from_pretrained(inputs / "model")
    return MultiTurnSFTDataset(
        parquet_files=str(inputs / f"{split}.parquet"), tokenizer=tokenizer, config=config
    )


def _samples(dataset) -> list[tuple[list[int], list[int]]]:
    out = []
    for i in range(len(dataset)):
        item = dataset[i]
        ids, mask = item["input_ids"].tolist(), item["loss_mask"].tolist()
        # verl rolls the flattened loss mask left by one: a sample's loss covers the positions
        # whose next token has mask 1, so its first token's mask must be 0 (a user turn)
        assert mask[0] == 0, "the first token of a sample is in the loss"
        out.append((ids, mask))
    return out


def _weights(step_dir: Path, world: int) -> dict:
    """The full state dict from the FSDP2 shards of every rank."""
    import torch
    import torch.distributed.tensor  # noqa: F401 - lets weights_only loading accept DTensors

    shards = [
        torch.load(
            step_dir / f"model_world_size_{world}_rank_{r}.pt",
            weights_only=True,
            map_location="cpu",
        )
        for r in range(world)
    ]
    full = {}
    for key, first in shards[0].items():
        if not hasattr(first, "to_local"):
            full[key] = first
            continue
        (placement,) = first.placements
        assert placement.is_shard(), f"{key}: {placement}"
        full[key] = torch.cat([s[key].to_local() for s in shards], dim=placement.dim)
        assert full[key].shape == first.shape, key
    return full


def _nll_sums(model_dir: Path, weights: dict, samples) -> list[float]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(weights, strict=True)
    model = model.to(torch.float64)
    model.eval()
    # one right-padded batch: causal attention keeps every real token from seeing the padding
    width = max(len(ids) for ids, _ in samples)
    x = torch.zeros(len(samples), width, dtype=torch.long)
    attention = torch.zeros(len(samples), width, dtype=torch.long)
    weight = torch.zeros(len(samples), width - 1, dtype=torch.float64)
    for i, (ids, mask) in enumerate(samples):
        x[i, : len(ids)] = torch.tensor(ids)
        attention[i, : len(ids)] = 1
        weight[i, : len(ids) - 1] = torch.tensor(mask[1:], dtype=torch.float64)
    with torch.no_grad():
        logits = model(input_ids=x, attention_mask=attention).logits.to(torch.float64)
    logp = torch.log_softmax(logits[:, :-1], dim=-1)
    nll = -logp.gather(2, x[:, 1:, None])[..., 0]
    sums = (nll * weight).sum(dim=1).tolist()
    return sums


def _layout(n: int, world: int, per_rank: int) -> list[list[list[int]]]:
    """[batch][rank] -> sample indices, as DistributedSampler(shuffle=False, drop_last=True) and a
    DataLoader(batch_size=per_rank, drop_last=True) give them."""
    total = n - n % world
    ranks = [list(range(r, total, world)) for r in range(world)]
    batches = len(ranks[0]) // per_rank
    return [
        [ranks[r][b * per_rank : (b + 1) * per_rank] for r in range(world)] for b in range(batches)
    ]


def val_losses(sums, samples, layout, budget: int) -> dict:
    tokens = [sum(m) for _, m in samples]
    lengths = [len(ids) for ids, _ in samples]
    means, micro, loss_tokens = [], [], []
    for batch in layout:
        n_b = sum(tokens[i] for rank in batch for i in rank)
        means.append(sum(sums[i] for rank in batch for i in rank) / n_b)
        per_rank = [min(len(r), math.ceil(sum(lengths[i] for i in r) / budget)) for r in batch]
        micro.append(max(per_rank))
        loss_tokens.append(n_b)
    used = [i for batch in layout for rank in batch for i in rank]
    return {
        "old": sum(means) / sum(micro),
        "new": sum(means) / len(means),
        "token_weighted": sum(sums[i] for i in used) / sum(tokens[i] for i in used),
        "batch_means": means,
        "micro_batches": micro,
        "batch_loss_tokens": loss_tokens,
    }


def train_tokens(lengths: list[int], world: int, per_rank: int, steps: int) -> list[int]:
    import torch

    g = torch.Generator()
    g.manual_seed(0)  # DistributedSampler's seed 0 + epoch 0
    order = torch.randperm(len(lengths), generator=g).tolist()
    total = len(lengths) - len(lengths) % world
    order = order[:total]
    ranks = [order[r:total:world] for r in range(world)]
    out = []
    for step in range(steps):
        batch = [i for r in ranks for i in r[step * per_rank : (step + 1) * per_rank]]
        out.append(sum(lengths[i] for i in batch))
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m subjects.verl.oracle RUN_DIR OUT.json", file=sys.stderr)
        return 2
    run_dir = Path(args[0]).resolve()
    run = json.loads((run_dir / "run.json").read_text())
    settings = run["settings"]
    world, per_rank = settings["world"], settings["batch_size"] // settings["world"]
    inputs = run_dir / "inputs"
    val = _samples(_dataset(inputs, "val"))
    layout = _layout(len(val), world, per_rank)
    result = {"verl": run["verl"], "layout": layout, "val": {}}
    for ckpt in sorted((run_dir / "ckpt").glob("global_step_*"), key=lambda p: int(p.name[12:])):
        sums = _nll_sums(inputs / "model", _weights(ckpt, world), val)
        result["val"][ckpt.name[12:]] = val_losses(
            sums, val, layout, settings["max_tokens_per_rank"]
        )
    train = _dataset(inputs, "train")
    lengths = [len(train[i]["input_ids"]) for i in range(len(train))]
    result["global_tokens"] = train_tokens(lengths, world, per_rank, settings["steps"])
    Path(args[1]).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
