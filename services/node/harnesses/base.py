"""What a harness preset is: how to install, configure, run and judge one agent CLI.

The executor gives every harness the same environment (``HarnessContext.env``): a base
URL per protocol family pointing at the session's proxy route, the session token as API
key, the model name, ids and directories, then the task's and the agent spec's env.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

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
        base = {
            "HOME": self.home,
            "SESSION_ID": self.session_id,
            "TASK_ID": self.task_id,
            "POLAR_SESSION_ID": self.session_id,
            "POLAR_TASK_ID": self.task_id,
            "POLAR_ATTEMPT": str(self.attempt),
            "POLAR_INSTRUCTION": self.instruction,
            "POLAR_MODEL": self.agent.model,
            "POLAR_WORKDIR": self.workdir,
            "POLAR_LOG_DIR": self.log_dir,
            "POLAR_ARTIFACT_DIR": self.artifact_dir,
            "POLAR_PROXY_URL": self.session_base,
            "OPENAI_BASE_URL": self.openai_base_url,
            "OPENAI_API_KEY": self.token,
            "OPENAI_MODEL": self.agent.model,
            "ANTHROPIC_BASE_URL": self.anthropic_base_url,
            "ANTHROPIC_API_KEY": self.token,
            "ANTHROPIC_MODEL": self.agent.model,
            "GOOGLE_GEMINI_BASE_URL": self.gemini_base_url,
            "GEMINI_API_KEY": self.token,
            "NO_PROXY": "127.0.0.1,localhost",
        }
        return {**base, **self.task_env, **self.agent.env}


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
