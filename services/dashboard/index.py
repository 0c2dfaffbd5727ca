"""The dashboard's in-memory index of sessions: what filtering and paging run on.

Redis keeps sessions by id and per task, with no index by state, reward, reason or
harness, and the dashboard never writes there; so it keeps one row per session in
memory (~300 bytes each: 10,000 sessions are a few MB), loaded from the registry at
start and kept current from the session events. Pure: no I/O, no clock of its own.
"""

from __future__ import annotations

import re
from collections import Counter, deque
from collections.abc import Iterable, Mapping

import msgspec

from schemas import Session, SessionState, SessionStateChanged
from schemas.session import TERMINAL_STATES

STATES = [s.value for s in SessionState]
MAX_LIMIT = 200  # rows one page may ask for
SORTS = ("task", "updated", "reward")


class BadQuery(ValueError):
    """A filter or page the caller got wrong: answered 400 with this message."""


class SessionRow(msgspec.Struct, kw_only=True):
    session_id: str
    task_id: str
    index: int = 0
    state: str = SessionState.REGISTERED.value
    version: int = 0
    attempt: int = 0
    node: str | None = None
    harness: str | None = None
    reward: float | None = None
    outcome: str | None = None
    reason: str | None = None
    eval_status: str | None = None
    eval_reason: str | None = None
    created_at: float = 0.0
    updated_at: float = 0.0
    entered: dict[str, float] = {}  # state -> when the session (last) entered it
    # what the harness left (its SessionFinished artifacts, while the dashboard has them):
    # the run's exit code and the last lines of its stderr, shown beside a failure's reason
    exit_code: int | None = None
    stderr: str | None = None
    # the registry's record of this version was read: its reward and reasons are here (an
    # event moves the state first; what the final transition wrote follows on the re-read)
    synced: bool = False


class Filters(msgspec.Struct, frozen=True, kw_only=True):
    task: str | None = None
    states: frozenset[str] = frozenset()
    reward_min: float | None = None
    reward_max: float | None = None
    reason: str | None = None  # substring of reason or eval_reason, any case
    harness: str | None = None

    def match(self, r: SessionRow) -> bool:
        if self.task is not None and r.task_id != self.task:
            return False
        if self.states and r.state not in self.states:
            return False
        if self.harness is not None and r.harness != self.harness:
            return False
        if self.reward_min is not None and (r.reward is None or r.reward < self.reward_min):
            return False
        if self.reward_max is not None and (r.reward is None or r.reward > self.reward_max):
            return False
        if self.reason is not None:
            text = f"{r.reason or ''}\n{r.eval_reason or ''}".lower()
            if self.reason.lower() not in text:
                return False
        return True


class Page(msgspec.Struct, kw_only=True):
    total: int  # rows matching the filters
    offset: int
    limit: int
    rows: list[SessionRow]


def _float(q: Mapping[str, str], key: str) -> float | None:
    raw = q.get(key)
    if raw in (None, ""):
        return None
    try:
        return float(raw)
    except ValueError:
        raise BadQuery(f"{key} must be a number, got {raw!r}") from None


def _int(q: Mapping[str, str], key: str, default: int, lo: int, hi: int) -> int:
    raw = q.get(key)
    if raw in (None, ""):
        return default
    try:
        value = int(raw)
    except ValueError:
        raise BadQuery(f"{key} must be an integer, got {raw!r}") from None
    if not lo <= value <= hi:
        raise BadQuery(f"{key} must be between {lo} and {hi}, got {value}")
    return value


def parse_query(q: Mapping[str, str]) -> tuple[Filters, int, int, str]:
    """(filters, offset, limit, sort) from a request's query string."""
    states = frozenset(s.strip().upper() for s in (q.get("state") or "").split(",") if s.strip())
    unknown = sorted(states - set(STATES))
    if unknown:
        raise BadQuery(f"unknown state(s) {unknown}; known: {STATES}")
    sort = q.get("sort") or "task"
    if sort not in SORTS:
        raise BadQuery(f"sort must be one of {list(SORTS)}, got {sort!r}")
    filters = Filters(
        task=q.get("task") or None,
        states=states,
        reward_min=_float(q, "reward_min"),
        reward_max=_float(q, "reward_max"),
        reason=q.get("reason") or None,
        harness=q.get("harness") or None,
    )
    offset = _int(q, "offset", 0, 0, 10**9)
    limit = _int(q, "limit", 50, 1, MAX_LIMIT)
    return filters, offset, limit, sort


def row_of(session: Session, harness: str | None) -> SessionRow:
    return SessionRow(
        session_id=session.session_id,
        task_id=session.task_id,
        index=session.index,
        state=session.state.value,
        version=session.version,
        attempt=session.attempt,
        node=session.node,
        harness=harness,
        reward=session.reward,
        outcome=session.outcome.value if session.outcome else None,
        reason=session.reason,
        eval_status=session.eval_status,
        eval_reason=session.eval_reason,
        created_at=session.created_at,
        updated_at=session.updated_at,
    )


class SessionIndex:
    def __init__(self, window_seconds: float = 60.0) -> None:
        self.rows: dict[str, SessionRow] = {}
        self.tasks: dict[str, list[str]] = {}  # task -> its session ids, in index order
        self.harness: dict[str, str | None] = {}  # task -> its agent's harness
        self.submitted: dict[str, float] = {}  # task -> when it was registered
        self.version = 0  # bumped by every change: what live updates watch
        self.window = window_seconds
        self._ended: deque[float] = deque()  # when sessions reached a terminal state

    # -- writes (from the registry and the events) -------------------------------------
    def add_task(self, task_id: str, harness: str | None, submitted_at: float) -> None:
        self.harness[task_id] = harness
        self.submitted.setdefault(task_id, submitted_at)
        self.tasks.setdefault(task_id, [])

    def put(self, session: Session) -> None:
        """The registry's record of a session (its reward, reasons, node) wins over what
        the events said; entry times are kept."""
        old = self.rows.get(session.session_id)
        if old is not None and old.version > session.version:
            return  # an older read than what the events already told
        row = row_of(session, self.harness.get(session.task_id))
        if old is not None:
            row.entered, row.exit_code, row.stderr = old.entered, old.exit_code, old.stderr
        row.synced = True
        if old is None:
            ids = self.tasks.setdefault(session.task_id, [])
            ids.append(session.session_id)
            ids.sort()
        self.rows[session.session_id] = row
        self.version += 1

    def apply(self, ev: SessionStateChanged) -> bool:
        """A state change seen on the bus; False for one already applied or older."""
        row = self.rows.get(ev.session_id)
        if row is None:
            row = SessionRow(session_id=ev.session_id, task_id=ev.task_id)
            self.rows[ev.session_id] = row
            ids = self.tasks.setdefault(ev.task_id, [])
            ids.append(ev.session_id)
            ids.sort()
            row.harness = self.harness.get(ev.task_id)
        state = ev.to_state.value
        if row.entered.get(state) != ev.ts:
            row.entered = {**row.entered, state: ev.ts}
            self.version += 1  # a replayed event still fills the timeline
        if ev.version <= row.version:
            return False
        was_terminal = row.state in TERMINAL_STATES
        row.state, row.version, row.updated_at = state, ev.version, ev.ts
        row.synced = False
        if ev.node:
            row.node = ev.node
        if ev.reason:
            row.reason = ev.reason
        if ev.to_state in TERMINAL_STATES and not was_terminal:
            self._ended.append(ev.ts)
        self.version += 1
        return True

    def note_run(self, session_id: str, exit_code: int | None, stderr: str | None) -> None:
        """What the harness's run left (its artifacts): exit code and stderr's last lines
        (``last_lines(plain(...))``), shown beside a failure's reason."""
        row = self.rows.get(session_id)
        if row is None or (row.exit_code, row.stderr) == (exit_code, stderr):
            return
        row.exit_code, row.stderr = exit_code, stderr
        self.version += 1

    # -- reads --------------------------------------------------------------------------
    def query(self, filters: Filters, offset: int = 0, limit: int = 50, sort: str = "task") -> Page:
        ids: Iterable[str] = self.rows if filters.task is None else self.tasks.get(filters.task, [])
        hits = [r for sid in ids if (r := self.rows.get(sid)) and filters.match(r)]
        if sort == "updated":
            hits.sort(key=lambda r: -r.updated_at)
        elif sort == "reward":
            hits.sort(key=lambda r: (r.reward is None, -(r.reward or 0.0)))
        elif filters.task is None:
            hits.sort(key=lambda r: (r.task_id, r.index))
        return Page(total=len(hits), offset=offset, limit=limit, rows=hits[offset : offset + limit])

    def task_rows(self, task_id: str) -> list[SessionRow]:
        return [self.rows[s] for s in self.tasks.get(task_id, []) if s in self.rows]

    def state_counts(self) -> dict[str, int]:
        return dict(Counter(r.state for r in self.rows.values()))

    def sessions_per_second(self, now: float) -> float:
        while self._ended and self._ended[0] < now - self.window:
            self._ended.popleft()
        return len(self._ended) / self.window

    def errors_by_reason(self, top: int = 10) -> list[tuple[str, int]]:
        """Why sessions that did not complete ended (and zero rewards' why), most first."""
        c: Counter[str] = Counter()
        for r in self.rows.values():
            if r.state in ("ERROR", "TIMEOUT", "CANCELLED"):
                c[f"{r.state}: {first_line(r.reason or r.eval_reason or 'no reason given')}"] += 1
            elif r.eval_status == "error":
                c[f"eval error: {first_line(r.eval_reason or 'no reason given')}"] += 1
        return c.most_common(top)


FAILED = frozenset({"ERROR", "TIMEOUT", "CANCELLED"})
ENDED = FAILED | {"COMPLETED"}


def cause(row: SessionRow) -> str:
    """Why a session ended as it did, as the lists show it. A run that failed, timed out
    or was cancelled: the run's own reason (the harness's exit code and error line, the
    deadline, the cancel), since its evaluator's "reward 0 by rule" says nothing of why;
    with the harness's exit code and stderr when the reason does not already hold them.
    An evaluated run: the evaluator's reason."""
    if row.state in FAILED:
        why = row.reason or row.eval_reason or ""
        extra = []
        if row.exit_code is not None and f"code {row.exit_code}" not in why:
            extra.append(f"exit code {row.exit_code}")
        if row.stderr and row.stderr.splitlines()[-1].strip() not in why:
            extra.append(f"stderr: {row.stderr.splitlines()[-1].strip()}")
        return " · ".join([why, *extra]) if why else " · ".join(extra)
    return row.eval_reason or row.reason or ""


# ANSI escapes a harness's terminal output carries: CSI (colours, cursor), OSC (titles,
# links), and the two-byte ones; none means anything on a page
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]")


def plain(text: str) -> str:
    """``text`` as a terminal would have left it: escapes dropped, and a line a progress
    bar rewrote (carriage returns) shown as it ended."""
    text = _ANSI.sub("", text)
    if "\r" not in text:
        return text
    lines = text.replace("\r\n", "\n").split("\n")
    return "\n".join(line.rstrip("\r").rsplit("\r", 1)[-1] for line in lines)


def last_lines(text: str, n: int = 3, width: int = 400) -> str:
    """The last ``n`` non-blank lines of ``text``, at most ``width`` characters."""
    lines = [line.rstrip() for line in text.splitlines() if line.strip()][-n:]
    out = "\n".join(lines)
    return out if len(out) <= width else "…" + out[-(width - 1) :]


def first_line(text: str, width: int = 120) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= width else line[: width - 1] + "…"
