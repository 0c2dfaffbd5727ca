"""Which line of a failed run's output says why it failed.

A CLI that fails often writes harmless diagnostics to stderr (Claude Code's
``[claude-code:unrecognized_model] ...`` for a model outside its catalog, deprecation
notices) while the real error is on stdout (``API Error: 529 ...``), or the other way
round. So both streams are read: a line that is an error wins over a plain line, and a
plain line over a warning; among equals the last one (usage hints follow the error),
stderr before stdout. A stdout line is an error only if it starts as one (the model's
prose is printed there too).
"""

from __future__ import annotations

import re

MAX_CHARS = 500
_ERROR = re.compile(
    r"error|fatal|panic|traceback|exception|failed|failure|refused|denied"
    r"|unauthori[sz]ed|forbidden|timed out|cannot|unable to",
    re.IGNORECASE,
)
_WARNING = re.compile(r"\bwarn(ing)?s?\b|deprecat|isn't described by", re.IGNORECASE)
# A tagged diagnostic such as "[claude-code:unrecognized_model] {...}": harmless unless
# its tag says error; the JSON after the tag is detail, not the verdict.
_TAG = re.compile(r"^\[([\w.-]+:[\w.-]+)\]")

# On stdout, where an agent CLI also prints the model's own text, a line is an error only
# when it starts as one ("API Error: 529", "TypeError: …", "error: …"): prose that
# mentions an error ("I fixed the error in calc.py") is the model talking, and outranked
# pi's real reason on stderr ("Response was truncated…", issue 38.10).
_LEADS_AS_ERROR = re.compile(
    r"^\W*(\w+\s)?\w*(error|fatal|panic|traceback|exception|failed|failure)\b", re.IGNORECASE
)

ERROR, PLAIN, WARNING = 2, 1, 0


def line_kind(line: str) -> int:
    """ERROR, PLAIN or WARNING."""
    tag = _TAG.match(line)
    if tag:
        return ERROR if _ERROR.search(tag.group(1)) else WARNING
    if _WARNING.search(line):
        return WARNING
    return ERROR if _ERROR.search(line) else PLAIN


def failure_line(stdout: str, stderr: str) -> str:
    """The line of the two streams that best says why the run failed ("" if both are
    empty)."""
    best, best_rank = "", (-1, -1, -1)
    # stderr ranks above stdout on ties, later lines above earlier ones
    for stream_rank, text in ((1, stderr), (0, stdout)):
        lines = [line.strip() for line in text.splitlines()]
        for i, line in enumerate(lines):
            if not line:
                continue
            kind = line_kind(line)
            if kind == ERROR and stream_rank == 0 and not _LEADS_AS_ERROR.match(line):
                kind = PLAIN  # the model's prose on stdout
            rank = (kind, stream_rank, i)
            if rank > best_rank:
                best, best_rank = line, rank
    return best[:MAX_CHARS]
