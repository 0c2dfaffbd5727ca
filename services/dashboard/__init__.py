"""``polar dashboard``: tasks, sessions, model calls, tokens and rewards, live."""
