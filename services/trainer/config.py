"""The trainer's configuration: one frozen msgspec Struct, from YAML/JSON or ``POLAR_CONFIG``.

Unknown keys are errors (a typo must not silently fall back to a default).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Literal

import msgspec
import yaml
from msgspec import Meta, Struct

from services.client.connection import Connection
from services.common.settings import ServiceSettings
from services.trainer.toolparse import DEFAULT_RULE, ToolParseRule

# the policy-gradient estimator (services/trainer/objective.py)
Objective = Literal["grpo", "rloo", "dr_grpo"]
# which rewards are compared for an advantage (services/trainer/batch.py)
Grouping = Literal["auto", "session", "trace", "prompt"]
# what a sample older than max_staleness gets: left out, or stale_weight
StalePolicy = Literal["drop", "downweight"]
Positive = Annotated[float, Meta(gt=0)]


class ConfigError(ValueError):
    """The configuration cannot be used (fatal at start)."""


class _Cfg(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


class TaskSourceConfig(_Cfg):
    """Task templates (TaskRequest dicts without ``task_id``): a JSONL file, or a
    ``module:function`` returning an iterable of them (called with ``args``)."""

    path: str | None = None  # a JSONL file of task templates
    generator: str | None = None  # or a "module:function" that returns them
    args: dict[str, object] = {}  # the generator's keyword arguments
    heldout: Annotated[int, Meta(ge=0)] = 0  # templates held out (chosen by the seed)
    heldout_path: str | None = None  # or a file of its own (then ``heldout`` is ignored)

    def __post_init__(self) -> None:
        if (self.path is None) == (self.generator is None):
            raise ValueError("tasks: give exactly one of `path` or `generator`")


class EvalConfig(_Cfg):
    every: Annotated[int, Meta(ge=0)] = 1  # steps between held-out evaluations; 0: none
    at_start: bool = True  # evaluate before the first step too
    at_end: bool = True  # and after the last
    num_samples: Annotated[int, Meta(ge=1)] = 1  # sessions per held-out task
    priority: int = 10  # held-out sessions go ahead of training rollouts
    # deep-merged into each held-out task (e.g. the agent's env telling it to decode greedily)
    overrides: dict[str, object] = {}
    timeout_seconds: Positive = 600.0  # an evaluation's tasks must end within this


class TrainerConfig(ServiceSettings, frozen=True, kw_only=True):
    port: int = 8150
    # names the run: its consumer, checkpoints and log
    run_id: Annotated[str, Meta(pattern=r"^[A-Za-z0-9_]{1,32}$")] = "run"
    tasks: TaskSourceConfig  # where the training tasks come from
    model_dir: str  # the model to train (a Hugging Face directory)
    checkpoint_dir: str  # where its checkpoints (and by default the log and plot) go
    log_path: str | None = None  # JSONL; default <checkpoint_dir>/log.jsonl
    plot_path: str | None = None  # PNG; default <checkpoint_dir>/curves.png
    proxy_url: str = "http://127.0.0.1:8200"  # the proxy the weights are pushed through
    admin_token: str | None = None  # the proxy's admin token (`polar train` gives the stack's)
    device: Literal["auto", "cpu", "cuda"] = "auto"  # where to train; auto: cuda when there is one
    threads: Annotated[int, Meta(ge=1)] = 1  # torch's CPU threads
    seed: int = 0  # torch's seed and the task order's
    # -- the loop
    steps: Annotated[int, Meta(ge=1)] = 10  # optimizer steps to run
    # or stop after the step that ends past this many seconds from the start (then the
    # final held-out evaluation and the plot, as after the last of `steps`)
    max_seconds: Positive | None = None
    groups_per_step: Annotated[int, Meta(ge=1)] = 4  # task groups in each step's batch
    group_size: Annotated[int, Meta(ge=1)] = 4  # each task's num_samples
    rollout_ahead: Annotated[int, Meta(ge=0)] = 0  # tasks in flight beyond the step's own
    partial_after_seconds: Positive | None = 300.0  # a group missing members is used after this
    ack_wait_seconds: Positive = 60.0  # a dead trainer's uncommitted groups come back after this
    # the run's durable consumer on POLAR_TRAJECTORIES: a run that finishes deletes it; one
    # that dies leaves it for a resume, and the server drops it after this many seconds
    # without a trainer (a later resume starts a new one from the stream's start)
    consumer_inactive_seconds: Positive | None = 7 * 24 * 3600.0
    # push the weights to the engines every this many steps
    sync_every: Annotated[int, Meta(ge=1)] = 1
    keep_checkpoints: Annotated[int, Meta(ge=1)] = 3  # the newest kept; older ones are deleted
    # also keep the step of the best held-out accuracy, named by <checkpoint_dir>/BEST
    keep_best: bool = True
    cancel_on_exit: bool = True  # cancel tasks still in flight when the run ends
    # -- the objective
    objective: Objective = "grpo"
    grouping: Grouping = "auto"
    lr: Positive = 1e-4  # Adam's learning rate
    weight_decay: Annotated[float, Meta(ge=0)] = 0.0  # AdamW's decay
    grad_clip: Positive | None = 1.0  # the gradient's norm is clipped to this; None: no clipping
    clip_eps: Annotated[float, Meta(gt=0, lt=1)] = 0.2  # PPO's clip range around a ratio of 1
    clip_eps_high: Annotated[float, Meta(gt=0)] | None = None  # default: clip_eps
    ratio_cap: Annotated[float, Meta(gt=1)] = 3.0  # dual clip: a ratio's weight is capped here
    kl_coef: Annotated[float, Meta(ge=0)] = 0.0  # KL to the initial weights; 0: no reference
    # weight versions a sample may lag the trainer's before it is stale
    max_staleness: Annotated[int, Meta(ge=0)] = 4
    stale_policy: StalePolicy = "drop"
    stale_weight: Annotated[float, Meta(ge=0, le=1)] = 0.1  # downweight factor
    dr_grpo_max_tokens: Annotated[int, Meta(ge=1)] = 256  # Dr. GRPO's constant normalizer
    # no forward for samples whose advantage is 0: the loss is the same (their terms are 0,
    # the denominator still counts their tokens) unless kl_coef > 0, but the mismatch check
    # then covers only the samples that went through the forward
    skip_zero_advantage: bool = False
    # max |captured - recomputed logprob| on-policy: a step over it stops the run
    mismatch_threshold: Positive = 1e-4
    # optimizer steps on each step's batch (PPO epochs): the later ones reuse the samples,
    # their ratio against the captured logprobs applied and clipped; the mismatch check
    # runs on the first, before the weights move
    updates_per_batch: Annotated[int, Meta(ge=1)] = 1
    # a session whose tool calls did not parse: zero_reward (its reward 0) | mask (loss
    # mask 0 on the failed calls) | keep (services/trainer/toolparse.py)
    tool_parse_failures: ToolParseRule = DEFAULT_RULE
    eval: EvalConfig = EvalConfig()  # the held-out evaluations

    @property
    def log_file(self) -> Path:
        return Path(self.log_path or Path(self.checkpoint_dir) / "log.jsonl")

    @property
    def plot_file(self) -> Path:
        return Path(self.plot_path or Path(self.checkpoint_dir) / "curves.png")

    @property
    def eps_high(self) -> float:
        return self.clip_eps if self.clip_eps_high is None else self.clip_eps_high


def parse_config(data: object, where: str = "config", *, strict: bool = True) -> TrainerConfig:
    try:
        return msgspec.convert(data, TrainerConfig, strict=strict)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{where}: {exc}") from None


STACK_KEYS = ("nats_url", "redis_url", "proxy_url", "admin_token")  # what a stack tells it


def stack_defaults(conn: Connection) -> dict[str, str]:
    """The config keys a stack fills when the config leaves them out: where NATS, Redis and
    the proxy are, with the credentials (``polar train -t topology.yaml``, or the
    environment file ``polar up`` writes)."""
    return {k: v for k in STACK_KEYS if (v := getattr(conn, k)) is not None}


def load_config(path: str | Path, defaults: Mapping[str, object] | None = None) -> TrainerConfig:
    """A JSON file (``.json``) or YAML; relative paths in it stay relative to the working
    directory. ``defaults``: values for keys the file leaves out (``stack_defaults``).
    YAML reads ``1e-4`` as a string (YAML 1.1 floats need a dot), so YAML
    values are converted leniently (numbers from strings); JSON ones strictly."""
    p = Path(path)
    try:
        raw = p.read_text("utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read {p}: {exc.strerror}") from None
    if p.suffix.lower() == ".json":
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{p}: not JSON: {exc}") from None
    else:
        try:
            data = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{p}: not YAML: {exc}") from None
    if defaults and isinstance(data, dict):
        data = {**defaults, **data}
    return parse_config(data, str(p), strict=p.suffix.lower() == ".json")
