"""Evaluator plugins and their registry.

Nothing registers itself at import time: ``default_registry()`` builds the registry of
the built-ins (``session_completed``, ``test_on_output``, ``swebench``, ``command``, ``exact_answer``, ``rubric``, ``harbor``);
a task may also name a custom evaluator as ``"module:Class"`` (a subclass of
``Evaluator``, or any class with ``needs_runtime`` and ``async def evaluate(ctx)``).
"""

from evaluators.base import EvalContext, EvalResult, Evaluator, EvaluatorError
from evaluators.registry import EvaluatorRegistry, create_evaluator, default_registry, run_evaluator

__all__ = [
    "EvalContext",
    "EvalResult",
    "Evaluator",
    "EvaluatorError",
    "EvaluatorRegistry",
    "create_evaluator",
    "default_registry",
    "run_evaluator",
]
