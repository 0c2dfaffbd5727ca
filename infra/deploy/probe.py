"""One real task through a deployed stack, to its trajectory: the check every deployment
in infra/deploy/ is run with (compose, Slurm; the tests call ``probe``).

    python -m infra.deploy.probe --nats nats://127.0.0.1:14222 [--samples 2]
        [--scheduler http://127.0.0.1:18100]   # with POLAR_ADMIN_TOKEN in the environment

It submits a task (on ``polar.tasks.submit``, or with ``--scheduler`` through the
scheduler's ``POST /tasks`` with the admin token, which checks the deployment's tokens
too: a scheduler without one refuses every submission) whose shell harness makes one chat call
through the proxy (``OPENAI_BASE_URL``, which the gateway gives each session) and writes
the reply to ``reply.txt``, graded by a ``command`` evaluator in the session's live
runtime (1 when ``reply.txt`` is there: the gateway's own evaluator reached it); then it reads ``polar.trajectories.<task>`` until every
sample's trajectory is there and prints one line per trajectory: session, outcome,
reward, tokens sampled, the reply. ``--sandbox`` is the task's ``runtime.sandbox``
(auto: bubblewrap where the gateway has it; in a container that needs the capabilities
compose.yaml gives the gateway, infra/deploy/README.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
import uuid

import httpx
import orjson
from nats.js.api import ConsumerConfig, DeliverPolicy

from schemas import Trajectory, decode
from schemas import subjects as S
from services.common.bus import Bus

AGENT = """
import json, os, urllib.request
body = {"model": "polar-tiny", "max_tokens": 8,
        "messages": [{"role": "user", "content": "Say hello."}]}
req = urllib.request.Request(os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions",
    data=json.dumps(body).encode(), headers={"content-type": "application/json",
    "authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
with urllib.request.urlopen(req, timeout=120) as r:
    reply = json.load(r)["choices"][0]["message"]["content"] or ""
open("reply.txt", "w").write(reply)
print("reply:", reply)
"""


def probe_task(task_id: str, samples: int, python: str = "python3", sandbox: str = "auto") -> dict:
    return {
        "task_id": task_id,
        "instruction": "say hello through the proxy",
        "num_samples": samples,
        "timeout_seconds": 240,
        "runtime": {
            "backend": "local",
            "sandbox": sandbox,
            "prepare": [{"action": "upload_file", "content": AGENT, "dest": "agent.py"}],
        },
        # no diff: only the session's own (live) runtime on its gateway holds reply.txt,
        # so a reward of 1 says the gateway's evaluator graded it there (node-affine)
        "agent": {
            "harness": "shell",
            "command": f"{python} agent.py",
            "model": "polar-tiny",
            "collect_diff": False,
        },
        "evaluator": {
            "name": "command",
            "runtime": "live",
            "config": {"command": "test -f reply.txt && echo 1 || echo 0"},
        },
    }


async def wait_healthy(urls: list[str], timeout: float) -> None:
    """Until each base URL's ``/healthz`` answers 200: a harness started while the
    proxy it calls is still starting fails its session (connection refused)."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=2.0) as client:
        for url in urls:
            while True:
                try:
                    if (await client.get(f"{url.rstrip('/')}/healthz")).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{url}/healthz not healthy in {timeout}s")
                await asyncio.sleep(0.3)


class Refused(Exception):
    """The scheduler did not take the probe task (its token, or the task)."""


async def submit_http(
    scheduler: str, admin_token: str | None, spec: dict, client: httpx.AsyncClient | None = None
) -> None:
    """POST ``spec`` to the scheduler's ``/tasks``; Refused unless it answers 201."""
    headers = {"authorization": f"Bearer {admin_token}"} if admin_token else {}
    async with contextlib.AsyncExitStack() as stack:
        if client is None:
            client = await stack.enter_async_context(
                httpx.AsyncClient(timeout=30.0, trust_env=False)
            )
        r = await client.post(f"{scheduler.rstrip('/')}/tasks", json=spec, headers=headers)
    if r.status_code != 201:
        hint = "" if admin_token else " (no POLAR_ADMIN_TOKEN given)"
        raise Refused(f"{scheduler} refused the probe task{hint}: {r.status_code} {r.text[:300]}")


async def probe(
    nats_url: str,
    samples: int = 2,
    timeout: float = 240.0,
    python: str = "python3",
    sandbox: str = "auto",
    wait: list[str] = (),
    scheduler: str | None = None,
    admin_token: str | None = None,
) -> list[Trajectory]:
    """Submit the probe task (once every URL in ``wait`` is healthy), on NATS or, given
    ``scheduler``, over its HTTP API with ``admin_token`` (default: POLAR_ADMIN_TOKEN);
    its trajectories once all ``samples`` are delivered (TimeoutError with what did
    arrive when not within ``timeout``; Refused when the scheduler does not take it)."""
    if scheduler and admin_token is None:
        admin_token = os.environ.get("POLAR_ADMIN_TOKEN") or None
    task_id = f"probe-{uuid.uuid4().hex[:8]}"
    await wait_healthy(list(wait), timeout)
    bus = await Bus.open(nats_url, "deploy-probe", declare=False)
    deadline = time.monotonic() + timeout
    try:
        while True:  # a stack just started: its scheduler declares the streams
            try:
                await bus.js.stream_info(S.STREAM_TRAJECTORIES)
                break
            except Exception:  # noqa: BLE001 - not there yet (or the cluster electing)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no {S.STREAM_TRAJECTORIES} stream in {timeout}s") from None
                await asyncio.sleep(0.5)
        sub = await bus.js.subscribe(
            S.trajectories(task_id),
            config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL),
            ordered_consumer=True,
        )
        spec = probe_task(task_id, samples, python, sandbox)
        if scheduler:
            await submit_http(scheduler, admin_token, spec)
        else:
            await bus.publish(S.TASKS_SUBMIT, orjson.dumps(spec), msg_id=task_id)
        got: list[Trajectory] = []
        while len(got) < samples:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{task_id}: {len(got)} of {samples} trajectories in {timeout}s")
            try:
                msg = await sub.next_msg(timeout=min(left, 5.0))
            except TimeoutError:
                continue
            got.append(decode(await bus.payload(msg), Trajectory))
        return got
    finally:
        await bus.close()


def describe(t: Trajectory) -> str:
    sampled = sum(sum(tr.loss_mask) for tr in t.traces)
    reply = ""
    for tr in t.traces:
        for m in tr.messages:
            if m.get("role") == "assistant":
                reply = str(m.get("content") or "")
    return (
        f"{t.task_id} {t.session_id} outcome={t.outcome.value} reward={t.reward} "
        f"traces={len(t.traces)} sampled_tokens={sampled} reply={reply!r}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nats", required=True, help="the stack's NATS URL")
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=240.0)
    ap.add_argument("--python", default="python3", help="the harness's interpreter")
    ap.add_argument("--sandbox", default="auto", choices=("auto", "bwrap", "none"))
    ap.add_argument(
        "--wait", action="append", default=[], metavar="URL",
        help="a service (the proxy, ...) whose /healthz must answer first; repeatable",
    )  # fmt: skip
    ap.add_argument(
        "--scheduler", metavar="URL",
        help="submit through this scheduler's POST /tasks with POLAR_ADMIN_TOKEN "
        "(from the environment: a command line is visible to others)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    started = time.monotonic()
    try:
        got = asyncio.run(
            probe(args.nats, args.samples, args.timeout, args.python, args.sandbox, args.wait,
                  scheduler=args.scheduler)
        )  # fmt: skip
    except (TimeoutError, Refused) as exc:
        print(f"probe: {exc}", file=sys.stderr)
        return 1
    for t in got:
        print(describe(t))
    print(f"probe: {len(got)} trajectories in {time.monotonic() - started:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
