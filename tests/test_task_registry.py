"""Tasks open like rewards (docs/tasks.md#your-own-task): the built-ins are registered in the task
registry, and a task class outside asyncrl, named ``module:Class`` in ``data.task``, feeds prompts
that the real trainer trains a step on (tiny model, real DeepSpeed on CPU)."""

from __future__ import annotations

import copy
import math
import textwrap

import pytest
import torch

from asyncrl.core.config import load_config
from asyncrl.core.choices import BUILTIN_TASKS
from asyncrl.core.config_sections import DataConfig
from asyncrl.tasks.registry import TaskError, register_task, registered_tasks, task_factory
from asyncrl.tasks.rewards import math_verify_reward
from asyncrl.tasks.tasks import TrainPromptStream, load_task

EXTERNAL = '''
from asyncrl.tasks.base import Problem, Task, problem_hash
from asyncrl.tasks.registry import TaskError


def _problem(k):
    text = f"What is 2 * {k}?"
    split = "train" if k % 2 == 0 else "heldout"
    return Problem(text, str(2 * k), {"task": "doubling", "gold": str(2 * k), "problem_hash": problem_hash(text),
                                      "split": split})


class DoublingTask(Task):
    """What is 2 * k? (k < 40; even k train, odd k held out)."""

    name = "doubling"

    def __init__(self, data, seed):
        self.seed = seed
        self.problems = [_problem(k) for k in range(40)]

    def num_train(self):
        return 20

    def train_problem(self, index):
        return self.problems[2 * index]

    def heldout(self, n):
        if n > 20:
            raise TaskError(f"doubling has 20 held-out problems, {n} requested")
        return self.problems[1::2][:n]
'''


@pytest.fixture
def external_task(tmp_path, monkeypatch):
    """A module outside the package, importable like a user's reward module."""
    (tmp_path / "my_doubling_task.py").write_text(textwrap.dedent(EXTERNAL))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_doubling_task:DoublingTask"


def test_builtin_tasks_are_registered_like_any_other():
    assert registered_tasks()[:len(BUILTIN_TASKS)] == BUILTIN_TASKS
    assert type(load_task(DataConfig())).__name__ == "ArithmeticTask"
    with pytest.raises(TaskError, match="needs data.path"):
        task_factory("gsm8k")(DataConfig(), 0)


def test_register_task_by_name(external_task):
    from my_doubling_task import DoublingTask

    register_task("doubling_for_test", DoublingTask)
    try:
        assert isinstance(task_factory("doubling_for_test")(DataConfig(), 0), DoublingTask)
        with pytest.raises(ValueError, match="registered already"):
            register_task("doubling_for_test", lambda data, seed: None)
    finally:
        from asyncrl.tasks import registry

        registry._TASKS.pop("doubling_for_test")


def test_config_takes_a_builtin_name_or_module_class(external_task):
    assert DataConfig(task=external_task).task == external_task
    with pytest.raises(ValueError, match="module:Class"):
        DataConfig(task="no such task")
    with pytest.raises(TaskError, match="cannot import module"):
        load_task(DataConfig(task="definitely_not_a_module_xyz:Task"))
    with pytest.raises(TaskError, match="has no attribute"):
        load_task(DataConfig(task="my_doubling_task:Missing"))
    with pytest.raises(TaskError, match="not an asyncrl Task"):
        load_task(DataConfig(task="builtins:slice"))


def test_external_task_feeds_prompts_and_trains_a_step(external_task, tmp_path, tiny_model_dir):
    from asyncrl.models import load_causal_lm, load_tokenizer
    from trainer.trainer import Trainer

    cfg = load_config([], overrides={
        "model": {"path": str(tiny_model_dir)},
        "run": {"output_dir": str(tmp_path), "name": "ext", "total_steps": 2},
        "data": {"task": external_task},
        "rollout": {"n_samples_per_prompt": 2},
        "trainer": {"micro_batch_tokens": 64, "optimizer": {"lr": 1e-3}},
    })
    tokenizer = load_tokenizer(tiny_model_dir)
    stream = TrainPromptStream(cfg.data, tokenizer, seed=cfg.data.seed)
    assert type(stream.task).__name__ == "DoublingTask" and len(stream) == 20
    assert [p.text for p in load_task(cfg.data).heldout(2)] == ["What is 2 * 1?", "What is 2 * 3?"]

    model = load_causal_lm(tiny_model_dir, "float32")
    groups = []
    for prompt in (stream.get(0), stream.get(1)):
        assert prompt.problem.text.startswith("What is 2 * ") and prompt.problem.metadata["task"] == "doubling"
        samples = []
        for i, answer in enumerate((prompt.problem.gold, "-1")):
            text = f"Answer: {answer}"
            response = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids = torch.tensor([prompt.prompt_ids + response])
            with torch.no_grad():
                logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
            behaviour = logp[len(prompt.prompt_ids) - 1:].gather(1, torch.tensor(response)[:, None])[:, 0]
            reward = math_verify_reward(prompt.prompt_text, text, prompt.problem.metadata)
            samples.append({"sample_id": f"c{prompt.cursor}-{i}", "index": i, "response_ids": response,
                            "behaviour_logprobs": behaviour.tolist(), "versions": [0] * len(response),
                            "finish_reason": "stop", "reward": reward})
        assert [s["reward"] for s in samples] == [1.0, 0.0]  # the task's gold, scored by the real reward
        groups.append({"group_id": f"c{prompt.cursor}", "prompt_ids": prompt.prompt_ids, "samples": samples,
                       "metadata": prompt.problem.metadata})

    trainer = Trainer(cfg, model=copy.deepcopy(model))
    try:
        before = [p.detach().clone() for p in trainer.module.parameters()]
        plan = trainer.begin_step(groups)
        for mb in plan.minibatches:
            metrics = trainer.forward_backward(mb)
            assert math.isfinite(metrics["loss"])
        om = trainer.optim_step()
        assert math.isfinite(om["grad_norm"]) and om["grad_norm"] > 0
        assert trainer.step == 1
        assert any(not torch.equal(a, b) for a, b in zip(before, trainer.module.parameters()))
    finally:
        trainer.close()
