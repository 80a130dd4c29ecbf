"""Selective rollout: skip train prompts predicted to give zero-variance groups, before generating them.

A GRPO group whose rewards are all equal (all-correct or all-wrong) has zero advantage and teaches
nothing, yet costs a full rollout. Dynamic sampling (DAPO) drops such groups *after* generation;
this rule skips them *before* it, from each prompt's history in the buffer. It is GRESO's
probabilistic pre-rollout filter (Zheng et al. 2025, "Act Only When It Pays: Efficient Reinforcement
Learning for LLM Reasoning via Selective Rollouts", arXiv:2506.02177, section 4; reference code
``verl/trainer/ttis/presampling_selector.py``, ``easy_probabilistic_skip`` / ``hard_probabilistic_skip``),
in the spirit of Kimi k1.5's curriculum and prioritized sampling by success rate (Kimi Team 2025,
arXiv:2501.12599, "sampling strategies") and POLARIS' removal, during training, of prompts the model
always solves (An et al. 2025, https://hkunlp.github.io/blog/2025/Polaris; no arXiv paper):

* **History** (buffer side, ``buffers/lua/score.lua``): when a group of train problem i finishes,
  i's *streak* z_i = the number of its finished visits in a row, the latest included, whose groups
  were zero-variance with the same common reward (0 when the latest group was mixed). i is the
  problem's key (:func:`asyncrl.tasks.base.problem_key`, a hash of its text), not its position in
  the epoch: a generated task (the main job's arithmetic) draws its few hundred problems at many
  positions of one 100,000-prompt epoch, and the history must follow the problem across them. Zero variance
  is the buffer's own test (all kept rewards exactly equal: ``zero_variance_groups``). The prompt is
  *easy* when that common raw reward is >= ``easy_reward_threshold`` (all-correct), else *hard*.
* **Rule** (this module, at the feeder): at a visit of problem i at dataset position c, with z_i > 0,
  ``p_skip = 1 - max(p**z_i, explore_floor)`` with p = ``p_easy`` or ``p_hard`` — GRESO's
  ``skip_probability = 1 - max(p ** count, 0.01)`` with the floor configurable (p_min > 0, so a
  prompt is fed with probability >= p_min at every visit). The prompt is skipped when
  ``u(seed, i, c) < p_skip``, u a uniform draw that is a pure function of (``data.seed``, i, c)
  (BLAKE2b), so a restarted feeder makes the same decision for the same visit, and each visit
  draws anew (also the visits of one problem within an epoch). On top, a prompt
  skipped at ``max_consecutive_skips`` visits in a row (``prompt_skips``, kept by the feed script
  and cleared when a group of it finishes) is fed at the next one: no prompt is skipped forever.
* **Books**: a skipped position is counted by the feed script that moves the cursor past it —
  ``skipped_prompts:zero_variance_predicted`` (and ``predicted_skips:easy`` / ``:hard``) — so
  cursor = groups fed + prompts skipped by reason, and a resume neither repeats nor loses one.

Not implemented from GRESO: its adaptive p (±0.01 per step toward a target zero-variance share)
and its adaptive rollout batch size; p_easy and p_hard are fixed here.
docs/buffer.md#selective-rollout-skipping-predicted-zero-variance-prompts.
"""

from __future__ import annotations

import hashlib
from typing import Any

__all__ = ["SelectiveRollout", "explore_draw", "skip_probability"]


def skip_probability(streak: int, p_explore: float, explore_floor: float) -> float:
    """GRESO's skip probability ``1 - max(p_explore**streak, explore_floor)`` (0 when ``streak`` <= 0).

    Args:
        streak: consecutive zero-variance finished visits of the prompt, all of one kind.
        p_explore: the kind's exploration probability, in (0, 1].
        explore_floor: p_min, in (0, 1]: the result is at most ``1 - explore_floor``.

    Raises:
        ValueError: ``p_explore`` or ``explore_floor`` outside (0, 1].
    """
    if not 0.0 < p_explore <= 1.0 or not 0.0 < explore_floor <= 1.0:
        raise ValueError(f"p_explore and explore_floor must be in (0, 1], got {p_explore} and {explore_floor}")
    if streak <= 0:
        return 0.0
    return 1.0 - max(p_explore ** streak, explore_floor)


def explore_draw(seed: int, problem: int, cursor: int) -> float:
    """A uniform number in [0, 1) that depends only on (``seed``, ``problem``, ``cursor``).

    The first 8 bytes of ``BLAKE2b("selective-rollout:{seed}:{problem}:{cursor}")`` over 2**64: the
    same in every process and Python version (unlike ``hash``), independent across visits
    (``cursor``: the visit's dataset position).
    """
    digest = hashlib.blake2b(f"selective-rollout:{seed}:{problem}:{cursor}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0 ** 64


class SelectiveRollout:
    """The feeder's side of the rule: which dataset positions to skip, and why.

    Args:
        buffer: an open :class:`buffers.ReplayBuffer` (``prompt_histories``).
        stream: the run's :class:`asyncrl.tasks.tasks.TrainPromptStream` (its ``seed``; the feeder passes the positions' problem keys).
        cfg: ``data.selective_rollout`` (:class:`asyncrl.core.config_sections.SelectiveRolloutConfig`).

    Raises:
        ValueError: the config's probabilities are outside (0, 1] or ``max_consecutive_skips`` < 1.
    """

    def __init__(self, buffer: Any, stream: Any, cfg: Any) -> None:
        skip_probability(1, cfg.p_easy, cfg.explore_floor)
        skip_probability(1, cfg.p_hard, cfg.explore_floor)
        if cfg.max_consecutive_skips < 1:
            raise ValueError(f"max_consecutive_skips must be >= 1, got {cfg.max_consecutive_skips}")
        self.buffer = buffer
        self.stream = stream
        self.cfg = cfg

    @property
    def enabled(self) -> bool:
        return bool(self.cfg.enabled)

    def kind(self, reward: float) -> str:
        """``easy`` (all-correct) when a zero-variance group's common reward is >= the threshold, else ``hard``."""
        return "easy" if reward >= self.cfg.easy_reward_threshold else "hard"

    def decide(self, cursor: int, problem: int, history: Any) -> str | None:
        """``"easy"`` / ``"hard"`` when the visit at ``cursor`` (of the problem with key ``problem``,
        with its :class:`buffers.pass_rates.PromptHistory`) is skipped, None when it is fed."""
        if history.streak <= 0 or history.reward is None or history.skips >= self.cfg.max_consecutive_skips:
            return None
        kind = self.kind(history.reward)
        p = self.cfg.p_easy if kind == "easy" else self.cfg.p_hard
        if explore_draw(self.stream.seed, problem, cursor) < skip_probability(history.streak, p, self.cfg.explore_floor):
            return kind
        return None

    async def decisions(self, start: int, problems: list[int]) -> list[str | None]:
        """:meth:`decide` for the positions ``start, start + 1, ...`` holding the problems with keys
        ``problems`` (``stream.problem_key`` of each position; one buffer round trip)."""
        histories = await self.buffer.prompt_histories(sorted(set(problems)))
        return [self.decide(c, p, histories[p]) for c, p in enumerate(problems, start)]
