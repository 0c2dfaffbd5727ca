"""prefix_merging: chain completions in time order into as few traces as possible.

A completion joins the open chain whose tokens (latest prompt + output) are a prefix of
its prompt, the longest such chain winning; otherwise it starts a chain with a reason and
a lineage (see ``breaks``). Side calls always get their own chain. Loss mask is 1 exactly
on sampled tokens.

End of turn: ``eot_token_id`` from the config, else the most common last output token of
turns the model ended itself (``stop``/``tool_calls``). A turn without its eot (``length``,
or a ``stop`` whose eot the engine did not return) is closed by the eot the next prompt
adds: that token is glue (mask 0), never attributed to the model, since the model was
never reported as sampling it. Such turns are listed in the notes.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from msgspec import Struct

from schemas import BuildStats, CompletionRecord, Outcome, Trace
from services.builder.strategies.base import Call, detect_eot, full_calls, parse_config, stats_of
from services.builder.strategies.breaks import classify, lineage_of, parent_of, settle
from services.builder.strategies.chains import Chain


class PrefixMergingConfig(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    eot_token_id: int | None = None


def assemble(calls: list[Call], eot: int | None) -> list[Chain]:
    chains: list[Chain] = []
    last_main: Chain | None = None
    for call in calls:
        if call.rec.side_call is None:
            joinable = [c for c in chains if c.takes(call)]
            if joinable:
                target = max(joinable, key=lambda c: len(c.tokens))
                target.append(call, eot)
                last_main = target
                continue
        parent = parent_of(call, chains)
        reason = classify(call, parent, last_main, eot)
        chain = Chain.start(len(chains), call, reason, lineage_of(call, parent, reason, eot))
        chains.append(chain)
        if call.rec.side_call is None:
            last_main = chain
    settle(chains, eot)
    return chains


def notes_of(chains: list[Chain], calls: list[Call], eot: int | None, source: str) -> dict:
    glue_closed = [seq for ch in chains for seq, _ in ch.glue_closed]
    by_reason = Counter(reason for ch in chains for _, reason in ch.glue_closed)
    drift = {str(c.seq): c.rec.drift_reason for c in calls if c.rec.drift_reason}
    retagged = {str(ch.first.seq): ch.retagged_from for ch in chains if ch.retagged_from}
    notes: dict[str, Any] = {"eot_token_id": eot, "eot_source": source}
    if retagged:  # seq -> the reason the chain had before the builder recognised it
        notes["retagged_chains"] = retagged
    if glue_closed:
        notes["turns_closed_by_glue"] = glue_closed
        notes["turns_closed_by_glue_by_finish"] = dict(by_reason)
    if drift:
        notes["drift_reasons"] = drift
    return notes


class PrefixMerging:
    name = "prefix_merging"

    def build(
        self, records: list[CompletionRecord], config: dict[str, Any], outcome: Outcome
    ) -> tuple[list[Trace], BuildStats, dict[str, Any]]:
        cfg = parse_config(config, PrefixMergingConfig, self.name)
        calls = full_calls(records).calls
        eot, source = cfg.eot_token_id, "config"
        if eot is None:
            eot = detect_eot(calls)
            source = "detected" if eot is not None else "unknown"
        chains = assemble(calls, eot)
        session_id = calls[0].rec.session_id if calls else ""
        by_seq = {c.seq: c for c in calls}
        traces = [ch.to_trace(session_id, by_seq) for ch in chains]
        breaks = dict(Counter(ch.reason for ch in chains))
        return traces, stats_of(calls, traces, breaks), notes_of(chains, calls, eot, source)
