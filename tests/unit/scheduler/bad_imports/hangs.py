"""Importing this blocks for a minute."""

import time

time.sleep(60)


class Evaluator:  # never reached
    async def evaluate(self, ctx): ...
