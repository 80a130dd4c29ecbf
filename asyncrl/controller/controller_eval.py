"""The controller's held-out evaluation (a mixin of :class:`asyncrl.controller.controller.Controller`).

Every ``monitoring.eval_interval`` trainer steps (and before training and at the end) the
controller pauses every role (SIGSTOP), runs ``asyncrl eval`` on the newest published weights in
its own process group with a deadline (``monitoring.eval_timeout_seconds``: past it the group is
killed, the evaluation is reported as failed in one line and training goes on), resumes the
roles and logs ``eval/*``; the time spent is never training time (``time/eval_seconds``).
Each evaluation's results are kept in ``<run_dir>/eval/step-<k>.json``, their model paths
relative to the folder holding the run (:func:`record_path`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.controller.supervisor import resume_roles

if TYPE_CHECKING:
    from asyncrl.controller.resources import Assignment

__all__ = ["ControllerEvaluation", "record_path"]


def record_path(path: str, run_dir: Path) -> str:
    """``path`` as the run's evaluation records name it.

    A file or directory inside ``run_dir`` (the published weights, ``eval/model``) is named
    relative to the folder that holds the run, ``<run>/weights/v000020``, so the record carries no
    absolute path of the machine the run was on and still says which run it came from; anything
    else (a model name, a URI, a directory outside the run) is kept as given.
    """
    p = Path(path)
    if not p.is_absolute():
        return path
    try:
        run = run_dir.resolve()
        return str(p.resolve().relative_to(run.parent)) if p.resolve().is_relative_to(run) else path
    except OSError:
        return path


class ControllerEvaluation:
    """Held-out evaluation of the newest weights (expects the controller's ``cfg``, ``cfg_path``,
    ``run_dir``, ``clock``, ``progress``, ``scraper``, ``prom``, ``stopping``, ``trainer_step``,
    ``eval_before``, ``eval_seconds_total``, ``last_eval_step`` and ``_log``)."""

    async def _latest_weights(self, buf: Any) -> tuple[str, int]:
        """(model directory, policy version) of the newest published weights; the base model at version 0.

        The announcement's URI when it is a directory (``disk``); otherwise (``http``, ``nccl``
        announce a URL) the newest version directory under the weights directory, full weights
        (``config.json``) or a LoRA adapter (``adapter_config.json``)."""
        ann = await buf.clock.latest() if buf is not None else None
        if ann is not None and ann.uri and Path(ann.uri).is_dir():
            return ann.uri, int(ann.version)
        weights_dir = Path(self.cfg.weight_sync.dir or self.run_dir / "weights")
        if ann is not None and weights_dir.is_dir():
            cands = sorted((p for p in weights_dir.iterdir() if p.is_dir() and ((p / "config.json").exists()
                                                                              or (p / "adapter_config.json").exists())),
                           key=lambda p: p.stat().st_mtime)
            if cands:
                return str(cands[-1]), int(ann.version)
        return self.cfg.model.path, 0

    def _eval_model_dir(self, weights: str) -> str:
        """A model directory for ``asyncrl eval``: the published weights plus the base model's
        tokenizer and chat template (published versions hold weights and config only).

        Symlinks in ``<run_dir>/eval/model``, rebuilt for every evaluation. A LoRA run publishes
        adapters only (``trainer.lora``): the adapter is merged into the base model there instead
        (:func:`asyncrl.models.merge_adapter`), a full copy of the model.
        """
        from asyncrl.models import is_adapter_dir, merge_adapter, resolve_model_path

        wdir = Path(weights)
        if not wdir.is_dir() or wdir.resolve() == resolve_model_path(self.cfg.model.path).resolve():
            return weights
        base = resolve_model_path(self.cfg.model.path)
        target = self.run_dir / "eval" / "model"
        if is_adapter_dir(wdir):
            return str(merge_adapter(wdir, base, target, self.cfg.model.dtype))
        if target.exists():
            shutil.rmtree(target)
        target.mkdir(parents=True)
        for f in wdir.iterdir():
            (target / f.name).symlink_to(f.resolve())
        for f in base.iterdir():
            weightish = f.suffix in (".safetensors", ".bin", ".pt", ".gguf") or f.name.endswith(".index.json")
            if f.is_file() and not weightish and not (target / f.name).exists():
                (target / f.name).symlink_to(f.resolve())
        return str(target)

    async def _evaluate(self, buf: Any, sup: Any, assignment: Assignment) -> None:
        """Held-out evaluation of the newest weights with every role paused; logs ``eval/*``."""
        from asyncrl.core.process_guard import pdeathsig_preexec

        cfg = self.cfg
        weights, version = await self._latest_weights(buf)
        model = self._eval_model_dir(weights) if version > 0 else weights
        self.progress.set_status("evaluating")
        self.progress.refresh()
        start = time.monotonic()
        if sup is not None:
            sup.pause()
        out_dir = self.run_dir / "eval"
        out_dir.mkdir(exist_ok=True)
        timed_out = False
        cmd = [sys.executable, "-m", "asyncrl.cli", "eval", "--config", str(self.cfg_path), "--model", model,
               "--num_problems", str(cfg.monitoring.eval_num_problems), "--json",
               "--batch_size", str(cfg.monitoring.eval_batch_size),
               "--threads", str(assignment.eval_threads), "--modes", ",".join(cfg.monitoring.eval_modes)]
        try:
            proc = await asyncio.create_subprocess_exec(
                *cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True,
                env=dict(os.environ), preexec_fn=pdeathsig_preexec())  # evaluation needs no Redis: no credentials
            done = asyncio.ensure_future(proc.communicate())
            deadline = time.monotonic() + cfg.monitoring.eval_timeout_seconds  # never a silent hang
            while not done.done():
                await asyncio.wait([done], timeout=0.5)
                if self.stopping and proc.returncode is None:
                    proc.terminate()  # Ctrl-C/SIGTERM: do not make the user wait for the evaluation
                if time.monotonic() > deadline and proc.returncode is None and not timed_out:
                    timed_out = True
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)  # its own session: the whole group
            stdout, stderr = done.result()
        finally:
            seconds = resume_roles(sup, self.clock, start)  # evaluation time is never training time
            if sup is not None:
                self.scraper.reset()
            self.eval_seconds_total += seconds
            self.progress.set_status("training")
        self.last_eval_step = self.trainer_step
        metrics: dict[str, float] = {"time/eval_seconds": self.eval_before + self.eval_seconds_total,
                                     "eval/eval_seconds": seconds, "eval/policy_version": version}
        if timed_out:
            print(f"asyncrl train: held-out evaluation did not finish within {cfg.monitoring.eval_timeout_seconds:.0f} s "
                  "(monitoring.eval_timeout_seconds): killed; training goes on", file=sys.stderr)
            metrics["eval/failed"] = 1
        elif proc.returncode != 0 and self.stopping:
            print("asyncrl train: held-out evaluation interrupted", file=sys.stderr)
            metrics["eval/failed"] = 1
        elif proc.returncode != 0:
            print(f"asyncrl train: held-out evaluation failed (status {proc.returncode}); training goes on:\n"
                  + stderr.decode(errors="replace")[-2000:], file=sys.stderr)
            metrics["eval/failed"] = 1
        else:
            results = json.loads(stdout.decode())
            kept = [{**r, "model": record_path(r["model"], self.run_dir)} if isinstance(r.get("model"), str) else r
                    for r in results]
            (out_dir / f"step-{self.trainer_step}.json").write_text(json.dumps(
                {"step": self.trainer_step, "policy_version": version, "model": record_path(weights, self.run_dir),
                 "results": kept}, indent=1))
            for r in results:
                if r["mode"] == "sampled":
                    metrics.update({"eval/accuracy_sampled": r["accuracy"], "eval/ci95_low": r["accuracy_ci_low"],
                                    "eval/ci95_high": r["accuracy_ci_high"],
                                    "eval/format_compliance": r["format_compliance"], "eval/num_problems": r["n"]})
                    if r.get("episodes"):  # a workflow's episodes (docs/agents.md)
                        e = r["episodes"]
                        metrics.update({"eval/turns_mean": e["turns_mean"], "eval/tool_calls_mean": e["tool_calls_mean"],
                                        "eval/first_turn_accuracy": e["first_turn_accuracy"]})
                else:
                    metrics.update({"eval/accuracy_greedy": r["accuracy"],
                                    "eval/greedy_ci95_low": r["accuracy_ci_low"],
                                    "eval/greedy_ci95_high": r["accuracy_ci_high"]})
        self._log(metrics)
        if self.prom is not None:
            self.prom.evaluated(metrics.get("eval/accuracy_sampled"), seconds)
