"""Routing replay (R3) for transformers MoE models: the training forward routes every token
to the experts the inference engine routed it to.

``with replay_routing(model, experts): model(input_ids)`` makes each sparse MoE block of a
transformers Qwen3-MoE model (``Qwen3MoeSparseMoeBlock``: a ``gate`` router returning
``(router_logits, weights, indices)``, and ``experts`` that take those) use the given
expert ids instead of its own top-k. Other routers (other scoring: sigmoid, biased or
grouped top-k) are refused rather than replayed with the wrong weights. The weights of the chosen experts are still the
router's: its softmax over all experts at those ids, renormalised when the model
renormalises, so gradients reach the router as they do without replay (as slime, verl and
Megatron replay: indices from the rollout, weights from the trainer's logits).

``experts`` is ``[batch, seq, layers, top_k]`` or ``[seq, layers, top_k]`` ids
(``schemas.routing.routing_array`` gives the latter per trace), one row per token of the
forward's input (batch-major, as the blocks flatten it), layers in model order: the MoE
layers (the embedded engine's rows), or every decoder layer (vLLM's and SGLang's, whose
rows of a dense layer are not read). A row
holding ``-1`` (``NO_ROUTING``: a position the engine never fed, such as the last token, or
one without routing) takes the block's own top-k there.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

NO_ROUTING = -1
# routers whose math this module redoes: softmax in float32, top-k, renormalised when
# norm_topk_prob (transformers 5.25)
ROUTERS = frozenset({"Qwen3MoeTopKRouter"})


class RoutingReplayError(ValueError):
    """The model has no MoE blocks, or the routing does not fit it or its input."""


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The routers of ``model``'s sparse MoE blocks, in model order. Raises
    RoutingReplayError for a block whose router is not one of ``ROUTERS``."""
    routers = []
    for name, module in model.named_modules():
        gate, experts = getattr(module, "gate", None), getattr(module, "experts", None)
        if not isinstance(gate, torch.nn.Module) or experts is None:
            continue
        if type(gate).__name__ not in ROUTERS:
            raise RoutingReplayError(
                f"{name}.gate is a {type(gate).__name__}; routing replay knows "
                f"{', '.join(sorted(ROUTERS))}"
            )
        routers.append(gate)
    return routers


def _decoder_layers(model: torch.nn.Module) -> list[bool]:
    """Per decoder layer (``model.layers``), whether it is a sparse MoE one; empty when the
    model keeps no such list."""
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        return []
    return [
        isinstance(getattr(getattr(layer, "mlp", None), "gate", None), torch.nn.Module)
        and hasattr(layer.mlp, "experts")
        for layer in layers
    ]


def _as_tensor(experts) -> torch.Tensor:
    ids = experts if isinstance(experts, torch.Tensor) else torch.as_tensor(experts)
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise RoutingReplayError(f"expert ids must be integers, not {ids.dtype}")
    if ids.dim() == 3:
        ids = ids[None]
    if ids.dim() != 4:
        raise RoutingReplayError(
            f"experts must be [batch, seq, moe_layers, top_k] or [seq, moe_layers, top_k], "
            f"not {tuple(ids.shape)}"
        )
    return ids.long()


@contextmanager
def replay_routing(model: torch.nn.Module, experts) -> Iterator[None]:
    """For the duration, ``model``'s MoE blocks route by ``experts`` (module doc)."""
    routers = moe_routers(model)
    if not routers:
        raise RoutingReplayError(f"{type(model).__name__} has no sparse MoE blocks to replay")
    ids = _as_tensor(experts)
    batch, seq, layers, top_k = ids.shape
    decoder = _decoder_layers(model)
    if layers == len(decoder) != len(routers):  # every decoder layer's row: the MoE ones
        ids = ids[:, :, [i for i, is_moe in enumerate(decoder) if is_moe]]
        layers = len(routers)
    if layers != len(routers):
        raise RoutingReplayError(
            f"routing has {layers} MoE layers; {type(model).__name__} has {len(routers)}"
            + (f" of {len(decoder)} decoder layers" if decoder else "")
        )
    picks = sorted({int(r.top_k) for r in routers})
    if picks != [top_k]:
        raise RoutingReplayError(f"routing picks top {top_k}; the model's routers pick {picks}")
    experts_min = min(int(r.num_experts) for r in routers)
    if ids.numel() and (ids.min() < NO_ROUTING or ids.max() >= experts_min):
        raise RoutingReplayError(f"expert ids must be in [0, {experts_min}) or {NO_ROUTING}")
    rows = ids.reshape(batch * seq, layers, top_k)
    # an instance attribute shadows the class's forward; a replay inside another restores it
    saved = [router.__dict__.get("forward") for router in routers]
    for layer, router in enumerate(routers):
        router.forward = _replaying(router, rows[:, layer])
    try:
        yield
    finally:
        for router, before in zip(routers, saved, strict=True):
            if before is None:
                del router.forward
            else:
                router.forward = before


def _replaying(router: torch.nn.Module, chosen: torch.Tensor):
    own = (chosen < 0).any(dim=-1, keepdim=True)  # rows the engine gave no routing
    chosen = chosen.clamp(min=0)

    def forward(hidden_states: torch.Tensor):
        hidden = hidden_states.reshape(-1, router.weight.shape[1])
        if hidden.shape[0] != chosen.shape[0]:
            raise RoutingReplayError(
                f"routing covers {chosen.shape[0]} tokens; the forward has {hidden.shape[0]}"
            )
        logits = torch.nn.functional.linear(hidden, router.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        picked = chosen.to(logits.device)
        if bool(own.any()):
            _, mine = torch.topk(probs, router.top_k, dim=-1)
            picked = torch.where(own.to(logits.device), mine, picked)
        weights = probs.gather(1, picked)
        if router.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(logits.dtype), picked

    return forward


__all__ = ["NO_ROUTING", "RoutingReplayError", "moe_routers", "replay_routing"]
