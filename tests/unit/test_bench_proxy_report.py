"""The proxy bench's verdicts: best cell each side, and each cell at equal load."""

from tests.bench.proxy_bench.report import RLLM, Run, verdicts


def run(target: str, sessions: int, calls_per_cpu_s: float, stream: bool = False) -> Run:
    # 100 calls over 0.1 s of wall time and 100 / calls_per_cpu_s CPU seconds
    return Run(target, stream, sessions, [0.001] * 100, 0.1, 0, cpu=100 / calls_per_cpu_s)


def test_ratios_best_cell_and_cell_by_cell():
    runs = [
        Run("direct", False, 1, [0.0001] * 100, 0.01, 0),
        run("polar-chat", 1, 1600),
        run(RLLM, 1, 400),
        run("polar-chat", 64, 4000),
        run(RLLM, 64, 250),
        run("polar-chat first calls", 1, 1000),  # one call at a time: in no ratio
    ]
    lines = verdicts(runs)
    assert "max req per CPU-s, polar-chat: 4000 = 10.0x rllm-gateway's 400 (meets >= 10x)" in lines
    assert "req per CPU-s over rllm-gateway's, 1 sessions, non-streaming: polar-chat 4.0x" in lines
    assert (
        "req per CPU-s over rllm-gateway's, 64 sessions, non-streaming: polar-chat 16.0x" in lines
    )
    assert not any("first calls" in line and "over" in line for line in lines)
