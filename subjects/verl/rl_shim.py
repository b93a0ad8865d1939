"""Run verl 0.7.1's ``main_ppo`` on CPU ranks: the SFT shim's patches plus those PPO needs.

Loaded ONLY through verl's own hook, in every process that imports verl (the driver, Ray's
TaskRunner, the worker and reward actors: Ray's local cluster passes the driver's environment on):
``VERL_USE_EXTERNAL_MODULES=subjects.verl.rl_shim``, with the repository root on ``PYTHONPATH``
(``subjects.verl.run_ppo`` sets both). Importing it applies ``subjects.verl.cpu_shim`` first
(gloo for nccl, the engine lookup for cpu, ``torch.cpu`` memory calls, fp32 instead of CPU
autocast, the qwen_vl_utils stand-in, data loading in the process); what PPO needs on top, each
patch saying what fails without it:

7. ``process group``: the legacy workers (``workers/fsdp_workers.py:158-160``) and the engine
   workers (``utils/distributed.py:82``) initialise torch.distributed with
   ``f"cpu:gloo,{get_device_name()}:{get_nccl_backend()}"``, which on CPU (with patch 1) is
   ``"cpu:gloo,cpu:gloo"``, and torch rejects it ("Duplicate device type cpu"). The patch wraps
   ``torch.distributed.init_process_group`` so that a backend string naming only gloo, for cpu
   alone, becomes plain ``"gloo"``; any other backend passes unchanged.
8. ``rollout``: the rollout registry (``workers/rollout/base.py`` ``_ROLLOUT_REGISTRY``) holds
   only vLLM, SGLang and TensorRT-LLM; the patch adds ``("parity_seeded", "async")``, the stand-in
   of ``subjects.verl.rl_rollout`` (the command line selects it with
   ``actor_rollout_ref.rollout.name=parity_seeded`` and its manager with
   ``+actor_rollout_ref.rollout.agent.agent_loop_manager_class=...``).
9. ``value head attention``: the legacy critic loads its model through
   ``verl.utils.model.load_valuehead_model``, which passes
   ``attn_implementation="flash_attention_2"`` to ``from_pretrained`` whatever the config says
   (``utils/model.py:633-640``); flash-attn has no CPU build, so transformers raises and verl
   reports "not a value head model, please install trl". The patch loads with the attention the
   critic's config asks for (``+critic.model.override_config.attn_implementation=sdpa``), as
   the engine path does; the weights loaded are the same.
10. ``padding helpers``: the engine path turns the trainer's padded batches into packed ones
   (``workers/utils/padding.py:53`` ``left_right_2_no_padding``) with ``unpad_input`` of
   ``verl.utils.attention_utils``, which imports ``flash_attn.bert_padding`` unless the host is
   an NPU (``utils/attention_utils.py:27-30``): no flash-attn, no module. Those four helpers are
   plain torch (index, gather, scatter); verl ships the same code for NPU in
   ``verl.utils.npu_flash_attn_utils`` (torch and einops only). The patch takes them from there
   where flash_attn cannot be imported; nothing else changes.

A diagnostic, off unless asked (``subjects.verl.run_ppo --dump``): with ``PARITY_VERL_DUMP=DIR``
the trainer saves, at every step, the batch tensors it computed the old log-probs and values of
(``DIR/step{N}.pt``: input ids, masks, ``old_log_probs``, ``entropys``, ``values``); on the engine
side rank 0 also saves the actor's parameters at each log-prob pass (``engine_actor{K}.pt``) and
the model inputs of its first two forwards (``engine_actor_inputs{K}.pt``); the rollout stand-in
saves the weights each sync sends it (``rollout_weights{K}.pt``); on both sides rank 0 saves the
gradients at each grad-norm clip, gathered, with each rank's shard and the norm
(``grads{K}.pt``: the critic's, then the actor's, at each step). Numbers are unchanged.

Another, off unless asked (``run_ppo --trace-step K``): with ``PARITY_VERL_TRACE=K`` and
``PARITY_VERL_TRACE_OUT=DIR`` every rank traces the ops of training step K into ``DIR/ops/``
(``parity.record.optrace``, what the harness's diagnosis reads to name the first differing op):
the worker calls that compute, in the order the trainer makes them (the critic's values, the
actor's log-probs, the critic's update, the actor's update), each traced inside
``OpTracer.within`` with its role (``critic:``/``actor:`` before the module names: both models
are a Qwen2 body with the same module paths), the trace written when step K's actor update
returns. The worker counts the step itself (one actor update per step). Numbers are unchanged.

``applied()`` (from ``subjects.verl.cpu_shim``) lists every patch in force.
"""

from __future__ import annotations

import torch
import torch.distributed

from subjects.verl import cpu_shim
from subjects.verl.cpu_shim import _note, applied  # noqa: F401 - applied is this module's API too
from subjects.verl.hooks import after_import

ROLLOUT = "parity_seeded"
ROLLOUT_CLASS = "subjects.verl.rl_rollout.SeededRollout"


# -- 7. one gloo backend for cpu -----------------------------------------------------------------


def _only_gloo(backend) -> bool:
    if not isinstance(backend, str) or "," not in backend:
        return False
    parts = {part.strip() for part in backend.split(",")}
    return parts == {"cpu:gloo"}


def _patch_process_group() -> None:
    original = torch.distributed.init_process_group
    if getattr(original, "_parity_shim", False):
        return

    def init_process_group(*args, **kwargs):
        if args and _only_gloo(args[0]):
            args = ("gloo", *args[1:])
        if _only_gloo(kwargs.get("backend")):
            kwargs["backend"] = "gloo"
        return original(*args, **kwargs)

    init_process_group._parity_shim = True
    torch.distributed.init_process_group = init_process_group
    _note("process group: backend 'cpu:gloo,cpu:gloo' -> 'gloo'")


# -- 8. the seeded rollout in verl's registry ----------------------------------------------------


def _register_rollout(base) -> None:
    base._ROLLOUT_REGISTRY[(ROLLOUT, "async")] = ROLLOUT_CLASS
    _note(f"rollout: _ROLLOUT_REGISTRY[({ROLLOUT!r}, 'async')] = {ROLLOUT_CLASS}")


# -- 9. the legacy value head loaded with the configured attention -------------------------------


def _patch_valuehead(model_utils) -> None:
    original = model_utils.load_valuehead_model
    if getattr(original, "_parity_shim", False):
        return

    def load_valuehead_model(local_path, torch_dtype, model_config, trust_remote_code):
        from transformers import AutoModelForTokenClassification

        return AutoModelForTokenClassification.from_pretrained(
            pretrained_model_name_or_path=local_path,
            torch_dtype=torch_dtype,
            config=model_config,
            attn_implementation=getattr(model_config, "_attn_implementation", None) or "sdpa",
            trust_remote_code=trust_remote_code,
            use_safetensors=True,
        )

    load_valuehead_model._parity_shim = True
    model_utils.load_valuehead_model = load_valuehead_model
    _note("value head attention: load_valuehead_model uses the config's attn_implementation")


# -- 10. the packing helpers without flash-attn ---------------------------------------------------


def _patch_padding_helpers(attention_utils) -> None:
    import importlib.util

    original = attention_utils._get_attention_functions
    if getattr(original, "_parity_shim", False) or importlib.util.find_spec("flash_attn"):
        return

    def _get_attention_functions():
        from verl.utils import npu_flash_attn_utils as plain

        helpers = (plain.index_first_axis, plain.pad_input, plain.rearrange, plain.unpad_input)
        (
            attention_utils._index_first_axis,
            attention_utils._pad_input,
            attention_utils._rearrange,
            attention_utils._unpad_input,
        ) = helpers
        return helpers

    _get_attention_functions._parity_shim = True
    attention_utils._get_attention_functions = _get_attention_functions
    _note("padding helpers: unpad_input & co. from verl.utils.npu_flash_attn_utils (plain torch)")


# -- diagnostic: the trainer's per-step tensors ---------------------------------------------------


def _untraced():
    """The dumps' own ops kept out of a step's op trace (they gather shards, which the two worker
    implementations lay out differently: ops of the diagnostic, not of the training)."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def _dump_tensors(ray_trainer) -> None:
    import os

    where = os.environ.get("PARITY_VERL_DUMP")
    if not where:
        return
    trainer = ray_trainer.RayPPOTrainer
    compute_old, compute_values = trainer._compute_old_log_prob, trainer._compute_values

    def _save(self, name: str, tensors: dict) -> None:
        path = os.path.join(where, f"step{self.global_steps}.pt")
        saved = torch.load(path, weights_only=True) if os.path.exists(path) else {}
        saved[name] = {k: v.detach().clone() for k, v in tensors.items()}
        torch.save(saved, path)

    def _compute_old_log_prob(self, batch):
        old, mfu = compute_old(self, batch)
        keys = ("input_ids", "attention_mask", "response_mask", "position_ids")
        _save(self, "batch", {k: batch.batch[k] for k in keys})
        _save(self, "old", {k: old.batch[k] for k in ("old_log_probs", "entropys")})
        return old, mfu

    def _compute_values(self, batch):
        values = compute_values(self, batch)
        _save(self, "values", {"values": values.batch["values"]})
        return values

    trainer._compute_old_log_prob = _compute_old_log_prob
    trainer._compute_values = _compute_values
    os.makedirs(where, exist_ok=True)
    _note(f"dump: the trainer's per-step tensors into {where}")


def _dump_engine_actor(engine_workers) -> None:
    """With PARITY_VERL_DUMP: the engine actor's parameters as its log-prob pass sees them."""
    import functools
    import os

    where = os.environ.get("PARITY_VERL_DUMP")
    if not where:
        return
    worker = engine_workers.ActorRolloutRefWorker
    original = worker.compute_log_prob

    @functools.wraps(original)  # keeps verl's dispatch attributes
    def compute_log_prob(self, data):
        full = {}
        with _untraced():
            for name, param in self.actor.engine.module.named_parameters():
                tensor = param.full_tensor() if hasattr(param, "full_tensor") else param
                full[name] = tensor.detach().to("cpu", copy=True)
        self._parity_calls = getattr(self, "_parity_calls", 0) + 1
        if torch.distributed.get_rank() == 0:
            torch.save(full, os.path.join(where, f"engine_actor{self._parity_calls}.pt"))
        return original(self, data)

    worker.compute_log_prob = compute_log_prob


def _dump_engine_inputs(transformer_impl) -> None:
    """With PARITY_VERL_DUMP: the model inputs of the engine actor's first two forwards (rank 0):
    what its attention mask lets each token see."""
    import os

    where = os.environ.get("PARITY_VERL_DUMP")
    if not where:
        return
    engine = transformer_impl.FSDPEngineWithLMHead
    original = engine.prepare_model_inputs

    def prepare_model_inputs(self, micro_batch):
        inputs, args = original(self, micro_batch)
        if type(self) is engine:  # the actor, not the value head that inherits this
            calls = getattr(self, "_parity_calls", 0) + 1
            self._parity_calls = calls
            if calls <= 2 and torch.distributed.get_rank() == 0:
                with _untraced():
                    kept = {k: v.detach().clone() for k, v in inputs.items() if torch.is_tensor(v)}
                    torch.save(kept, os.path.join(where, f"engine_actor_inputs{calls}.pt"))
        return inputs, args

    engine.prepare_model_inputs = prepare_model_inputs


def _dump_grads(module) -> None:
    """With PARITY_VERL_DUMP: every gradient as the grad-norm clip sees it (before clipping),
    gathered to full tensors, with the shard each rank holds and the norm it returns
    (``grads{K}.pt`` on rank 0, K counting the clip calls of the worker process: critic, then
    actor, at each step). Patched where each worker module imported the function by name."""
    import os

    where = os.environ.get("PARITY_VERL_DUMP")
    original = getattr(module, "fsdp2_clip_grad_norm_", None)
    if not where or original is None or getattr(original, "_parity_shim", False):
        return

    def fsdp2_clip_grad_norm_(parameters, *args, **kwargs):
        parameters = list(parameters)
        full, shards = [], []
        with _untraced():
            for p in parameters:
                grad = p.grad
                if grad is None:
                    continue
                local = grad.to_local() if hasattr(grad, "to_local") else grad
                shards.append((tuple(local.shape), str(getattr(grad, "placements", ""))))
                gathered = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
                full.append(gathered.detach().to("cpu", copy=True))
        norm = original(parameters, *args, **kwargs)
        with _untraced():  # the full norm: every rank takes part in the gather
            whole = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        _dump_grads.calls += 1
        if torch.distributed.get_rank() == 0:
            saved = {"grads": full, "shards": shards, "norm": whole.detach().to("cpu", copy=True)}
            torch.save(saved, os.path.join(where, f"grads{_dump_grads.calls}.pt"))
        return norm

    fsdp2_clip_grad_norm_._parity_shim = True
    module.fsdp2_clip_grad_norm_ = fsdp2_clip_grad_norm_


_dump_grads.calls = 0


# -- diagnostic: every op of one training step ---------------------------------------------------


class _StepTrace:
    """One process's trace of step ``step`` (module doc): its tracer, the actor updates done."""

    def __init__(self, step: int, out: str):
        self.step, self.out = step, out
        self.updates = 0  # actor updates this process finished: the step is updates + 1
        self.tracer = None
        self.inside = False  # a traced call is running (the engine actor's own TrainingWorker)

    def call(self, original, worker, role: str, model, args, kwargs):
        if self.inside or self.updates + 1 != self.step:
            return original(worker, *args, **kwargs)
        from parity.record.optrace import OpTracer

        if self.tracer is None:
            self.tracer = OpTracer()
        self.inside = True
        try:
            with self.tracer.within(role, model):
                return original(worker, *args, **kwargs)
        finally:
            self.inside = False

    def updated(self) -> None:
        """After an actor update: step K's trace written when K's returns."""
        self.updates += 1
        if self.updates == self.step and self.tracer is not None:
            self.tracer.write(self.out, self.step, torch.distributed.get_rank())
            self.tracer = None


def _trace_step(classes) -> None:
    """With PARITY_VERL_TRACE: wrap the computing methods of ``classes`` ((class, role, method
    names, where the model is, whether a call is the actor update) each) in the step's trace."""
    import functools
    import os

    step = os.environ.get("PARITY_VERL_TRACE")
    if not step:
        return
    global _STEP_TRACE
    if _STEP_TRACE is None:
        _STEP_TRACE = _StepTrace(int(step), os.environ["PARITY_VERL_TRACE_OUT"])
    trace = _STEP_TRACE

    def wrap(original, role: str, model_of, update: bool):
        @functools.wraps(original)  # keeps verl's dispatch attributes
        def traced(self, *args, **kwargs):
            result = trace.call(original, self, role, model_of(self), args, kwargs)
            if update:
                trace.updated()
            return result

        traced._parity_shim = True
        return traced

    for cls, role, names, model_of, update in classes:
        for name in names:
            original = getattr(cls, name)
            if not getattr(original, "_parity_shim", False):
                setattr(cls, name, wrap(original, role, model_of, name == update))


_STEP_TRACE: _StepTrace | None = None


def _trace_legacy(fsdp_workers) -> None:
    _trace_step([
        (fsdp_workers.ActorRolloutRefWorker, "actor", ("compute_log_prob", "update_actor"),
         lambda w: getattr(w, "actor_module_fsdp", None), "update_actor"),
        (fsdp_workers.CriticWorker, "critic", ("compute_values", "update_critic"),
         lambda w: getattr(w, "critic_module", None), None),
    ])  # fmt: skip


def _trace_engine(engine_workers) -> None:
    def module(training_worker):
        return getattr(getattr(training_worker, "engine", None), "module", None)

    _trace_step([
        (engine_workers.ActorRolloutRefWorker, "actor", ("compute_log_prob", "update_actor"),
         lambda w: module(getattr(w, "actor", None)), "update_actor"),
        # the critic is a TrainingWorker the trainer calls itself (the actor's own is called
        # inside a traced actor call, and passes through)
        (engine_workers.TrainingWorker, "critic", ("infer_batch", "train_mini_batch"),
         module, None),
    ])  # fmt: skip


def install() -> None:
    assert cpu_shim.applied() is not None  # its patches are in force once it is imported
    _patch_process_group()
    after_import("verl.workers.rollout.base", _register_rollout)
    after_import("verl.utils.model", _patch_valuehead)
    after_import("verl.utils.attention_utils", _patch_padding_helpers)
    after_import("verl.trainer.ppo.ray_trainer", _dump_tensors)
    after_import("verl.workers.fsdp_workers", _trace_legacy)
    after_import("verl.workers.engine_workers", _trace_engine)  # inside the dump's wrapper
    after_import("verl.workers.engine_workers", _dump_engine_actor)
    after_import("verl.workers.engine.fsdp.transformer_impl", _dump_engine_inputs)
    for name in ("actor.dp_actor", "critic.dp_critic", "engine.fsdp.transformer_impl"):
        after_import(f"verl.workers.{name}", _dump_grads)


install()
