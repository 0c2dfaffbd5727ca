"""What a harness preset is: how to install, configure, run and judge one agent CLI.

The executor gives every harness the same environment (``HarnessContext.env``): a base
URL per protocol family pointing at the session's proxy route, the session token as API
key, the model name, ids and directories, then the task's and the agent spec's env.
``SESSION_ENV`` is that environment, each variable with what it holds: the one source of
both the harness's environment and its reference (docs/reference/harnesses.md).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import attrgetter

from schemas import AgentSpec, Outcome
from services.node.harnesses.failure import failure_line


@dataclass(frozen=True)
class HarnessContext:
    session_id: str
    task_id: str
    attempt: int
    instruction: str
    token: str  # the session's API key / URL secret
    proxy_url: str  # the proxy as reached from inside the sandbox, e.g. http://127.0.0.1:8200
    agent: AgentSpec
    workdir: str  # inside the sandbox
    home: str
    log_dir: str
    artifact_dir: str
    task_env: dict[str, str] = field(default_factory=dict)

    @property
    def session_base(self) -> str:
        return f"{self.proxy_url.rstrip('/')}/s/{self.token}"

    @property
    def openai_base_url(self) -> str:
        return f"{self.session_base}/v1"

    @property
    def anthropic_base_url(self) -> str:
        return self.session_base  # Anthropic clients append /v1/messages themselves

    @property
    def gemini_base_url(self) -> str:
        return self.session_base  # google-genai appends /v1beta/models/...

    def env(self) -> dict[str, str]:
        """``SESSION_ENV``, then the task's ``runtime.env``, then ``agent.env`` (the last
        one to name a variable wins)."""
        base = {var.name: var.value(self) for var in SESSION_ENV}
        return {**base, **self.task_env, **self.agent.env}


@dataclass(frozen=True)
class EnvVar:
    name: str
    value: Callable[[HarnessContext], str]
    doc: str  # what it holds, for the reference


SESSION_ENV: tuple[EnvVar, ...] = (
    EnvVar("HOME", attrgetter("home"),
           "the session's own home, fresh for each session: a CLI preset writes its config here"),
    EnvVar("SESSION_ID", attrgetter("session_id"), "the session's id, as `POLAR_SESSION_ID`"),
    EnvVar("TASK_ID", attrgetter("task_id"), "the task's id, as `POLAR_TASK_ID`"),
    EnvVar("POLAR_SESSION_ID", attrgetter("session_id"),
           "the session's id: `<task_id>-<sample index, 4 digits>`"),
    EnvVar("POLAR_TASK_ID", attrgetter("task_id"),
           "the task's `task_id` (the scheduler's own when the task named none)"),
    EnvVar("POLAR_ATTEMPT", lambda ctx: str(ctx.attempt),
           "the attempt: 0, then 1, 2, … when the session runs again "
           "(`max_retries`, `infra_retries`)"),
    EnvVar("POLAR_INSTRUCTION", attrgetter("instruction"), "the task's `instruction`: the prompt"),
    EnvVar("POLAR_MODEL", attrgetter("agent.model"),
           "`agent.model`: the model name to ask the proxy for"),
    EnvVar("POLAR_WORKDIR", attrgetter("workdir"),
           "the working directory, the run's cwd: where `prepare` put the task's files"),
    EnvVar("POLAR_LOG_DIR", attrgetter("log_dir"),
           "`$HOME/.polar/logs`: what is written here is collected with the session's logs"),
    EnvVar("POLAR_ARTIFACT_DIR", attrgetter("artifact_dir"),
           "`$HOME/.polar/artifacts`: a path for the harness's own use; nothing collects it "
           "(the workdir files named in `agent.output_files` are collected)"),
    EnvVar("POLAR_PROXY_URL", attrgetter("session_base"),
           "the session's proxy route, `<proxy>/s/<session token>`: every protocol is below it"),
    EnvVar("OPENAI_BASE_URL", attrgetter("openai_base_url"),
           "`$POLAR_PROXY_URL/v1`: OpenAI Chat Completions (`/chat/completions`), "
           "Responses (`/responses`), `/models`"),
    EnvVar("OPENAI_API_KEY", attrgetter("token"),
           "the session token: the key every protocol of the session's route takes"),
    EnvVar("OPENAI_MODEL", attrgetter("agent.model"), "`agent.model`"),
    EnvVar("ANTHROPIC_BASE_URL", attrgetter("anthropic_base_url"),
           "`$POLAR_PROXY_URL`: Anthropic Messages (clients append `/v1/messages`)"),
    EnvVar("ANTHROPIC_API_KEY", attrgetter("token"), "the session token"),
    EnvVar("ANTHROPIC_MODEL", attrgetter("agent.model"), "`agent.model`"),
    EnvVar("GOOGLE_GEMINI_BASE_URL", attrgetter("gemini_base_url"),
           "`$POLAR_PROXY_URL`: Gemini (clients append `/v1beta/models/<model>:generateContent`)"),
    EnvVar("GEMINI_API_KEY", attrgetter("token"), "the session token"),
    EnvVar("NO_PROXY", lambda ctx: "127.0.0.1,localhost",
           "`127.0.0.1,localhost`: the node's HTTP proxy, if any, is not used to reach Polar's"),
)  # fmt: skip


@dataclass(frozen=True)
class HarnessRun:
    """How to launch the harness once installed and configured."""

    argv: list[str]
    env: dict[str, str]
    cwd: str


class Harness(ABC):
    """A harness preset. Subclasses override what differs; the defaults fit a plain CLI."""

    name = "harness"
    # Paths (relative to HOME or the workdir) that are the harness's own config and logs:
    # excluded from the workdir diff, collected as logs.
    own_paths: tuple[str, ...] = ()
    protocol: str | None = None
    # An agent CLI: a run that ends well without one model call did nothing (a crash it
    # hid, a config it ignored), so it is an error, not an empty COMPLETED trajectory.
    calls_model: bool = False

    def version(self, ctx: HarnessContext) -> str | None:
        return ctx.agent.version

    async def install(self, runtime, ctx: HarnessContext) -> None:
        """Make the CLI available in the runtime (INIT stage). Nothing by default."""
        return None

    async def configure(self, runtime, ctx: HarnessContext) -> None:
        """Write this session's config files into its own HOME (INIT stage). Nothing by default."""
        return None

    @abstractmethod
    def run(self, ctx: HarnessContext) -> HarnessRun | None:
        """The headless command line; None means there is nothing to run."""

    def judge(self, exit_code: int | None, stdout: str, stderr: str) -> tuple[Outcome, str | None]:
        """Outcome of a run that neither timed out nor was cancelled; a failure's reason
        names the harness, its exit code and the line of its output that is the error."""
        if exit_code == 0:
            return Outcome.COMPLETED, None
        why = failure_line(stdout, stderr)
        reason = f"{self.name} exited with code {exit_code}"
        return Outcome.ERROR, f"{reason}: {why}" if why else reason
