"""Two facts of verl 0.7.1's engine workers with ``use_remove_padding=False``, read from verl's own
functions without Ray or a training run: run with the verl environment's python.

    python -m subjects.verl.rl_probe MODEL_DIR

prints one JSON object:

- ``actor_attention``: the engine actor's padded branch. A left-padded batch goes through
  ``left_right_2_no_padding`` (``workers/utils/padding.py``) and
  ``FSDPEngineWithLMHead.prepare_model_inputs`` (``workers/engine/fsdp/transformer_impl.py``) as
  the trainer sends it: ``sequence_lengths`` (prompt and response tokens of each row),
  ``response_length`` and ``attention_ones`` (the ones per row of the attention mask the model
  gets; ``response_length`` each, as the mask is built from ``loss_mask``, the response mask).
- ``critic_remove_padding``: the engine critic's setting. The trainer turns ``config.critic``
  into ``CriticConfig`` (``omega_conf_to_dataclass``), then hands ``model_config`` to the
  ``TrainingWorker``, which reads ``use_remove_padding`` from it. ``critic_model``: what the
  command line set (``critic.model.use_remove_padding=False``); ``engine_model_config``: what the
  engine reads (``CriticConfig.__post_init__`` builds ``model_config`` from five keys of
  ``critic.model`` and ``HFModelConfig`` defaults the rest: True).
"""

from __future__ import annotations

import json
import os
import sys

import torch


def actor_attention(response_length: int = 4) -> dict:
    """The padded branch of the engine actor on a 3-row left-padded batch."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.utils.dataset.dataset_utils import DatasetPadMode
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    from verl.workers.utils.padding import left_right_2_no_padding

    prompt_lengths, prompt_width = [5, 7, 3], 8
    rows = len(prompt_lengths)
    width = prompt_width + response_length
    attention = torch.zeros((rows, width), dtype=torch.long)
    for i, n in enumerate(prompt_lengths):
        attention[i, prompt_width - n :] = 1
    position = (attention.cumsum(-1) - 1).clamp(min=0)
    batch = TensorDict(
        {
            "input_ids": torch.arange(rows * width).reshape(rows, width) % 50 + 1,
            "attention_mask": attention,
            "response_mask": torch.ones((rows, response_length), dtype=torch.long),
            "position_ids": position,
        },
        batch_size=rows,
    )
    batch = left_right_2_no_padding(batch)
    batch["temperature"] = torch.ones(rows)
    tu.assign_non_tensor(batch, use_remove_padding=False, pad_mode=DatasetPadMode.NO_PADDING)
    engine = FSDPEngineWithLMHead.__new__(FSDPEngineWithLMHead)  # the method reads no state
    inputs, _ = FSDPEngineWithLMHead.prepare_model_inputs(engine, batch)
    return {
        "sequence_lengths": attention.sum(-1).tolist(),
        "response_length": response_length,
        "attention_ones": inputs["attention_mask"].sum(-1).tolist(),
    }


def critic_remove_padding(model: str) -> dict:
    """The critic's use_remove_padding as set on the command line, and as the engine reads it."""
    import verl
    from hydra import compose, initialize_config_dir
    from verl.utils.config import omega_conf_to_dataclass

    where = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    overrides = [
        f"actor_rollout_ref.model.path={model}",
        f"critic.model.path={model}",
        "critic.model.use_remove_padding=False",
        "critic.strategy=fsdp",
        "critic.ppo_micro_batch_size_per_gpu=4",
    ]
    with initialize_config_dir(config_dir=where, version_base=None):
        config = compose(config_name="ppo_trainer", overrides=overrides)
    critic = omega_conf_to_dataclass(config.critic)
    return {
        "critic_model": bool(config.critic.model.use_remove_padding),
        "engine_model_config": bool(critic.model_config.use_remove_padding),
    }


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m subjects.verl.rl_probe MODEL_DIR", file=sys.stderr)
        return 2
    facts = {
        "actor_attention": actor_attention(),
        "critic_remove_padding": critic_remove_padding(args[0]),
    }
    print(json.dumps(facts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
