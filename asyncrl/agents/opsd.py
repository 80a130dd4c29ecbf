"""On-policy self-distillation (OPSD) as a decorator on a workflow's ``run`` (docs/agents.md).

The student samples its own episode (the workflow as usual). Then, for every model call, the
*teacher* — the same policy given privileged context (for the built-in tasks: the gold answer),
or a configured reference model — scores the student's own tokens, and each token's advantage
is the clipped teacher-minus-student log-ratio

    A_t = clip(log pi_teacher(y_t | privileged context, y_<t) - log pi_student(y_t | context, y_<t), -c, c)

a per-token reverse-KL signal (the policy-gradient form of on-policy distillation, Agarwal et
al. 2024, "On-Policy Distillation of Language Models: Learning from Self-Generated Mistakes",
arXiv:2306.13649; with the teacher being the model itself given privileged information, Zhao et
al. 2026, "Self-Distilled Reasoner: On-Policy Self-Distillation for Large Language Models",
arXiv:2601.18734). The advantages are set on the steps, so the trainer takes the precomputed-
advantage path and skips the group estimator (rllm PR #398's design: OPSD needs no grouping).

Both log-probabilities come from the rollout engine's prompt logprobs — ``/generate`` with
``max_new_tokens: 0``, ``return_logprob`` and ``logprob_start_len`` — so it works unchanged on
SGLang, and teacher and student are computed the same way (same temperature handling).

When to use it: when a privileged hint exists for every training problem (a reference answer
or solution) and rewards are sparse or mostly equal within a group (GRPO then gets no signal;
OPSD still gets one per token). It costs two extra prefills per model call. It does not need
``n_samples_per_prompt > 1``.
"""

from __future__ import annotations

import functools
from typing import Any, Awaitable, Callable, Sequence

from asyncrl.agents.model import EpisodeModel
from asyncrl.agents.workflow import Episode, EpisodeTask, TokenLimit

__all__ = ["opsd", "gold_answer_hint", "gold_answer_note", "opsd_advantages", "PLACEMENTS"]

#: where the privileged context goes: a system message before the prompt, or the end of the prompt's last user message
PLACEMENTS = ("system", "user")


def _gold(task: EpisodeTask) -> Any:
    """The task's gold answer, for the default privileged contexts; ValueError when it has none."""
    gold = task.metadata.get("gold")
    if gold is None:
        raise ValueError("OPSD's default teacher needs metadata['gold']; pass privileged=... to opsd()")
    return gold


def gold_answer_hint(task: EpisodeTask) -> str:
    """The default privileged context: a system message stating the task's gold answer.

    Raises:
        ValueError: the task has no ``gold`` in its metadata (give ``privileged=`` instead).
    """
    return f"The correct final answer is {_gold(task)}. Answer as if you had worked it out yourself."


def gold_answer_note(task: EpisodeTask) -> str:
    """The default privileged context of ``placement="user"``: ``"(The answer is <gold>.)"``,
    appended to the prompt's last user message.

    Raises:
        ValueError: the task has no ``gold`` in its metadata (give ``privileged=`` instead).
    """
    return f"(The answer is {_gold(task)}.)"


def opsd_advantages(teacher: Sequence[float], student: Sequence[float], clip: float, coef: float = 1.0) -> list[float]:
    """``coef * clip(teacher_t - student_t, -clip, clip)`` per token (the module docstring's formula).

    Raises:
        ValueError: the two sequences differ in length, or a value is not finite.
    """
    if len(teacher) != len(student):
        raise ValueError(f"teacher has {len(teacher)} logprobs, student {len(student)}")
    out = []
    for t, s in zip(teacher, student):
        d = float(t) - float(s)
        if d != d or d in (float("inf"), float("-inf")):
            raise ValueError("teacher/student logprobs must be finite")
        out.append(coef * max(-clip, min(clip, d)))
    return out


def opsd(privileged: Callable[[EpisodeTask], str] | None = None, *, clip: float = 5.0, coef: float = 1.0,
         role: str = "system", placement: str = "system"
         ) -> Callable[[Callable[..., Awaitable[Episode]]], Callable[..., Awaitable[Episode]]]:
    """Decorate ``async def run(task, model, env)`` with on-policy self-distillation.

    Args:
        privileged: builds the privileged text from the task. None: :func:`gold_answer_hint` for
            ``placement="system"``, :func:`gold_answer_note` for ``"user"``.
        placement: ``"system"``: the text is prepended to each trajectory's prompt as a ``role``
            message (ChatML: ``<|im_start|>system ... <|im_end|>``), so the teacher sees
            ``hint + prompt + the student's tokens``; ``"user"``: it is appended to the prompt's
            last user message (:meth:`ChatFormat.with_user_note_ids`). ``agent.opsd_hint``
            overrides it when set. Measured on SmolLM2-135M's arithmetic task: the policy told the
            answer in the user message answers right 51% of the time, in a system message 26%
            (the student: 21%) — a teacher that knows more is what OPSD needs.
        clip: c of the clipped log-ratio (nats), > 0.
        coef: weight λ of the clipped log-ratio, > 0 (``agent.opsd_coef`` overrides it when set).
            With ``trainer.precomputed_advantages: add`` the weighted log-ratios are added to the
            group estimator's advantage from the rewards instead of replacing it.
        role: chat role of the hint message.

    Returns:
        the wrapped workflow: it returns the same :class:`Episode`; every step gets per-token
        ``advantages``. Without a scorer (``asyncrl eval``) the steps are left as they are.

    Raises:
        ValueError: ``clip <= 0``, ``coef <= 0`` or an unknown ``placement``.
    """
    if placement not in PLACEMENTS:
        raise ValueError(f"opsd placement must be one of {PLACEMENTS}, got {placement!r}")
    if clip <= 0:
        raise ValueError(f"opsd clip must be > 0, got {clip}")
    if coef <= 0:
        raise ValueError(f"opsd coef must be > 0, got {coef}")

    def wrap(run: Callable[..., Awaitable[Episode]]) -> Callable[..., Awaitable[Episode]]:
        @functools.wraps(run)
        async def wrapped(task: EpisodeTask, model: EpisodeModel, env: Any) -> Episode:
            try:
                episode = await run(task, model, env)
            except TokenLimit:
                # a call cut by rollout.max_response_len is still the student's own text: it gets
                # its per-token advantages (the runner ends the episode as token_limit and keeps them)
                await score(task, model)
                raise
            await score(task, model)
            return episode

        async def score(task: EpisodeTask, model: EpisodeModel) -> None:
            if model.scorer is None or not model.steps:
                return
            where = placement if model.opsd_hint is None else str(model.opsd_hint)
            if where not in PLACEMENTS:
                raise ValueError(f"agent.opsd_hint must be one of {PLACEMENTS}, got {where!r}")
            text = (privileged or (gold_answer_note if where == "user" else gold_answer_hint))(task)
            hint_ids = model.chat.message_ids(text, role) if where == "system" else []
            weight = coef if model.opsd_coef is None else float(model.opsd_coef)
            for traj in model.trajectories:  # each trajectory's calls, with its own prompt
                teacher_prompt = (hint_ids + list(traj.prompt_ids) if where == "system"
                                  else model.chat.with_user_note_ids(traj.prompt_ids, text))
                for step in traj.steps:
                    target = list(step.output.token_ids)
                    if not target:
                        step.advantages = []
                        continue
                    before = traj.response_ids[:step.start]
                    teacher = await (model.teacher_scorer or model.scorer)(teacher_prompt + before, target)
                    student = await model.scorer(list(traj.prompt_ids) + before, target)
                    step.advantages = opsd_advantages(teacher, student, clip, weight)

        wrapped.opsd = True  # type: ignore[attr-defined]
        return wrapped

    return wrap
