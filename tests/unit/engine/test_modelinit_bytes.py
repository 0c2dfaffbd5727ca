"""``polar model init`` with the byte tokenizer and small dims (the learning demo's model)."""

import json

import pytest

from services.common.tokenization.tokenizer import ChatTokenizer
from services.engine.modelinit import init_model_dir
from services.engine.weights import load_model

DIMS = {"hidden_size": 64, "intermediate_size": 128, "num_key_value_heads": 4}


def test_byte_model_tokenizes_every_character_alone(tmp_path):
    out = init_model_dir(tmp_path / "m", seed=1, dims=DIMS, tokenizer="bytes")
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == 265 and config["hidden_size"] == 64
    tok = ChatTokenizer.load(out)
    for text in ("**.*..*.**", "10", "*.*.*.*.*."):
        ids = tok.tokenizer.encode(text).ids
        assert len(ids) == len(text)
        assert tok.tokenizer.decode(ids) == text
    prompt = tok.render_ids([{"role": "user", "content": "How many * in **.*..*.**?"}], None, True)
    text = tok.tokenizer.decode(prompt, skip_special_tokens=False)
    assert text == "<|im_start|>user\nHow many * in **.*..*.**?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.tokenizer.token_to_id("<|im_end|>") in tok.eos_token_ids
    model = load_model(out)
    assert model.config.vocab_size == 265


def test_bad_tokenizer_or_dims_are_refused(tmp_path):
    with pytest.raises(ValueError, match="tokenizer must be one of"):
        init_model_dir(tmp_path / "a", tokenizer="chars")
    with pytest.raises(ValueError, match="unknown model dims"):
        init_model_dir(tmp_path / "b", dims={"hidden": 64})


def test_init_scale_narrows_the_weights(tmp_path):
    from services.engine.weights import load_tensors

    wide = load_tensors(init_model_dir(tmp_path / "w", tokenizer="bytes", dims=DIMS))
    flat = load_tensors(
        init_model_dir(tmp_path / "f", tokenizer="bytes", dims=DIMS, init_scale=0.05)
    )
    for name in ("lm_head.weight", "model.layers.0.mlp.up_proj.weight"):
        assert abs(float(flat[name].std() / wide[name].std()) - 0.05) < 0.005


def test_polar_model_init_writes_the_demos_byte_vocabulary_model(tmp_path):
    """`polar model init DIR --preset demo` is the learning demo's model, byte for byte, so
    a user's own run can start from it (issue 38.5)."""
    from typer.testing import CliRunner

    from services.cli import main
    from services.demo.warmstart import create_model

    r = CliRunner().invoke(main.app, ["model", "init", str(tmp_path / "cli"), "--preset", "demo"])
    assert r.exit_code == 0, r.output
    create_model(tmp_path / "demo", seed=0)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        assert (tmp_path / "cli" / name).read_bytes() == (tmp_path / "demo" / name).read_bytes()
    assert json.loads((tmp_path / "cli" / "config.json").read_text())["vocab_size"] == 265
    r = CliRunner().invoke(main.app, ["model", "init", str(tmp_path / "x"), "--preset", "huge"])
    assert r.exit_code != 0 and "--preset must be one of tiny, demo, demo-vllm" in r.output
