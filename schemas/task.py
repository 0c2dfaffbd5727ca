"""TaskRequest: what a trainer publishes on ``polar.tasks.submit``.

Every field but ``instruction`` has a default, so a person can ``nats pub`` a task by hand:

    nats pub polar.tasks.submit '{"task_id": "t1", "instruction": "fix the tests",
                                  "num_samples": 4, "agent": {"command": "./agent.sh"}}'
"""

# This docstring, the classes' and the comments on the fields are the task reference
# (docs/reference/task.md, written by `python -m infra.docgen`; a test keeps it current):
# a comment on a field's line, or on the lines just above it, documents the field; one
# above a named type (`Id`) documents every field of that type.

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta, Struct, field

# Ids are embedded in NATS subjects and Redis keys: keep them token-safe.
Id = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
Seconds = Annotated[float, Meta(gt=0, le=7 * 24 * 3600)]
MAX_SAMPLES = 4096
MAX_TASK_BYTES = 512 * 1024  # default submit limit; NATS max_payload is 1 MiB

BUILTIN_HARNESSES = frozenset(
    {"shell", "noop", "codex", "claude_code", "gemini_cli", "qwen_code", "opencode", "pi"}
)
BUILTIN_BUILDERS = frozenset({"per_request", "prefix_merging"})
BUILTIN_EVALUATORS = frozenset(
    {
        "session_completed", "test_on_output", "swebench", "command", "exact_answer",
        "rubric", "harbor",
    }
)  # fmt: skip


class _Spec(Struct, frozen=True, kw_only=True, omit_defaults=True):
    pass


# -- prepare actions (run during INIT, in order) --------------------------------------
class UploadFile(_Spec, tag="upload_file", tag_field="action"):
    """Write one file into the runtime: inline text (``content``) or a file of the node's
    (``src``)."""

    dest: str  # path inside the runtime, relative to the workdir unless absolute
    content: str | None = None  # inline text
    src: str | None = None  # path on the node
    mode: int = 0o644  # the file's permission bits (JSON has no octal: 420 is 0o644)

    def __post_init__(self) -> None:
        if (self.content is None) == (self.src is None):
            raise ValueError("upload_file needs exactly one of `content` or `src`")


class UploadDir(_Spec, tag="upload_dir", tag_field="action"):
    """Copy a directory of the node's into the runtime."""

    src: str  # directory on the node
    dest: str = "."  # where in the runtime, relative to the workdir unless absolute


class ExecAction(_Spec, tag="exec", tag_field="action"):
    """Run a command in the runtime. A command that fails every attempt ends the prepare
    steps there, and the session fails its INIT with the step's log."""

    command: str | list[str]  # a shell line, or an argv
    cwd: str | None = None  # where it runs; null: the workdir
    env: dict[str, str] = {}  # added to the runtime's environment for this command
    timeout_seconds: Seconds = 600.0  # past it, the command's whole process tree is killed
    retries: Annotated[int, Meta(ge=0, le=20)] = 0  # more attempts after a failed one
    # the wait before the first retry, doubled before each next one (at most 300 s)
    backoff_seconds: Annotated[float, Meta(ge=0, le=600)] = 1.0
    # this step gets the node's network even where the session's is isolated (an install
    # in INIT); the harness never does. Local runtimes: a container's network is its own.
    network: bool = False


PrepareAction = UploadFile | UploadDir | ExecAction


class Resources(_Spec):
    """Limits of a container runtime (docker, apptainer); the local runtime sets none."""

    cpus: Annotated[float, Meta(gt=0, le=1024)] | None = None  # CPUs (fractions allowed)
    memory_mb: Annotated[int, Meta(gt=0)] | None = None  # memory limit in MiB


# a container's network mode: none, the engine's bridge, or the node's own
Network = Literal["none", "bridge", "host"]
# auto: isolated (`none`: the sandbox's own loopback and the proxy bridge, which passes
# only the session's own routes) where the sandbox is bubblewrap; the node's network
# (`host`) where there is no sandbox, with the loud NO SANDBOX warning. `host` must be
# asked for: it puts every port of the node in the harness's reach (docs/explanation/security.md).
LocalNetwork = Literal["auto", "none", "host"]


# -- runtimes (discriminated by `backend`) ---------------------------------------------
class LocalRuntime(_Spec, tag="local", tag_field="backend"):
    """The harness runs as a process of the node, in a bubblewrap sandbox where there is
    one, with its own workdir and HOME."""

    # auto: bubblewrap for every harness that runs something (the CLIs, shell, a custom
    # class) where it is installed, with a loud warning where not; none for noop
    # (services/runtimes/factory.py `with_default_sandbox`)
    sandbox: Literal["auto", "none", "bwrap"] = "auto"
    network: LocalNetwork = "auto"
    prepare: list[PrepareAction] = []  # steps run in order during INIT, before the harness
    env: dict[str, str] = {}  # the harness's environment, over Polar's (agent.env wins)
    resources: Resources = Resources()  # not applied by the local runtime


class DockerRuntime(_Spec, tag="docker", tag_field="backend"):
    """A container per session, from an image (docker or podman's Docker API)."""

    image: str  # the image to run, e.g. "python:3.12-slim"
    network: Network = "bridge"
    prepare: list[PrepareAction] = []  # steps run in order during INIT, before the harness
    env: dict[str, str] = {}  # the harness's environment, over Polar's (agent.env wins)
    resources: Resources = Resources()  # CPU and memory limits
    mounts: list[str] = []  # "host:container[:ro]"
    workdir: str = "/workspace"  # the workdir inside the container


class ApptainerRuntime(_Spec, tag="apptainer", tag_field="backend"):
    """An Apptainer (Singularity) container per session, for clusters without Docker."""

    image: str  # .sif path or docker:// reference
    network: Network = "host"
    prepare: list[PrepareAction] = []  # steps run in order during INIT, before the harness
    env: dict[str, str] = {}  # the harness's environment, over Polar's (agent.env wins)
    resources: Resources = Resources()  # CPU and memory limits
    binds: list[str] = []  # "host:container[:ro]", as apptainer's --bind takes them
    workdir: str = "/workspace"  # the workdir inside the container


RuntimeSpec = LocalRuntime | DockerRuntime | ApptainerRuntime


class AgentSpec(_Spec):
    """The agent: which harness runs it and how (docs/reference/harnesses.md)."""

    harness: str = "shell"  # a preset name or "module:Class"
    command: str | list[str] | None = None  # the shell harness's command
    model: str = "polar"  # the model name the harness is told to use
    version: str | None = None  # CLI version override for presets
    protocol: str | None = None  # for CLIs that speak several APIs
    # appended to an argv `command` (shell); a preset puts them between its options and the prompt
    args: list[str] = []
    env: dict[str, str] = {}  # applied last, over Polar's variables and runtime.env
    settings: dict[str, object] = {}  # a preset's settings (docs/reference/harnesses.md)
    output_files: list[str] = []  # workdir files collected as artifacts after the run
    # The workdir's diff (a git baseline in INIT, ``git diff`` after the run): null takes it
    # when the evaluator may read the workspace (services/node/artifacts.py `takes_diff`);
    # true/false always/never (e.g. true to see it on the dashboard under session_completed).
    collect_diff: bool | None = None

    def __post_init__(self) -> None:
        if self.harness == "shell" and not self.command:
            raise ValueError("the `shell` harness needs `agent.command`")


class BuilderSpec(_Spec):
    """How a session's model calls become its trajectory's traces."""

    name: str = "prefix_merging"  # or "module:Class"
    config: dict[str, object] = {}  # the builder's own settings


class EvaluatorSpec(_Spec):
    """What scores a session: its reward."""

    name: str = "session_completed"  # or "module:Class"
    config: dict[str, object] = {}  # the evaluator's own settings (see its section below)
    # live: the session's own runtime, as the agent left it; fresh: a new one from the
    # task's runtime spec, the agent's output applied to it
    runtime: Literal["live", "fresh"] = "live"
    prewarm: bool = False  # a fresh runtime is started and prepared while the agent runs
    timeout_seconds: Seconds = 600.0  # past it, the evaluation is an error


class ReplaySpec(_Spec):
    """Answer this task's model calls from a recorded session instead of the engine
    (``polar replay``): each call with the recorded call of the same number, when its
    request is the recorded one; the first that is not stops the replay, reported."""

    session_id: Annotated[str, Meta(min_length=1, max_length=200)]  # the recorded session
    attempt: Annotated[int, Meta(ge=0)] = 0  # its attempt whose calls are replayed
    # that attempt's first call number (Session.seq_floor): the replay's call i is the
    # recorded call seq_floor + i
    seq_floor: Annotated[int, Meta(ge=0)] = 0
    # a fork: the first `until` calls are replayed, the rest go to the engine under the
    # current weights; null: every call replayed (no engine is called)
    until: Annotated[int, Meta(ge=0)] | None = None
    train: bool = False  # replayed calls' sampled tokens keep loss mask 1 (default 0)


class TaskRequest(_Spec):
    """A task: one instruction, run ``num_samples`` times, each run a session."""

    instruction: str  # the prompt, given to the agent ($POLAR_INSTRUCTION for a shell agent)
    # null: the scheduler names it (on the bus, the same JSON again within the scheduler's
    # submit_dedupe_seconds is the same task)
    task_id: Id | None = None
    num_samples: Annotated[int, Meta(ge=1, le=MAX_SAMPLES)] = 1  # sessions: a GRPO group
    priority: Annotated[int, Meta(ge=-1000, le=1000)] = 0  # higher starts first
    timeout_seconds: Seconds = 3600.0  # each session's whole life must end within it
    # the agent's run alone; null: timeout_seconds
    agent_timeout_seconds: Seconds | None = None
    max_retries: Annotated[int, Meta(ge=0, le=10)] = 0  # for any failure of an attempt
    # more, for faults of the system only (a holder lost, the bus or registry unreachable)
    infra_retries: Annotated[int, Meta(ge=0, le=10)] = 2
    # stop after N usable sessions: once N are COMPLETED, the live rest are cancelled
    early_stop: Annotated[int, Meta(ge=1)] | None = None
    runtime: RuntimeSpec = field(default_factory=LocalRuntime)  # where each session runs
    agent: AgentSpec = AgentSpec(harness="noop")  # no agent: the noop harness
    builder: BuilderSpec = BuilderSpec()  # how the model calls become traces
    evaluator: EvaluatorSpec = EvaluatorSpec()  # what gives each session its reward
    # the TaskResult is POSTed here when the task ends (retried), as well as published on
    # polar.tasks.<task_id>.result
    callback_url: Annotated[str, Meta(pattern=r"^https?://")] | None = None
    metadata: dict[str, object] = {}  # the caller's own: kept with the spec, unread by Polar
    replay: ReplaySpec | None = None  # re-run a recorded session (polar replay, docs/replay.md)

    def __post_init__(self) -> None:
        if not self.instruction.strip():
            raise ValueError("`instruction` must not be empty")
        if self.agent_timeout_seconds and self.agent_timeout_seconds > self.timeout_seconds:
            raise ValueError("`agent_timeout_seconds` exceeds `timeout_seconds`")
        if self.early_stop is not None and self.early_stop > self.num_samples:
            raise ValueError("`early_stop` exceeds `num_samples`")

    @property
    def agent_timeout(self) -> float:
        return self.agent_timeout_seconds or self.timeout_seconds
