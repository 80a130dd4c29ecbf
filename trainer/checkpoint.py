"""Trainer checkpoints: save and restore a run's training state at a step.

A checkpoint is ``<run_dir>/checkpoints/step<step:08d>/``: DeepSpeed's model and optimizer
state, the trainer's counters (step, optimizer steps, published versions, lineage, world size),
the RNG state, the caller's ``extra_state`` (the dataset cursor), the resolved ``config.yaml``,
and with ``trainer.advantage: gae`` the critic (``critic/``) and with
``trainer.reference.ema_eta`` the EMA reference (``reference.safetensors``), so that all of them
restore to one step. ``checkpoints/latest`` names the newest complete one (replaced atomically
after every rank finished). The buffer's side of a restart is ``ReplayBuffer.recover``
(docs/architecture.md#acknowledgement-and-recovery).

:class:`TrainerCheckpoints` is a base of :class:`trainer.trainer.Trainer`; call its methods on
the trainer (``trainer.save_checkpoint(...)``, ``trainer.load_checkpoint()``).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch

__all__ = ["CheckpointError", "TrainerCheckpoints"]


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded (missing, incomplete, other world size)."""


class TrainerCheckpoints:
    """Checkpoint save and restore of a :class:`trainer.trainer.Trainer` (one of its bases).

    Uses the trainer's ``engine``, ``critic``, ``ref_model``, ``cfg``, ``checkpoint_dir``,
    ``weights_dir``, ``rank``, ``world_size``, its counters (``step``, ``optimizer_steps``,
    ``published_version(s)``, ``lineage``) and ``_barrier``.
    """

    def save_checkpoint(self, extra_state: dict[str, Any] | None = None,
                        step_record: dict[str, float] | None = None) -> Path:
        """Save model, optimizer, step, versions, lineage, RNG and ``extra_state`` (dataset cursor).

        Written by DeepSpeed into ``<run_dir>/checkpoints/step<step:08d>/``, plus the resolved
        config (``config.yaml``); ``latest`` is replaced atomically only after every rank
        finished, and checkpoints beyond ``keep_checkpoints`` are removed. Collective.

        ``step_record`` (rank 0): the step's metrics record as known before the checkpoint, kept
        in ``asyncrl.json`` so that a resume can write it if a crash lost the step's line
        (:func:`trainer.loop.train_loop`).

        Returns:
            the checkpoint directory.
        """
        from asyncrl.core.config import dump_config

        tag = f"step{self.step:08d}"
        client_state = {
            "asyncrl": {
                "step": self.step, "optimizer_steps": self.optimizer_steps,
                "published_version": self.published_version, "published_versions": self.published_versions[-64:],
                "lineage": self.lineage, "world_size": self.world_size,
                "extra_state": json.dumps(extra_state or {}),
            },
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        }
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        self._barrier()
        self.engine.save_checkpoint(str(self.checkpoint_dir), tag=tag, client_state=client_state, save_latest=False)
        path = self.checkpoint_dir / tag
        if self.critic is not None:  # beside the actor, before `latest` moves: both restore to one step
            self.critic.engine.save_checkpoint(str(path), tag="critic", save_latest=False,
                                               client_state={"asyncrl_critic": {"step": self.step, **self.critic.state()}})
        if self.ref_model is not None and self.cfg.trainer.reference.ema_eta is not None and self.rank == 0:
            from safetensors.torch import save_model

            save_model(self.ref_model, str(path / "reference.safetensors"))  # tied weights stored once
        self._barrier()
        if self.rank == 0:
            dump_config(self.cfg, path / "config.yaml")
            meta = {"tag": tag, "step": self.step, "policy_version": self.published_version,
                    "lineage": self.lineage, "extra_state": extra_state or {}, "step_record": step_record}
            (path / "asyncrl.json").write_text(json.dumps(meta, indent=2))
            tmp = self.checkpoint_dir / "latest.tmp"
            with open(tmp, "w") as f:
                f.write(tag)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.checkpoint_dir / "latest")
            tags = sorted(p.name for p in self.checkpoint_dir.iterdir() if p.is_dir() and p.name.startswith("step"))
            for old in tags[:-self.cfg.trainer.keep_checkpoints]:
                if old != tag:
                    shutil.rmtree(self.checkpoint_dir / old, ignore_errors=True)
        self._barrier()
        return path

    def load_checkpoint(self, tag: str | None = None) -> dict[str, Any] | None:
        """Restore the newest checkpoint (or ``tag``); returns its ``extra_state``, or None if none exists.

        Without a checkpoint the trainer stays at step 0 (the initial model) and version
        directories newer than 0 in the weights directory are deleted (a previous trainer of
        this run died before its first checkpoint; the caller rewinds the buffer to step 0).

        Collective. The LR schedule needs no state of its own: it is a function of the restored
        :attr:`optimizer_steps`. On rank 0 :attr:`checkpoint_step_record` becomes the step record
        kept with the checkpoint (None if it has none).

        Raises:
            CheckpointError: ``tag`` missing, files incomplete, or saved with another world size
                under ZeRO (DeepSpeed shards the optimizer per rank).
        """
        latest = self.checkpoint_dir / "latest"
        if tag is None:
            if not latest.is_file():
                # Starting from the initial model (version 0): versions a trainer killed before
                # its first checkpoint published belong to an abandoned lineage.
                self._discard_versions_after(0)
                return None
            tag = latest.read_text().strip()
        if not (self.checkpoint_dir / tag).is_dir():
            raise CheckpointError(f"no checkpoint {tag} in {self.checkpoint_dir}")
        try:
            path, client = self.engine.load_checkpoint(str(self.checkpoint_dir), tag=tag, load_optimizer_states=True,
                                                       load_lr_scheduler_states=False)
        except (FileNotFoundError, RuntimeError, AssertionError, ValueError) as exc:
            raise CheckpointError(f"cannot load checkpoint {self.checkpoint_dir / tag}: {exc}") from exc
        if path is None or not client or "asyncrl" not in client:
            raise CheckpointError(f"checkpoint {self.checkpoint_dir / tag} is incomplete (no asyncrl client state)")
        state = client["asyncrl"]
        if state["world_size"] != self.world_size and self.engine.zero_optimization_stage() > 0:
            raise CheckpointError(
                f"checkpoint {tag} was saved by {state['world_size']} ranks under ZeRO; resume with the same world size")
        self.step = int(state["step"])
        self.optimizer_steps = int(state["optimizer_steps"])
        self.published_version = int(state["published_version"])
        self.published_versions = list(state["published_versions"])
        self.lineage = int(state["lineage"])
        self._load_critic_and_reference(tag)
        self.checkpoint_step_record = None
        if self.rank == 0:
            try:
                meta = json.loads((self.checkpoint_dir / tag / "asyncrl.json").read_text())
            except (OSError, ValueError):
                meta = {}  # a checkpoint named by tag whose rank 0 died before writing it
            if isinstance(meta.get("step_record"), dict):
                self.checkpoint_step_record = meta["step_record"]
        rng = client.get("rng") or {}
        if "torch" in rng:
            torch.set_rng_state(rng["torch"])
        if "python" in rng:
            random.setstate(rng["python"])
        self._plan = None
        self._pending_last = False
        # Versions published after this checkpoint belong to the abandoned lineage; they are
        # published again (with different weights) as training continues.
        self._discard_versions_after(self.published_version)
        self._barrier()
        return json.loads(state["extra_state"])

    def _load_critic_and_reference(self, tag: str) -> None:
        """Restore the critic (weights, optimizer, value normaliser, KL coefficient) and an EMA reference.

        Raises:
            CheckpointError: the checkpoint has no critic (or no reference) that the config needs,
                or its critic was saved at another step than the actor.
        """
        path = self.checkpoint_dir / tag
        if self.critic is not None:
            if not (path / "critic").is_dir():
                raise CheckpointError(f"checkpoint {path} has no critic but trainer.advantage is gae: resume with the "
                                      "config the run was started with (its config.yaml is in the checkpoint)")
            try:
                loaded, client = self.critic.engine.load_checkpoint(str(path), tag="critic", load_optimizer_states=True,
                                                                    load_lr_scheduler_states=False)
            except (FileNotFoundError, RuntimeError, AssertionError, ValueError) as exc:
                raise CheckpointError(f"cannot load the critic of checkpoint {path}: {exc}") from exc
            state = (client or {}).get("asyncrl_critic")
            if loaded is None or state is None or int(state["step"]) != self.step:
                raise CheckpointError(f"checkpoint {path}: the critic was saved at step "
                                      f"{None if state is None else state['step']}, the actor at step {self.step}")
            try:
                self.critic.load_state(state)
            except ValueError as exc:
                raise CheckpointError(f"checkpoint {path}: {exc}") from exc
        if self.ref_model is not None and self.cfg.trainer.reference.ema_eta is not None:
            ref_file = path / "reference.safetensors"
            if not ref_file.is_file():
                raise CheckpointError(f"checkpoint {path} has no reference.safetensors but trainer.reference.ema_eta "
                                      "is set (the reference followed the actor): resume with the run's config")
            from safetensors.torch import load_model

            missing, unexpected = load_model(self.ref_model, str(ref_file), strict=False)
            if unexpected or set(missing) - {"lm_head.weight"}:
                raise CheckpointError(f"checkpoint {ref_file} does not match the reference model: missing {missing}, "
                                      f"unexpected {unexpected}")

    def _discard_versions_after(self, version: int) -> None:
        """Delete published version directories newer than ``version`` (rank 0) and forget them."""
        if self.rank == 0:
            from asyncrl.core.weights import list_versions, version_dir_name

            for v in list_versions(self.weights_dir):
                if v > version:
                    shutil.rmtree(self.weights_dir / version_dir_name(v), ignore_errors=True)
        self.published_versions = [v for v in self.published_versions if v <= version]
