"""TaskRequest: what a trainer publishes on ``polar.tasks.submit``.

Every field but ``instruction`` has a default, so a person can ``nats pub`` a task by hand:

    nats pub polar.tasks.submit '{"task_id": "t1", "instruction": "fix the tests",
                                  "num_samples": 4, "agent": {"command": "./agent.sh"}}'
"""

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
    dest: str  # path inside the runtime, relative to the workdir unless absolute
    content: str | None = None  # inline text
    src: str | None = None  # path on the node
    mode: int = 0o644

    def __post_init__(self) -> None:
        if (self.content is None) == (self.src is None):
            raise ValueError("upload_file needs exactly one of `content` or `src`")


class UploadDir(_Spec, tag="upload_dir", tag_field="action"):
    src: str  # directory on the node
    dest: str = "."


class ExecAction(_Spec, tag="exec", tag_field="action"):
    command: str | list[str]
    cwd: str | None = None
    env: dict[str, str] = {}
    timeout_seconds: Seconds = 600.0
    retries: Annotated[int, Meta(ge=0, le=20)] = 0
    backoff_seconds: Annotated[float, Meta(ge=0, le=600)] = 1.0
    # this step gets the node's network even where the session's is isolated (an install
    # in INIT); the harness never does. Local runtimes: a container's network is its own.
    network: bool = False


PrepareAction = UploadFile | UploadDir | ExecAction


class Resources(_Spec):
    cpus: Annotated[float, Meta(gt=0, le=1024)] | None = None
    memory_mb: Annotated[int, Meta(gt=0)] | None = None


Network = Literal["none", "bridge", "host"]
# auto: isolated (`none`: the sandbox's own loopback and the proxy bridge, which passes
# only the session's own routes) where the sandbox is bubblewrap; the node's network
# (`host`) where there is no sandbox, with the loud NO SANDBOX warning. `host` must be
# asked for: it puts every port of the node in the harness's reach (docs/security.md).
LocalNetwork = Literal["auto", "none", "host"]


# -- runtimes (discriminated by `backend`) ---------------------------------------------
class LocalRuntime(_Spec, tag="local", tag_field="backend"):
    # auto: bubblewrap for every harness that runs something (the CLIs, shell, a custom
    # class) where it is installed, with a loud warning where not; none for noop
    # (services/runtimes/factory.py `with_default_sandbox`)
    sandbox: Literal["auto", "none", "bwrap"] = "auto"
    network: LocalNetwork = "auto"
    prepare: list[PrepareAction] = []
    env: dict[str, str] = {}
    resources: Resources = Resources()


class DockerRuntime(_Spec, tag="docker", tag_field="backend"):
    image: str
    network: Network = "bridge"
    prepare: list[PrepareAction] = []
    env: dict[str, str] = {}
    resources: Resources = Resources()
    mounts: list[str] = []  # "host:container[:ro]"
    workdir: str = "/workspace"


class ApptainerRuntime(_Spec, tag="apptainer", tag_field="backend"):
    image: str  # .sif path or docker:// reference
    network: Network = "host"
    prepare: list[PrepareAction] = []
    env: dict[str, str] = {}
    resources: Resources = Resources()
    binds: list[str] = []
    workdir: str = "/workspace"


RuntimeSpec = LocalRuntime | DockerRuntime | ApptainerRuntime


class AgentSpec(_Spec):
    harness: str = "shell"  # a preset name or "module:Class"
    command: str | list[str] | None = None  # the shell harness's command
    model: str = "polar"  # the model name the harness is told to use
    version: str | None = None  # CLI version override for presets
    protocol: str | None = None  # for CLIs that speak several APIs
    args: list[str] = []
    env: dict[str, str] = {}
    settings: dict[str, object] = {}
    output_files: list[str] = []  # workdir files collected as artifacts after the run
    # The workdir's diff (a git baseline in INIT, ``git diff`` after the run): None takes it
    # when the evaluator may read the workspace (services/node/artifacts.py `takes_diff`);
    # true/false always/never (e.g. true to see it on the dashboard under session_completed).
    collect_diff: bool | None = None

    def __post_init__(self) -> None:
        if self.harness == "shell" and not self.command:
            raise ValueError("the `shell` harness needs `agent.command`")


class BuilderSpec(_Spec):
    name: str = "prefix_merging"  # or "module:Class"
    config: dict[str, object] = {}


class EvaluatorSpec(_Spec):
    name: str = "session_completed"  # or "module:Class"
    config: dict[str, object] = {}
    runtime: Literal["live", "fresh"] = "live"
    prewarm: bool = False
    timeout_seconds: Seconds = 600.0


class TaskRequest(_Spec):
    instruction: str
    task_id: Id | None = None
    num_samples: Annotated[int, Meta(ge=1, le=MAX_SAMPLES)] = 1
    priority: Annotated[int, Meta(ge=-1000, le=1000)] = 0
    timeout_seconds: Seconds = 3600.0
    agent_timeout_seconds: Seconds | None = None
    max_retries: Annotated[int, Meta(ge=0, le=10)] = 0  # for any failure of an attempt
    # more, for faults of the system only (a holder lost, the bus or registry unreachable)
    infra_retries: Annotated[int, Meta(ge=0, le=10)] = 2
    early_stop: Annotated[int, Meta(ge=1)] | None = None  # stop after N usable sessions
    runtime: RuntimeSpec = field(default_factory=LocalRuntime)
    agent: AgentSpec = AgentSpec(harness="noop")  # no agent: the noop harness
    builder: BuilderSpec = BuilderSpec()
    evaluator: EvaluatorSpec = EvaluatorSpec()
    callback_url: Annotated[str, Meta(pattern=r"^https?://")] | None = None
    metadata: dict[str, object] = {}

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
