"""How ``asyncrl train`` splits the machine's cores (and GPUs) between the roles.

One job: :func:`assign_resources` turns ``resources.*`` and the three knobs into an
:class:`Assignment` of cores, GPUs and nice values per role.

Default core split (``resources.rollout_cores``/``trainer_cores`` override it): with the
asynchronous knobs on, the trainer gets the upper half of the cores (at least one) and the
rollout servers the rest, split evenly between servers — on 2 cores: rollout core 0,
trainer core 1. A synchronous config (``p = 1``, ``M ≥ max_response_len``, ``η = 0``) gives
every role all cores, since generation and training alternate. The feeder and controller are
light and not pinned; each role's torch threads = its number of cores.

With ``resources.core_sharing`` ``shared``, ``trainer_first`` or ``rollout_first``, every role
gets every core and one of them is niced (``trainer_first``: the rollout servers run at nice 19;
``rollout_first``: the trainer does). With ``follow``, every role may run on every core but keeps
the torch threads of its ``split`` half, and the rollout servers widen to the trainer's threads
too while the trainer waits for a batch (:mod:`asyncrl.core.core_follow`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from asyncrl.controller.errors import ControllerError

__all__ = ["Assignment", "assign_resources"]


@dataclass
class Assignment:
    """Cores and GPUs of each role (None: not pinned / not set).

    Attributes:
        rollout_cores: one core list per rollout server.
        trainer_cores: cores shared by the trainer ranks.
        rollout_gpus: one GPU list per rollout server.
        trainer_gpus: GPUs of the trainer ranks.
        eval_threads: torch threads of the held-out evaluation (all cores; roles are paused).
        rollout_nice, trainer_nice: nice values of the roles (``resources.core_sharing``).
        rollout_threads, trainer_threads: torch threads per rollout server / of the trainer when
            they differ from the number of cores a role may use (``follow``); None: one per core.
        rollout_wide_threads: a rollout server's threads while the trainer waits (``follow``).
    """

    rollout_cores: list[list[int] | None]
    trainer_cores: list[int] | None
    rollout_gpus: list[list[int] | None]
    trainer_gpus: list[int] | None
    eval_threads: int
    rollout_nice: int = 0
    trainer_nice: int = 0
    rollout_threads: int | None = None
    trainer_threads: int | None = None
    rollout_wide_threads: int | None = None

    def describe(self) -> str:
        """One line for the log: ``rollout-0 cores [0]; trainer cores [1]`` (``, nice 19`` when lowered)."""
        nice = (lambda n: f", nice {n}" if n else "")  # noqa: E731
        threads = (lambda n: f", {n} threads" if n else "")  # noqa: E731
        wide = f" ({self.rollout_wide_threads} while the trainer waits)" if self.rollout_wide_threads else ""
        parts = [f"rollout-{i} cores {c if c is not None else 'all'}{nice(self.rollout_nice)}{threads(self.rollout_threads)}{wide}"
                 for i, c in enumerate(self.rollout_cores)]
        parts.append(f"trainer cores {self.trainer_cores if self.trainer_cores is not None else 'all'}"
                     f"{nice(self.trainer_nice)}{threads(self.trainer_threads)}")
        if self.trainer_gpus is not None:
            parts.append(f"trainer gpus {self.trainer_gpus}")
        if any(g is not None for g in self.rollout_gpus):
            parts.append("rollout gpus " + ", ".join(str(g) for g in self.rollout_gpus))
        return "; ".join(parts)


def assign_resources(cfg: Any, available: list[int] | None = None, num_rollout: int | None = None) -> Assignment:
    """Split cores (and GPUs) between the roles; see the module docstring for the default.

    Args:
        cfg: the run config (``resources.*``, ``rollout.num_servers``, the three knobs).
        available: usable core ids (default: this process's affinity).
        num_rollout: rollout server processes (default: ``len(server_urls)`` or ``num_servers``).

    Raises:
        ControllerError: a configured core is not available, or a role got an empty list.
    """
    from asyncrl.controller.supervisor import split_cores

    cores = sorted(available if available is not None else os.sched_getaffinity(0))
    n = num_rollout or (len(cfg.rollout.server_urls) or cfg.rollout.num_servers)
    res = cfg.resources
    for name in ("rollout_cores", "trainer_cores"):
        chosen = getattr(res, name)
        if chosen is not None:
            missing = sorted(set(chosen) - set(cores))
            if not chosen or missing:
                raise ControllerError(f"resources.{name}={chosen}: cores {missing or chosen} are not available "
                                      f"(this machine offers {cores})")
    rollout_nice = trainer_nice = 0
    rollout_threads = trainer_threads = rollout_wide = None
    if res.rollout_cores is not None or res.trainer_cores is not None:
        rollout = res.rollout_cores or cores
        trainer = res.trainer_cores or cores
    elif cfg.is_synchronous or len(cores) == 1:
        rollout, trainer = cores, cores
    elif res.core_sharing == "follow":
        # every role on every core with the threads of its split half; the rollout servers take the
        # trainer's threads too while it waits for a batch (asyncrl/core/core_follow.py)
        k = max(1, len(cores) // 2)
        rollout, trainer = cores, cores
        trainer_threads = k
        rollout_threads = max(1, (len(cores) - k) // n)
        rollout_wide = rollout_threads + max(1, k // n)
    elif res.core_sharing != "split":
        # every role on every core; an idle role's threads sleep and hold nothing
        rollout, trainer = cores, cores
        rollout_nice = 19 if res.core_sharing == "trainer_first" else 0
        trainer_nice = 19 if res.core_sharing == "rollout_first" else 0
    else:
        k = max(1, len(cores) // 2)
        trainer, rollout = cores[-k:], cores[:-k]
    rollout_gpus: list[list[int] | None] = [None] * n
    if res.rollout_gpus is not None:
        rollout_gpus = [list(g) for g in split_cores(list(res.rollout_gpus), n)] if res.rollout_gpus else [[]] * n
    return Assignment(
        rollout_cores=[list(c) for c in split_cores(list(rollout), n)],
        trainer_cores=list(trainer),
        rollout_gpus=rollout_gpus,
        trainer_gpus=list(res.trainer_gpus) if res.trainer_gpus is not None else None,
        eval_threads=len(cores),
        rollout_nice=rollout_nice,
        trainer_nice=trainer_nice,
        rollout_threads=rollout_threads,
        trainer_threads=trainer_threads,
        rollout_wide_threads=rollout_wide,
    )
