"""``asyncrl train``: asynchronous partial-rollout RL end to end on one machine.

The controller runs every role as its own process, exactly as a cluster would (docs/architecture.md#roles):

1. resolves the config (flags > ``ASYNCRL_*`` > YAML > defaults; :mod:`asyncrl.controller.train`) and
   writes it to ``<run_dir>/config.yaml``;
2. starts the embedded Redis (AOF in ``<run_dir>/redis``) unless ``--redis_url`` is given;
3. starts ``rollout.num_servers`` rollout servers (``asyncrl rollout-server``: embedded engine +
   rollout worker, one port each), the trainer (``asyncrl trainer``, under ``torchrun`` when
   ``trainer.world_size > 1``) and the prompt feeder (``python -m asyncrl.feeder``);
4. supervises them (:mod:`asyncrl.controller.supervisor`): a role that dies is reported with its last log
   lines and restarted (rollout servers, feeder: the buffer reclaims their work / the cursor is
   in Redis; trainer: it resumes from its checkpoint and the buffer rewinds), up to a few
   times; a role that exits with status 2 (bad configuration) or keeps dying stops the run;
5. shows live progress (:mod:`asyncrl.controller.progress`), logs its own metrics (buffer depth by state,
   partial ratio, rollout tokens/s, version clock) and forwards every role's JSONL records to
   TensorBoard/W&B (:mod:`asyncrl.metrics.tracking`);
6. runs the held-out evaluation every ``monitoring.eval_interval`` trainer steps (and once
   before training, and at the end unless interrupted) on the newest published weights, with every role
   paused (SIGSTOP) so that evaluation uses all cores and its time is excluded from the
   training wall clock (reported separately as ``time/eval_seconds``);
7. stops when the trainer finishes ``run.total_steps``, after ``run.max_wall_seconds`` of
   training wall time, or on Ctrl-C/SIGTERM: SIGTERM to the feeder, then the rollout servers
   (they park their partial samples), then the trainer (it checkpoints), then Redis; exit 0.
   A second Ctrl-C kills everything at once.

``--resume RUN_DIR`` continues a run: the config comes from ``RUN_DIR/config.yaml`` (flags
still override, e.g. ``--total_steps``), Redis restarts on the same AOF, the feeder continues
from the dataset cursor stored in Redis (no prompt repeated or skipped), the trainer from its
newest checkpoint, and the training wall clock from where it stopped. Starting a new run in an
existing run directory is refused unless ``--overwrite`` is given.

Core split: :mod:`asyncrl.controller.resources` (on 2 cores with the asynchronous knobs on: rollout core
0, trainer core 1; a synchronous config gives every role all cores).

Run directory: ``config.yaml``, ``clock.json``, ``run_state.json`` (status, step, wall
seconds), ``metrics-<role>.jsonl``, ``metrics/`` (the trainer's step records and
``tail.json``, how far they were forwarded: :class:`asyncrl.controller.run_watch.TrainerTail`),
``logs/<role>.log``, ``redis/``, ``checkpoints/``, ``weights/``, ``eval/step-<k>.json``.

Simplified: one machine; attached SGLang servers (``rollout.server_urls``) get one rollout
server role each with that URL; the rollout roles' idle ratios come from their own metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.controller.controller_eval import ControllerEvaluation
from asyncrl.controller.errors import ControllerError
from asyncrl.controller.run_watch import (
    BufferWatcher,
    PrometheusExport,
    RolloutScraper,
    TrainerTail,
    normalize_trainer_record,
    reconcile_groups,
)
from asyncrl.controller.supervisor import resume_roles

if TYPE_CHECKING:
    from asyncrl.controller.resources import Assignment

__all__ = ["Controller", "resume_roles", "run_session"]

#: Seconds between two buffer-stats polls (each costs a few Redis round trips per live group).
STATS_INTERVAL_SECONDS = 2.0
#: After the controller restarts Redis, role failures within this many seconds are restarted
#: without counting against their restart limits (they are the outage's, not the role's).
OUTAGE_EXCUSE_SECONDS = 30.0
#: Longest wait for the previous session's processes (draining after their controller died) on
#: ``--resume``: the trainer's stop grace (180 s) plus Redis' own stop.
PREVIOUS_SESSION_WAIT_SECONDS = 240.0
#: How long the embedded Redis outlives a dead controller, waiting for the roles to drain.
REDIS_GUARD_GRACE_SECONDS = 240.0


class _ForceStop(BaseException):
    """Second Ctrl-C while stopping: kill everything now."""


# ----------------------------------------------------------------------------------------------
# the controller


class Controller(ControllerEvaluation):
    """One ``asyncrl train`` session (see the module docstring).

    :meth:`run` goes through named phases, like the trainer's loop: ``_prepare`` (run directory,
    core split, loggers), ``_start`` (Redis, buffer, base-model evaluation, roles),
    ``_supervise`` (until done, failed, out of time or signalled; ``_evaluate`` every
    ``monitoring.eval_interval`` steps), ``_stop`` (roles in order, final evaluation),
    ``_summarise`` (end-of-run checks and summary) and, whatever happens, ``_release``.
    """

    def __init__(self, cfg: Any, resumed: bool) -> None:
        self.cfg = cfg
        self.resumed = resumed
        self.run_dir = Path(cfg.run.run_dir)
        self.cfg_path = self.run_dir / "config.yaml"
        self.state_path = self.run_dir / "run_state.json"
        from asyncrl.core.process_guard import PidRecord

        self.pids_file = self.run_dir / "pids.json"
        self.pids = PidRecord(self.pids_file)
        self._stats_down = False
        self.stopping = False
        self.stop_reason = ""
        self.signals = 0
        self.blocking_stop = False
        self.trainer_step = 0
        self.last_eval_step: int | None = None
        self.max_staleness_seen: int | None = None
        self.final_checks: dict[str, Any] = {}
        self.eval_seconds_total = 0.0
        self.role_restarts = 0
        self.redis = None
        self.redis_url = ""
        self.failed: str | None = None
        self.rollout_urls: list[str] = []
        self.scraper = RolloutScraper([])
        self.prom: PrometheusExport | None = None
        self.sup: Any = None  # the Supervisor, once the roles start
        self.buf: Any = None  # the ReplayBuffer, once Redis is up
        self.status = "failed"  # what run_state.json says when the session ends

    # -- signals --------------------------------------------------------------------------------

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.signals += 1
        if self.signals == 1:
            self.stopping = True
            self.stop_reason = f"{signal.Signals(signum).name} received"
            print(f"\nasyncrl train: {self.stop_reason}: stopping the roles in order "
                  "(rollout servers park partials, the trainer checkpoints); again to kill", file=sys.stderr)
        elif self.blocking_stop:
            raise _ForceStop()
        else:
            self.stopping = True

    # -- state ----------------------------------------------------------------------------------

    def _read_state(self) -> dict[str, Any]:
        try:
            return json.loads(self.state_path.read_text())
        except (OSError, ValueError):
            return {}

    def _write_state(self, status: str) -> None:
        state = self._read_state()
        if self.prom is not None:
            state["controller_metrics_url"] = f"http://{self.cfg.monitoring.metrics_host}:{self.prom.port}/metrics"
        state.update(self.final_checks)
        state.update(status=status, step=self.trainer_step, wall_seconds=round(self.clock.wall_seconds(), 3),
                     eval_seconds=round(self.eval_seconds_total + state.get("eval_seconds_before", 0.0), 3),
                     updated_unix=time.time())
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        os.replace(tmp, self.state_path)

    # -- setup ----------------------------------------------------------------------------------

    def _prepare_run_dir(self) -> None:
        from asyncrl.core.config import dump_config
        from asyncrl.core.secret_values import private_dir
        from asyncrl.metrics.tracking import RunClock

        private_dir(self.run_dir)  # 0700: config, logs, checkpoints, weights and the AOF are the owner's only
        # umask 077 like its roles (docs/security.md): the controller's metrics, tail/clock/run_state/pids
        # files and the embedded redis-server's log and AOF are created 0600 / 0700 too (issue #31 item 6)
        os.umask(0o077)
        dump_config(self.cfg, self.cfg_path)  # 0600, without secrets
        previous = self._read_state()
        sessions = int(previous.get("sessions", 0)) + 1
        before_wall = float(previous.get("wall_seconds", 0.0)) if self.resumed else 0.0
        self.eval_before = float(previous.get("eval_seconds", 0.0)) if self.resumed else 0.0
        self.trainer_step = int(previous.get("step", 0)) if self.resumed else 0
        self.clock = RunClock.start(self.run_dir, previous_wall_seconds=before_wall)
        state = {"sessions": sessions, "eval_seconds_before": self.eval_before}
        self.state_path.write_text(json.dumps(state))
        self._write_state("starting")

    def _start_redis(self) -> None:
        from asyncrl.controller.redis_server import make_embedded_redis

        from asyncrl.core.secret_values import reveal

        if self.cfg.buffer.redis_url:
            self.redis_url = reveal(self.cfg.buffer.redis_url) or ""
            return
        from asyncrl.core.process_guard import guard

        if self.redis is None:
            # Redis outlives a dead controller until the roles have drained (asyncrl.core.process_guard)
            self.redis = guard(make_embedded_redis(self.run_dir / "redis", None, self.cfg.security.redis_password,
                                                   run=self.cfg.run.name), self.pids_file, REDIS_GUARD_GRACE_SECONDS)
        self.redis.start()  # a restart: same port, files and passwords (children keep their URLs)
        self.redis_url = self.redis.url
        self._record_pids()

    def _record_pids(self) -> None:
        """``pids.json``: the roles and the Redis guardian (asyncrl.core.process_guard.PidRecord)."""
        self.pids.update(self.sup, self.redis)

    def role_redis_url(self, role: str) -> str:
        """The Redis URL a role's process gets (in its environment): its own ACL user on the
        embedded server, else the one configured URL (``buffer.redis_url``, every role alike)."""
        if self.redis is not None and role in self.redis.role_passwords:
            return self.redis.url_for(role)
        return self.redis_url

    def role_specs(self, assignment: Assignment) -> list[Any]:
        """The feeder, rollout server and trainer :class:`~asyncrl.controller.supervisor.RoleSpec` s
        (:func:`asyncrl.controller.roles.role_specs`); keeps the rollout servers' URLs."""
        from asyncrl.controller.roles import child_env, role_specs
        from asyncrl.core.secret_values import API_KEY_ENV, REDIS_URL_ENV, reveal

        env = child_env(self.cfg, self.redis_url, self.run_dir)
        api_key = reveal(self.cfg.security.api_key)
        if api_key:
            env[API_KEY_ENV] = api_key  # config.yaml holds no secrets: roles get them from the environment
        specs, self.rollout_urls = role_specs(self.cfg, self.cfg_path, env, assignment)
        for spec in specs:  # each role its own Redis user (docs/security.md)
            if spec.name == "env-server":  # it never talks to Redis: no credentials at all
                continue
            role = "rollout" if spec.name.startswith("rollout") else spec.name
            spec.env[REDIS_URL_ENV] = self.role_redis_url(role if role in ("feeder", "rollout", "trainer") else "controller")
        return specs

    # -- logging --------------------------------------------------------------------------------

    def _log(self, metrics: dict[str, float]) -> None:
        rec = self.logger.log(self.trainer_step, metrics)
        self.progress.update(rec)

    def _forward_children(self) -> None:
        forwarded = False
        for role, raw in self.trainer_tail.read_new():
            step, metrics = normalize_trainer_record(raw)
            self.trainer_step = max(self.trainer_step, step)
            if "staleness/max" in metrics:
                seen = int(metrics["staleness/max"])
                self.max_staleness_seen = seen if self.max_staleness_seen is None else max(self.max_staleness_seen, seen)
            rec = self.trainer_logger.log(step, metrics)
            self.logger.forward(rec)
            self.progress.update(rec)
            forwarded = True
        if forwarded:
            self.trainer_tail.save()
        for rec in self.tail.read_new():
            if rec.get("role") == "trainer" and isinstance(rec.get("step"), int):
                self.trainer_step = max(self.trainer_step, rec["step"])
            self.logger.forward(rec)
            self.progress.update(rec)

    # -- the run --------------------------------------------------------------------------------

    def _handle_exits(self, events: list[Any]) -> bool:
        """Report role exits; returns True when the run is over (trainer done, or a fatal failure)."""
        over = False
        for ev in events:
            if ev.restarted:
                self.role_restarts += 1
                if self.prom is not None:
                    self.prom.restarted(ev.name, ev.reason)
                print(f"asyncrl train: {ev.describe()}", file=sys.stderr)
                self._log({"supervisor/restarts": self.role_restarts})
                continue
            if ev.name == "trainer" and not ev.failed:
                self.stop_reason = f"the trainer finished (step {self.trainer_step})"
                over = True
                continue
            if ev.failed or ev.name == "trainer":
                self.failed = ev.describe()
                self.stop_reason = f"role {ev.name!r} failed"
                print(f"asyncrl train: {self.failed}\nasyncrl train: stopping the run "
                      f"(full log: {self.run_dir / 'logs' / (ev.name + '.log')})", file=sys.stderr)
                over = True
            else:
                # a rollout server or the feeder exiting 0 on its own (e.g. attached server gone)
                self.failed = f"role {ev.name!r} exited on its own. Last log lines:\n{ev.log_tail}"
                self.stop_reason = f"role {ev.name!r} exited on its own"
                print(f"asyncrl train: {self.failed}", file=sys.stderr)
                over = True
        return over

    async def run(self) -> int:
        """The session, phase by phase: prepare, start, supervise (evaluating every
        ``monitoring.eval_interval`` steps), stop, summarise; whatever happens, release.

        Returns:
            the exit code: 0 finished or stopped, 1 failed or killed, 2 a bad setup.
        """
        from asyncrl.controller.supervisor import SupervisorError

        code = self._prepare()
        if code is not None:
            return code
        try:
            code = await self._start()
            if code is not None:
                return code
            await self._supervise()
            await self._stop()
            self._summarise()
            return 1 if self.status == "failed" else 0
        except _ForceStop:
            print("asyncrl train: killed every role (second interrupt)", file=sys.stderr)
            self.status = "killed"
            return 1
        except (SupervisorError, ControllerError) as exc:
            print(f"asyncrl train: {exc}", file=sys.stderr)
            return 1
        finally:
            await self._release()

    def _prepare(self) -> int | None:
        """The run directory, the core split, the loggers and the progress display; 2 on a bad setup."""
        from asyncrl.controller.progress import Progress
        from asyncrl.controller.resources import assign_resources
        from asyncrl.metrics.tracking import MetricsLogger, MetricsTail, TrackingError

        cfg = self.cfg
        self._prepare_run_dir()
        try:
            self.assignment = assign_resources(cfg)
            self.logger = MetricsLogger(self.run_dir, cfg.monitoring, role="controller",
                                        config=cfg.model_dump(mode="json"))
            if cfg.monitoring.controller_metrics_port is not None:
                self.prom = PrometheusExport(cfg)
                print(f"asyncrl train: controller metrics on "
                      f"http://{cfg.monitoring.metrics_host}:{self.prom.port}/metrics", file=sys.stderr)
        except (ControllerError, TrackingError, OSError) as exc:
            print(f"asyncrl train: {exc}", file=sys.stderr)
            return 2
        self.trainer_logger = MetricsLogger(self.run_dir, None, role="trainer")
        self.tail = MetricsTail(self.run_dir, skip_roles=["controller", "trainer"])
        self.trainer_tail = TrainerTail(self.run_dir)
        if self.resumed:
            self.tail.seek_to_end()
            # the trainer may have gone on after the previous controller's last read (its records
            # are forwarded now) or even finished the run (then run_state.json's step lags)
            self.trainer_step = max(self.trainer_step, self.trainer_tail.resume())
        self.progress = Progress(cfg.run.total_steps, cfg.run.name, cfg.buffer.max_staleness,
                                 live=None if cfg.monitoring.progress else False)
        self.eval_on = cfg.monitoring.eval_interval is not None
        print(f"asyncrl train: run {cfg.run.name!r} in {self.run_dir} ({'resumed' if self.resumed else 'new'}); "
              f"{self.assignment.describe()}", file=sys.stderr)
        return None

    async def _start(self) -> int | None:
        """Redis, the buffer, the base model's evaluation (new runs) and the roles; an exit code
        when the run ends here (1: Redis did not start; 0: stopped during that evaluation)."""
        from asyncrl.controller.cpu_share import CpuShareSampler
        from asyncrl.controller.redis_server import RedisServerError
        from asyncrl.controller.supervisor import Supervisor

        from asyncrl.core.process_guard import wait_previous_session

        cfg = self.cfg
        # processes of an earlier session (its controller was killed) still drain: they hold the
        # rollout ports and the Redis AOF until they exit
        wait_previous_session(self.pids_file, str(self.run_dir.resolve()), PREVIOUS_SESSION_WAIT_SECONDS)
        try:
            self._start_redis()
        except RedisServerError as exc:
            print(f"asyncrl train: {exc}", file=sys.stderr)
            return 1
        from buffers import ReplayBuffer

        self.buf = await ReplayBuffer.open_for(cfg, role="controller", url=self.redis_url)
        self.watcher = BufferWatcher(self.buf)
        self.progress.start()
        if self.resumed:
            self.last_eval_step = self.trainer_step  # evaluated (or not due) when the last session ended
        if self.eval_on and not self.resumed:
            await self._evaluate(None, None, self.assignment)  # the base model, before any training
        if self.stopping:
            self.status = "stopped"
            return 0
        self.sup = Supervisor(self.run_dir / "logs")
        for spec in self.role_specs(self.assignment):
            self.sup.start(spec)
        self._record_pids()
        self.scraper = RolloutScraper(self.rollout_urls)
        self.cpu = CpuShareSampler(self.assignment.eval_threads)  # eval_threads = the run's cores
        self.progress.set_status("training")
        return None

    async def _supervise(self) -> None:
        """Until the trainer finishes, a role fails, ``run.max_wall_seconds`` passes or a signal
        comes: report role exits, forward records, restart a dead Redis, poll the statistics and
        evaluate every ``monitoring.eval_interval`` steps. Sets :attr:`status`."""
        from redis.exceptions import RedisError

        from asyncrl.controller.redis_server import RedisServerError

        cfg, sup, watcher = self.cfg, self.sup, self.watcher
        next_stats = 0.0
        over = False
        while not over and not self.stopping:
            # Redis first: role exits caused by its outage are then excused, not counted as crashes
            if self.redis is not None and self.redis.proc is not None and self.redis.proc.poll() is not None:
                print(f"WARNING asyncrl train: redis-server exited ({self.redis.proc.returncode}); restarting it on "
                      f"its AOF; roles wait the outage out: {self.redis.log_tail(5)}", file=sys.stderr)
                sup.excuse_exits(OUTAGE_EXCUSE_SECONDS, "Redis restarted")
                try:
                    self._start_redis()
                except RedisServerError as exc:
                    raise ControllerError(f"redis-server could not be restarted on its AOF: {exc}") from exc
                sup.excuse_exits(OUTAGE_EXCUSE_SECONDS, "Redis restarted")
                self.role_restarts += 1
            over = self._handle_exits(sup.poll())
            self._record_pids()
            self._forward_children()
            wall = self.clock.wall_seconds()
            if time.monotonic() >= next_stats:
                next_stats = time.monotonic() + STATS_INTERVAL_SECONDS
                try:
                    self._log({**await watcher.poll(wall, self.trainer_step),
                               **await self.scraper.poll(self.trainer_step),
                               **self.cpu.sample({name: sup.pid(name) for name in sup.names})})
                    if self.prom is not None:
                        self.prom.update(watcher.last_stats, self.trainer_step, sup.running())
                    if self._stats_down:
                        self._stats_down = False
                        print("asyncrl train: buffer statistics available again", file=sys.stderr)
                except (OSError, ConnectionError, RedisError) as exc:  # Redis restarting: next poll
                    if not self._stats_down:  # one line per outage
                        self._stats_down = True
                        print(f"asyncrl train: buffer stats unavailable: {exc}", file=sys.stderr)
                self._write_state("running")
            k = cfg.monitoring.eval_interval
            if self.eval_on and not over and self.trainer_step // k > (self.last_eval_step or 0) // k:
                await self._evaluate(self.buf, sup, self.assignment)  # a multiple of k was reached (or passed)
            if cfg.run.max_wall_seconds is not None and wall >= cfg.run.max_wall_seconds and not over:
                self.stop_reason = f"run.max_wall_seconds={cfg.run.max_wall_seconds:g} reached"
                over = True
            self.progress.refresh()
            if not over and not self.stopping:
                await asyncio.sleep(0.25)
        self.status = "failed" if self.failed else ("finished" if "finished" in self.stop_reason else "stopped")

    async def _stop(self) -> None:
        """Stop the roles in order (a second Ctrl-C kills them), take in their last records and,
        when the run ended on its own, evaluate the final weights."""
        sup = self.sup
        self.progress.set_status("stopping")
        self.progress.refresh()
        self.blocking_stop = True
        codes = sup.stop_all()
        self.blocking_stop = False
        if codes.get("trainer", 0) not in (0, None) and self.status != "failed":
            self.status = "failed"
            self.failed = f"the trainer exited with status {codes['trainer']} while stopping:\n{sup.log_tail('trainer')}"
            print(f"asyncrl train: {self.failed}", file=sys.stderr)
        self._forward_children()
        self._log(await self.watcher.poll(self.clock.wall_seconds(), self.trainer_step))
        # a final evaluation when the run ends on its own (not after Ctrl-C/SIGTERM: exit promptly)
        if self.eval_on and self.last_eval_step != self.trainer_step and self.status != "failed" and not self.signals:
            await self._evaluate(self.buf, None, self.assignment)

    def _summarise(self) -> None:
        """The end-of-run checks (the books, staleness) into ``run_state.json``, and the summary lines."""
        watcher, status = self.watcher, self.status
        if watcher.last_stats:
            ok, balance = reconcile_groups(watcher.last_stats)
            self.final_checks = {"groups_reconcile": ok, "groups_balance": balance,
                                 "max_staleness_seen": self.max_staleness_seen,
                                 "max_staleness": self.cfg.buffer.max_staleness}
        self._write_state(status)
        self.progress.stop()
        st = watcher.last_stats
        reason = self.stop_reason or "stopped"
        checks = self.final_checks
        ok, balance = checks.get("groups_reconcile", False), checks.get("groups_balance", "no buffer statistics")
        eta = self.cfg.buffer.max_staleness
        seen = self.max_staleness_seen
        lines = [
            f"asyncrl train: {status}: {reason}. step {self.trainer_step}/{self.cfg.run.total_steps}, "
            f"policy version {st.get('version')}, training wall time {self.clock.wall_seconds():.0f} s "
            f"(+{self.eval_seconds_total:.0f} s held-out evaluation)",
            f"  buffer: groups by state {st.get('groups_by_state')}, dropped by reason {st.get('dropped_by_reason')}, "
            f"multi-version samples {watcher.multi_version_samples}, role restarts {self.role_restarts}",
            f"  groups {'reconcile' if ok else 'DO NOT reconcile'}: {balance}",
            f"  max staleness seen in a train batch: {'—' if seen is None else seen} "
            f"({'within' if seen is None or seen <= eta else 'ABOVE'} buffer.max_staleness = {eta})",
            f"  run directory {self.run_dir}: `asyncrl report {self.run_dir}`; continue with "
            f"`asyncrl train --resume {self.run_dir} --total_steps N`",
        ]
        print("\n".join(lines), file=sys.stderr)

    async def _release(self) -> None:
        """Whatever happened: kill the roles left, close the buffer, stop Redis, record the status."""
        if self.sup is not None:
            self.sup.kill_all()
        if self.buf is not None:
            await self.buf.close()
        if self.redis is not None:
            self.redis.stop()
        with contextlib.suppress(OSError):  # best effort at exit: run_state.json's directory may be gone
            self._write_state(self.status)
        self.progress.stop()
        self.logger.close()
        self.trainer_logger.close()


def run_session(cfg: Any, resumed: bool) -> int:
    """Run one ``asyncrl train`` session in the foreground; returns its exit code.

    Ctrl-C and SIGTERM go to the :class:`Controller` while it runs (the first stops the roles in
    order, a second kills them); the previous handlers are restored afterwards.
    """
    ctl = Controller(cfg, resumed)
    previous = {s: signal.signal(s, ctl._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return asyncio.run(ctl.run())
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
