"""One place per concept: the finish reasons, the advantage estimators and reward shaping agree everywhere.

The Lua scripts cannot import Python, so ``buffers/lua/settings.lua``'s ``FINISH_CODE`` table is
checked equal to :data:`asyncrl.core.types.FINISH_CODES` here; the Python lists derive from the enum.
"""

from __future__ import annotations

import re
from pathlib import Path

from asyncrl.core.types import FINISH_CODES, REPORTED_FINISH_REASONS, SEGMENT_REASONS, FinishReason
from asyncrl.metrics import FINISH_REASONS as METRIC_FINISH_REASONS
from buffers.settings import FINISH_REASONS as BUFFER_FINISH_REASONS

LUA = Path(__file__).resolve().parent.parent / "buffers" / "lua" / "settings.lua"


def _lua_finish_codes() -> dict[str, int]:
    m = re.search(r"^local FINISH_CODE = \{([^}]*)\}", LUA.read_text(), re.M)
    assert m, "FINISH_CODE table not found in buffers/lua/settings.lua"
    return {k: int(v) for k, v in re.findall(r"(\w+)\s*=\s*(\d+)", m.group(1))}


def test_lua_finish_codes_equal_the_enum():
    assert _lua_finish_codes() == FINISH_CODES
    assert set(FINISH_CODES) == {r.value for r in FinishReason}
    assert max(FINISH_CODES.values()) < 16  # the scripts store code + 16 * trajectory


def test_python_lists_derive_from_the_enum():
    assert BUFFER_FINISH_REASONS == REPORTED_FINISH_REASONS == ("stop", "length", "abort", "budget", "turn")
    assert METRIC_FINISH_REASONS == ("stop", "length", "budget", "abort", "error")
    assert set(METRIC_FINISH_REASONS) - {"error"} <= {r.value for r in FinishReason}
    assert SEGMENT_REASONS == {1: "stop", 2: "length", 3: "abort", 4: "budget", 5: "abort", 6: "turn", 7: "obs", 8: "ctx"}


def test_estimator_choices_are_built_from_the_registry():
    import typing

    import trainer.advantages as advantages
    from asyncrl.core.choices import ADVANTAGE_ESTIMATORS, GROUP_ESTIMATORS
    from asyncrl.core.config_trainer import TrainerConfig

    assert advantages.ESTIMATORS == GROUP_ESTIMATORS
    assert all(callable(getattr(advantages, name)) for name in GROUP_ESTIMATORS)  # one function per name
    assert typing.get_args(TrainerConfig.model_fields["advantage"].annotation) == ADVANTAGE_ESTIMATORS
    assert ADVANTAGE_ESTIMATORS == (*GROUP_ESTIMATORS, "gae")


def test_reward_shaping_is_one_formula():
    import torch

    from asyncrl.tasks.rewards import process_reward
    from trainer.advantages import process_rewards

    raw = [0.0, 1.0, 100.0, -3.25, 0.3]
    for bias, scale, clip in ((0.5, 2.0, 10.0), (0.0, 1.0, float("inf")), (1.0, 3.0, 2.5)):
        rewards = torch.tensor(raw)  # float32, as the trainer holds them
        tensor = process_rewards(rewards, bias=bias, scale=scale, clip=clip)
        assert tensor.dtype == torch.float32
        assert tensor.tolist() == torch.tensor([process_reward(r, scale, bias, clip) for r in rewards.tolist()]).tolist()
        old = ((rewards.to(torch.float64) - bias) * scale).clamp(-clip, clip).float()  # the formula it replaced
        assert torch.equal(tensor, old)
