"""Where a replayed model request differs from the recorded one, said readably.

A replay answers call N from the record of call N, so the proxy first checks that the
harness asked the same thing. ``request_diff`` compares two normalized requests
(``capture.normalized_json``: ``{"messages": [...], "tools": [...]}``) as JSON values and
lists the first differences in document order, each with a path such as
``messages[3].content`` and short excerpts around the change. A string change whose
differing text is all dates, clock times, timestamps, UUIDs, hex ids, temporary paths or
durations (``NONDETERMINISM``) is marked as nondeterminism: the harness wrote the same
request on another day, not a different one.

Pure functions, no I/O; a 1 MB request costs a few milliseconds (two orjson parses and a
walk that only descends into the parts that differ).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any, Literal

import msgspec
import orjson

Kind = Literal["changed", "added", "removed", "type"]

EXCERPT_CHARS = 160
# Characters of common text shown before a change, and after it.
CONTEXT_BEFORE = 50
CONTEXT_AFTER = 40

# --- nondeterminism ---------------------------------------------------------------------

_MONTH = (
    r"(?:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?"
    r"|Sep(?:t(?:ember)?)?|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)\.?"
)
_WEEKDAY = r"(?:Mon|Tues?|Wed(?:nes)?|Thu(?:rs?)?|Fri|Sat(?:ur)?|Sun)(?:day)?\.?"
_DAY = r"(?:[12]\d|3[01]|0?[1-9])(?:st|nd|rd|th)?"
_YEAR = r"(?:19|20)\d\d"
_ISO_DATE = r"\d{4}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])"
_TIME = r"(?:[01]?\d|2[0-3]):[0-5]\d(?::[0-5]\d(?:[.,]\d+)?)?"
_ZONE = r"(?:Z|UTC|GMT|[+-](?:[01]\d|2[0-3]):?[0-5]\d)"
_DURATION_UNIT = r"(?:ms|µs|us|ns|s|secs?|seconds?|mins?|minutes?)"

# (name, regex), tried in this order at each position. Every name reads after "a" in
# ``describe`` ("a date"). No capturing groups: the match's group number names it.
NONDETERMINISM: tuple[tuple[str, str], ...] = (
    (
        "UUID",
        r"(?<![0-9A-Fa-f-])[0-9A-Fa-f]{8}(?:-[0-9A-Fa-f]{4}){3}-[0-9A-Fa-f]{12}(?![0-9A-Fa-f])",
    ),
    (
        "datetime",
        # 2026-12-07T14:03:22.5+01:00, 2026-12-07 14:03 UTC; `date` and `ls -l` output:
        # "Mon Dec  7 14:03:22 UTC 2026", "Dec  7 14:03"
        rf"(?<!\d){_ISO_DATE}[T ]{_TIME}(?:\s?{_ZONE})?(?![\d:])"
        rf"|\b(?:{_WEEKDAY},?\s+)?{_MONTH}\s+{_DAY}\s+{_TIME}(?![\d:])"
        rf"(?:(?:\s+[A-Z]{{2,5}})?\s+{_YEAR}\b)?",
    ),
    (
        "date",
        # 2026-12-07, "Mon Dec  7 2026", "December 7, 2026", "7 Dec 2026", "Mon Dec 7",
        # 12/07/2026, 07.12.2026, 2026/12/07
        rf"(?<!\d){_ISO_DATE}(?!\d)"
        rf"|\b(?:{_WEEKDAY},?\s+)?{_MONTH}\s+{_DAY},?\s+{_YEAR}\b"
        rf"|\b(?:{_WEEKDAY},?\s+)?{_DAY}\s+{_MONTH},?\s+{_YEAR}\b"
        rf"|\b{_WEEKDAY},?\s+{_MONTH}\s+{_DAY}\b"
        rf"|(?<![\d./])(?:\d{{1,2}}[/.]\d{{1,2}}[/.]{_YEAR}|{_YEAR}/\d\d/\d\d)(?![\d/])",
    ),
    (
        "temp path",
        # only the random part: /tmp/tmp8x_k2js, mktemp's /tmp/tmp.Xa3bC9dE1f,
        # /tmp/pytest-of-root/pytest-12, macOS's /var/folders/xy/abc123/T
        r"(?<=/)tmp[a-z0-9_]{6,10}(?!\w)|(?<=/)tmp\.[A-Za-z0-9]{6,12}(?!\w)"
        r"|(?<=/)pytest-of-[^/\s]+/pytest-\d+|(?:/private)?/var/folders/[\w-]+/[\w-]+/T(?=/)",
    ),
    # Unix time in s, ms, us or ns, 2001-2033
    ("timestamp", r"(?<![\w.])1\d{9}(?:\d{3}){0,3}(?:\.\d+)?(?!\w|\.\d)"),
    # git SHAs, request ids: a letter and a digit, so neither words nor plain numbers
    (
        "hex id",
        r"(?<![0-9A-Za-z])(?=[0-9A-Fa-f]*[A-Fa-f])(?=[0-9A-Fa-f]*\d)[0-9A-Fa-f]{12,}(?![0-9A-Za-z])",
    ),
    # a git commit at the start of a line (`git log --oneline`, Claude Code's "Recent
    # commits:"), or after "commit": a repository made at a session's start has new ones
    ("git commit", r"(?:^|(?<=\n))[0-9a-f]{7,12}(?= )|\bcommit [0-9a-f]{7,40}\b"),
    # an id its label names, however short: Codex's exec output "Chunk ID: 7032d2"
    ("labelled id", r"\b(?:ID|Id|id)[:=#]\s?[0-9A-Fa-f]{4,}(?![0-9A-Za-z])"),
    (
        "duration",
        # 0m1.234s (time), "in 12s", "took 153 ms", 1.234s, "153ms"; not a bare "5 minutes"
        rf"(?<![\w.])\d+m\d+(?:\.\d+)?s(?!\w)"
        rf"|\b(?:in|took|after|elapsed:?|[Tt]ime:?)\s+\d+(?:\.\d+)?\s?{_DURATION_UNIT}(?!\w)"
        rf"|(?<![\w.])\d+\.\d+\s?{_DURATION_UNIT}(?!\w)"
        rf"|(?<![\w.])\d+\s?(?:ms|µs|us|ns)(?!\w)",
    ),
    # 14:03, 14:03:22.5, 9:05 pm; not a file.py:12:34 position
    ("clock time", rf"(?<![\d:.]){_TIME}(?:\s?[AaPp][Mm]\b)?(?![\d:])"),
)

assert all(re.compile(src).groups == 0 for _, src in NONDETERMINISM)
_NAMES = tuple(name for name, _ in NONDETERMINISM)
_MASK = re.compile("|".join(f"({src})" for _, src in NONDETERMINISM))
# How far before a mismatch masking resumes after a run of equal text, and how far past
# it a search may look: longer than any match but the unbounded hex ids and paths,
# which are searched again without the bound when they reach it.
_MASK_MARGIN = 256


def explain(recorded: str, now: str) -> list[str] | None:
    """The ``NONDETERMINISM`` names whose matches differ, when masking every match makes
    the two strings equal; None when something else differs too.

    Both strings are read in step: equal runs are skipped at C speed (resuming the mask
    a margin before the next mismatch), so a 1 MB tool output with one new timestamp
    costs no 1 MB of regex; a mismatch that no match covers ends the look at once. Only
    a long span of changes that all are nondeterminism is masked whole (about a
    microsecond a character).
    """
    a, b = recorded, now
    i = j = 0
    explained: set[int] = set()
    while True:
        k = _prefix_len(a, i, b, j)
        if i + k == len(a) and j + k == len(b):
            return [_NAMES[n - 1] for n in sorted(explained)]
        if k > _MASK_MARGIN:
            skip = k - _MASK_MARGIN
            i, j, k = i + skip, j + skip, _MASK_MARGIN
        # the mismatch is at a[i + k] / b[j + k]: a match must start at or before it
        ma, mb = _search(a, i, i + k), _search(b, j, j + k)
        if ma is None or mb is None or ma.lastindex != mb.lastindex:
            return None
        if a[i : ma.start()] != b[j : mb.start()]:
            return None
        if ma.group() != mb.group():
            explained.add(ma.lastindex)
        i, j = ma.end(), mb.end()


def _search(s: str, pos: int, last: int) -> re.Match[str] | None:
    """The first mask match from ``pos``, if it starts at or before ``last``."""
    end = min(len(s), last + 1 + _MASK_MARGIN)  # no scan through a long matchless text
    m = _MASK.search(s, pos, end)
    if m is None or m.start() > last:
        return None
    if m.end() > end - 16 and end < len(s):
        m = _MASK.search(s, pos)  # its lookaheads saw a false end of text: look again
    return m


def _prefix_len(a: str, i: int, b: str, j: int) -> int:
    """Length of the common prefix of a[i:] and b[j:]: slices compared in growing
    chunks, then halved, so C compares and no whole string is copied."""
    n = min(len(a) - i, len(b) - j)
    k, step = 0, 32
    while k < n:
        m = min(step, n - k)
        if a[i + k : i + k + m] != b[j + k : j + k + m]:
            lo, hi = k, k + m  # equal up to lo; a mismatch before hi
            while hi - lo > 8:
                mid = (lo + hi) // 2
                if a[i + lo : i + mid] == b[j + lo : j + mid]:
                    lo = mid
                else:
                    hi = mid
            while a[i + lo] == b[j + lo]:
                lo += 1
            return lo
        k += m
        step = min(step * 2, 1 << 16)
    return n


# --- the result -------------------------------------------------------------------------


class Difference(msgspec.Struct, frozen=True):
    path: str  # messages[3].content, tools[0].function.description; "" for the document
    kind: Kind
    recorded: str  # excerpt: the text around the change, or compact JSON; "" when added
    now: str  # "" when removed
    nondeterministic: list[str]  # NONDETERMINISM names explaining a string change

    @property
    def is_nondeterministic(self) -> bool:
        return self.kind == "changed" and bool(self.nondeterministic)

    def describe(self) -> str:
        where = self.path or "the request"
        if self.kind == "added":
            return f"{where}: added {_quote(self.now)}"
        if self.kind == "removed":
            return f"{where}: removed (was {_quote(self.recorded)})"
        text = f"{where}: recorded {_quote(self.recorded)}, now {_quote(self.now)}"
        if self.kind == "type":
            return text + " (another type)"
        if self.nondeterministic:
            return text + " (" + ", ".join(f"a {name}" for name in self.nondeterministic) + ")"
        return text


class RequestDiff(msgspec.Struct, frozen=True):
    differences: list[Difference]  # the first ``limit``, in document order
    more: int = 0  # differences found past ``limit``, not listed
    more_nondeterministic: bool = True  # whether those are all nondeterminism too

    @property
    def only_nondeterministic(self) -> bool:
        return self.more_nondeterministic and all(d.is_nondeterministic for d in self.differences)

    def describe(self) -> str:
        count = len(self.differences) + self.more
        parts = [d.describe() for d in self.differences]
        if self.more:
            parts.append(f"and {self.more} more")
        text = (
            f"The request differs from the recorded one in {count} "
            f"place{'' if count == 1 else 's'}: " + "; ".join(parts) + "."
        )
        if self.only_nondeterministic:
            text += " All of it looks like nondeterminism (dates, times, ids, timings)."
        return text


# --- comparing --------------------------------------------------------------------------


# What a request asks of the sampler, in each protocol's own names (OpenAI chat and
# Responses, Anthropic; Gemini's sit in ``generationConfig``): a replay whose harness
# now samples otherwise diverges at ``sampling.<name>``.
SAMPLING_KEYS = (
    "temperature", "top_p", "top_k", "min_p", "seed", "n", "stop", "stop_sequences",
    "max_tokens", "max_completion_tokens", "max_output_tokens", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "reasoning_effort", "reasoning", "thinking",
    "generationConfig",
)  # fmt: skip


def sampling_of(raw_request: bytes) -> dict[str, Any]:
    """The sampling parameters a raw request body names (absent ones left out)."""
    try:
        body = orjson.loads(raw_request)
    except orjson.JSONDecodeError:
        return {}
    if not isinstance(body, dict):
        return {}
    return {k: body[k] for k in SAMPLING_KEYS if k in body}


def with_sampling(normalized: bytes, raw_request: bytes) -> bytes:
    """The normalized request (messages, tools) with its sampling parameters beside them:
    the document a replay compares."""
    doc = orjson.loads(normalized)
    if isinstance(doc, dict):
        doc["sampling"] = sampling_of(raw_request)
    return orjson.dumps(doc)


def request_diff(recorded: bytes, now: bytes, *, limit: int = 5) -> RequestDiff | None:
    """None when the two normalized requests are equal JSON values (key order and
    whitespace aside; 1 and 1.0 are equal, true and 1 are not)."""
    if recorded == now:
        return None
    a, b = orjson.loads(recorded), orjson.loads(now)
    if _same(a, b):
        return None
    found: list[Difference] = []
    more = 0
    more_nondeterministic = True
    for kind, path, old, new, count in _walk(a, b, ""):
        if len(found) < limit:
            found.append(_difference(kind, path, old, new, count))
            continue
        more += 1
        if more_nondeterministic:  # once one is not, the rest need no look
            more_nondeterministic = (
                kind == "changed" and type(old) is str and bool(explain(old, new))
            )
    return RequestDiff(found, more, more_nondeterministic)


_JSON_TYPES: dict[type, str] = {
    str: "string",
    int: "number",
    float: "number",
    bool: "boolean",
    type(None): "null",
    list: "array",
    dict: "object",
}


def _same(a: Any, b: Any) -> bool:
    # ``a == b`` alone would take true for 1 (bool is an int); this is the JSON equality
    ta = type(a)
    if ta is not type(b):
        return ta in (int, float) and type(b) in (int, float) and a == b
    if ta is dict:
        return len(a) == len(b) and all(k in b and _same(v, b[k]) for k, v in a.items())
    if ta is list:
        return len(a) == len(b) and all(map(_same, a, b))
    return a == b


_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _child(path: str, key: str) -> str:
    if _KEY.fullmatch(key):
        return f"{path}.{key}" if path else key
    return f"{path}[{orjson.dumps(key).decode()}]"


# (kind, path, recorded value, new value, how many list items were added or removed)
Raw = tuple[Kind, str, Any, Any, int]


def _walk(a: Any, b: Any, path: str) -> Iterator[Raw]:
    """The differences of two unequal values, in document order."""
    ta, tb = _JSON_TYPES.get(type(a)), _JSON_TYPES.get(type(b))
    if ta != tb:
        yield ("type", path, a, b, 1)
    elif ta == "object":
        for key, value in a.items():
            if key not in b:
                yield ("removed", _child(path, key), value, None, 1)
            elif not _same(value, b[key]):
                yield from _walk(value, b[key], _child(path, key))
        for key, value in b.items():
            if key not in a:
                yield ("added", _child(path, key), None, value, 1)
    elif ta == "array":
        yield from _walk_list(a, b, path)
    else:
        yield ("changed", path, a, b, 1)


def _walk_list(a: list, b: list, path: str) -> Iterator[Raw]:
    # Equal items at both ends are set aside, so one inserted message reads as one
    # addition, not as every later message changed.
    n = min(len(a), len(b))
    start = 0
    while start < n and _same(a[start], b[start]):
        start += 1
    tail = 0
    while tail < n - start and _same(a[-1 - tail], b[-1 - tail]):
        tail += 1
    end_a, end_b = len(a) - tail, len(b) - tail
    i = start
    while i < end_a and i < end_b:
        if not _same(a[i], b[i]):
            yield from _walk(a[i], b[i], f"{path}[{i}]")
        i += 1
    if i < end_a:
        yield ("removed", f"{path}[{i}]", a[i], None, end_a - i)
    elif i < end_b:
        yield ("added", f"{path}[{i}]", None, b[i], end_b - i)


def _difference(kind: Kind, path: str, old: Any, new: Any, count: int) -> Difference:
    if kind == "changed" and type(old) is str:
        start, end_old, end_new = _changed_region(old, new)
        return Difference(
            path,
            kind,
            _excerpt(old, start, end_old),
            _excerpt(new, start, end_new),
            explain(old, new) or [],
        )
    more = f" (+{count - 1} more)" if count > 1 else ""
    return Difference(
        path,
        kind,
        "" if kind == "added" else _json_excerpt(old, EXCERPT_CHARS - len(more)) + more,
        "" if kind == "removed" else _json_excerpt(new, EXCERPT_CHARS - len(more)) + more,
        [],
    )


def _changed_region(a: str, b: str) -> tuple[int, int, int]:
    """(start, end in a, end in b) of the text between the common prefix and suffix."""
    start = _prefix_len(a, 0, b, 0)
    n = min(len(a), len(b)) - start
    # the suffix: the same search on reversed tails (bounded, so the copy is small)
    tail = 0
    step = 32
    while tail < n:
        m = min(step, n - tail)
        ra, rb = a[len(a) - tail - m : len(a) - tail], b[len(b) - tail - m : len(b) - tail]
        if ra != rb:
            tail += _prefix_len(ra[::-1], 0, rb[::-1], 0)
            break
        tail += m
        step = min(step * 2, 1 << 16)
    return start, len(a) - tail, len(b) - tail


def _excerpt(s: str, start: int, end: int) -> str:
    """The text around ``s[start:end]``, at most EXCERPT_CHARS with its "…" marks."""
    lo = max(0, start - CONTEXT_BEFORE)
    hi = min(len(s), max(end, start) + CONTEXT_AFTER, lo + EXCERPT_CHARS - 2)
    return ("…" if lo else "") + s[lo:hi] + ("…" if hi < len(s) else "")


def _json_excerpt(value: Any, width: int) -> str:
    text = orjson.dumps(value).decode()
    return text if len(text) <= width else text[: width - 1] + "…"


_ESCAPES = str.maketrans({"\n": "\\n", "\r": "\\r", "\t": "\\t"})


def _quote(text: str) -> str:
    return "'" + text.translate(_ESCAPES) + "'"
