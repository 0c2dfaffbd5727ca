"""verl's prompt files for the Polar recipe: one row per Polar task, in verl's RL
dataset format (``prompt`` as chat messages, ``extra_info``).

    python examples/verl_grpo/make_data.py                      # tasks.jsonl -> ~/data/polar_verl
    python examples/verl_grpo/make_data.py --tasks my.jsonl --out ~/data/mine --val 4

Each line of ``--tasks`` is a Polar task (docs/reference/task.md) without ``task_id``
and ``num_samples`` (verl's ``rollout.n`` is the group size): its ``instruction``
becomes the row's user message, every other field goes, as JSON, to
``extra_info.polar_task``, which the adapter merges over the recipe's ``polar.task``
(a string: parquet would otherwise give every row every other row's keys, as nulls).
The last ``--val`` rows are the validation file.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def rows(tasks: list[dict]) -> list[dict]:
    out = []
    for i, task in enumerate(tasks):
        fields = {
            k: v for k, v in task.items() if k not in ("instruction", "task_id", "num_samples")
        }
        out.append(
            {
                "data_source": "polar",
                "prompt": [{"role": "user", "content": task["instruction"]}],
                "ability": "agent",
                "reward_model": {"style": "polar", "ground_truth": ""},  # Polar's evaluator scores
                "agent_name": "polar",
                "extra_info": {"index": i, "polar_task": json.dumps(fields)},
            }
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=Path, default=HERE / "tasks.jsonl")
    parser.add_argument("--out", type=Path, default=Path.home() / "data" / "polar_verl")
    parser.add_argument("--val", type=int, default=2, help="rows kept for validation")
    args = parser.parse_args()
    import pyarrow as pa
    import pyarrow.parquet as pq

    lines = args.tasks.read_text().splitlines()
    tasks = [json.loads(line) for line in lines if line.strip()]
    table = rows(tasks)
    train, val = table[: len(table) - args.val], table[len(table) - args.val :]
    args.out.expanduser().mkdir(parents=True, exist_ok=True)
    for name, part in (("train", train), ("val", val or train[:1])):
        path = args.out.expanduser() / f"{name}.parquet"
        pq.write_table(pa.Table.from_pylist(part), path)
        print(f"{path}: {len(part)} prompts")


if __name__ == "__main__":
    main()
