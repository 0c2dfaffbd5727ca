"""Runtime latencies: start, exec `true`, a 1 MiB upload/download, stop; per backend.

    python tests/bench/bench_runtimes.py [--n 10]

Docker runs only when DOCKER_HOST is set or the podman socket of infra/podman/setup.sh
exists; bwrap only when bubblewrap is installed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from schemas.task import DockerRuntime, LocalRuntime
from services.runtimes import create_runtime

PODMAN_SOCKET = Path(os.environ.get("POLAR_PODMAN_DIR", "/tmp/polar-podman")) / "podman.sock"


def backends() -> dict[str, object]:
    found: dict[str, object] = {"local": LocalRuntime()}
    if shutil.which("bwrap"):
        found["bwrap"] = LocalRuntime(sandbox="bwrap", network="none")
    if os.environ.get("DOCKER_HOST") or PODMAN_SOCKET.exists():
        found["docker"] = DockerRuntime(image=os.environ.get("POLAR_TEST_IMAGE", "polar-test:latest"),
                                        network="none")  # fmt: skip
    return found


async def one_round(spec: object, i: int, base: Path, docker_host: str | None) -> dict[str, float]:
    t: dict[str, float] = {}
    rt = create_runtime(spec, f"bench-{i}", base_dir=base, proxy_url="http://127.0.0.1:9",
                        docker_host=docker_host)  # type: ignore[arg-type]  # fmt: skip
    payload = os.urandom(1 << 20)
    for name, step in (
        ("start", rt.start),
        ("exec", lambda: rt.exec("true")),
        ("upload 1MiB", lambda: rt.upload_file("blob", payload)),
        ("download 1MiB", lambda: rt.download("blob")),
        ("stop", rt.stop),
    ):
        started = time.perf_counter()
        await step()
        t[name] = (time.perf_counter() - started) * 1000
    return t


async def main(n: int) -> None:
    docker_host = os.environ.get("DOCKER_HOST") or f"unix://{PODMAN_SOCKET}"
    with tempfile.TemporaryDirectory(prefix="polar-bench-rt-") as tmp:
        for name, spec in backends().items():
            rounds = [await one_round(spec, i, Path(tmp), docker_host) for i in range(n)]
            cells = []
            for step in rounds[0]:
                values = sorted(r[step] for r in rounds)
                cells.append(f"{step} p50 {statistics.median(values):.1f} ms"
                             f" max {values[-1]:.1f}")  # fmt: skip
            print(f"{name:7s} " + " | ".join(cells))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=10)
    asyncio.run(main(parser.parse_args().n))
