"""The controller's progress display: live panel on a terminal, plain lines elsewhere."""

from __future__ import annotations

import io

import pytest

from asyncrl.controller.progress import Progress

TRAINER = {"step": 3, "wall_seconds": 65.0, "role": "trainer", "reward/mean": 0.4, "staleness/max": 1,
           "time/forward_backward_seconds": 1.5, "time/wait_batch_seconds": 0.25, "idle_ratio/trainer": 0.2}
CONTROLLER = {"step": 3, "wall_seconds": 66.0, "role": "controller", "policy/version": 3,
              "buffer/groups_ready": 2, "buffer/groups_generating": 5, "buffer/samples_partial": 3,
              "buffer/partial_ratio": 0.2, "rollout/tokens_per_second": 123.4, "idle_ratio/rollout-0": 0.05,
              "buffer/drops": 1, "buffer/restarts": 4}


def test_live_panel_shows_every_field():
    out = io.StringIO()
    p = Progress(100, "tiny", max_staleness=2, stream=out, live=True)
    p.console.width = 140
    with p:
        p.update(TRAINER)
        p.update(CONTROLLER)
        p.update({"step": 3, "wall_seconds": 70.0, "role": "controller", "eval/accuracy_sampled": 0.25,
                  "eval/num_problems": 400})
        p.set_status("training")
        p.refresh()
    text = out.getvalue()
    for needle in ("step", "3/100", "policy version", "reward", "0.4", "sampled 0.25", "(n=400)",
                   "123.4 tokens/s", "partial ratio 0.20", "max 1", "bound 2", "generating 5", "ready 2",
                   "partial 3", "forward_backward 1.50", "wait_batch 0.25", "rollout-0 0.05", "trainer 0.20",
                   "1 / 4", "training"):
        assert needle in text, needle


def test_plain_lines_when_not_a_terminal():
    out = io.StringIO()
    p = Progress(10, "tiny", max_staleness=1, stream=out, plain_interval_seconds=0.0)
    assert p.live_mode is False  # StringIO is not a TTY
    p.start()
    p.update(TRAINER)
    p.update(CONTROLLER)
    p.refresh()
    p.refresh()  # same step: no new line
    p.update({**TRAINER, "step": 4})
    p.refresh()
    p.stop()
    lines = out.getvalue().splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("[starting] step 3/10") and "v3" in lines[0] and "tok/s 123.4" in lines[0]
    assert "groups[generating=5 ready=2]" in lines[0] and "idle[rollout-0=0.05 trainer=0.20]" in lines[0]
    assert "stale 1/1" in lines[0]
    assert lines[1].startswith("[starting] step 4/10")


def test_plain_lines_are_rate_limited_but_eval_results_always_print():
    out = io.StringIO()
    p = Progress(10, stream=out, live=False, plain_interval_seconds=3600)
    p.update(TRAINER)
    p.refresh()
    p.update({**TRAINER, "step": 4})
    p.refresh()  # rate-limited
    p.update({"step": 4, "wall_seconds": 80.0, "role": "controller", "eval/accuracy_sampled": 0.5})
    p.refresh()  # an eval result prints at once
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and "acc 0.5" in lines[1]


# ---- rollout tokens/s: generation comes in bursts after each weight update -------------------


async def test_rollout_tokens_per_second_spans_the_bursts_between_trainer_steps(redis_url):
    """The main job's pattern: a burst right after a publish, then the staleness bound blocks the
    rollout for the rest of a 40-second trainer step; the progress line prints when the step
    ends. A 10-second window read 0.0 there, every time; the rate over whole steps does not."""
    from asyncrl.controller.run_watch import BufferWatcher
    from asyncrl.feeder.feeder import group_id_for
    from buffers import BufferSettings, ReplayBuffer

    buf = await ReplayBuffer.open(redis_url, "tps", BufferSettings(
        rollout_batch_size=4, train_batch_groups=2, n_samples_per_prompt=2, max_budget=64,
        max_response_len=64, max_staleness=2, stale_policy="restart", lease_seconds=600.0))
    await buf.feed([buf.make_group(group_id_for(c), [1, 2, 3], {}) for c in range(4)], 0)
    items = await buf.claim("w", 8)
    watcher = BufferWatcher(buf)
    out = io.StringIO()
    progress = Progress(10, stream=out, live=False, plain_interval_seconds=0.0)

    async def burst(n_tokens: int) -> None:
        for it in items:
            base = it.length_tokens
            await buf.append(it, [5 + (base + j) % 40 for j in range(n_tokens)], [-0.5] * n_tokens, [0] * n_tokens)

    def poll_record(m: dict, wall: float, step: int) -> dict:
        return {"step": step, "wall_seconds": wall, "role": "controller", **m}

    assert "rollout/tokens_per_second" not in await watcher.poll(0.0, 0)  # one observation: no rate yet
    step, wall = 0, 0.0
    for _cycle in range(4):  # 4 trainer steps of 40 s, 8 samples x 5 tokens generated 1 s after each step starts
        for dt in range(2, 41, 2):
            wall += 2.0
            if dt == 2:
                await burst(5)
            m = await watcher.poll(wall, step)
        step += 1
        m = await watcher.poll(wall, step)
        progress.update(poll_record(m, wall, step))
        progress.update({"step": step, "wall_seconds": wall, "role": "trainer", "reward/mean": 0.5})
        progress.refresh()
        # every step so far generated 40 tokens in 40 s of training wall time
        assert m["rollout/tokens_per_second"] == pytest.approx(1.0, rel=0.06), (step, m)
    assert m["buffer/appended_tokens"] == 160
    lines = out.getvalue().splitlines()
    assert len(lines) == 4 and all("tok/s 1.0" in line for line in lines), lines
    # the window holds whole steps only (at least 60 s of them), not the whole run
    assert wall - watcher.tokens_window.points[0][0] == pytest.approx(80.0)
    await buf.close()


def test_rate_window_edges():
    from asyncrl.controller.run_watch import RateWindow

    w = RateWindow(min_seconds=10.0, min_steps=1, max_seconds=30.0)
    assert w.add(0.0, 0, 0) is None and w.add(0.0, 5, 0) is None  # no time elapsed
    assert w.add(5.0, 50, 0) == pytest.approx(10.0)  # no step boundary yet: since the first point
    assert w.add(8.0, 60, 1) == pytest.approx(60 / 8)  # step 1 starts at 8 s: too recent to start the window
    assert w.add(20.0, 72, 1) == pytest.approx(72 / 20)
    assert w.add(21.0, 80, 2) == pytest.approx(20 / 13)  # window from the start of step 1 (8 s, 60)
    assert w.add(22.0, 0, 2) == 0.0  # a counter that went back (restarted server) is clamped
    # the trainer stalls in step 2: the newest point max_seconds old (22 s) starts the window
    assert w.add(60.0, 100, 2) == pytest.approx(100 / 38) and w.points[0][0] == 22.0
    w.clear()
    assert w.add(40.0, 10, 2) is None
    with pytest.raises(ValueError, match="min_seconds"):
        RateWindow(min_seconds=0)
    with pytest.raises(ValueError, match="min_seconds"):
        RateWindow(min_seconds=60, max_seconds=10)
