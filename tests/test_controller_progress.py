"""The controller's progress display: live panel on a terminal, plain lines elsewhere."""

from __future__ import annotations

import io

from asyncrl.progress import Progress

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
