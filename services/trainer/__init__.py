"""The trainer: submits tasks, consumes scored groups, takes policy-gradient steps on the
captured tokens and pushes each new checkpoint to the engines (``polar train CONFIG``,
``polar serve trainer``)."""
