"""The reason of a failed run is the line that is the error, from either stream."""

from schemas import Outcome
from services.node.harnesses import default_registry
from services.node.harnesses.failure import ERROR, PLAIN, WARNING, failure_line, line_kind

# What Claude Code printed when the engine behind the proxy had died (issue 13): a
# catalog warning on stderr, the real error on stdout.
CLAUDE_STDERR = (
    "\"m-1\" isn't described by this version's model catalog; assuming a 200k context.\n"
    '[claude-code:unrecognized_model] {"model":"m-1","behavesAs":null,"source":"--model"}\n'
)
CLAUDE_STDOUT = (
    'API Error: 529 {"type":"error","error":{"type":"overloaded_error",'
    '"message":"no healthy worker in http://127.0.0.1:30000"}}\n'
)
CODEX_STDERR = (
    "[2026-11-29T10:01:02Z WARN codex_core::config] unknown key `goals` in config.toml\n"
    "error: unexpected status 502 Bad Gateway: engine unavailable\n"
)
NODE_CRASH = (
    "(node:4121) [DEP0040] DeprecationWarning: The `punycode` module is deprecated.\n"
    "file:///opt/qwen/cli.js:88\n"
    "TypeError: Cannot read properties of undefined (reading 'choices')\n"
    "    at parse (file:///opt/qwen/cli.js:88:14)\n"
    "Node.js v22.11.0\n"
)


def test_the_error_on_stdout_beats_a_warning_on_stderr():
    assert failure_line(CLAUDE_STDOUT, CLAUDE_STDERR).startswith("API Error: 529")


def test_the_claude_code_preset_reports_the_api_error():
    harness = default_registry().create("claude_code")
    outcome, reason = harness.judge(1, CLAUDE_STDOUT, CLAUDE_STDERR)
    assert outcome == Outcome.ERROR
    assert reason.startswith("claude_code exited with code 1: API Error: 529")
    assert "no healthy worker" in reason


def test_a_tagged_diagnostic_and_warnings_are_not_errors():
    assert line_kind("[claude-code:unrecognized_model] {}") == WARNING
    assert line_kind("[claude-code:api_error] 529 overloaded") == ERROR
    assert line_kind("(node:1) DeprecationWarning: punycode") == WARNING
    assert line_kind("WARN: retrying after error") == WARNING
    assert line_kind("Done in 3.2s") == PLAIN


def test_an_error_after_a_warning_in_one_stream():
    assert failure_line("", CODEX_STDERR) == (
        "error: unexpected status 502 Bad Gateway: engine unavailable"
    )


def test_a_stack_trace_gives_its_exception_line_not_its_last_line():
    got = failure_line("", NODE_CRASH)
    assert got == "TypeError: Cannot read properties of undefined (reading 'choices')"


def test_without_an_error_line_stderr_comes_first_then_a_warning_as_last_resort():
    assert failure_line("partial answer\n", "Killed\n") == "Killed"
    assert failure_line("partial answer\n", "") == "partial answer"
    assert failure_line("", "[claude-code:unrecognized_model] {}\n") == (
        "[claude-code:unrecognized_model] {}"
    )
    assert failure_line("", "") == ""


def test_the_line_is_capped():
    assert len(failure_line("error: " + "x" * 2000, "")) == 500


def test_the_shell_harness_reason_carries_the_error_line():
    shell = default_registry().create("shell")
    _, reason = shell.judge(2, "", "sh: 1: nosuchcmd: not found\nerror: build failed\n")
    assert reason == "shell exited with code 2: error: build failed"


def test_the_models_prose_on_stdout_does_not_hide_the_real_reason_on_stderr():
    """pi's reason was model text from stdout over its real stderr line (issue 38.10)."""
    stdout = "I found the error in calc.py and fixed it; the tests failed before.\n"
    stderr = "Response was truncated: the model reached its max_tokens\n"
    assert failure_line(stdout, stderr) == stderr.strip()
    # an error that leads its stdout line still wins over a plain stderr line
    assert failure_line("Error: 401 unauthorized\n", "retrying\n") == "Error: 401 unauthorized"
