"""Polar behind trainers people already use (see docs/training.md).

``rollouts``: the Polar side every adapter shares: tasks out, whole groups back, from a
synchronous trainer loop (a background event loop holds the NATS connections).
``trl``: a ``rollout_func`` and a weight-sync callback for TRL's ``GRPOTrainer``.
``slime``: a rollout function for slime's ``--rollout-function-path`` hook.
``verl_agent_loop``: ``PolarAgentLoop``, verl's agent loop, and ``PolarRouter``, its
engine hookup (runs in verl's own venv; ``verl_sessions`` is its verl-free half).
``collate``: traces -> padded tensors with attention and loss masks.

Nothing here is imported by Polar's services; trainers import it.
"""
