"""Command line: ``init DIR`` writes a tiny model directory, ``serve`` runs the server.

The lead's ``polar`` CLI mounts these as ``polar model init`` and ``polar serve model``;
``python -m services.engine --model-dir DIR --port N`` runs ``serve`` directly.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from services.engine.config import (
    CONFIG_ENV,
    DEFAULT_MODEL_DIR,
    EngineConfig,
    ServeConfig,
    config_to_env,
)

app = typer.Typer(help="Polar's embedded CPU model server.", no_args_is_help=True)


@app.command("init")
def init_command(
    model_dir: Annotated[Path, typer.Argument(help="Directory to write the model into.")],
    seed: Annotated[int, typer.Option(help="Weight seed (the tokenizer is always the same).")] = 0,
    vision: Annotated[
        bool, typer.Option(help="Add an image encoder: a vision-language model.")
    ] = False,
    preset: Annotated[
        str,
        typer.Option(
            help="tiny (4,096-id BPE, width 128), demo (the learning demo's byte-vocabulary "
            "model: 265 ids, width 64, flat init) or demo-vllm (demo's with 2 heads, for vLLM)"
        ),
    ] = "tiny",
    tokenizer: Annotated[
        str | None, typer.Option(help="bpe or bytes (one id per byte): the preset's otherwise")
    ] = None,
    init_scale: Annotated[
        float | None, typer.Option(help="scales the weights' std: the preset's otherwise")
    ] = None,
) -> None:
    """Write a tiny Qwen2-architecture model with a real tokenizer and chat template."""
    from services.engine.modelinit import PRESETS, init_model_dir

    if preset not in PRESETS:
        raise typer.BadParameter(f"--preset must be one of {', '.join(PRESETS)}, not {preset!r}")
    p = PRESETS[preset]
    out = init_model_dir(
        model_dir,
        seed=seed,
        dims=p.dims,
        tokenizer=tokenizer or p.tokenizer,
        init_scale=p.init_scale if init_scale is None else init_scale,
        vision=vision,
    )
    typer.echo(f"wrote {out} ({preset}: {p.about})")


def run_server(config: ServeConfig) -> None:
    """Serve ``config`` with granian (one worker: the engine lives in that process)."""
    from granian import Granian
    from granian.constants import Interfaces

    from services.engine.policy import load_policy
    from services.engine.server import ensure_model_dir

    ensure_model_dir(config.model_dir)  # fail fast, and create the default model
    if config.policy:
        load_policy(config.policy)
    os.environ[CONFIG_ENV] = config_to_env(config)
    Granian(
        "services.engine.app:app_from_env",
        factory=True,
        address=config.host,
        port=config.port,
        interface=Interfaces.ASGI,
        workers=1,
        log_access=False,
    ).serve()


@app.command("serve")
def serve_command(
    model_dir: Annotated[Path, typer.Option(help="HF model directory.")] = DEFAULT_MODEL_DIR,
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 30000,
    policy: Annotated[Path | None, typer.Option(help="Scripted policy YAML.")] = None,
    max_queue: Annotated[int, typer.Option(help="Waiting requests before 503.")] = 256,
    max_batch: Annotated[int, typer.Option(help="Sequences generating together.")] = 32,
    max_prefill_tokens: Annotated[int, typer.Option(help="Prompt tokens per step.")] = 4096,
    prefix_cache_tokens: Annotated[int, typer.Option(help="0 disables prefix reuse.")] = 65536,
    threads: Annotated[int, typer.Option(help="torch threads for the engine.")] = 1,
    weight_version: Annotated[str, typer.Option(help="Initial weight version.")] = "1",
    served_model_name: Annotated[
        str, typer.Option(help="The model name clients see (default: the directory's name).")
    ] = "",
    default_max_tokens: Annotated[
        int, typer.Option(help="Tokens to generate when a request sets no limit.")
    ] = 256,
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="POLAR_ENGINE_API_KEY",
            help="Require `Authorization: Bearer KEY` on every route but /health and "
            "/metrics (set it in the environment: a command line is visible to others).",
        ),
    ] = None,
) -> None:
    """Serve SGLang's HTTP surface (/generate, /v1/chat/completions, weight control)."""
    engine = EngineConfig(
        max_batch=max_batch,
        max_queue=max_queue,
        max_prefill_tokens=max_prefill_tokens,
        prefix_cache_tokens=prefix_cache_tokens,
    )
    run_server(
        ServeConfig(
            model_dir=str(model_dir),
            host=host,
            port=port,
            policy=str(policy) if policy else None,
            served_model_name=served_model_name,
            weight_version=weight_version,
            threads=threads,
            default_max_tokens=default_max_tokens,
            engine=engine,
            api_key=api_key or None,
        )
    )


def main() -> None:
    app()
