"""The task's evaluator program: the ``command`` evaluator runs it in the session's
sandbox after the agent and takes the last line it prints as the reward.

The reward: the fraction of the answer's letters that are capitals (0 with no letters).
A random model says anything; GRPO pushes it towards shouting.
"""

from pathlib import Path

answer = Path("answer.txt").read_text(encoding="utf-8") if Path("answer.txt").exists() else ""
letters = [c for c in answer if c.isalpha()]
print(sum(c.isupper() for c in letters) / len(letters) if letters else 0.0)
