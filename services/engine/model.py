"""A plain-torch forward pass for Llama/Qwen2/Qwen3-family causal LMs, with a KV cache.

Reads Hugging Face weight names (``model.layers.N.self_attn.q_proj.weight`` ...) so any small
model directory of these families runs on CPU in float32. One call processes a *ragged
batch*: several sequences, each contributing a chunk of new tokens (a whole prompt, a
prompt tail after a cached prefix, or one decode token). Linear layers run over all tokens
at once; attention runs per sequence against that sequence's own cache, so a sequence's
numbers do not depend on what else is in the batch and no padding or mask is ever shared.

A Qwen3-MoE model (``config.moe``) replaces the MLP of its sparse layers by a softmax
router over SwiGLU experts (top-k, renormalised when ``norm_topk_prob``), as transformers'
Qwen3MoeSparseMoeBlock computes it; every cached forward records the experts each token
was routed to in the sequence's ``KVCache`` (``routed``), so the rows of a reused prefix
come with its keys and values.

A vision model (``config.vision``) also reads images: ``encode_images`` turns pixels into
patch embeddings (``vision.py``) and every entry point takes, per sequence, the
``SequenceImages`` whose rows replace the token embeddings at the images' pad positions.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from services.engine.modelconfig import ModelConfig, ModelLoadError, MoeConfig
from services.engine.vision import SequenceImages, VisionEncoder


class KVCache:
    """Keys and values of one sequence, per layer ([kv_heads, capacity, head_dim] each),
    growing by doubling. An MoE model's cache also holds, per position, the experts its
    forward routed the token to (``routing``: (MoE layers, top_k) ids per position)."""

    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        capacity: int = 64,
        routing: tuple[int, int] | None = None,
    ):
        self.length = 0
        self._k = [torch.empty(kv_heads, capacity, head_dim) for _ in range(layers)]
        self._v = [torch.empty(kv_heads, capacity, head_dim) for _ in range(layers)]
        self._routing = (
            None if routing is None else torch.empty(capacity, *routing, dtype=torch.int32)
        )

    @property
    def capacity(self) -> int:
        return self._k[0].shape[1]

    def reserve(self, total: int) -> None:
        if total <= self.capacity:
            return
        cap, n = max(total, 2 * self.capacity), self.length
        for store in (self._k, self._v):
            for i, old in enumerate(store):
                grown = torch.empty(old.shape[0], cap, old.shape[2])
                grown[:, :n] = old[:, :n]
                store[i] = grown
        if self._routing is not None:
            old = self._routing
            self._routing = torch.empty(cap, *old.shape[1:], dtype=old.dtype)
            self._routing[:n] = old[:n]

    def write(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``/``v`` ([t, kv_heads, head_dim]) after the committed length; return the
        [kv_heads, n, head_dim] views attention reads (contiguous in their last two dims, as
        CPU SDPA's memory-efficient kernel requires)."""
        n, t = self.length, k.shape[0]
        if t == 1:
            self._k[layer][:, n] = k[0]
            self._v[layer][:, n] = v[0]
        else:
            self._k[layer][:, n : n + t] = k.transpose(0, 1)
            self._v[layer][:, n : n + t] = v.transpose(0, 1)
        return self._k[layer][:, : n + t], self._v[layer][:, : n + t]

    def write_routing(self, rows: torch.Tensor) -> None:
        """Store the experts of the positions being computed (after the committed length)."""
        self._routing[self.length : self.length + rows.shape[0]] = rows

    def routed(self) -> torch.Tensor | None:
        """The committed positions' experts [length, MoE layers, top_k] (int32, a view:
        callers must not write to it); None for a dense model."""
        return None if self._routing is None else self._routing[: self.length]

    def commit(self, tokens: int) -> None:
        self.length += tokens

    def truncated_copy(self, length: int) -> KVCache:
        """A new cache holding the first ``length`` positions (prefix-cache reuse)."""
        heads, _, dim = self._k[0].shape
        routing = None if self._routing is None else tuple(self._routing.shape[1:])
        copy = KVCache(len(self._k), heads, dim, capacity=max(64, length + 64), routing=routing)
        for src, dst in ((self._k, copy._k), (self._v, copy._v)):
            for i in range(len(src)):
                dst[i][:, :length] = src[i][:, :length]
        if routing is not None:  # the prefix's rows travel with its keys and values
            copy._routing[:length] = self._routing[:length]
        copy.length = length
        return copy


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, weight.shape, weight, eps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _causal_mask(prefix: int, t: int) -> torch.Tensor:
    # Row i (absolute position prefix + i) may attend to keys 0 .. prefix + i.
    keys = torch.arange(prefix + t)
    return keys[None, :] <= (prefix + torch.arange(t))[:, None]


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, prefix: int) -> torch.Tensor:
    """Pre-scaled q [t, heads, dim] against one sequence's keys and values
    [kv_heads, n, dim]; query heads are grouped over their shared kv head."""
    t, heads, dim = q.shape
    kv_heads = keys.shape[0]
    if t == 1:  # decode: two small matmuls beat SDPA's dispatch cost on CPU
        scores = torch.bmm(q.view(kv_heads, heads // kv_heads, dim), keys.transpose(1, 2))
        return torch.bmm(torch.softmax(scores, dim=-1), values).view(1, heads * dim)
    # 4-D inputs let CPU SDPA take its flash (memory-efficient) kernel, masked or causal.
    mask = None if prefix == 0 else _causal_mask(prefix, t)[None, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        keys[None],
        values[None],
        attn_mask=mask,
        is_causal=mask is None,
        scale=1.0,
        enable_gqa=True,
    )[0]
    return out.transpose(0, 1).reshape(t, heads * dim)


def _batched(x: torch.Tensor, rows: torch.Tensor, b: int, t: int) -> torch.Tensor:
    """Rows of b sequences of length t as [b, heads, t, dim], contiguous like _attend's."""
    return x[rows].view(b, t, x.shape[1], x.shape[2]).transpose(1, 2).contiguous()


def _attend_whole(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[tuple[int, int]]
) -> torch.Tensor:
    """Causal self-attention of whole sequences of a ragged batch (rows of q [n, heads,
    dim], k and v [n, kv_heads, dim]). Sequences of equal length go through one batched
    SDPA call: no padding, so each sequence's numbers are its own."""
    by_length: dict[int, list[tuple[int, int]]] = {}
    for s, e in bounds:
        by_length.setdefault(e - s, []).append((s, e))
    pieces, order = [], []
    for t, spans in by_length.items():
        rows = torch.cat([torch.arange(s, e, device=q.device) for s, e in spans])
        b = len(spans)
        qb, kb, vb = (_batched(x, rows, b, t) for x in (q, k, v))
        out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=1.0, enable_gqa=True)
        pieces.append(out.transpose(1, 2).reshape(b * t, q.shape[1] * q.shape[2]))
        order.append(rows)
    if len(pieces) == 1 and len(bounds) == 1:
        return pieces[0]
    perm = torch.cat(order)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    return torch.cat(pieces)[inverse]


def _attend_masked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bounds: list[tuple[int, int]],
    masks: list[torch.Tensor],
) -> torch.Tensor:
    """Like ``_attend_whole``, but each packed row attends under its own boolean mask
    ([t, t], True where a query may see a key) instead of plain causality."""
    by_length: dict[int, list[int]] = {}
    for g, (s, e) in enumerate(bounds):
        by_length.setdefault(e - s, []).append(g)
    pieces, order = [], []
    for t, members in by_length.items():
        rows = torch.cat([torch.arange(*bounds[g], device=q.device) for g in members])
        b = len(members)
        qb, kb, vb = (_batched(x, rows, b, t) for x in (q, k, v))
        mask = torch.stack([masks[g] for g in members])[:, None]
        out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=1.0, enable_gqa=True)
        pieces.append(out.transpose(1, 2).reshape(b * t, q.shape[1] * q.shape[2]))
        order.append(rows)
    perm = torch.cat(order)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    return torch.cat(pieces)[inverse]


def _pack_shared_prefixes(
    sequences: list[list[int]], starts: list[int], prompt_keys: list[object] | None = None
):
    """Sequences grouped by identical prompt (``seq[:start]``, and ``prompt_keys[j]``: the
    images inside it), each group packed as one
    row: the prompt once, then every member's continuation inputs (``seq[start:-1]``) at
    the positions they have in their own sequence. Returns the packed ids and positions,
    each row's bounds and attention mask (a continuation sees the prompt and its own
    earlier tokens, never another member's), per sequence the packed rows whose
    logits predict its tokens ``seq[start:]``, in input order, and per sequence where it
    lies: (row of its prompt's first token, prompt length, row of its continuation's
    first token, whether it is its group's first member)."""
    groups: dict[tuple, list[int]] = {}
    for j, (seq, start) in enumerate(zip(sequences, starts, strict=True)):
        if not 1 <= start <= len(seq):
            raise ValueError(f"sequence {j}: start {start} outside 1..{len(seq)}")
        extra = prompt_keys[j] if prompt_keys is not None else None
        groups.setdefault((tuple(seq[:start]), extra), []).append(j)
    ids: list[int] = []
    positions: list[int] = []
    bounds, masks = [], []
    predict: list[list[int]] = [[] for _ in sequences]
    origins: list[tuple[int, int, int, bool]] = [(0, 0, 0, True)] * len(sequences)
    for (prompt, _), members in groups.items():
        base, n = len(ids), len(prompt)
        ids += prompt
        positions += range(n)
        segments = []
        for j in members:
            inputs = sequences[j][n:-1] if len(sequences[j]) > n else []
            offset = len(ids) - base
            if len(sequences[j]) > n:
                predict[j] = [base + n - 1, *range(base + offset, base + offset + len(inputs))]
            origins[j] = (base, n, base + offset, j == members[0])
            ids += inputs
            positions += range(n, n + len(inputs))
            segments.append((offset, len(inputs)))
        t = len(ids) - base
        mask = torch.zeros(t, t, dtype=torch.bool)
        mask[:n, :n] = torch.ones(n, n, dtype=torch.bool).tril()
        for offset, m in segments:
            mask[offset : offset + m, :n] = True
            mask[offset : offset + m, offset : offset + m] = torch.ones(
                m, m, dtype=torch.bool
            ).tril()
        bounds.append((base, base + t))
        masks.append(mask)
    return ids, positions, bounds, masks, predict, origins


def _image_rows(
    images: list[SequenceImages | None] | None, placement
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Rows of a ragged batch that take image embeddings, and those embeddings:
    ``placement(j, positions)`` maps sequence ``j``'s absolute positions to (a keep mask,
    the rows of the kept ones)."""
    if not images or all(im is None or not im.positions.numel() for im in images):
        return None
    rows, embeds = [], []
    for j, im in enumerate(images):
        if im is None or not im.positions.numel():
            continue
        keep, at = placement(j, im.positions)
        rows.append(at)
        embeds.append(im.embeds[keep])
    return torch.cat(rows), torch.cat(embeds)


class _Experts:
    """An MoE layer's router and experts, stored transposed for ``mm``: ``router`` [hidden,
    experts], ``gate_up`` [experts, hidden, 2 * inter] (gate | up), ``down`` [experts,
    inter, hidden]. Reads transformers' per-expert names (what ``save_pretrained`` writes)
    or its fused 3-D ``experts.gate_up_proj`` / ``experts.down_proj``."""

    def __init__(self, get, p: str, moe: MoeConfig, hidden: int):
        self.moe = moe
        e, inter = moe.num_experts, moe.intermediate_size
        router = get(f"{p}mlp.gate.weight")
        fused = get(f"{p}mlp.experts.gate_up_proj", optional=True)
        if fused is not None:
            gate_up, down = fused, get(f"{p}mlp.experts.down_proj")  # [e, 2i, h], [e, h, i]
        else:
            names = [f"{p}mlp.experts.{j}." for j in range(e)]
            gate_up = torch.stack(
                [torch.cat([get(n + "gate_proj.weight"), get(n + "up_proj.weight")]) for n in names]
            )
            down = torch.stack([get(n + "down_proj.weight") for n in names])
        want = {
            "router": (e, hidden),
            "gate_up": (e, 2 * inter, hidden),
            "down": (e, hidden, inter),
        }
        for name, tensor in (("router", router), ("gate_up", gate_up), ("down", down)):
            if tuple(tensor.shape) != want[name]:
                raise ModelLoadError(
                    f"{p}mlp: {name} weights have shape {tuple(tensor.shape)}, "
                    f"the config says {want[name]}"
                )
        self.router = router.t().contiguous()
        self.gate_up = gate_up.transpose(1, 2).contiguous()
        self.down = down.transpose(1, 2).contiguous()

    def __call__(self, x: torch.Tensor, routed: list[torch.Tensor] | None) -> torch.Tensor:
        """The sparse block over rows ``x`` [n, hidden]; appends the chosen experts [n,
        top_k] (highest weight first) to ``routed``. Transformers' math: softmax in float32
        over all experts, top-k, optional renormalisation, weighted sum of SwiGLU outputs."""
        moe, inter = self.moe, self.moe.intermediate_size
        probs = torch.softmax(torch.mm(x, self.router), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, moe.top_k, dim=-1)
        if moe.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if routed is not None:
            routed.append(experts)
        # group the (token, slot) pairs by expert: one sort, one host sync, one mm pair each
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=moe.num_experts).tolist()
        rows = order // moe.top_k
        inputs = x[rows]
        scales = weights.flatten()[order, None].to(x.dtype)
        out = torch.zeros_like(x)
        start = 0
        for e, count in enumerate(counts):
            if not count:
                continue
            end = start + count
            gate_up = torch.mm(inputs[start:end], self.gate_up[e])
            y = torch.mm(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], self.down[e])
            out.index_add_(0, rows[start:end], y * scales[start:end])
            start = end
        return out


class _Layer:
    """One decoder layer's weights, fused for few large ops: q|k|v and gate|up are single
    matrices, all stored transposed for ``addmm``. An MoE layer has ``experts`` instead of
    gate|up and down."""

    def __init__(self, get, p: str, config: ModelConfig, moe: MoeConfig | None = None):
        names = ("q", "k", "v")
        weights = [get(f"{p}self_attn.{n}_proj.weight") for n in names]
        biases = [get(f"{p}self_attn.{n}_proj.bias", optional=True) for n in names]
        self.qkv = torch.cat(weights, dim=0).t().contiguous()
        self.qkv_bias = None if biases[0] is None else torch.cat(biases)
        self.o = get(f"{p}self_attn.o_proj.weight").t().contiguous()
        self.o_bias = get(f"{p}self_attn.o_proj.bias", optional=True)
        self.q_norm = get(f"{p}self_attn.q_norm.weight", optional=True)
        self.k_norm = get(f"{p}self_attn.k_norm.weight", optional=True)
        self.ln1 = get(f"{p}input_layernorm.weight")
        self.ln2 = get(f"{p}post_attention_layernorm.weight")
        self.experts = None if moe is None else _Experts(get, p, moe, config.hidden_size)
        if moe is not None:
            return
        gate, up = get(f"{p}mlp.gate_proj.weight"), get(f"{p}mlp.up_proj.weight")
        self.gate_up = torch.cat([gate, up], dim=0).t().contiguous()
        self.down = get(f"{p}mlp.down_proj.weight").t().contiguous()
        self.inter = gate.shape[0]


Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _bounds(lengths: list[int]) -> list[tuple[int, int]]:
    """(start, end) rows of each sequence in a ragged batch."""
    out, start = [], 0
    for t in lengths:
        out.append((start, start + t))
        start += t
    return out


def _project(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.mm(x, weight_t) if bias is None else torch.addmm(bias, x, weight_t)


class CausalLM:
    """Weights + forward. ``tensors`` maps HF names to tensors (converted to float32)."""

    def __init__(self, config: ModelConfig, tensors: dict[str, torch.Tensor]):
        self.config = config

        def get(name: str, optional: bool = False) -> torch.Tensor | None:
            if name not in tensors:
                if optional:
                    return None
                raise ModelLoadError(f"weights are missing {name}")
            return tensors[name].float()

        self.embed = get("model.embed_tokens.weight")
        self.norm = get("model.norm.weight")
        head = None if config.tie_word_embeddings else get("lm_head.weight", optional=True)
        self.lm_head_t = (self.embed if head is None else head).t().contiguous()
        sparse = set(config.moe.layers) if config.moe is not None else set()
        self.layers = [
            _Layer(get, f"model.layers.{i}.", config, config.moe if i in sparse else None)
            for i in range(config.num_hidden_layers)
        ]
        half = torch.arange(0, config.head_dim, 2, dtype=torch.int64).float() / config.head_dim
        self.inv_freq = (1.0 / (config.rope_theta**half)).to(self.embed.device)
        self.scale = config.head_dim**-0.5
        self.vision = VisionEncoder(config.vision, get) if config.vision is not None else None

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """Preprocessed images [n, 3, S, S] -> patch embeddings [n, tokens, hidden]."""
        if self.vision is None:
            raise ValueError("this model has no image encoder (no vision_config)")
        return self.vision(pixels.to(self.embed.device))

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos()[:, None, :], emb.sin()[:, None, :]

    def _attention(self, i: int, h: torch.Tensor, rope, attend: Attend) -> torch.Tensor:
        c, layer = self.config, self.layers[i]
        n, heads, kv_heads, dim = (
            h.shape[0],
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
        )
        qkv = _project(h, layer.qkv, layer.qkv_bias).view(n, heads + 2 * kv_heads, dim)
        q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
        if layer.q_norm is not None:
            q = _rms_norm(q, layer.q_norm, c.rms_norm_eps)
            k = _rms_norm(k, layer.k_norm, c.rms_norm_eps)
        cos, sin = rope
        q = (q * cos + _rotate_half(q) * sin) * self.scale
        k = k * cos + _rotate_half(k) * sin
        return _project(attend(i, q, k, v), layer.o, layer.o_bias)

    def _hidden(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        attend: Attend,
        images: tuple[torch.Tensor, torch.Tensor] | None = None,
        routed: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The decoder stack over a ragged batch's tokens (one row each); ``attend`` is how
        each sequence's queries meet its keys (through a KV cache, or its own tokens);
        ``images`` (rows, embeddings) replace those rows' token embeddings; ``routed``
        receives each MoE layer's chosen experts [rows, top_k], in layer order."""
        eps = self.config.rms_norm_eps
        x = F.embedding(ids, self.embed)
        if images is not None:
            rows, embeds = images
            x = x.index_put((rows.to(x.device),), embeds.to(x.device))
        rope = self._rope(positions)
        for i, layer in enumerate(self.layers):
            x = x + self._attention(i, _rms_norm(x, layer.ln1, eps), rope, attend)
            if layer.experts is not None:
                x = x + layer.experts(_rms_norm(x, layer.ln2, eps), routed)
                continue
            gate_up = torch.mm(_rms_norm(x, layer.ln2, eps), layer.gate_up)
            x = x + torch.mm(
                F.silu(gate_up[:, : layer.inter]) * gate_up[:, layer.inter :], layer.down
            )
        return x

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return torch.mm(_rms_norm(x, self.norm, self.config.rms_norm_eps), self.lm_head_t)

    @torch.inference_mode()
    def forward(
        self,
        token_chunks: list[list[int]],
        caches: list[KVCache],
        all_logits: bool = False,
        images: list[SequenceImages | None] | None = None,
    ) -> list[torch.Tensor]:
        """Run each sequence's new tokens through the model, extending its cache; a
        sequence's ``images`` whose positions fall in this chunk are put in place.

        Returns, per sequence, the logits of its last new token ([vocab]), or of every new
        token ([t, vocab]) when ``all_logits``. Caches are committed on return, an MoE
        model's with the experts each new token was routed to.
        """
        bounds = _bounds([len(t) for t in token_chunks])
        pairs = list(zip(caches, [e - s for s, e in bounds], strict=True))
        positions = torch.cat([torch.arange(cache.length, cache.length + t) for cache, t in pairs])
        for cache, t in pairs:
            cache.reserve(cache.length + t)
        ids = torch.tensor([tok for chunk in token_chunks for tok in chunk], dtype=torch.long)

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            outs = []
            for (start, end), cache in zip(bounds, caches, strict=True):
                keys, values = cache.write(i, k[start:end], v[start:end])
                outs.append(_attend(q[start:end], keys, values, cache.length))
            return torch.cat(outs, dim=0) if len(outs) > 1 else outs[0]

        def in_chunk(j: int, at: torch.Tensor):
            done, (start, end) = caches[j].length, bounds[j]
            keep = (at >= done) & (at < done + end - start)
            return keep, start + at[keep] - done

        routed: list[torch.Tensor] | None = [] if self.config.moe is not None else None
        x = self._hidden(ids, positions, attend, _image_rows(images, in_chunk), routed)
        if routed:
            rows = torch.stack(routed, dim=1).to(torch.int32)  # [tokens, MoE layers, top_k]
            for (start, end), cache in zip(bounds, caches, strict=True):
                cache.write_routing(rows[start:end])
        for cache, t in pairs:
            cache.commit(t)
        if not all_logits:
            x = x[[end - 1 for _, end in bounds]]
        logits = self._logits(x)
        if all_logits:
            return [logits[s:e] for s, e in bounds]
        return list(logits.unbind(0))

    def sequence_logprobs(
        self,
        sequences: list[list[int]],
        starts: list[int],
        images: list[SequenceImages | None] | None = None,
    ) -> list[torch.Tensor]:
        """log p(seq[j] | seq[:j]) for j >= start ([len - start]) of whole sequences, each
        from position 0, with no cache and no in-place writes: autograd runs through it when
        the weights require grad. The trainer's forward: the math the engine samples with."""
        bounds = _bounds([len(s) for s in sequences])
        device = self.embed.device
        positions = torch.cat([torch.arange(len(s), device=device) for s in sequences])
        ids = torch.tensor([t for s in sequences for t in s], dtype=torch.long, device=device)

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return _attend_whole(q, k, v, bounds)

        def whole(j: int, at: torch.Tensor):
            return torch.ones_like(at, dtype=torch.bool), bounds[j][0] + at

        x = self._hidden(ids, positions, attend, _image_rows(images, whole))
        rows = [
            torch.arange(s + start - 1, e - 1) for (s, e), start in zip(bounds, starts, strict=True)
        ]
        logprobs = torch.log_softmax(self._logits(x[torch.cat(rows).to(device)]), dim=-1)
        targets = torch.tensor(
            [t for seq, start in zip(sequences, starts, strict=True) for t in seq[start:]],
            dtype=torch.long,
            device=device,
        )
        picked = logprobs.gather(1, targets[:, None])[:, 0]
        return list(
            picked.split([e - s - start for (s, e), start in zip(bounds, starts, strict=True)])
        )

    def shared_prefix_logprobs(
        self,
        sequences: list[list[int]],
        starts: list[int],
        images: list[SequenceImages | None] | None = None,
    ) -> list[torch.Tensor]:
        """``sequence_logprobs``, with sequences that share their prompt (``seq[:start]``,
        e.g. a GRPO group's samples of one question) packed so the prompt goes through the
        model once: each continuation attends to the prompt and to itself, at its own
        positions, so its numbers are the ones its own sequence gives (to float rounding).
        Autograd runs through it like through ``sequence_logprobs``; prompts share a row
        only when the images inside them are the same."""
        device = self.embed.device
        keys = None
        if images is not None:
            keys = [im.before(s) if im else () for im, s in zip(images, starts, strict=True)]
        ids, positions, bounds, masks, predict, origins = _pack_shared_prefixes(
            sequences, starts, keys
        )
        masks = [m.to(device) for m in masks]

        def packed(j: int, at: torch.Tensor):
            # a prompt's images are placed once per group, continuations' by each member
            base, n, rest, first = origins[j]
            keep = torch.where(at < n, first, at < len(sequences[j]) - 1)
            at = at[keep]
            return keep, torch.where(at < n, base + at, rest + at - n)

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return _attend_masked(q, k, v, bounds, masks)

        x = self._hidden(
            torch.tensor(ids, dtype=torch.long, device=device),
            torch.tensor(positions, device=device),
            attend,
            _image_rows(images, packed),
        )
        rows = torch.tensor([r for p in predict for r in p], dtype=torch.long, device=device)
        logprobs = torch.log_softmax(self._logits(x[rows]), dim=-1)
        targets = torch.tensor(
            [t for seq, start in zip(sequences, starts, strict=True) for t in seq[start:]],
            dtype=torch.long,
            device=device,
        )
        picked = logprobs.gather(1, targets[:, None])[:, 0]
        return list(picked.split([len(p) for p in predict]))

    def new_cache(self) -> KVCache:
        c = self.config
        routing = None if c.moe is None else (len(c.moe.layers), c.moe.top_k)
        return KVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, routing=routing)

    def teacher_forced_logprobs(
        self, ids: list[int], start: int, images: SequenceImages | None = None
    ) -> list[float]:
        """log p(ids[j] | ids[:j]) for j >= start, from one uncached full-sequence pass."""
        logits = self.forward([ids], [self.new_cache()], all_logits=True, images=[images])[0]
        logprobs = torch.log_softmax(logits, dim=-1)
        targets = torch.tensor(ids[start:])
        return logprobs[start - 1 : len(ids) - 1].gather(1, targets[:, None])[:, 0].tolist()
