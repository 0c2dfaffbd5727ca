"""The model directory format and the plain-torch forward pass, cross-checked with transformers."""

import json
import random

import pytest
import torch

from services.engine.modelconfig import ModelLoadError, load_config, parse_config
from services.engine.weights import load_model


def test_directory_is_a_complete_hf_model(model_dir):
    names = {p.name for p in model_dir.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    } <= names
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["vocab_size"] == 4096
    assert (
        "<tool_call>"
        in json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"]
    )


def test_cli_init_is_deterministic(model_dir, tmp_path):
    """`init DIR` writes byte-identical tokenizer and weights on every run."""
    from typer.testing import CliRunner

    from services.engine.cli import app

    result = CliRunner().invoke(app, ["init", str(tmp_path / "again")])
    assert result.exit_code == 0, result.output
    for name in ("tokenizer.json", "model.safetensors", "tokenizer_config.json", "config.json"):
        assert (tmp_path / "again" / name).read_bytes() == (model_dir / name).read_bytes(), name


def test_missing_model_dir_names_the_fix(tmp_path):
    from services.engine.server import ensure_model_dir

    with pytest.raises(ModelLoadError, match="polar model init"):
        ensure_model_dir(tmp_path / "nothing")


def test_cached_forward_equals_full_forward(model):
    """Prefill + token-by-token decode through the KV cache matches one uncached pass."""
    ids = [random.Random(1).randrange(4096) for _ in range(40)]
    full = model.forward([ids], [model.new_cache()], all_logits=True)[0]
    cache = model.new_cache()
    steps = [model.forward([ids[:10]], [cache])[0]]
    steps += [model.forward([[t]], [cache])[0] for t in ids[10:]]
    assert (torch.stack(steps) - full[9:]).abs().max().item() < 1e-4


def test_ragged_batch_equals_separate_runs(model):
    rng = random.Random(2)
    prompts = [[rng.randrange(4096) for _ in range(n)] for n in (1, 7, 30)]
    alone = [model.forward([p], [model.new_cache()])[0] for p in prompts]
    together = model.forward(prompts, [model.new_cache() for _ in prompts])
    for a, b in zip(alone, together, strict=True):  # float32 sums in another order
        assert (a - b).abs().max().item() < 1e-4


def _hf_logprob_diff(model_dir, ours, arch_class, n=12):
    rng = random.Random(3)
    hf = arch_class.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    worst = 0.0
    for _ in range(n):
        ids = [rng.randrange(ours.config.vocab_size) for _ in range(rng.randint(2, 120))]
        mine = torch.log_softmax(ours.forward([ids], [ours.new_cache()], all_logits=True)[0], -1)
        with torch.no_grad():
            theirs = torch.log_softmax(hf(torch.tensor([ids])).logits[0], -1)
        worst = max(worst, (mine - theirs).abs().max().item())
    return worst


def test_forward_matches_transformers_qwen2(model_dir, model):
    transformers = pytest.importorskip("transformers")
    assert _hf_logprob_diff(model_dir, model, transformers.Qwen2ForCausalLM) < 1e-4


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_any_small_hf_directory_of_the_supported_families(tmp_path, family):
    """A directory written by transformers itself (Llama: no biases, untied; Qwen3: q/k
    norms, explicit head_dim) serves with the same numbers as transformers."""
    transformers = pytest.importorskip("transformers")
    common = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    if family == "llama":
        config, cls = (
            transformers.LlamaConfig(**common, tie_word_embeddings=False),
            transformers.LlamaForCausalLM,
        )
    else:
        config, cls = transformers.Qwen3Config(**common, head_dim=24), transformers.Qwen3ForCausalLM
    torch.manual_seed(0)
    cls(config).save_pretrained(str(tmp_path))
    ours = load_model(tmp_path)
    assert ours.config.architecture == cls.__name__
    assert _hf_logprob_diff(tmp_path, ours, cls, n=4) < 1e-4


def test_unsupported_architecture_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match="not supported"):
        load_config(tmp_path)
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_config(tmp_path / "missing")


def test_rope_scaling_is_refused_not_ignored():
    raw = json.loads(
        '{"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8, '
        '"intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2, '
        '"rope_scaling": {"rope_type": "yarn", "factor": 4}}'
    )
    with pytest.raises(ModelLoadError, match="yarn"):
        parse_config(raw)


def test_missing_weights_are_a_load_error(model_dir, tmp_path):
    (tmp_path / "config.json").write_bytes((model_dir / "config.json").read_bytes())
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_model(tmp_path)


def test_sequence_logprobs_of_a_ragged_batch_match_each_sequence_alone(model, model_dir):
    """The trainer's forward: whole sequences of mixed and repeated lengths at once (equal
    lengths share one attention call) give each sequence's teacher-forced logprobs, and
    a backward through it reaches every weight."""
    from services.engine.model import CausalLM
    from services.engine.weights import load_tensors

    rng = random.Random(3)
    seqs = [[rng.randrange(4096) for _ in range(n)] for n in (9, 5, 9, 12, 5, 9)]
    starts = [4, 2, 1, 6, 4, 8]
    params = {k: torch.nn.Parameter(v) for k, v in load_tensors(model_dir).items()}
    rows = CausalLM(model.config, params).sequence_logprobs(seqs, starts)
    for row, seq, start in zip(rows, seqs, starts, strict=True):
        alone = model.teacher_forced_logprobs(seq, start)
        assert row.shape == (len(seq) - start,)
        assert max(abs(a - b) for a, b in zip(row.tolist(), alone, strict=True)) < 1e-5
    sum(r.sum() for r in rows).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in params.values())


def test_shared_prefix_logprobs_match_each_sequence_alone(model, model_dir):
    """The trainer's packed forward: samples sharing a prompt (a GRPO group) put the prompt
    through once, and each sample's logprobs and gradients are still its own sequence's:
    a member cannot see another member's tokens, and positions continue from the prompt."""
    from services.engine.model import CausalLM
    from services.engine.weights import load_tensors

    rng = random.Random(5)
    prompts = [[rng.randrange(4096) for _ in range(n)] for n in (7, 7, 4)]
    seqs, starts = [], []
    for p in prompts:
        for n in (1, 3, 2, 3):
            seqs.append(p + [rng.randrange(4096) for _ in range(n)])
            starts.append(len(p))
    seqs.append(prompts[0][:5])  # a sequence with nothing after its start
    starts.append(5)
    tensors = load_tensors(model_dir)
    params = {k: torch.nn.Parameter(v.clone()) for k, v in tensors.items()}
    rows = CausalLM(model.config, params).shared_prefix_logprobs(seqs, starts)
    assert rows[-1].shape == (0,)
    for row, seq, start in zip(rows, seqs, starts, strict=True):
        alone = model.teacher_forced_logprobs(seq, start) if start < len(seq) else []
        assert row.shape == (len(seq) - start,)
        assert max((abs(a - b) for a, b in zip(row.tolist(), alone, strict=True)), default=0) < 1e-5
    # the same gradient as the unpacked forward
    sum(r.sum() for r in rows).backward()
    ref = {k: torch.nn.Parameter(v.clone()) for k, v in tensors.items()}
    plain = CausalLM(model.config, ref).sequence_logprobs(seqs[:-1], starts[:-1])
    sum(r.sum() for r in plain).backward()
    for k in params:  # float32 sums in another order: equal to rounding
        diff = float((params[k].grad - ref[k].grad).abs().max())
        assert diff <= 1e-4 * (1 + float(ref[k].grad.abs().max())), (k, diff)
    with pytest.raises(ValueError, match="start 0"):
        CausalLM(model.config, tensors).shared_prefix_logprobs([[1, 2]], [0])
