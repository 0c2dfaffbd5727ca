"""The shell harness (any command) and the noop harness (runs nothing)."""

from __future__ import annotations

from services.node.harnesses.base import Harness, HarnessContext, HarnessRun


class ShellHarness(Harness):
    """Runs ``agent.command`` (a shell line or an argv) in the workdir with stdin closed.
    The instruction is in ``$POLAR_INSTRUCTION``; ``agent.args`` are appended to an argv."""

    name = "shell"

    def run(self, ctx: HarnessContext) -> HarnessRun:
        cmd = ctx.agent.command
        if not cmd:
            raise ValueError("the shell harness needs agent.command")
        argv = ["sh", "-c", cmd] if isinstance(cmd, str) else [*cmd, *ctx.agent.args]
        return HarnessRun(argv=argv, env=ctx.env(), cwd=ctx.workdir)


class NoopHarness(Harness):
    """Nothing to run: the session completes at once (pipeline smoke tests, benchmarks)."""

    name = "noop"

    def run(self, ctx: HarnessContext) -> None:
        return None
