"""The Trainer API: ``forward_backward``, ``optim_step``, ``publish_weights``, checkpoints.

The shape follows torchtitan's RL ``PolicyTrainer`` and Tinker's training client: the loop
(``trainer/loop.py``) owns the order of calls and the learning-rate schedule; this class owns
the DeepSpeed engine, the maths wiring and the I/O of weights and checkpoints.

One train step (one train batch of prompt groups):

1. :meth:`begin_step` — advantages and loss masks (``trainer/batch.py``), the split into
   ``ppo_n_minibatches`` mini-batches (repeated for ``ppo_epochs``), packing of each mini-batch
   into micro-batches dealt to ranks, and — when decoupled PPO takes more than one optimizer
   step per batch — the proximal logprobs pi_prox recomputed with the weights at the start of
   the step (with a single optimizer step pi_prox *is* the current policy, so the logprobs of
   the training forward pass are used, detached: exactly equal and one forward pass cheaper);
   reference logprobs when ``kl_coef > 0``.
2. :meth:`forward_backward` per mini-batch: forward + backward over this rank's micro-batches;
   gradients accumulate (loss weights are normalised over the whole mini-batch, so the sum
   over micro-batches and ranks is the mini-batch loss). Early stop: for mini-batches after
   the first, the mean importance ratio of the first micro-batch (all ranks) is checked
   before any backward; above ``early_stop_imp_ratio`` the rest of the batch is skipped.
3. :meth:`optim_step`: clip, AdamW step at the learning rate the loop passes. The optimizer
   step that completes a batch advances :attr:`step`, the policy version of the weights.
4. :meth:`publish_weights` every ``weight_sync.interval`` steps (durable first, then announce;
   ``trainer/publisher.py``), and checkpoints (``trainer/checkpoint.py``).

LoRA (``trainer.lora``, trainer/lora.py): the actor is a PEFT model whose adapter alone trains;
the reference is the same module with the adapter disabled; publishing writes the adapter only.

Policy versions: the weights after ``step`` train batches have version ``step`` (version 0 is
the initial model); staleness of a token = ``step`` at the start of the batch minus its version.
Rank 0 fetches batches; :meth:`broadcast_groups` shares them with other ranks as JSON bytes
(no pickling).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from trainer.attention import BLOCK_ATTENTION, BLOCK_ATTENTION_BASES
from trainer.batch import PreparedSample, TrainBatch, TrainGroup, TrainSample, prepare_batch
from trainer.checkpoint import CheckpointError, TrainerCheckpoints
from trainer.losses import LossInputs, LossSettings, aggregation_weights, policy_loss, token_logprobs_and_entropy
from trainer.packing import (
    SHARED_MASK_IMPLEMENTATIONS, build_micro_batch, deal_to_ranks, pack_by_tokens, packed_logits, shared_prefix_tokens,
    split_minibatches,
)
from trainer.publisher import WeightPublishing

__all__ = ["Trainer", "MiniBatch", "StepPlan", "CheckpointError"]

log = logging.getLogger("asyncrl.trainer")

_CRITIC_SUM_KEYS = ("value_loss", "value_clipped_tokens", "value_tokens")
_SUM_KEYS = ("tokens", "clipped_tokens", "dual_clipped_tokens", "imp_weight_sum", "imp_weight_capped", "imp_weight_masked",
             "ratio_sum", "behaviour_kl_sum", "entropy_sum", "ref_kl_sum", "pg_loss", "kl_loss",
             "entropy_loss", "loss", "processed_tokens")


@dataclass
class MiniBatch:
    """One optimizer step's share of a train batch, as seen by this rank.

    Attributes:
        index: mini-batch index within the batch (0-based, over all epochs).
        epoch: PPO epoch.
        is_last: the last mini-batch of the batch (its optimizer step advances the version).
        sample_indices: indices (into the batch's samples) of the whole mini-batch.
        micro_batches: this rank's micro-batches (lists of sample indices; None = empty pass).
        total_loss_tokens / total_loss_samples: normalisers over the whole mini-batch.
    """

    index: int
    epoch: int
    is_last: bool
    sample_indices: list[int]
    micro_batches: list[list[int] | None]
    total_loss_tokens: float
    total_loss_samples: float


@dataclass
class StepPlan:
    """A train batch prepared for this rank: samples, mini-batches and precomputed logprobs."""

    batch: TrainBatch
    minibatches: list[MiniBatch]
    policy_version: int
    prox_logprobs: dict[int, torch.Tensor] = field(default_factory=dict)
    ref_logprobs: dict[int, torch.Tensor] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    optimizer_steps: int = 0
    done: bool = False
    critic: Any = None
    """The critic's :class:`trainer.critic.CriticEstimate` (``advantage: gae``): old values and targets."""


def _disable_dropout(model: torch.nn.Module) -> None:
    """RL recomputes logprobs of sampled tokens: dropout would make them differ from the engine's."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    for key in ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
        if hasattr(model.config, key) and isinstance(getattr(model.config, key), float):
            setattr(model.config, key, 0.0)


class Trainer(WeightPublishing, TrainerCheckpoints):
    """A DeepSpeed policy trainer for one rank (construct it on every rank).

    Args:
        cfg: the resolved :class:`asyncrl.core.config.AsyncRLConfig`.
        announce: ``announce(version, uri, checksum)`` called on rank 0 after weights are durable
            (sync or async; the buffer's clock ``publish``). None: publish without announcing.
        model: an already loaded transformers causal LM (fp32) instead of ``cfg.model.path``.
        critic_model: with ``trainer.advantage: gae``, an already loaded value model
            (:func:`trainer.critic.load_value_model`) instead of ``trainer.critic.model_path``.

    Attributes:
        step: train batches completed = policy version of the current weights.
        optimizer_steps: optimizer steps taken (drives the LR schedule).
        published_version: newest published version (0 = the initial model).
        lineage: the buffer's lineage counter recorded at the last checkpoint/recovery.
        rank, world_size: this process's place in the data-parallel group.

    Weight publishing (:meth:`full_state_dict`, :meth:`publish_weights`) comes from
    :class:`trainer.publisher.WeightPublishing`, checkpoints (:meth:`save_checkpoint`,
    :meth:`load_checkpoint`) from :class:`trainer.checkpoint.TrainerCheckpoints`.
    """

    def __init__(self, cfg: Any, *, announce: Callable[[int, str, str], Any] | None = None, model: Any = None,
                 critic_model: Any = None):
        from trainer.engine import build_engine, init_distributed

        self.cfg = cfg
        if cfg.trainer.heap_mmap_threshold_bytes is not None:
            from trainer.memory import fix_mmap_threshold

            # freed activations go back to the system, not to malloc's heap (trainer/memory.py)
            fix_mmap_threshold(cfg.trainer.heap_mmap_threshold_bytes)
        self.rank, self.world_size = init_distributed()
        torch.manual_seed(cfg.run.seed)
        random.seed(cfg.run.seed)
        if model is None:
            from asyncrl.models import load_causal_lm

            model = load_causal_lm(cfg.model.path, "float32")
        _disable_dropout(model)
        self.model_config = model.config
        self.model_source = self._model_source(cfg.model.path, model)
        self._extra_files = self._tokenizer_files() if self.rank == 0 else {}
        self.lora = cfg.trainer.lora is not None
        if self.lora:
            from trainer.lora import apply_lora

            model = apply_lora(model, cfg.trainer.lora)
        self.engine = build_engine(model, cfg)
        #: where DeepSpeed put the model (the accelerator's device: cuda:<local rank> on a GPU, else
        #: cpu); packed micro-batches and the loss's tensors are made there (see :meth:`_forward`)
        self.device = next(self.engine.module.parameters()).device
        self.ref_model = None
        needs_ref = cfg.trainer.loss.kl_coef > 0 or cfg.trainer.kl_ctl.coef > 0
        if needs_ref and self.lora and not cfg.trainer.reference.model_path:
            pass  # the base with the adapter disabled, set once the attention implementation is chosen
        elif needs_ref:
            from asyncrl.models import load_causal_lm

            ref_path = cfg.trainer.reference.model_path or cfg.model.path
            self.ref_model = load_causal_lm(ref_path, "float32").to(self.device)
            self.ref_model.requires_grad_(False)
        self.loss_settings = LossSettings.from_config(cfg.trainer.loss)
        self.temperature = float(cfg.rollout.temperature)
        self.share_prompts = bool(cfg.trainer.share_prompts)
        impls = {getattr(m.config, "_attn_implementation", None) for m in (model, self.ref_model) if m is not None}
        if self.share_prompts and not impls <= set(SHARED_MASK_IMPLEMENTATIONS):
            log.warning("trainer.share_prompts needs the %s attention implementation; the model uses %s: every sample "
                        "carries its own prompt", " or ".join(SHARED_MASK_IMPLEMENTATIONS), ", ".join(map(str, impls)))
            self.share_prompts = False
        self.attention = cfg.trainer.attention
        if self.attention == "blocks":
            if impls <= set(BLOCK_ATTENTION_BASES):
                for m in (model, self.ref_model):
                    if m is not None:
                        m.set_attn_implementation(BLOCK_ATTENTION)
            else:
                log.warning("trainer.attention 'blocks' needs a model loaded with %s attention; the model uses %s: "
                            "attention runs over the packed row", " or ".join(BLOCK_ATTENTION_BASES[:2]),
                            ", ".join(map(str, impls)))
                self.attention = "row"
        if needs_ref and self.ref_model is None:  # LoRA: the reference is the base, the adapter switched off
            from trainer.lora import AdapterDisabled

            self.ref_model = AdapterDisabled(self.engine, self.engine.module)
        self.critic = None
        if cfg.trainer.advantage == "gae":
            from trainer.critic import Critic

            self.critic = Critic(cfg, attn_implementation=BLOCK_ATTENTION if self.attention == "blocks" else None,
                                 all_reduce=self._all_reduce, model=critic_model)
        self.step = 0
        self.optimizer_steps = 0
        self.published_version = 0
        self.published_versions: list[int] = []
        self.lineage = 0
        #: the record (trainer.jsonl line) of the step the loaded checkpoint holds, or None
        self.checkpoint_step_record: dict[str, float] | None = None
        self.announce = announce
        run_dir = Path(cfg.run.run_dir)
        self.weights_dir = Path(cfg.weight_sync.dir) if cfg.weight_sync.dir else run_dir / "weights"
        self.checkpoint_dir = run_dir / "checkpoints"
        self.http_server = None
        if cfg.weight_sync.transport == "http" and self.rank == 0:
            from asyncrl.core.weights import WeightFileServer

            self.http_server = WeightFileServer(self.weights_dir, cfg.weight_sync.http_host or cfg.rollout.host,
                                                cfg.weight_sync.http_port, api_key=cfg.security.api_key).start()
        self.nccl_pusher = None
        if cfg.weight_sync.transport == "nccl" and self.rank == 0:
            from asyncrl.core.secret_values import reveal
            from trainer.publisher import NcclWeightPusher

            urls = list(cfg.rollout.server_urls) or [
                f"http://{cfg.rollout.host}:{cfg.rollout.base_port + i}" for i in range(cfg.rollout.num_servers)]
            self.nccl_pusher = NcclWeightPusher(urls, cfg.rollout.host if cfg.rollout.host != "0.0.0.0" else "127.0.0.1",
                                                backend="nccl" if torch.cuda.is_available() else "gloo",
                                                api_key=reveal(cfg.security.api_key))
        self._plan: StepPlan | None = None
        self._pending_last = False
        self._aio: asyncio.AbstractEventLoop | None = None
        from trainer.engine import GradNormProbe

        self._grad_norm = GradNormProbe(self.engine)

    # ------------------------------------------------------------------ plumbing

    @property
    def module(self) -> torch.nn.Module:
        """The wrapped transformers model."""
        return self.engine.module

    @property
    def steps_per_batch(self) -> int:
        """Optimizer steps per train batch without early stop."""
        return self.cfg.trainer.ppo_n_minibatches * self.cfg.trainer.ppo_epochs

    @property
    def total_optimizer_steps(self) -> int:
        """Optimizer steps of the whole run (the LR schedule's horizon)."""
        return self.cfg.run.total_steps * self.steps_per_batch

    def run_async(self, value: Any) -> Any:
        """Resolve ``value`` if it is awaitable, on this trainer's own event loop (one per process)."""
        if not inspect.isawaitable(value):
            return value
        if self._aio is None:
            self._aio = asyncio.new_event_loop()
        return self._aio.run_until_complete(value)

    def _barrier(self) -> None:
        import torch.distributed as dist

        if self.world_size > 1:
            dist.barrier()

    def _all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        import torch.distributed as dist

        if self.world_size == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return t.tolist()

    def broadcast_groups(self, groups: list[Any] | None, stop: bool = False) -> tuple[list[TrainGroup] | None, bool]:
        """Share rank 0's batch (and its stop flag) with every rank, as JSON bytes.

        Args:
            groups: rank 0's prompt groups (ignored on other ranks); None when there is no batch.
            stop: rank 0's request to stop after this batch (SIGTERM).

        Returns:
            ``(groups as TrainGroup or None, stop)`` on every rank.
        """
        import torch.distributed as dist

        payload = None
        if self.rank == 0:
            gs = None if groups is None else [TrainGroup.from_record(g) for g in groups]
            payload = json.dumps({"stop": bool(stop), "groups": None if gs is None else [
                {"group_id": g.group_id, "prompt_ids": g.prompt_ids, "metadata": g.metadata,
                 "samples": [s.__dict__ for s in g.samples]} for g in gs]}, default=str).encode()
        if self.world_size > 1:
            size = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.long)
            dist.broadcast(size, 0)
            buf = torch.empty(int(size), dtype=torch.uint8)
            if self.rank == 0:
                buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            dist.broadcast(buf, 0)
            payload = bytes(buf.numpy())
        data = json.loads(payload)
        if data["groups"] is None:
            return None, data["stop"]
        out = []
        for g in data["groups"]:
            samples = [TrainSample(**s) for s in g["samples"]]
            out.append(TrainGroup(g["group_id"], g["prompt_ids"], samples, g["metadata"]))
        return out, data["stop"]

    # ------------------------------------------------------------------ forward passes

    def _forward(self, module: Any, mb_samples: list[PreparedSample], indices: list[int] | None, grad: bool,
                 with_entropy: bool):
        prompts = [s.prompt_ids for s in mb_samples]
        responses = [s.response_ids for s in mb_samples]
        local = None if indices is None else list(range(len(indices)))
        # on the model's device: the packed row, its masks (built lazily) and everything the
        # forward pass makes with a factory function (torch.zeros, torch.tensor, ...)
        with torch.device(self.device):
            packed = build_micro_batch(prompts, responses, local, share_prompts=self.share_prompts)
            with torch.set_grad_enabled(grad):
                logits = packed_logits(module, packed)
                logprobs, entropy = token_logprobs_and_entropy(logits, packed.targets, self.temperature, with_entropy)
        return packed, logits, logprobs, entropy

    @torch.no_grad()
    def _logprobs_for(self, module: Any, plan_samples: list[PreparedSample], indices: list[int] | None) -> dict[int, torch.Tensor]:
        samples = [plan_samples[i] for i in indices] if indices is not None else []
        packed, _, logprobs, _ = self._forward(module, samples, indices, grad=False, with_entropy=False)
        out = {}
        for local, start, end in packed.token_offsets:
            out[indices[local]] = logprobs[start:end].clone()
        return out

    # ------------------------------------------------------------------ the step

    def begin_step(self, groups: list[Any]) -> StepPlan:
        """Prepare a train batch: advantages, masks, mini-batches, micro-batches, pi_prox / pi_ref.

        Args:
            groups: the batch's prompt groups (the same list, in the same order, on every rank).

        Returns:
            the :class:`StepPlan`; pass its ``minibatches`` to :meth:`forward_backward` in order.

        Raises:
            trainer.batch.BatchError / trainer.advantages.AdvantageError: unusable input.
            RuntimeError: the previous step was not finished.
        """
        if self._plan is not None and not self._plan.done:
            raise RuntimeError("begin_step called before the previous step finished (optim_step on its last mini-batch)")
        t = self.cfg.trainer
        batch = prepare_batch(groups, self.cfg, self.step)
        n = len(batch.samples)
        ranges = split_minibatches(n, min(t.ppo_n_minibatches, n))
        minibatches: list[MiniBatch] = []
        per_epoch = []
        for r in ranges:
            idx = list(r)
            lengths = [batch.samples[i].num_tokens for i in idx]
            shared = shared_prefix_tokens([batch.samples[i].prompt_ids for i in idx]) if self.share_prompts else None
            micro = [[idx[j] for j in mb] for mb in pack_by_tokens(lengths, t.micro_batch_tokens, shared)]
            mine = deal_to_ranks(micro, self.world_size)[self.rank]
            tokens = float(sum(batch.samples[i].num_loss_tokens for i in idx))
            seqs = float(sum(1 for i in idx if batch.samples[i].num_loss_tokens > 0))
            per_epoch.append((idx, mine, tokens, seqs))
        for epoch in range(t.ppo_epochs):
            for idx, mine, tokens, seqs in per_epoch:
                minibatches.append(MiniBatch(len(minibatches), epoch, False, idx, mine, tokens, seqs))
        minibatches[-1].is_last = True
        plan = StepPlan(batch, minibatches, self.step, metrics=dict(batch.stats))
        need_prox = self.loss_settings.correction in ("decoupled", "gspo") and len(minibatches) > 1
        if need_prox or self.ref_model is not None:
            was_training = self.module.training
            self.module.eval()
            for idx, mine, _, _ in per_epoch:
                for indices in mine:
                    if need_prox:
                        plan.prox_logprobs.update(self._logprobs_for(self.engine, batch.samples, indices))
                    if self.ref_model is not None:
                        plan.ref_logprobs.update(self._logprobs_for(self.ref_model, batch.samples, indices))
            self.module.train(was_training)
        if self.critic is not None:
            mine_all = [indices for _, mine, _, _ in per_epoch for indices in mine]
            plan.critic = self.critic.estimate(batch.samples, mine_all, plan.ref_logprobs, self.share_prompts,
                                               t.adv_norm)
            plan.metrics.update(plan.critic.metrics)
        self._plan = plan
        return plan

    def forward_backward(self, mb: MiniBatch) -> dict[str, float]:
        """Forward and backward over this rank's micro-batches of one mini-batch.

        Returns:
            metrics of the whole mini-batch (all ranks): ``loss``, ``pg_loss``, ``kl_loss``,
            ``entropy_loss``, ``clip_fraction``, ``dual_clip_fraction``, ``importance_weight_mean``,
            ``importance_weight_max``, ``importance_weight_capped_fraction``, ``ratio_mean``,
            ``behaviour_kl``, ``entropy``, ``ref_kl``, ``loss_tokens``, ``processed_tokens``,
            ``micro_batches``, ``early_stopped`` (1.0 when the batch was cut short here: no
            gradient was accumulated, do not call :meth:`optim_step`).

        Raises:
            RuntimeError: no step begun.
        """
        plan = self._plan
        if plan is None or plan.done:
            raise RuntimeError("forward_backward needs begin_step first")
        s = self.loss_settings
        samples = plan.batch.samples
        single_step = len(plan.minibatches) == 1
        sums = dict.fromkeys(_SUM_KEYS, 0.0)
        critic_sums = dict.fromkeys(_CRITIC_SUM_KEYS, 0.0)
        imp_max = 0.0
        self.module.train()
        check_early = self.cfg.trainer.early_stop_imp_ratio is not None and mb.index > 0
        dev = self.device
        for j, indices in enumerate(mb.micro_batches):
            with torch.device(dev):  # the loss's own tensors (weights, masks, sums) where the logprobs are
                mb_samples = [samples[i] for i in indices] if indices is not None else []
                packed, logits, logprobs, entropy = self._forward(self.engine, mb_samples, indices, grad=True,
                                                                  with_entropy=s.entropy_coef > 0)
                if entropy is None:
                    with torch.no_grad():
                        _, entropy = token_logprobs_and_entropy(logits.detach(), packed.targets, self.temperature, True)
                behav, adv, mask, prox, ref, owner = [], [], [], [], [], []
                for local, start, end in packed.token_offsets:
                    i = indices[local]
                    smp = samples[i]
                    behav.append(smp.behaviour_logprobs)
                    adv.append(smp.advantages)
                    mask.append(smp.loss_mask)
                    owner.append(torch.full((end - start,), i, dtype=torch.long))
                    if s.correction in ("decoupled", "gspo") and not single_step:
                        prox.append(plan.prox_logprobs[i])
                    if self.ref_model is not None:
                        ref.append(plan.ref_logprobs[i])
                cat = (lambda xs: torch.cat([x.to(dev) for x in xs]) if xs else torch.zeros(0))
                sample_index = torch.cat(owner) if owner else torch.zeros(0, dtype=torch.long)
                weight = aggregation_weights(cat(mask), sample_index, self.cfg.trainer.loss.aggregation,
                                             mb.total_loss_tokens, mb.total_loss_samples)
                prox_t = None
                if s.correction in ("decoupled", "gspo"):
                    prox_t = logprobs.detach() if single_step else cat(prox)
                inputs = LossInputs(logprobs, cat(behav), cat(adv), weight, prox_t,
                                    cat(ref) if self.ref_model is not None else None, entropy, sample_index)
                loss, part = policy_loss(inputs, s)
                if j == 0 and check_early:
                    ratio_sum, tokens = self._all_reduce([part["ratio_sum"], part["tokens"]])
                    if tokens > 0 and ratio_sum / tokens > self.cfg.trainer.early_stop_imp_ratio:
                        del loss, logits, logprobs
                        self.step += 1
                        plan.done = True
                        plan.metrics["early_stopped_at_minibatch"] = float(mb.index)
                        return {"early_stopped": 1.0, "ratio_mean": ratio_sum / tokens}
                self.engine.backward(loss * self.world_size, scale_wrt_gas=False)
                if self.critic is not None:
                    critic = self.critic.forward_backward(packed, indices, plan.critic, weight, self.world_size)
                    for k, v in critic.items():
                        critic_sums[k] += v
                for k in _SUM_KEYS:
                    if k in part:
                        sums[k] += part[k]
                sums["loss"] += float(loss.detach())
                sums["processed_tokens"] += packed.num_tokens if indices is not None else 0
                imp_max = max(imp_max, part["imp_weight_max"])
                # this micro-batch's logits (T x vocab, 0.8 GB at 4,096 response tokens) and the
                # rest would otherwise live on through the next micro-batch's forward pass
                del packed, logits, logprobs, entropy, loss, inputs, prox_t, weight
        total = dict(zip(_SUM_KEYS, self._all_reduce([sums[k] for k in _SUM_KEYS])))
        imp_max = self._all_reduce([imp_max], op="max")[0]
        tok = max(total["tokens"], 1.0)
        metrics = {
            "loss": total["loss"], "pg_loss": total["pg_loss"], "kl_loss": total["kl_loss"],
            "entropy_loss": total["entropy_loss"],
            "clip_fraction": total["clipped_tokens"] / tok,
            "dual_clip_fraction": total["dual_clipped_tokens"] / tok,
            "importance_weight_mean": total["imp_weight_sum"] / tok,
            "importance_weight_max": imp_max,
            "importance_weight_capped_fraction": total["imp_weight_capped"] / tok,
            "importance_weight_masked_fraction": total["imp_weight_masked"] / tok,
            "ratio_mean": total["ratio_sum"] / tok,
            "behaviour_kl": total["behaviour_kl_sum"] / tok,
            "entropy": total["entropy_sum"] / tok,
            "ref_kl": total["ref_kl_sum"] / tok,
            "loss_tokens": total["tokens"],
            "processed_tokens": total["processed_tokens"],
            "micro_batches": float(len(mb.micro_batches)),
            "early_stopped": 0.0,
        }
        if self.critic is not None:
            value_loss, clipped, tokens = self._all_reduce([critic_sums[k] for k in _CRITIC_SUM_KEYS])
            metrics.update({"value_loss": value_loss, "value_clip_fraction": clipped / max(tokens, 1.0)})
        self._pending_last = mb.is_last
        return metrics

    def optim_step(self, lr: float | None = None) -> dict[str, float]:
        """Apply the accumulated gradients (clip, AdamW) and zero them.

        Args:
            lr: learning rate for this step (the loop's schedule); None uses
                :func:`trainer.engine.lr_at` of :attr:`optimizer_steps`.

        Returns:
            ``grad_norm`` (before clipping), ``lr``, ``optimizer_step``, ``step``.
        """
        from trainer.engine import lr_at

        if lr is None:
            lr = lr_at(self.optimizer_steps, self.cfg.trainer.optimizer, self.total_optimizer_steps)
        for group in self.engine.optimizer.param_groups:
            group["lr"] = lr
        self._grad_norm.reset()
        self.engine.step()
        norm = self._grad_norm.read()
        critic_metrics = self.critic.optim_step(self.total_optimizer_steps) if self.critic is not None else {}
        self.optimizer_steps += 1
        if self._plan is not None:
            self._plan.optimizer_steps += 1
        if self._pending_last:
            if self.cfg.trainer.reference.ema_eta is not None and self.ref_model is not None:
                self._reference_follows_actor(self.cfg.trainer.reference.ema_eta)
            self.step += 1
            self._pending_last = False
            if self._plan is not None:
                self._plan.done = True
        return {"grad_norm": norm, "lr": float(lr),
                "optimizer_step": float(self.optimizer_steps), "step": float(self.step), **critic_metrics}

    @torch.no_grad()
    def _reference_follows_actor(self, eta: float) -> None:
        """``ref <- eta * actor + (1 - eta) * ref``, parameter by parameter (AReaL's ``ref_ema_eta``).

        Every rank updates its own full copy of the reference (the actor's parameters are
        gathered under ZeRO-3). Collective under ZeRO-3.
        """
        actor = dict(self.module.named_parameters())
        ref = dict(self.ref_model.named_parameters())

        def blend():
            for name, p in ref.items():
                p.mul_(1.0 - eta).add_(actor[name].detach().to(p.dtype), alpha=eta)

        if self.engine.zero_optimization_stage() == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(actor.values()), modifier_rank=None):
                blend()
        else:
            blend()

    def close(self) -> None:
        """Stop the weight file server and the private event loop."""
        if self.http_server is not None:
            self.http_server.stop()
            self.http_server = None
        if self.nccl_pusher is not None:
            self.run_async(self.nccl_pusher.close())
            self.nccl_pusher = None
        if self._aio is not None:
            self._aio.close()
            self._aio = None
