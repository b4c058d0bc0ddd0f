"""The decoder-only transformer every supported checkpoint maps onto.

`forward(ids [T], kv)` runs T new tokens of one session (at positions `kv.q_pos`) against its cached prefix;
`forward_batch(ids [N], kvs)` runs several sessions' tokens, concatenated, in one pass: every projection, norm
and MoE layer sees all N tokens at once, and only attention runs per session (each over its own pages). All
compute goes through the op layer (`self.ops`), so a kernel backend swap touches no code here. Projections
that read the same input are fused at load time (q|k|v into `qkv_proj`, gate|up into `gate_up_proj`): fewer,
larger matmuls at batch 1.

Gemma 3 runs on the same decoder, switched by config: its (1 + w) norms are folded into plain `x * w` norms at
load time (recipes), its embeddings are scaled inside `embed_tokens`, its layers add sandwich norms, and its
local (sliding-window) and global layers rotate with two RoPE tables: every table is computed once per step
(`StepLayout.ropes`, one entry per `ModelConfig.ropes` kind) and each layer reads its kind's.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from streamserve.models.config import ModelConfig
from streamserve.models.layer_kv import LayerKV
from streamserve.models.ops import TORCH_OPS, Ops
from streamserve.models.quant import exact_top
from streamserve.models.step_layout import LayoutPlanner, Rope, StepLayout


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer, self.cfg = layer, cfg
        h, kvh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.sizes = (h * hd, kvh * hd, kvh * hd)
        self.qkv_proj = nn.Linear(cfg.hidden_size, sum(self.sizes), bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(h * hd, cfg.hidden_size, bias=cfg.o_bias)
        self.scale = cfg.attn_scale
        self.window = cfg.sliding_windows[layer]
        self.rope_kind = cfg.rope_kind(layer)
        # q and k leave qkv_proj side by side and untouched: one RoPE call rotates both (fewer ops per layer)
        self.joint_qk = cfg.qk_norm == "none" and cfg.clip_qkv is None
        if cfg.qk_norm == "per_head":  # Qwen3, Gemma 3: RMSNorm over each head's hd
            self.q_norm = nn.Parameter(torch.ones(hd))
            self.k_norm = nn.Parameter(torch.ones(hd))
        elif cfg.qk_norm == "full":  # OLMoE: RMSNorm over all heads at once
            self.q_norm = nn.Parameter(torch.ones(h * hd))
            self.k_norm = nn.Parameter(torch.ones(kvh * hd))

    def forward(self, x: torch.Tensor, kvs: list[LayerKV], layout: StepLayout, ops: Ops) -> torch.Tensor:
        """x [N, D] (the sessions' tokens, in the order of `kvs`) -> [N, D]."""
        cfg, n = self.cfg, x.shape[0]
        qkv = self.qkv_proj(x)  # [N, (H + 2 KVH) hd]
        if self.joint_qk:  # q and k as views of one [N, H + KVH, hd] block
            h, kvh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
            qk = qkv[:, :(h + kvh) * hd].view(n, h + kvh, hd)
            return self._forward_qk(qk, qk[:, :h], qk[:, h:], qkv[:, (h + kvh) * hd:].view(n, kvh, hd), kvs, layout,
                                    ops)
        q, k, v = qkv.split(self.sizes, dim=-1)  # [N, H*hd], [N, KVH*hd], [N, KVH*hd]
        if cfg.qk_norm == "full":
            q, k = ops.rms_norm(q, self.q_norm, cfg.rms_norm_eps), ops.rms_norm(k, self.k_norm, cfg.rms_norm_eps)
        if cfg.clip_qkv is not None:
            c = cfg.clip_qkv
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        q = q.reshape(n, cfg.num_heads, cfg.head_dim)
        k = k.reshape(n, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(n, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm == "per_head":
            q, k = ops.rms_norm(q, self.q_norm, cfg.rms_norm_eps), ops.rms_norm(k, self.k_norm, cfg.rms_norm_eps)
        return self._forward_qk(None, q, k, v, kvs, layout, ops)

    def _rotate(self, qk: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, rope: Rope, ops: Ops
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, hd], k [T, KVH, hd] rotated by `rope` (one call over `qk` [T, H + KVH, hd] when given)."""
        if qk is None:
            return ops.apply_rope(q, rope.cos, rope.sin), ops.apply_rope(k, rope.cos, rope.sin)
        both = ops.apply_rope(qk, rope.cos, rope.sin)
        return both[:, :self.cfg.num_heads], both[:, self.cfg.num_heads:]

    def _forward_qk(self, qk: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    kvs: list[LayerKV], layout: StepLayout, ops: Ops) -> torch.Tensor:
        """q [N, H, hd], k, v [N, KVH, hd] (q and k views of `qk` [N, H + KVH, hd] when given) -> [N, D]."""
        ropes, st = layout.ropes[self.rope_kind], layout.starts
        joint = ropes.joint
        if joint is not None:  # every session numbers absolute positions: one rotation for all N tokens
            q, k = self._rotate(qk, q, k, joint, ops)
            qk = None  # rotated: the views below must read q and k
        group = kvs[0].layer_group[self.layer]
        if len(kvs) == 1 and layout.blocks is None:  # one session (a CPU decode): its rows are all of them
            return self.o_proj(self._attend(qk, q, k, v, ropes.sessions[0], kvs[0], ops, joint is not None, group))
        pieces: list[torch.Tensor | None] = [None] * len(kvs)
        if layout.blocks is not None:  # one launch for every session of few tokens, absolute and rolling
            assert ops.attention_blocks is not None
            for i in layout.blocked:
                a, b = st[i], st[i + 1]
                if joint is None and not kvs[i].rolling:  # rolling rows are rotated inside the kernel
                    q[a:b], k[a:b] = self._rotate(None if qk is None else qk[a:b], q[a:b], k[a:b],
                                                  ropes.sessions[i], ops)
                paged = kvs[i].update(self.layer, k[a:b], v[a:b])
            inv_freq, scaling = layout.rope_tables[self.rope_kind]
            out = ops.attention_blocks(q, paged.k_pool, paged.v_pool, layout.blocks[group], self.scale, self.window,
                                       inv_freq=inv_freq, rope_scaling=scaling)  # [N, H*hd]: blocked rows set
            if len(layout.blocked) == len(kvs):
                return self.o_proj(out)
            for i in layout.blocked:
                pieces[i] = out[st[i]:st[i + 1]]
        elif layout.batch is not None:
            assert ops.attention_batch is not None
            for i in layout.batched:
                a, b = st[i], st[i + 1]
                if joint is None:  # rolling sessions in the step too: rotate the batched (absolute) ones here
                    q[a:b], k[a:b] = self._rotate(None if qk is None else qk[a:b], q[a:b], k[a:b],
                                                  ropes.sessions[i], ops)
                paged = kvs[i].update(self.layer, k[a:b], v[a:b])
            out = ops.attention_batch(q, paged.k_pool, paged.v_pool, layout.batch[group], self.scale, self.window)
            if len(layout.batched) == len(kvs):  # rows already in token order
                return self.o_proj(out)
            off = 0
            for i in layout.batched:
                pieces[i], off = out[off:off + st[i + 1] - st[i]], off + st[i + 1] - st[i]
        if layout.rolling is not None:
            assert ops.attention_rolling_batch is not None
            for i in layout.rolled:  # keys are cached as they are: the call rotates them by their place
                paged = kvs[i].update(self.layer, k[st[i]:st[i + 1]], v[st[i]:st[i + 1]])
            batch = layout.rolling[self.rope_kind][group]
            assert batch is not None
            out = ops.attention_rolling_batch(q, paged.k_pool, paged.v_pool, batch, self.scale, self.window)
            if len(layout.rolled) == len(kvs):  # rows already in token order
                return self.o_proj(out)
            off = 0
            for i in layout.rolled:
                pieces[i], off = out[off:off + st[i + 1] - st[i]], off + st[i + 1] - st[i]
        for i, kv in enumerate(kvs):
            if pieces[i] is None:
                a, b = st[i], st[i + 1]
                pieces[i] = self._attend(None if qk is None else qk[a:b], q[a:b], k[a:b], v[a:b],
                                         ropes.sessions[i], kv, ops, joint is not None, group)
        return self.o_proj(pieces[0] if len(kvs) == 1 else torch.cat(pieces))  # type: ignore[arg-type]

    def _attend(self, qk: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: Rope,
                kv: LayerKV, ops: Ops, roped: bool, group: int) -> torch.Tensor:
        """One session's T tokens: q [T, H, hd], k/v [T, KVH, hd] (rotated already if `roped`; views of `qk`
        [T, H + KVH, hd] when given) -> [T, H*hd]."""
        pol = kv.policy
        if kv.rolling:  # keys are cached as they are; attention rotates them by their place in the cache
            paged = kv.update(self.layer, k, v)
            rolling = rope.rolling[group] if rope.rolling is not None else None
            assert rolling is not None and pol.window is not None
            out = ops.attention_rolling(q, paged, kv.q_pos, rolling, self.scale, pol.sinks, pol.window,
                                        self.window)
        else:
            if not roped:
                q, k = self._rotate(qk, q, k, rope, ops)
            paged = kv.update(self.layer, k, v)
            out = ops.attention(q, paged, kv.q_pos, self.scale, self.window, pol.sinks, pol.window)
        return out.reshape(q.shape[0], -1)


class DenseMLP(nn.Module):
    """SwiGLU (silu(gate) * up) or, for Gemma 3, GeGLU with the tanh GELU."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.gelu = cfg.activation == "gelu_tanh"

    def forward(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [N, 2I]
        return self.down_proj(ops.gelu_tanh_mul(gate_up) if self.gelu else ops.silu_mul(gate_up))


class SparseMoE(nn.Module):
    """Router + E SwiGLU experts, weights stored fused: gate_up [E, 2I, D], down [E, D, I]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        assert cfg.moe is not None
        m = cfg.moe
        self.top_k, self.normalize = m.top_k, m.normalize_topk
        self.gate = nn.Linear(cfg.hidden_size, m.num_experts, bias=False)
        self.experts_gate_up = nn.Parameter(torch.empty(m.num_experts, 2 * m.intermediate_size, cfg.hidden_size))
        self.experts_down = nn.Parameter(torch.empty(m.num_experts, cfg.hidden_size, m.intermediate_size))
        self.quant: nn.Module | None = None  # quantized experts (models/quantize.py): they replace the two above

    def forward(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:
        weights, ids = ops.moe_route(self.gate(x), self.top_k, self.normalize)  # [T, k] fp32, [T, k]
        if self.quant is not None:
            return self.quant(x, weights, ids)
        return ops.moe_experts(x, weights, ids, self.experts_gate_up, self.experts_down)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.eps, self.sandwich = cfg.rms_norm_eps, cfg.sandwich_norms
        self.input_layernorm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.self_attn = Attention(cfg, layer)
        # pre-norm layers: the norm before the MLP; Gemma 3: the norm of the attention output
        self.post_attention_layernorm = nn.Parameter(torch.ones(cfg.hidden_size))
        if self.sandwich:
            self.pre_feedforward_layernorm = nn.Parameter(torch.ones(cfg.hidden_size))
            self.post_feedforward_layernorm = nn.Parameter(torch.ones(cfg.hidden_size))
        sparse = cfg.moe is not None and cfg.moe.sparse_layers[layer]
        self.mlp: nn.Module = SparseMoE(cfg) if sparse else DenseMLP(cfg)

    def forward(self, x: torch.Tensor, kvs: list[LayerKV], layout: StepLayout, ops: Ops) -> torch.Tensor:
        """x [N, D] -> [N, D]."""
        attn = self.self_attn(ops.rms_norm(x, self.input_layernorm, self.eps), kvs, layout, ops)
        if not self.sandwich:
            h, normed = ops.add_rms_norm(x, attn, self.post_attention_layernorm, self.eps)
            return h + self.mlp(normed, ops)
        # Gemma 3: each branch's output is normed before it joins the residual stream
        h, normed = ops.add_rms_norm(x, ops.rms_norm(attn, self.post_attention_layernorm, self.eps),
                                     self.pre_feedforward_layernorm, self.eps)
        return h + ops.rms_norm(self.mlp(normed, ops), self.post_feedforward_layernorm, self.eps)


@functools.lru_cache(maxsize=16)
def _rounded(value: float, dtype: torch.dtype) -> float:
    """`value` rounded to `dtype` (through fp32, as transformers casts Gemma's embedding scale)."""
    return torch.tensor(value, dtype=torch.float32).to(dtype).item()


class ScaledEmbedding(nn.Embedding):
    """Token embeddings times a constant (Gemma 3: sqrt(hidden_size) rounded to the weights' dtype), applied here
    so that `embed_tokens(ids)` is exactly what the first layer sees: an embedding chunk equal to it gives exactly
    the step of those ids. The lm_head tied to `weight` reads the unscaled table."""

    def __init__(self, vocab: int, dim: int, scale: float) -> None:
        super().__init__(vocab, dim)
        self.scale = scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = super().forward(ids)  # [N, D]
        return x if self.scale == 1.0 else x * _rounded(self.scale, x.dtype)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: Ops = TORCH_OPS) -> None:
        super().__init__()
        self.cfg, self.ops = cfg, ops
        self.embed_tokens = ScaledEmbedding(cfg.vocab_size, cfg.hidden_size, cfg.embed_scale)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        tables = [rope.inv_freq() for rope in cfg.ropes]
        self.rope_scalings = tuple(scaling for _, scaling in tables)  # per RoPE kind: the cos/sin factor
        # [kinds, hd/2] fp32; recomputed by `reset_rope` wherever the model is materialised
        self.register_buffer("rope_inv_freq", torch.stack([f for f, _ in tables]), persistent=False)
        # (RoPE kind, the pool's layer -> group map) -> the layer groups with layers of that kind
        self.planner = LayoutPlanner(self.cfg)  # how each forward's tokens split into sessions

    def reset_rope(self, device: torch.device | str) -> None:
        """Recompute the RoPE tables (fp32) on `device`: a model built on "meta" and materialised with `to_empty`,
        or cast with `.to(dtype)`, holds garbage or rounded tables until this runs."""
        self.rope_inv_freq = torch.stack([rope.inv_freq()[0] for rope in self.cfg.ropes]).to(device)

    @property
    def inv_freq(self) -> torch.Tensor:
        """[hd/2] fp32: the full-attention layers' RoPE table."""
        return self.rope_inv_freq[0]

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, kv: LayerKV, all_logits: bool = False) -> torch.Tensor:
        """ids [T] at positions kv.q_pos -> logits [T, V] if `all_logits` else [V] for the last token (fp32)."""
        logits = self.forward_batch(ids, [kv], None if all_logits else [ids.shape[0] - 1])
        return logits if all_logits else logits[0]

    @torch.inference_mode()
    def forward_batch(self, ids: torch.Tensor, kvs: list[LayerKV],
                      rows: list[int] | torch.Tensor | None = None,
                      embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """ids [N]: the new tokens of each session of `kvs` in turn (session i's at positions kvs[i].q_pos)
        -> logits [R, V] (fp32) of the tokens at `rows` (R indices; a device tensor keeps a captured graph
        free of host copies; None: all N). `embeds` (positions [E] long, vectors [E, D]): input vectors
        that replace the embeddings of those rows of `ids` (embedding chunks: audio, image, state...),
        applied right after `embed_tokens`, so a vector equal to `embed_tokens(id)` gives exactly id's step."""
        ops = self.ops
        x = self.embed_tokens(ids)  # [N, D] (scaled: Gemma 3)
        if embeds is not None:
            x = x.index_copy(0, embeds[0], embeds[1].to(x.dtype))
        layout = self.planner.plan(kvs, x.dtype, self.ops, self.rope_inv_freq, self.rope_scalings)
        for layer in self.layers:
            x = layer(x, kvs, layout, ops)
        if isinstance(rows, torch.Tensor):
            x = x.index_select(0, rows)
        elif rows is not None:
            x = x[rows[0]:rows[0] + 1] if len(rows) == 1 else x[torch.tensor(rows, device=x.device)]
        h = ops.rms_norm(x, self.norm, self.cfg.rms_norm_eps)
        logits = exact_top(self.lm_head, h, self.lm_head(h))  # [R, V] fp32, the top candidates at full resolution
        cap = self.cfg.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
