"""``arithmetic_retry`` written as a plain OpenAI-client program, trained through ``openai_harness``.

Run per episode by the rollout worker (``agent.harness_command``, docs/agents.md "Existing
agents"), with ``OPENAI_BASE_URL``, ``OPENAI_API_KEY`` and ``ASYNCRL_TASK`` in its environment.
It does what the built-in ``arithmetic_retry`` does: ask the problem (the task's ``messages``,
whose trailing assistant message is the prefill ``"82 + 2 ="``), check the answer with
:func:`asyncrl.tasks.rewards.check_answer` against the gold answer; if it is wrong, say
"Wrong answer. Try again." and re-open the turn with the same prefill, up to ``max_turns``
calls; then post the reward ``turn_discount ** (k - 1)`` for a correct answer at call k (else 0)
to ``/v1/episode/reward`` and exit. It is deterministic given the task and the replies, so an
interrupted episode replays exactly.

Nothing in it is asyncrl-specific except reading the task and posting the reward: the chat calls
are the ``openai`` package's ``client.chat.completions.create``.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.request

from openai import OpenAI

from asyncrl.tasks.rewards import check_answer

FEEDBACK = "Wrong answer. Try again."
DISCOUNT = 0.8


def post_reward(reward: float, metrics: dict[str, float]) -> None:
    """POST ``{"reward", "metrics"}`` to the session's ``/episode/reward`` (bearer = the session key)."""
    req = urllib.request.Request(os.environ["OPENAI_BASE_URL"].rstrip("/") + "/episode/reward",
                                 data=json.dumps({"reward": reward, "metrics": metrics}).encode(), method="POST",
                                 headers={"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}",
                                          "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        resp.read()


def main() -> int:
    task = json.loads(os.environ["ASYNCRL_TASK"])
    gold = str(task["metadata"].get("gold", ""))
    messages = list(task["messages"])
    prefill = messages.pop()["content"] if messages[-1]["role"] == "assistant" else ""
    client = OpenAI(max_retries=0)  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
    model = client.models.list().data[0].id
    for turn in range(1, int(task["max_turns"]) + 1):
        ask = messages + ([{"role": "assistant", "content": prefill}] if prefill else [])
        reply = client.chat.completions.create(model=model, messages=ask)
        answer = reply.choices[0].message.content or ""
        if check_answer(prefill + answer, gold).correct:
            post_reward(DISCOUNT ** (turn - 1), {"correct": 1.0, "turn_correct": float(turn)})
            return 0
        messages += [{"role": "assistant", "content": prefill + answer}, {"role": "user", "content": FEEDBACK}]
    post_reward(0.0, {"correct": 0.0})
    return 0


if __name__ == "__main__":
    sys.exit(main())
