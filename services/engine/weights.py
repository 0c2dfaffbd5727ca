"""Reading and writing Hugging Face checkpoints, and loading a servable model directory."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from services.engine.model import CausalLM
from services.engine.modelconfig import ModelLoadError, load_config


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The weight files of a directory: one safetensors file, an indexed set of shards, or
    a legacy ``pytorch_model.bin``."""
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text("utf-8"))["weight_map"].values()))
        return [model_dir / s for s in shards]
    legacy = model_dir / "pytorch_model.bin"
    if legacy.exists():
        return [legacy]
    raise ModelLoadError(f"{model_dir} has no model.safetensors, shard index or pytorch_model.bin")


def load_tensors(model_dir: str | Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(Path(model_dir)):
        try:
            if path.suffix == ".bin":
                part = torch.load(path, map_location="cpu", weights_only=True)
            else:
                part = load_file(str(path))
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise ModelLoadError(f"cannot read {path}: {exc}") from exc
        tensors.update({k: v.float() for k, v in part.items()})
    return tensors


def save_tensors(tensors: dict[str, torch.Tensor], model_dir: str | Path) -> None:
    contiguous = {k: v.detach().contiguous() for k, v in tensors.items()}
    save_file(contiguous, str(Path(model_dir) / "model.safetensors"), metadata={"format": "pt"})


def load_model(model_dir: str | Path) -> CausalLM:
    """Config + weights of a directory as a ready CausalLM. Raises ModelLoadError."""
    config = load_config(model_dir)
    return CausalLM(config, load_tensors(model_dir))
