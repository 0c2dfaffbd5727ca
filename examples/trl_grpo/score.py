"""The reward (the `command` evaluator runs it in the session's sandbox after the agent):
the fraction of answer.txt's characters that are digits, printed as the last line."""

from pathlib import Path

answer = Path("answer.txt").read_text(encoding="utf-8") if Path("answer.txt").exists() else ""
text = "".join(answer.split())
print(sum(c.isdigit() for c in text) / len(text) if text else 0.0)
