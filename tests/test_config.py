"""Configuration: every shipped YAML loads, source precedence, every error path, the CLI.

Sources, highest first: flags > ASYNCRL_* environment > YAML (--config) > defaults.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import yaml

from asyncrl.core.config import AsyncRLConfig, ConfigError, dump_config, load_config, read_yaml
from asyncrl.core.config_cli import main as config_main

REPO = Path(__file__).resolve().parent.parent
RUN_CONFIGS = sorted((REPO / "configs").glob("*.yaml"))  # top level only: configs/k8s holds manifests


def _asyncrl_cmd() -> list[str]:
    exe = shutil.which("asyncrl")
    return [exe] if exe else [sys.executable, "-m", "asyncrl.cli"]


def _write(tmp_path: Path, text: str, name: str = "c.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# ----------------------------------------------------------------------------------------------
# shipped configs


def test_run_configs_exist():
    names = {p.name for p in RUN_CONFIGS}
    assert {"tiny.yaml", "smollm2_arith.yaml"} <= names


@pytest.mark.parametrize("path", RUN_CONFIGS, ids=lambda p: p.name)
def test_every_run_config_loads(path):
    cfg = load_config(["--config", str(path)], environ={})
    assert isinstance(cfg, AsyncRLConfig)
    # every key in the file is a real field (extra keys would have raised) and is applied
    raw = read_yaml(path)
    dumped = cfg.model_dump(mode="json")
    for section, values in raw.items():
        assert section in dumped
        if isinstance(values, dict):
            for key in values:
                assert key in dumped[section]


def test_tiny_config_is_asynchronous():
    cfg = load_config(["--config", str(REPO / "configs" / "tiny.yaml")], environ={})
    r = cfg.rollout
    assert cfg.model.path == "tiny"
    assert r.partial_percent < 1
    assert r.max_budget < r.max_response_len
    assert cfg.buffer.max_staleness >= 1
    assert cfg.trainer.loss.correction != "none"
    assert not cfg.is_synchronous
    assert (r.n_samples_per_prompt, r.rollout_batch_size) == (4, 4)
    assert cfg.data.arithmetic.digits == 1


def test_main_job_config():
    cfg = load_config(["--config", str(REPO / "configs" / "smollm2_arith.yaml")], environ={})
    assert cfg.model.path == "smollm2-135m-instruct"
    assert cfg.data.task == "arithmetic"
    assert cfg.trainer.advantage == "grpo" and cfg.trainer.loss.correction == "decoupled"
    assert cfg.rollout.partial_percent == 0.75
    assert cfg.rollout.max_budget < cfg.rollout.max_response_len
    assert cfg.buffer.max_staleness == 1  # docs/results.md section K
    # The difficulty of docs/tasks.md: >= 400 distinct held-out problems for the evaluation.
    from asyncrl.tasks.tasks import load_task

    held = load_task(cfg.data).heldout(cfg.monitoring.eval_num_problems)
    assert len({p.metadata["problem_hash"] for p in held}) == cfg.monitoring.eval_num_problems >= 400
    assert cfg.data.arithmetic.digits_per_term == [2, 1] and cfg.data.response_prefix == "{expression} ="
    assert cfg.monitoring.eval_modes == ["sampled"] and cfg.run.max_wall_seconds == 3600


# ----------------------------------------------------------------------------------------------
# precedence


def test_precedence_flags_over_env_over_yaml_over_defaults(tmp_path):
    path = _write(
        tmp_path,
        "rollout:\n  max_budget: 100\n  temperature: 0.9\n  max_response_len: 300\n"
        "buffer:\n  max_staleness: 1\nrun:\n  seed: 5\n",
    )
    env = {"ASYNCRL_ROLLOUT__MAX_BUDGET": "200", "ASYNCRL_ROLLOUT__TEMPERATURE": "0.7", "ASYNCRL_MAX_STALENESS": "3"}
    cfg = load_config(["--config", str(path), "--max_budget", "50"], environ=env)
    assert cfg.rollout.max_budget == 50  # flag beats env and YAML
    assert cfg.rollout.temperature == 0.7  # env beats YAML
    assert cfg.buffer.max_staleness == 3  # env (headline name) beats YAML
    assert cfg.rollout.max_response_len == 300  # YAML beats default
    assert cfg.run.seed == 5
    assert cfg.rollout.rollout_batch_size == AsyncRLConfig().rollout.rollout_batch_size  # default


def test_dotted_flags_and_equals_form():
    cfg = load_config(["--rollout.temperature=0.5", "--trainer.loss.clip_eps_high", "0.3", "--seed", "7"], environ={})
    assert cfg.rollout.temperature == 0.5
    assert cfg.trainer.loss.clip_eps_high == 0.3
    assert cfg.run.seed == 7


def test_a_bool_field_from_a_flag_the_environment_and_yaml(tmp_path):
    """``buffer.timeline`` (on by default) is turned off by ``--buffer.timeline false`` (``bench/multiseed.py
    --arm NAME="--buffer.timeline false"``), ``=false``, the environment and YAML; a value that is no boolean
    is an error naming the field."""
    assert AsyncRLConfig().buffer.timeline is True
    assert load_config(["--buffer.timeline", "false"], environ={}).buffer.timeline is False
    assert load_config(["--buffer.timeline=false"], environ={}).buffer.timeline is False
    assert load_config([], environ={"ASYNCRL_BUFFER__TIMELINE": "false"}).buffer.timeline is False
    path = _write(tmp_path, "buffer:\n  timeline: false\n")
    assert load_config(["--config", str(path)], environ={}).buffer.timeline is False
    assert load_config(["--config", str(path), "--buffer.timeline", "true"], environ={}).buffer.timeline is True
    with pytest.raises(ConfigError, match="buffer.timeline"):
        load_config(["--buffer.timeline", "sometimes"], environ={})


def test_headline_flags_as_users_type_them():
    cfg = load_config(["--partial_percent", "0.7", "--max_budget", "1024", "--max_staleness", "2"], environ={})
    assert (cfg.rollout.partial_percent, cfg.rollout.max_budget, cfg.buffer.max_staleness) == (0.7, 1024, 2)
    assert cfg.rollout.train_batch_groups == 12  # ceil(0.7 * 16)


@pytest.mark.parametrize("p", [0.1, 0.25, 0.3, 0.5, 0.7, 0.75, 0.9, 1.0])
@pytest.mark.parametrize("r", [1, 3, 7, 10, 16, 64])
def test_config_and_buffer_share_one_train_batch_formula(p, r):
    from asyncrl.core.config import train_batch_groups
    from buffers import BufferSettings

    b = train_batch_groups(p, r)
    assert b == max(1, -(-round(p * r * 1000) // 1000))  # ceil(p * R), exact for these p and R
    cfg = load_config(["--partial_percent", str(p), "--rollout.rollout_batch_size", str(r), "--max_staleness", "1"], environ={})
    assert cfg.rollout.train_batch_groups == b
    assert BufferSettings.from_partial_percent(r, p).train_batch_groups == b
    assert BufferSettings.from_config(cfg).train_batch_groups == b


def test_asyncrl_config_env_names_the_yaml(tmp_path):
    path = _write(tmp_path, "run:\n  name: from-env-file\n")
    cfg = load_config([], environ={"ASYNCRL_CONFIG": str(path)})
    assert cfg.run.name == "from-env-file"


def test_env_variables_that_are_not_fields_are_ignored():
    cfg = load_config([], environ={"ASYNCRL_TEST_SOMETHING": "1", "ASYNCRL_CACHE_DIR": "/tmp/x"})
    assert cfg == AsyncRLConfig()


# ----------------------------------------------------------------------------------------------
# error paths


def test_unknown_yaml_key_names_it(tmp_path):
    path = _write(tmp_path, "rollout:\n  max_budgett: 64\n")
    with pytest.raises(ConfigError, match=r"rollout\.max_budgett: unknown key"):
        load_config(["--config", str(path)], environ={})


def test_unknown_yaml_section(tmp_path):
    path = _write(tmp_path, "rolout:\n  max_budget: 64\n")
    with pytest.raises(ConfigError, match=r"rolout: unknown key"):
        load_config(["--config", str(path)], environ={})


def test_unknown_flag_suggests_the_closest():
    with pytest.raises(ConfigError, match=r"unknown flag --max_budgte; did you mean --max_budget"):
        load_config(["--max_budgte", "64"], environ={})


def test_kebab_case_flag_is_rejected_with_the_underscore_spelling():
    with pytest.raises(ConfigError, match=r"--partial-percent: flags use underscores, e\.g\. --partial_percent"):
        load_config(["--partial-percent", "0.5"], environ={})
    with pytest.raises(ConfigError, match=r"--rollout\.max_response_len"):
        load_config(["--rollout.max-response-len", "64"], environ={})


def test_keeping_kv_across_updates_needs_the_in_place_pause_mode():
    """``rollout.flush_cache_on_update: false`` keeps old keys/values across an update, which only
    ``pause_mode: in_place`` does for running requests; with ``abort`` the config says so, and the
    worker's options refuse the same pair."""
    from rollout_server.worker import WorkerOptions

    with pytest.raises(ConfigError, match=r"flush_cache_on_update: false .* set pause_mode: in_place"):
        load_config(["--rollout.flush_cache_on_update", "false"], environ={})
    cfg = load_config(["--rollout.flush_cache_on_update", "false", "--rollout.pause_mode", "in_place"], environ={})
    assert WorkerOptions.from_config(cfg, "w0").flush_cache_on_update is False
    assert WorkerOptions.from_config(load_config([], environ={}), "w0").flush_cache_on_update is True
    with pytest.raises(ValueError, match="flush_cache_on_update=False .* needs pause_mode 'in_place'"):
        WorkerOptions("w0", flush_cache_on_update=False)


def test_flag_without_value_and_positional_argument():
    with pytest.raises(ConfigError, match=r"--max_budget needs a value"):
        load_config(["--max_budget"], environ={})
    with pytest.raises(ConfigError, match=r"unexpected argument 'oops'"):
        load_config(["oops"], environ={})


@pytest.mark.parametrize(
    ("flags", "field", "bound"),
    [
        (["--partial_percent", "1.5"], "rollout.partial_percent", "le 1.0"),
        (["--partial_percent", "0"], "rollout.partial_percent", "gt 0.0"),
        (["--max_budget", "0"], "rollout.max_budget", "ge 1"),
        (["--max_staleness", "-1"], "buffer.max_staleness", "ge 0"),
        (["--rollout.temperature", "0"], "rollout.temperature", "gt 0.0"),
        (["--trainer.zero_stage", "4"], "trainer.zero_stage", "le 3"),
        (["--monitoring.eval_batch_size", "0"], "monitoring.eval_batch_size", "ge 1"),
    ],
)
def test_out_of_range_value_names_field_and_range(flags, field, bound):
    with pytest.raises(ConfigError) as err:
        load_config(flags, environ={})
    text = str(err.value)
    assert field in text
    assert f"[allowed: {bound}]" in text
    assert f"(got {flags[1]!r})" in text or f"(got {yaml.safe_load(flags[1])!r})" in text


def test_wrong_type_names_the_field():
    with pytest.raises(ConfigError, match=r"rollout\.max_budget: .*integer"):
        load_config(["--max_budget", "lots"], environ={})


def test_bad_yaml(tmp_path):
    path = _write(tmp_path, "rollout:\n  max_budget: [64\n")
    with pytest.raises(ConfigError, match=r"is not valid YAML"):
        load_config(["--config", str(path)], environ={})


def test_non_mapping_yaml(tmp_path):
    path = _write(tmp_path, "- rollout\n- buffer\n")
    with pytest.raises(ConfigError, match=r"the top level must be a mapping of sections, got list"):
        load_config(["--config", str(path)], environ={})


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match=r"cannot read config file .*nope\.yaml"):
        load_config(["--config", str(tmp_path / "nope.yaml")], environ={})


def test_empty_yaml_is_defaults(tmp_path):
    path = _write(tmp_path, "")
    assert load_config(["--config", str(path)], environ={}) == AsyncRLConfig()


def test_stale_samples_without_correction_is_an_error():
    with pytest.raises(ConfigError, match=r"trainer\.loss\.correction is 'none'"):
        load_config(["--max_staleness", "1", "--trainer.loss.correction", "none"], environ={})
    # synchronous runs may go without a correction
    cfg = load_config(["--trainer.loss.correction", "none"], environ={})
    assert cfg.trainer.loss.correction == "none" and cfg.is_synchronous


def test_partial_percent_below_one_needs_staleness():
    with pytest.raises(ConfigError, match=r"set buffer\.max_staleness >= 1"):
        load_config(["--partial_percent", "0.5", "--max_staleness", "0"], environ={})


def test_top_p_and_top_k_must_stay_off():
    with pytest.raises(ConfigError, match=r"rollout\.top_p must be 1"):
        load_config(["--rollout.top_p", "0.9"], environ={})
    with pytest.raises(ConfigError, match=r"rollout\.top_k must be -1"):
        load_config(["--rollout.top_k", "50"], environ={})


def test_grpo_needs_two_samples_per_prompt():
    with pytest.raises(ConfigError, match=r"n_samples_per_prompt >= 2"):
        load_config(["--n_samples_per_prompt", "1"], environ={})


def test_file_task_needs_a_path():
    with pytest.raises(ConfigError, match=r"data\.task=jsonl needs data\.path"):
        load_config(["--data.task", "jsonl"], environ={})


def test_deprecated_use_partial_warns_and_sets_lightrft_default():
    with pytest.warns(DeprecationWarning, match=r"--use_partial is deprecated"):
        cfg = load_config(["--use_partial", "--max_staleness", "1"], environ={})
    assert cfg.rollout.partial_percent == 0.7


def test_deprecated_use_partial_does_not_override_partial_percent():
    for argv in (
        ["--use_partial", "--partial_percent", "0.5", "--max_staleness", "1"],
        ["--partial_percent", "0.5", "--use_partial", "--max_staleness", "1"],
    ):
        with pytest.warns(DeprecationWarning):
            cfg = load_config(argv, environ={})
        assert cfg.rollout.partial_percent == 0.5


def test_no_warning_without_use_partial():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(["--partial_percent", "0.5", "--max_staleness", "1"], environ={})


# ----------------------------------------------------------------------------------------------
# dump / round trip


def test_dump_config_round_trip(tmp_path):
    cfg = load_config(
        ["--config", str(REPO / "configs" / "tiny.yaml"), "--partial_percent", "0.5", "--rollout.stop", "[\"\\n\\n\"]"],
        environ={},
    )
    out = tmp_path / "run" / "config.yaml"
    dump_config(cfg, out)
    assert not out.with_suffix(".yaml.tmp").exists()
    again = load_config(["--config", str(out)], environ={})
    assert again == cfg
    assert again.rollout.stop == ["\n\n"]


# ----------------------------------------------------------------------------------------------
# `asyncrl config show`


def test_config_show_subprocess_shows_values():
    out = subprocess.run(
        [*_asyncrl_cmd(), "config", "show", "--config", str(REPO / "configs" / "tiny.yaml"),
         "--partial_percent", "0.5", "--max_budget", "64", "--max_staleness", "3"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    shown = yaml.safe_load(out.stdout)
    assert shown["rollout"]["partial_percent"] == 0.5
    assert shown["rollout"]["max_budget"] == 64
    assert shown["buffer"]["max_staleness"] == 3
    assert shown["model"]["path"] == "tiny"  # from the YAML


def test_config_show_subprocess_bad_input_exits_nonzero():
    out = subprocess.run(
        [*_asyncrl_cmd(), "config", "show", "--partial_percent", "2"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )
    assert out.returncode == 2
    assert "rollout.partial_percent" in out.stderr and "le 1.0" in out.stderr
    assert out.stdout == ""


def test_config_show_json_and_help(capsys):
    assert config_main(["show", "--json", "--max_budget", "8", "--max_response_len", "16"]) == 0
    import json

    shown = json.loads(capsys.readouterr().out)
    assert shown["rollout"]["max_budget"] == 8
    assert config_main(["show", "--help"]) == 0
    text = capsys.readouterr().out
    assert "--rollout.max_budget" in text and "--partial_percent" in text


def test_config_cli_usage_errors(capsys):
    assert config_main([]) == 2
    assert config_main(["shwo"]) == 2
    assert "unknown action 'shwo'" in capsys.readouterr().err
    assert config_main(["show", "--nope", "1"]) == 2
    assert "unknown flag --nope" in capsys.readouterr().err
