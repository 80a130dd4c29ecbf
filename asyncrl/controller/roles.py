"""The processes of an ``asyncrl train`` run: the prompt feeder, the reward model, the environment
server, the rollout servers and the trainer.

One job: turn the config and the core split (:class:`asyncrl.controller.resources.Assignment`) into each
role's :class:`asyncrl.controller.supervisor.RoleSpec`: command line, environment, cores, GPUs, nice
value, health check, restart and stop policy (the feeder stops first, then the rollout servers,
then the reward model and the environment server, which they may still be waiting on while they
drain, and the trainer).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from asyncrl.controller.resources import Assignment

__all__ = ["FATAL_EXIT_CODES", "child_env", "role_specs", "reward_model_spec", "env_server_spec"]

#: Exit statuses of roles that restarting cannot fix (argument/config errors).
FATAL_EXIT_CODES = (2,)


def child_env(cfg: Any, redis_url: str, run_dir: Path) -> dict[str, str]:
    """The environment every role process gets: the run's Redis URL and directory, JSONL-only tracking."""
    from asyncrl.metrics.tracking import SINKS_ENV

    env = {
        "ASYNCRL_BUFFER__REDIS_URL": redis_url,
        SINKS_ENV: "jsonl",  # the controller forwards records to TensorBoard/W&B (one run)
        "TOKENIZERS_PARALLELISM": "false",
        "ASYNCRL_RUN_DIR": str(run_dir),
    }
    if not (cfg.resources.trainer_gpus or cfg.resources.rollout_gpus):
        env["DS_ACCELERATOR"] = os.environ.get("DS_ACCELERATOR", "cpu")
    return env


def role_specs(cfg: Any, cfg_path: Path, env: dict[str, str], assignment: Assignment) -> tuple[list[Any], list[str]]:
    """The feeder, rollout server and trainer :class:`~asyncrl.controller.supervisor.RoleSpec` s, and the rollout servers' URLs.

    ``env`` (:func:`child_env`) is every role's environment; the rollout servers move to free
    ports (announced in it) when another run holds ``rollout.base_port``.
    """
    from asyncrl.core.core_follow import FLAG_ENV, WIDE_ENV
    from asyncrl.controller.errors import ControllerError
    from asyncrl.core.net import PortRangeError, free_port_range, ports_free
    from asyncrl.controller.supervisor import RoleSpec, http_health_check, role_command

    cfg_arg = ["--config", str(cfg_path)]
    specs = [RoleSpec("feeder", [sys.executable, "-m", "asyncrl.feeder", *cfg_arg],
                      env={**env, "OMP_NUM_THREADS": "1"}, restart=True, stop_order=0,
                      fatal_exit_codes=FATAL_EXIT_CODES,
                      stop_grace_seconds=10.0)]
    rm_spec = reward_model_spec(cfg, cfg_arg, env, assignment)  # sets the port every role reads, so first
    if rm_spec is not None:
        specs.append(rm_spec)
    es_spec = env_server_spec(cfg, cfg_arg, env, assignment)  # likewise: the rollout servers read its port
    if es_spec is not None:
        specs.append(es_spec)
    urls = list(cfg.rollout.server_urls)
    base_port = cfg.rollout.base_port
    n = len(assignment.rollout_cores)
    if not urls and not ports_free(cfg.rollout.host, base_port, n):
        # another run holds the configured ports: move this run's servers to free ones
        try:
            base_port = free_port_range(cfg.rollout.host, n)
        except PortRangeError as exc:  # the rollout ports of ``asyncrl train``: the run cannot start
            raise ControllerError(str(exc)) from exc
        span = lambda p: f"{p}..{p + n - 1}" if n > 1 else str(p)  # noqa: E731
        print(f"asyncrl train: port {span(cfg.rollout.base_port)} is busy; rollout servers use {span(base_port)}",
              file=sys.stderr)
        env["ASYNCRL_ROLLOUT__BASE_PORT"] = str(base_port)
    rollout_urls: list[str] = []
    follow_flag = str(Path(cfg.run.run_dir) / "cores" / "trainer.idle")
    for i, cores in enumerate(assignment.rollout_cores):
        renv = dict(env)
        url = urls[i].rstrip("/") if urls else f"http://{cfg.rollout.host}:{base_port + i}"
        rollout_urls.append(url)
        if cores is not None and cfg.rollout.engine_threads is None:
            renv["ASYNCRL_ROLLOUT__ENGINE_THREADS"] = str(assignment.rollout_threads or len(cores))
        if assignment.rollout_wide_threads:  # resources.core_sharing: follow
            renv.update({FLAG_ENV: follow_flag, WIDE_ENV: str(assignment.rollout_wide_threads)})
        specs.append(RoleSpec(f"rollout-{i}", role_command("rollout-server", *cfg_arg, "--server_index", str(i)),
                              env=renv, cores=cores, gpus=assignment.rollout_gpus[i], restart=True, stop_order=1,
                              fatal_exit_codes=FATAL_EXIT_CODES, stop_grace_seconds=30.0,
                              health_check=http_health_check(url + "/health"), health_interval_seconds=5.0,
                              health_failures=6, nice=assignment.rollout_nice))
    tenv = dict(env)
    if assignment.trainer_threads:  # fewer threads than the cores it may run on (follow)
        threads = str(assignment.trainer_threads)
        tenv.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, OPENBLAS_NUM_THREADS=threads)
    if assignment.rollout_wide_threads:
        tenv[FLAG_ENV] = follow_flag
    world = cfg.trainer.world_size
    if world > 1:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
                "-m", "asyncrl.cli", "trainer", *cfg_arg]
        if assignment.trainer_cores is not None:
            tenv["OMP_NUM_THREADS"] = str(max(1, (assignment.trainer_threads or len(assignment.trainer_cores)) // world))
    else:
        argv = role_command("trainer", *cfg_arg)
    specs.append(RoleSpec("trainer", argv, env=tenv, cores=assignment.trainer_cores, gpus=assignment.trainer_gpus,
                           restart=True, max_restarts=2, restart_delay_seconds=2.0, stop_order=2,
                           fatal_exit_codes=FATAL_EXIT_CODES,
                           stop_grace_seconds=180.0, nice=assignment.trainer_nice))
    return specs, rollout_urls


def reward_model_spec(cfg: Any, cfg_arg: list[str], env: dict[str, str], assignment: Assignment) -> Any:
    """The reward-model server's :class:`~asyncrl.controller.supervisor.RoleSpec`, or None.

    None unless ``reward.model.path`` is set and ``reward.model.url`` is not (an attached
    reward model runs elsewhere). When ``reward.model.port`` is 0 or busy, a free port is
    chosen and announced to every role in ``env`` (``ASYNCRL_REWARD__MODEL__PORT``). The server
    runs on the rollout servers' cores (it works when they score) and stops after them.
    """
    rm = cfg.reward.model
    if rm.path is None or rm.url is not None:
        return None

    def role_env(cores: list[int] | None) -> dict[str, str]:
        renv = dict(env)
        if cores is not None and rm.threads is None:
            renv["ASYNCRL_REWARD__MODEL__THREADS"] = str(len(cores))
        return renv

    return _side_server_spec("reward-model", rm, "ASYNCRL_REWARD__MODEL__PORT", "the reward model", cfg_arg, env,
                             assignment, role_env)


def env_server_spec(cfg: Any, cfg_arg: list[str], env: dict[str, str], assignment: Assignment) -> Any:
    """The environment server's :class:`~asyncrl.controller.supervisor.RoleSpec`, or None.

    None unless ``agent.env_server.enabled`` and ``agent.env_server.url`` is not set (an attached
    server runs elsewhere). When ``agent.env_server.port`` is 0 or busy, a free port is chosen and
    announced to every role in ``env`` (``ASYNCRL_AGENT__ENV_SERVER__PORT``). The server is
    restarted when it dies (it keeps no state: the rollout workers send the calls in flight again,
    docs/agents.md), is health-checked on ``/health``, gets no Redis credentials (it never talks
    to Redis), runs on the rollout servers' cores at their nice value (it mostly waits) and stops
    after the rollout servers, whose draining episodes may still be calling it.
    """
    from asyncrl.core.secret_values import REDIS_URL_ENV

    es = cfg.agent.env_server
    if not es.enabled or es.url is not None:
        return None

    def role_env(cores: list[int] | None) -> dict[str, str]:
        senv = {k: v for k, v in env.items() if k not in ("ASYNCRL_BUFFER__REDIS_URL", REDIS_URL_ENV)}
        senv["OMP_NUM_THREADS"] = "1"
        return senv

    return _side_server_spec("env-server", es, "ASYNCRL_AGENT__ENV_SERVER__PORT", "the environment server", cfg_arg,
                             env, assignment, role_env)


def _side_server_spec(name: str, section: Any, port_env: str, what: str, cfg_arg: list[str], env: dict[str, str],
                      assignment: Assignment, role_env: Callable[[list[int] | None], dict[str, str]]) -> Any:
    """The :class:`~asyncrl.controller.supervisor.RoleSpec` of a server the rollout servers call (the reward
    model, the environment server; its config ``section`` has ``host``, ``port``, ``server_url`` and
    ``drain_timeout_seconds``).

    Its port is ``section.port``, or a free one when that is 0 or busy, announced to every role in
    ``env[port_env]`` (a busy configured port is said on stderr, naming ``what``). It runs as
    ``asyncrl <name>`` on the union of the rollout servers' cores (None when any of them is unpinned),
    at their nice value, with ``role_env(cores)`` as its environment; it is restarted when it dies,
    health-checked on ``/health``, and stops after the rollout servers, with its drain deadline plus
    10 s to drain.
    """
    from asyncrl.core.net import free_port, ports_free
    from asyncrl.controller.supervisor import RoleSpec, http_health_check, role_command

    port = section.port
    if port == 0 or not ports_free(section.host, port, 1):
        port = free_port(section.host)
        if section.port:
            print(f"asyncrl train: port {section.port} is busy; {what} uses {port}", file=sys.stderr)
        env[port_env] = str(port)
    cores = None
    if all(c is not None for c in assignment.rollout_cores):
        cores = sorted({core for c in assignment.rollout_cores for core in c})
    url = section.model_copy(update={"port": port}).server_url
    return RoleSpec(name, role_command(name, *cfg_arg), env=role_env(cores), cores=cores, restart=True,
                    stop_order=2, fatal_exit_codes=FATAL_EXIT_CODES,
                    stop_grace_seconds=section.drain_timeout_seconds + 10.0,
                    health_check=http_health_check(url + "/health"), health_interval_seconds=5.0, health_failures=6,
                    nice=assignment.rollout_nice)
