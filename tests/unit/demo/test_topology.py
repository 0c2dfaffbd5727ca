"""The learning demo's stack: the embedded engine by default, a caller's vLLM on request."""

from pathlib import Path

import pytest

from infra.topology import parse_topology
from services.demo.run import Recipe, _vllm
from services.demo.topology import MODEL_NAME, stack_topology


def test_the_embedded_engine_is_a_service_of_the_stack(tmp_path):
    topo = parse_topology(stack_topology(tmp_path, tmp_path / "model"), "demo")
    (backend,) = topo.backends
    assert backend.kind == "embedded" and backend.model == MODEL_NAME
    assert "model" in topo.services
    assert backend.url == f"http://127.0.0.1:{topo.services['model'].port}"


def test_with_a_vllm_the_stack_has_no_model_service_and_routes_to_it(tmp_path):
    url = "http://127.0.0.1:18123"
    topo = parse_topology(stack_topology(tmp_path, tmp_path / "m", vllm_url=url), "demo")
    (backend,) = topo.backends
    assert (backend.kind, backend.url, backend.model) == ("vllm", url, MODEL_NAME)
    assert "model" not in topo.services
    assert topo.services["proxy"].config["model_dir"] == str(tmp_path / "m")  # token mode


def test_the_recipe_names_its_engine(tmp_path):
    assert _vllm(Recipe(), tmp_path) is None
    server = _vllm(Recipe(engine="vllm"), tmp_path)
    assert server.served_name == MODEL_NAME and "--enable-scale-out" in server.argv
    assert server.model_dir == tmp_path / "model-init" and server.proc is None  # not started
    with pytest.raises(ValueError, match="one of"):
        _vllm(Recipe(engine="sglang"), Path(tmp_path))


def test_the_model_for_vllm_has_heads_its_cpu_attention_takes():
    from services.demo.warmstart import DIMS, DIMS_VLLM

    head_dim = DIMS_VLLM["hidden_size"] // DIMS_VLLM["num_attention_heads"]
    assert head_dim == 32  # vLLM 0.32's CPU kernels refused 16 (the embedded model's)
    assert DIMS["hidden_size"] // DIMS["num_attention_heads"] == 16
    assert {k: v for k, v in DIMS_VLLM.items() if "heads" not in k} == {
        k: v for k, v in DIMS.items() if "heads" not in k
    }
