"""Server state and configuration: the loaded model, tokenizer, policy and running engine."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
from concurrent.futures import Future
from pathlib import Path

import torch

from services.common.tokenization import ChatTokenizer
from services.engine.config import (  # noqa: F401 - re-exported for the stack
    CONFIG_ENV,
    DEFAULT_MODEL_DIR,
    ServeConfig,
    config_from_env,
    config_to_env,
)
from services.engine.engine import Engine
from services.engine.modelconfig import ModelLoadError
from services.engine.policy import Policy, load_policy, messages_from_prompt, scripted_ids
from services.engine.sequence import GenerationRequest, GenerationResult
from services.engine.weights import load_model


def ensure_model_dir(model_dir: str | Path) -> Path:
    """The default tiny model is created on first use; any other directory must exist.

    Creation is atomic (built beside the target, then renamed), so several servers
    starting at once never read a half-written directory."""
    path = Path(model_dir).expanduser()
    if (path / "config.json").exists():
        return path
    if path != DEFAULT_MODEL_DIR:
        raise ModelLoadError(
            f"{path} is not a model directory (no config.json); run `polar model init {path}`"
        )
    from services.engine.modelinit import init_model_dir

    path.parent.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        init_model_dir(building)
        os.rename(building, path)
    except OSError:
        if not (path / "config.json").exists():  # not a lost race: a real failure
            raise
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return path


class ServerState:
    """Everything a handler needs. Built once at startup, then shared read-mostly."""

    def __init__(self, config: ServeConfig):
        torch.set_num_threads(max(1, config.threads))
        self.config = config
        self.model_path = str(ensure_model_dir(config.model_dir))
        self.tokenizer = ChatTokenizer.load(self.model_path)
        self.policy: Policy | None = load_policy(config.policy) if config.policy else None
        model = load_model(self.model_path)
        self.model_info = json.loads((Path(self.model_path) / "config.json").read_text("utf-8"))
        self.engine = Engine(
            model,
            self.tokenizer.decode,
            self.tokenizer.eos_token_ids,
            config.engine,
            weight_version=config.weight_version,
        ).start()
        self.served_model_name = config.served_model_name or Path(self.model_path).name

    def close(self) -> None:
        self.engine.stop()

    def forced_for(self, messages: list[dict] | None, prompt_ids: list[int]) -> list[int] | None:
        """Scripted reply ids for this prompt, or None without a policy.

        The script sees the conversation as the model does, read back from the prompt
        tokens, so chat mode and token mode (/generate) choose identically. Only for a
        template that is not ChatML does it fall back to the request's messages.
        """
        if self.policy is None:
            return None
        text = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        seen = messages_from_prompt(text) or messages or [{"role": "user", "content": text}]
        return scripted_ids(self.policy, self.tokenizer, seen)

    async def run(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """Submit and await; a cancelled caller (client gone) aborts its requests."""
        futures: list[Future] = []
        try:
            for request in requests:
                futures.append(self.engine.submit(request))
            return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))
        except BaseException:
            for request, future in zip(requests, futures, strict=False):
                # a cancelled await cancels the engine's future too: that one must go
                if not future.done() or future.cancelled():
                    self.engine.abort(request.rid)
            raise
