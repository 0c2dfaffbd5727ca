"""Custom builders loaded by ``"module:Class"`` in tests (unit and integration)."""

from __future__ import annotations

import time

from schemas import BuildStats, Trace
from services.builder.strategies.prefix_merging import PrefixMerging


class LastOnly:
    """Keeps only the last completion, as one trace: a minimal third-party builder."""

    def build(self, records, config, outcome):
        last = max(records, key=lambda r: r.seq)
        trace = Trace(
            trace_id=f"{last.session_id}/last",
            prompt_ids=list(last.prompt_ids),
            response_ids=list(last.output_ids),
            loss_mask=[1] * len(last.output_ids),
            response_logprobs=[None] * len(last.output_ids),
        )
        return [trace], BuildStats(completions=len(records), chains=1)


class Slow(PrefixMerging):
    """prefix_merging after ``sleep_seconds``: leaves time to kill a builder mid-build."""

    def build(self, records, config, outcome):
        config = dict(config)
        time.sleep(float(config.pop("sleep_seconds", 0)))
        return super().build(records, config, outcome)


class Broken:
    def build(self, records, config, outcome):
        raise RuntimeError("this builder always fails")


class BadShape:
    def build(self, records, config, outcome):
        return [
            Trace(
                trace_id="x",
                prompt_ids=[1],
                response_ids=[2, 3],
                loss_mask=[1],
                response_logprobs=[None, None],
            )
        ], BuildStats()


class NotABuilder:
    pass
