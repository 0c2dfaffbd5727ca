"""Your own task and `polar train`, the commands a user types (README.md), in one go:
``python -m examples.own_task.run`` (``just example-own-task``).

    python -m examples.own_task.run               # train.yaml's 8 steps
    python -m examples.own_task.run --steps 2     # the smoke size `just test` runs

From the repository root, in a temporary directory of its own (so it never touches a
stack of yours): ``polar model init`` (the tiny model), ``polar up -t topology.yaml``,
``polar submit -t topology.yaml task.yaml --wait``, ``polar train train.yaml -t
topology.yaml`` while the dashboard's Training page (``/api/training``, what the page
draws) is read every two seconds, then ``polar down``. The copies of topology.yaml and
train.yaml differ from the example's only in their paths (state dir, model, checkpoints).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from services.client.connection import read_env_file

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def polar(*args: str, check: bool = True, quiet: bool = False) -> subprocess.CompletedProcess:
    """``polar ARGS`` from the repository root; prints the command and its last line."""
    cmd = [sys.executable, "-m", "services.cli.main", *args]
    print(f"$ polar {' '.join(args)}", flush=True)
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    lines = (done.stdout + done.stderr).strip().splitlines()
    for line in lines if not quiet else lines[-1:]:
        print(f"  {line}", flush=True)
    if check and done.returncode != 0:
        raise SystemExit(f"polar {args[0]} exited {done.returncode}")
    return done


def write_copies(work: Path, model: Path, steps: int | None) -> tuple[Path, Path, dict]:
    """topology.yaml and train.yaml with paths under ``work`` (the model: ``model``);
    returns both and the trainer config."""
    topo = yaml.safe_load((HERE / "topology.yaml").read_text())
    topo["state_dir"] = str(work / "state")
    topo["services"]["model"]["config"]["model_dir"] = str(model)
    train = yaml.safe_load((HERE / "train.yaml").read_text())
    train["model_dir"] = str(model)
    train["checkpoint_dir"] = str(work / "runs" / train["run_id"])
    if steps is not None:
        train["steps"] = steps
    topo_path, train_path = work / "topology.yaml", work / "train.yaml"
    topo_path.write_text(yaml.safe_dump(topo, sort_keys=False))
    train_path.write_text(yaml.safe_dump(train, sort_keys=False))
    return topo_path, train_path, train


def dashboard_training(state_dir: Path) -> dict | None:
    """What the dashboard's Training page shows now (its ``/api/training``)."""
    env = read_env_file(state_dir / "polar.env")
    url, token = env.get("POLAR_DASHBOARD_URL"), env.get("POLAR_READ_TOKEN")
    if not url:
        return None
    try:
        r = httpx.get(f"{url}/api/training", headers={"authorization": f"Bearer {token}"})
        return r.json() if r.status_code == 200 else None
    except httpx.HTTPError:
        return None


def train_watching(topo: Path, train: Path, state_dir: Path, timeout: float) -> tuple[int, dict]:
    """``polar train`` in the foreground; the dashboard's view of it printed as it moves.
    Returns its exit status and the dashboard's last view."""
    cmd = [sys.executable, "-m", "services.cli.main", "train", str(train), "-t", str(topo)]
    print(f"$ polar train {train} -t {topo}", flush=True)
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline, seen, view = time.monotonic() + timeout, None, {}
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            view = dashboard_training(state_dir) or view
            now = (view.get("steps"), view.get("state"))
            if view.get("configured") and now != seen:
                seen = now
                print(f"  dashboard, Training page: {now[0]} steps, run {now[1]}", flush=True)
            time.sleep(2)
    finally:
        if proc.poll() is None:
            proc.terminate()
        out = proc.communicate(timeout=60)[0].decode(errors="replace")
    for line in out.strip().splitlines()[-12:]:
        print(f"  {line}", flush=True)
    view = dashboard_training(state_dir) or view
    print(f"  dashboard, Training page at the end: {view.get('steps')} steps, run "
          f"{view.get('state')}", flush=True)  # fmt: skip
    return proc.returncode, view


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="train.yaml's otherwise")
    parser.add_argument("--timeout", type=float, default=900.0, help="for polar train")
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="a model to serve and train (read only) instead of a new `polar model init` one",
    )
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="polar-own-task-"))
    model = args.model_dir.resolve() if args.model_dir else work / "model"
    topo, train, cfg = write_copies(work, model, args.steps)
    state_dir = work / "state"
    if args.model_dir is None:
        polar("model", "init", str(model))
    polar("up", "-t", str(topo), "--nats-context", "")
    try:
        submitted = polar("submit", "-t", str(topo), str(HERE / "task.yaml"), "--wait")
        rc, view = train_watching(topo, train, state_dir, args.timeout)
        polar("status", "-t", str(topo), check=False, quiet=True)
    finally:
        if not os.environ.get("POLAR_EXAMPLE_KEEP"):
            polar("down", "-t", str(topo), check=False)
    print(f"done in {time.monotonic() - t0:.0f}s; files in {work}")
    shown = view.get("configured") and view.get("steps") == cfg["steps"]
    return 0 if submitted.returncode == 0 and rc == 0 and shown else 1


if __name__ == "__main__":
    sys.exit(main())
