"""A deterministic rollout for verl 0.7.1's ``main_ppo`` on CPU, through verl's own hooks.

verl 0.7 generates only through vLLM, SGLang or TensorRT-LLM servers (``workers/rollout/base.py``
``_ROLLOUT_REGISTRY``), none of which runs on this CPU, and its stock ``AgentLoopManager`` is not
reproducible run to run (uuid4 request ids, least-loaded server routing). Two stand-ins:

- ``SeededRollout``: the rollout object each actor rank builds (``rollout.name=parity_seeded``;
  ``subjects.verl.rl_shim`` registers it in ``_ROLLOUT_REGISTRY``). It holds no model: the weight
  sync verl runs before every step (``update_weights``) hands it the actor's full tensors, which
  it consumes (each rank must: the generator all-gathers FSDP shards) and counts.
- ``SeededAgentLoopManager``: the trainer's rollout manager
  (``+actor_rollout_ref.rollout.agent.agent_loop_manager_class=subjects.verl.rl_rollout.SeededAgentLoopManager``;
  the trainer calls ``create`` and then only ``generate_sequences``). It tokenizes each prompt with
  the chat template as verl's agent loop does, left-pads it to ``rollout.prompt_length``, and draws
  ``rollout.response_length`` response tokens from a generator seeded by the step and the sample's
  position in the batch: the same samples on both sides, in batch order, whatever the worker
  implementation. The reward comes from verl's own reward loop workers (the
  ``custom_reward_function``), placed on the last response token as verl's agent loop places it.

With ``PARITY_VERL_RECORD=OUT`` (``run_ppo --record``) the manager writes the harness's data
digests of each training step into ``OUT/ranks/rank0.jsonl`` through ``parity.record``: the
prompts (token ids, in batch order: ``prompts``) and the rollout (``input_ids``,
``attention_mask``, ``response_mask``: ``rollout``), the data both worker implementations are
fed, taken where it is made (the trainer's process), so ``parity pair`` can say "prompts differ"
(data) apart from numbers. ``PARITY_VERL_PLANT=repeat-batch@K`` plants a data bug for tests: at
step K the manager takes step K-1's prompts again (the dataloader handing one side the same batch
twice); the responses stay seeded by step and position.

Responses never hold an EOS token and are all full length: every sample has the same number of
response tokens, so token-mean and sequence-mean aggregations see equal weights.
"""

from __future__ import annotations

import os

import numpy as np
import ray
import torch
from tensordict import TensorDict
from verl import DataProto
from verl.utils import hf_tokenizer
from verl.utils.fs import copy_to_local
from verl.utils.model import compute_position_id_with_mask
from verl.workers.rollout.base import BaseRollout

from subjects.verl.plant import plant as planted_step

NAME = "parity_seeded"
SEED = 20260
RECORD = "PARITY_VERL_RECORD"


class SeededRollout(BaseRollout):
    """The per-rank rollout object: takes the weights verl syncs to it, generates nothing."""

    def __init__(self, config, model_config, device_mesh, *args, **kwargs):
        super().__init__(config, model_config, device_mesh, *args, **kwargs)
        self.synced = 0  # weight syncs received

    async def resume(self, tags: list[str]):
        return None

    async def release(self):
        return None

    async def update_weights(self, weights, **kwargs):
        dump = os.environ.get("PARITY_VERL_DUMP")  # the diagnostic of subjects.verl.rl_shim
        keep = {} if dump and os.environ.get("RANK", "0") == "0" else None
        for name, tensor in weights:  # drains the generator: it all-gathers FSDP shards
            if keep is not None:
                keep[name] = tensor.detach().to("cpu", copy=True)
            del tensor
        self.synced += 1
        if keep is not None:
            torch.save(keep, os.path.join(dump, f"rollout_weights{self.synced}.pt"))


class SeededAgentLoopManager:
    """verl's rollout manager, replaced: seeded responses in batch order (module doc)."""

    def __init__(self, config, worker_group=None, rollout_resource_pool=None, reward_handles=None):
        self.config = config
        self.worker_group = worker_group
        self.reward_handles = reward_handles
        self.rollout = config.actor_rollout_ref.rollout
        local = copy_to_local(config.actor_rollout_ref.model.path)
        self.tokenizer = hf_tokenizer(local, trust_remote_code=False)
        self.rollout_replicas = []  # no servers: the checkpoint manager sleeps and wakes none
        self.vocab = len(self.tokenizer)
        self.specials = set(self.tokenizer.all_special_ids)
        self.plant = planted_step()
        self.previous = None  # the last training step's prompts (for the plant)
        self.recorder = None
        if os.environ.get(RECORD):
            from parity.record import Recorder

            self.recorder = Recorder(os.environ[RECORD], rank=0, metrics=False)

    @classmethod
    def create(
        cls, config, worker_group=None, rollout_resource_pool=None, reward_loop_worker_handles=None
    ):
        return cls(config, worker_group, rollout_resource_pool, reward_loop_worker_handles)

    def _prompt_ids(self, messages) -> list[int]:
        ids = self.tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=True
        )
        return list(ids)

    def _responses(self, n: int, step: int, validate: bool) -> torch.Tensor:
        """n rows of response tokens, row i drawn from a generator seeded by (step, i)."""
        allowed = torch.tensor([t for t in range(self.vocab) if t not in self.specials])
        rows = []
        for i in range(n):
            g = torch.Generator().manual_seed(SEED + 1_000_003 * step + 7919 * i + int(validate))
            pick = torch.randint(len(allowed), (self.rollout.response_length,), generator=g)
            rows.append(allowed[pick])
        return torch.stack(rows)

    def _planted(self, prompts: DataProto, step: int) -> DataProto:
        """The prompts this step trains on: the previous step's again at the planted step."""
        previous, self.previous = self.previous, prompts
        if step != self.plant or previous is None:
            return prompts
        print(f"[subjects.verl.rl_rollout] plant: step {step} takes step {step - 1}'s prompts")
        return previous

    def _record(self, step: int, prompt_ids: list[list[int]], out: DataProto) -> None:
        """The step's data digests (module doc)."""
        rec = self.recorder
        rec.digest.add_prompts(prompt_ids)
        batch = out.batch
        rec.batch(
            batch["input_ids"], batch["attention_mask"], batch["response_mask"], kind="rollout"
        )
        rec.log(step, {})

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        step = int(prompts.meta_info.get("global_steps", -1))
        validate = bool(prompts.meta_info.get("validate", False))
        if not validate:
            prompts = self._planted(prompts, step)
        n = len(prompts)
        plen, rlen = self.rollout.prompt_length, self.rollout.response_length
        pad = self.tokenizer.pad_token_id
        prompt_ids = torch.full((n, plen), pad, dtype=torch.long)
        prompt_mask = torch.zeros((n, plen), dtype=torch.long)
        kept = []
        for i, messages in enumerate(prompts.non_tensor_batch["raw_prompt"]):
            ids = self._prompt_ids(messages)[-plen:]
            kept.append(ids)
            prompt_ids[i, plen - len(ids) :] = torch.tensor(ids)
            prompt_mask[i, plen - len(ids) :] = 1
        responses = self._responses(n, step, validate)
        response_mask = torch.ones((n, rlen), dtype=torch.long)
        attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
        input_ids = torch.cat([prompt_ids, responses], dim=1)
        batch = TensorDict(
            {
                "prompts": prompt_ids,
                "responses": responses,
                "response_mask": response_mask,
                "input_ids": input_ids,
                "attention_mask": attention_mask,
                "position_ids": compute_position_id_with_mask(attention_mask),
            },
            batch_size=n,
        )
        out = DataProto(batch=batch, non_tensor_batch={}, meta_info={})
        scores, extra = self._scores(out, prompts)
        rm_scores = torch.zeros((n, rlen), dtype=torch.float32)
        rm_scores[:, rlen - 1] = torch.tensor(scores, dtype=torch.float32)
        out.batch["rm_scores"] = rm_scores
        out.non_tensor_batch["__num_turns__"] = np.full(n, 2, dtype=np.int32)
        # text only: verl's agent loop gives every sample an empty dict, which the trainer reads
        out.non_tensor_batch["multi_modal_inputs"] = np.array([{} for _ in range(n)], dtype=object)
        for key, values in extra.items():
            out.non_tensor_batch[key] = np.array(values)
        out.meta_info = {"timing": {}, "reward_extra_keys": list(extra)}
        if self.recorder is not None and not validate:
            self._record(step, kept, out)
        return out

    def _scores(self, out: DataProto, prompts: DataProto) -> tuple[list[float], dict]:
        """verl's reward loop workers score the samples (the custom_reward_function)."""
        keys = ("data_source", "reward_model", "extra_info")
        data = DataProto(
            batch=out.batch.select("prompts", "responses", "attention_mask", "input_ids"),
            non_tensor_batch={k: prompts.non_tensor_batch[k] for k in keys},
        )
        results = ray.get(self.reward_handles[0].compute_score_batch.remote(data))
        scores = [float(r["reward_score"]) for r in results]
        infos = [r.get("reward_extra_info", {}) for r in results]
        extra = {k: [info[k] for info in infos] for k in (infos[0] if infos else {})}
        return scores, extra

    def start_profile(self, **kwargs):
        return None

    def stop_profile(self):
        return None

    def clear_kv_cache(self):
        return None
