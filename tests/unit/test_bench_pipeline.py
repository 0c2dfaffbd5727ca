"""The pipeline bench's pure parts: the topology it starts, Redis key families, the
py-spy summary, CPU of a process group split into own and reaped children's."""

from __future__ import annotations

import subprocess
import sys
import time

from infra.topology import parse_topology, plan_services
from tests.bench.pipeline_bench.measure import family
from tests.bench.pipeline_bench.report import profile_table
from tests.bench.pipeline_bench.stack import topology
from tests.bench.proxy_bench import procs


def test_topology_is_one_node_in_front_of_the_engine(tmp_path):
    import yaml

    topo = parse_topology(yaml.safe_dump(topology(tmp_path, "http://127.0.0.1:9", (4, 4, 8))))
    names = sorted(p.name for p in plan_services(topo))
    assert names == sorted(
        ["proxy", "scheduler", "pool-node0", "executor-node0", "builder", "evaluator"]
    )
    assert all(p.port == 0 for p in plan_services(topo))
    assert topo.backends[0].url == "http://127.0.0.1:9"


def test_key_families():
    assert family("polar:task:t1:sessions") == "polar:task:*:sessions"
    assert family("polar:task:t1:counts") == "polar:task:*:counts"
    assert family("polar:task:t1") == "polar:task:"
    assert family("polar:session:t1-0001") == "polar:session:"
    assert family("polar:counts") == "polar:"


def test_profile_table_attributes_samples_to_the_deepest_project_frame(tmp_path):
    raw = tmp_path / "x.pyspy"
    raw.write_text(
        "process 1:x;main (services/cli/main.py:1);run (services/executor/handlers.py:5);"
        "scan (services/runtimes/procs.py:9);read (os.py:3) 3\n"
        "process 1:x;main (services/cli/main.py:1);select (selectors.py:2) 1\n"
    )
    text = "\n".join(profile_table(raw))
    assert "| `scan (services/runtimes/procs.py)` | 75.0 | 75.0 |" in text
    assert "| `run (services/executor/handlers.py)` | 75.0 | 0.0 |" in text
    assert "(outside the project: start-up, event loop)` | 25.0 |" in text
    assert "main (services/cli/main.py)" not in text.split("| leaf function")[0]
    assert "(4 samples" in text


def test_cpu_split_counts_a_reaped_child_apart():
    burn = "import subprocess,sys; subprocess.run([sys.executable,'-c','sum(range(10**7))'])"
    proc = subprocess.Popen(
        [sys.executable, "-c", burn + "; import time; time.sleep(5)"], start_new_session=True
    )
    try:
        deadline = time.monotonic() + 30
        while procs.cpu_split(proc.pid)[1] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert procs.cpu_split(proc.pid)[1] > 0.05  # the child's sum, once its parent reaped it
    finally:
        proc.kill()
        proc.wait()
