"""``polar submit``'s exit codes, and the verdict on a waited-for task.

    0  submitted (without --wait), or the task ended with at least one COMPLETED session
    1  refused: the local check, the scheduler or the registry said no; or the task
       file could not be read, or the stack not reached
    2  no answer: no scheduler answered, or --timeout passed before the task ended
    3  the task ended but no session COMPLETED (every one ERROR, TIMEOUT or CANCELLED)

A session that COMPLETED may still have reward 0: that is the evaluator's verdict on
the agent's work, not a failure of the run, so it exits 0.
"""

from __future__ import annotations

from collections import Counter

from schemas import SessionState, TaskResult

OK, REFUSED, NO_ANSWER, NONE_COMPLETED = 0, 1, 2, 3


def verdict(result: TaskResult) -> tuple[int, str | None]:
    """The exit code of a task that ended, and why when it is not 0."""
    if any(s.state == SessionState.COMPLETED for s in result.sessions):
        return OK, None
    states = Counter(str(s.state) for s in result.sessions)
    by_state = ", ".join(f"{n} {state}" for state, n in sorted(states.items()))
    why = f"no session completed ({by_state or 'no sessions'})"
    reasons = Counter(s.reason for s in result.sessions if s.reason)
    if reasons:
        reason, n = reasons.most_common(1)[0]
        why += f"; {'every one' if n == len(result.sessions) else f'{n} of them'}: {reason}"
    return NONE_COMPLETED, why
