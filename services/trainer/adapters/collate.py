"""Traces -> padded tensors a policy-gradient step consumes.

``collate(traces, pad_id)`` right-pads every trace's ``prompt_ids + response_ids`` to the
longest and gives, per row (all ``[batch, max_len]``):

- ``input_ids``: the tokens, ``pad_id`` after the end;
- ``attention_mask``: 1 on real tokens, 0 on padding;
- ``loss_mask``: 1 exactly on tokens the model sampled (the trace's loss mask, placed
  after its prompt), 0 on the prompt, tool results, template glue and padding;
- ``logprobs``: the engine's logprob of each sampled token at its position, 0.0 elsewhere
  (use it only where ``loss_mask`` is 1);
- ``position_ids``: 0.. per row.

Logprob ``i`` belongs to the token at position ``i``: the model's prediction for it is
read off the logits at ``i - 1`` (shift the logits, not the targets). ``rewards`` (one
per trace, 0.0 where None) comes along when asked. When any trace holds images,
``images`` lists per row its ``Trace.images`` (digest, start, length: the row's
positions, padding being on the right), for a multimodal trainer to put each image's
embeddings there (bytes: ``subjects.image_object(digest)``).

MoE routing (R3), when any trace has it and ``routing`` gives its rows (a dict by object,
``TrajectoryClient.routing``, or a function): ``routed_experts`` ``[batch, max_len,
layers, top_k]`` int64, the expert ids the engine routed the token at each position to
(layers in model order, each position's ids highest router weight first), -1 where a
position has none; ``routing_mask`` ``[batch, max_len]`` 1 where it has them. Position
``i``'s row is what the engine computed feeding token ``i`` (the last token of a trace has
none): replay it there (docs/training.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from schemas import Trace
from schemas.routing import NO_ROUTING, routing_array


def collate(
    traces: Sequence[Trace],
    pad_id: int,
    *,
    with_rewards: bool = False,
    routing: Mapping[str, bytes] | Callable[[str], bytes] | None = None,
) -> dict[str, Any]:
    import torch

    if not traces:
        raise ValueError("collate needs at least one trace")
    width = max(len(t.prompt_ids) + len(t.response_ids) for t in traces)
    shape = (len(traces), width)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    attention = torch.zeros(shape, dtype=torch.long)
    loss_mask = torch.zeros(shape, dtype=torch.float32)
    logprobs = torch.zeros(shape, dtype=torch.float32)
    for row, t in enumerate(traces):
        p, n = len(t.prompt_ids), len(t.response_ids)
        input_ids[row, : p + n] = torch.tensor([*t.prompt_ids, *t.response_ids])
        attention[row, : p + n] = 1
        if n:
            loss_mask[row, p : p + n] = torch.tensor(t.loss_mask, dtype=torch.float32)
            lps = [0.0 if lp is None else lp for lp in t.response_logprobs]
            logprobs[row, p : p + n] = torch.tensor(lps, dtype=torch.float32)
    out: dict[str, Any] = {
        "input_ids": input_ids,
        "attention_mask": attention,
        "loss_mask": loss_mask,
        "logprobs": logprobs,
        "position_ids": torch.arange(width).expand(shape).clone(),
    }
    if any(t.images for t in traces):
        out["images"] = [list(t.images) for t in traces]
    routed = [t for t in traces if t.routing is not None]
    if routed and routing is not None:
        out["routed_experts"], out["routing_mask"] = _routing(traces, width, routing)
    if with_rewards:
        out["rewards"] = torch.tensor([t.reward or 0.0 for t in traces], dtype=torch.float32)
    return out


def _routing(traces: Sequence[Trace], width: int, read) -> tuple[Any, Any]:
    import torch

    shapes = {(t.routing.layers, t.routing.top_k) for t in traces if t.routing is not None}
    if len(shapes) > 1:
        raise ValueError(f"traces of one batch route through different shapes: {sorted(shapes)}")
    [(layers, top_k)] = shapes
    experts = torch.full((len(traces), width, layers, top_k), NO_ROUTING, dtype=torch.long)
    mask = torch.zeros((len(traces), width), dtype=torch.long)
    for row, t in enumerate(traces):
        if t.routing is None:
            continue
        ids, present = routing_array(t.routing, len(t.prompt_ids) + len(t.response_ids), read)
        n = len(present)
        experts[row, :n] = torch.from_numpy(ids).long()
        mask[row, :n] = torch.from_numpy(present).long()
    return experts, mask
