"""Count the stars: images through every protocol into a model that reads them, rewards
from the exact count, and a trainer that trains on them. ``just example-count-stars``.

    python -m examples.count_stars.run
    python -m examples.count_stars.run --steps 1 --warm-steps 4   # the smoke size `just test` runs

1. A tiny vision-language model (``polar model init --vision``) with a format-only warm
   start (warmstart.py), served by the embedded engine in a whole stack.
2. One task per protocol (OpenAI chat, OpenAI Responses, Anthropic, Gemini): the agent
   (agent.py) sends a star image; each call's record is printed with its image's digest
   and token span, and the captured logprobs are recomputed teacher-forced, in this
   process, with the image read back from the object store by its digest.
3. ``polar train`` (train.yaml): groups of sessions per image, rewards from the exact
   count, GRPO steps whose mismatch check recomputes the image-bearing samples.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import torch
import yaml

from examples.count_stars.images import star_image
from examples.count_stars.warmstart import QUESTION, create_model, warm_start
from examples.runner import REPO, run_tasks, stack, train_addresses
from schemas import CompletionRecord, decode
from schemas import subjects as S
from schemas.completion import reconstruct_prompts
from services.common.bus import Bus
from services.demo.topology import MODEL_NAME, stack_topology
from services.engine.vision import place_images, preprocess
from services.engine.weights import load_model

HERE = Path(__file__).resolve().parent
PROTOCOLS = ("openai_chat", "openai_responses", "anthropic_messages", "gemini")


def template(image: Path, count: int, protocol: str) -> dict:
    """A task template: the agent sends ``image`` through ``protocol``; the answer must
    be ``count``, exactly."""
    return {
        "instruction": QUESTION,
        "timeout_seconds": 300,
        "agent_timeout_seconds": 120,
        "runtime": {
            "backend": "local",
            "prepare": [
                {"action": "upload_file", "src": str(HERE / "agent.py"), "dest": "agent.py"},
                {"action": "upload_file", "src": str(image), "dest": "stars.png"},
            ],
        },
        "agent": {
            "harness": "shell",
            "command": f"{sys.executable} agent.py",
            "model": MODEL_NAME,
            "env": {"STARS_PROTOCOL": protocol},
        },
        "builder": {"name": "per_request"},
        "evaluator": {"name": "exact_answer", "config": {"answers": {QUESTION: str(count)}}},
        "metadata": {"family": "count_stars", "stars": count, "protocol": protocol},
    }


def images(out: Path, counts: list[int], seed: int) -> list[Path]:
    paths = []
    for i, count in enumerate(counts):
        path = out / f"stars-{count}-{seed + i}.png"
        path.write_bytes(star_image(count, seed=seed + i))
        paths.append(path)
    return paths


async def show_records(topo, runs, model_dir: Path) -> bool:
    """Each protocol's record (image digest, span) and its teacher-forced recomputation."""
    model = load_model(model_dir)
    bus = await Bus.open(topo.nats_url, "count-stars-example", declare=False)
    worst = 0.0
    try:
        for run in runs:
            sid = run.session.session_id
            sub = await bus.js.subscribe(S.completions(sid), ordered_consumer=True)
            rec = decode(await bus.payload(await sub.next_msg(timeout=10)), CompletionRecord)
            await sub.unsubscribe()
            prompt = reconstruct_prompts([rec])[rec.seq]
            blobs = await bus.blobs()
            data = [(await blobs.get(S.image_object(im.digest))).data for im in rec.images]
            size = model.config.vision.image_size
            with torch.no_grad():
                embeds = model.encode_images(torch.stack([preprocess(d, size) for d in data]))
                placed = place_images(
                    [(im.start, im.length) for im in rec.images],
                    embeds,
                    [im.digest for im in rec.images],
                )
                truth = model.teacher_forced_logprobs(prompt + rec.output_ids, len(prompt), placed)
            diff = max(abs(a - b) for a, b in zip(truth, rec.output_logprobs, strict=True))
            worst = max(worst, diff)
            spans = ", ".join(f"{im.digest[:19]}… at {im.start}+{im.length}" for im in rec.images)
            if run is runs[0]:
                print(f"record {sid}/{rec.seq} images: {msgspec.json.encode(rec.images).decode()}")
            print(
                f"{rec.protocol:<19} stars {run.task['metadata']['stars']}  answer "
                f"{msgspec.json.decode(rec.reply)['content']!r:<5} reward "
                f"{run.session.reward}  prompt {len(prompt)} tokens, image {spans}  "
                f"teacher-forced max |Δ| {diff:.1e}"
            )
    finally:
        await bus.close()
    return worst <= 1e-4


def train(topo, out: Path, model_dir: Path, steps: int | None = None) -> int:
    tasks = out / "tasks.jsonl"
    counts = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    paths = images(out, counts, seed=100)
    lines = [
        json.dumps(template(p, c, PROTOCOLS[i % 4]))
        for i, (p, c) in enumerate(zip(paths, counts, strict=True))
    ]
    tasks.write_text("\n".join(lines) + "\n")
    cfg = yaml.safe_load((HERE / "train.yaml").read_text())
    cfg.update(
        **train_addresses(topo),  # the stack's: weight pushes need its admin token
        model_dir=str(model_dir),
        checkpoint_dir=str(out / "ckpt"),
        tasks={"path": str(tasks)},
    )
    if steps is not None:
        cfg["steps"] = steps
    config = out / "train.json"
    config.write_text(json.dumps(cfg, indent=2))
    t0 = time.monotonic()
    rc = subprocess.run(
        [sys.executable, "-m", "services.cli.main", "train", str(config)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,  # its steps are read back from its log below
    ).returncode
    print(f"polar train exited {rc} after {time.monotonic() - t0:.0f}s")
    for line in (out / "ckpt" / "log.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r.get("type") == "step":
            print(
                f"step {r['step']}: groups {r['groups']} rewards mean {r['reward_mean']:.3f} "
                f"(std {r['reward_std']:.3f}), mismatch max {r['mismatch_max']:.1e} over "
                f"{r['mismatch_tokens']} tokens, loss {r['loss']:.4f}"
            )
    return rc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="train.yaml's otherwise (2)")
    parser.add_argument("--warm-steps", type=int, default=40, help="format warm-start steps")
    args = parser.parse_args(argv)
    out = Path(tempfile.mkdtemp(prefix="polar-count-stars-"))
    t0 = time.monotonic()
    loss, seconds = warm_start(create_model(out / "base"), out / "model", steps=args.warm_steps)
    model_dir = out / "model"
    print(f"vision model warm-started (digit format only) in {seconds:.0f}s, loss {loss:.3f}")
    with stack(lambda state: stack_topology(state, model_dir, max_run=4, max_batch=16)) as topo:
        paths = images(out, [5, 3, 7, 2], seed=1)
        tasks = [
            {"task_id": f"stars-{p}-{int(time.time())}", **template(path, c, p)}
            for p, path, c in zip(PROTOCOLS, paths, [5, 3, 7, 2], strict=True)
        ]
        runs = asyncio.run(run_tasks(topo, tasks, 300))
        matched = asyncio.run(show_records(topo, runs, model_dir))
        rc = train(topo, out, model_dir, args.steps)
    print(f"done in {time.monotonic() - t0:.0f}s; files in {out}")
    return 0 if matched and rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
