"""Importing this kills the importing process (as a segfault or ``os.abort`` would)."""

import os
import signal

os.kill(os.getpid(), signal.SIGKILL)


class Evaluator:  # never reached
    async def evaluate(self, ctx): ...
