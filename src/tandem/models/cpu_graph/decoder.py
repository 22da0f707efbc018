"""A decoder model's step on the CPU as ggml graphs, node for node as llama.cpp builds it (llama-graph.cpp, the
models/<arch>.cpp files): the embedding lookup, norms, rope, the KV cache stores and the attention over the cache,
the MLP or the routed experts, the output head. The weights are read where they lie (the file mapping, or the
copies ggml repacks), the cache is the state pool's memory, and the program of each step shape is built once and
kept (`StepGraph`).

The values are those of the layer-by-layer path (models/decoder.py), which are llama.cpp's on the bundled Gemma 3:
every op the layers emulate in numpy/torch to round as ggml does is ggml's own op here; the attention reads the
f16 keys where they lie and the values transposed beside them (`CacheCopies`), as llama.cpp's graph without flash
attention does. As in llama.cpp, the last layer computes only the rows whose logits the step returns once its
attention is done.

Shapes in comments are ggml's, ne0 first: D = hidden, T = the step's rows, Hd = head size, H / G = query / KV
heads, N = a sequence's rows, S = the keys it reads, F = the MLP's width, V = vocabulary, B = logit rows.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import ggml
import numpy as np
import torch

from tandem.layers.attention import Attention, query_scaling
from tandem.layers.delta_net import DeltaNetPool, DeltaNetShape, GatedDeltaNet, SplitBetaAlpha
from tandem.layers.ffn import NormedFFN, ParallelFFN, RoutedFFN
from tandem.layers.gated_attention import GatedAttention
from tandem.layers.linear import BiasedLinear, GGMLLinear
from tandem.layers.mlp import GatedMLP
from tandem.layers.moe import MoE, NormedSoftmaxTopKRouter, SoftmaxTopKRouter, TopKSoftmaxRouter
from tandem.layers.shared_expert import MoEWithSharedExpert
from tandem.models.blocks import Block
from tandem.models.cpu_graph.coverage import CACHE_TYPES, GELU_TANH, GLU_OPS
from tandem.models.cpu_graph.ggml_graph import GraphBuilder, GraphProgram, Tensor
from tandem.models.cpu_graph.step import (
    CacheCopies,
    DecodeGroup,
    GroupInputs,
    StepInputs,
    StepKey,
    attention_kinds,
    decode_group,
    layer_windows,
)
from tandem.models.decoder import DecoderModel
from tandem.quant import flash_attention as flash_kernel
from tandem.quant.expert_ffn import ExpertFFN, expert_ffn_nodes
from tandem.quant.ggml_weights import GGMLWeight

__all__ = ["StepProgram", "build_step"]

_ROPE_NEOX = 2  # GGML_ROPE_TYPE_NEOX: tandem's rope rotates the two halves of a head together


@dataclass(eq=False)
class _GroupLeaves:
    """A decode group's inputs as the graph's leaves (GroupInputs)."""

    shape: DecodeGroup
    query_rows: Tensor
    output_rows: Tensor
    step_rows: Tensor
    masks: list[Tensor]


@dataclass(eq=False)
class StepProgram:
    program: GraphProgram
    inputs: StepInputs
    logits: ggml.ggml_tensor  # the node the logits [B, V] are computed into, pointed at each call's buffer


# -- building -----------------------------------------------------------------------------------------------------


def build_step(
    model: DecoderModel, caches: Sequence[CacheCopies | DeltaNetPool], key: StepKey, experts: Mapping[int, ExpertFFN],
    n_threads: int,
) -> StepProgram:  # fmt: skip
    """The program of one step shape (see the module docstring); `caches` holds each layer's state (an attention
    layer's cache as the graphs read it, a delta-net's pool), `experts` each MoE layer's experts as the graphs
    multiply them, keyed by the id of its `MoE` (`StepGraph`); run with at most `n_threads` threads."""
    return _StepBuilder(model, caches, key, experts, n_threads).build()


class _StepBuilder:
    def __init__(
        self,
        model: DecoderModel,
        caches: Sequence[CacheCopies | DeltaNetPool],
        key: StepKey,
        experts: Mapping[int, ExpertFFN],
        n_threads: int,
    ) -> None:
        self.model, self.caches, self.key, self.experts = model, caches, key, experts
        self.n_threads = n_threads
        self.windows = layer_windows(model)
        windows = attention_kinds(model)
        n_layers, n_blocks = len(model.blocks), sum(len(s.blocks) for s in key.seqs)
        # a delta-net layer's nodes per sequence are fewer than an attention layer's per query block
        self.b = GraphBuilder(n_tensors=512 + n_layers * (128 + 40 * n_blocks))
        self.ctx = self.b.ctx
        t = key.n_tokens
        self.kinds = {w: i for i, w in enumerate(windows)}
        geometries = {(c.pool.k.shape[2], c.pool.v.shape[3]) for c in caches if isinstance(c, CacheCopies)}
        group = decode_group(key)
        self.inputs = StepInputs(
            ids=np.zeros(t, dtype=np.int32),
            positions=np.zeros(t, dtype=np.int32),
            rows=np.zeros(t, dtype=np.int32),  # set_rows takes int32 row numbers
            # flash attention reads the values where they lie: no transposed copy to write
            vt_index={} if key.flash else {(g, dv): np.zeros(t * g * dv, dtype=np.int64) for g, dv in geometries},
            masks=[[] if group is not None and j in group.members else
                   [np.zeros((q.n, q.views[k][1]), dtype=np.float16 if key.flash else np.float32)
                    for k in range(len(windows))]
                   for j, s in enumerate(key.seqs) for q in s.blocks],  # fmt: skip
            logit_rows=None if key.n_logits is None else np.zeros(key.n_logits, dtype=np.int32),
            group=None if group is None else GroupInputs.of(group, key),
        )
        b, i = self.b, self.inputs
        self.ids, self.pos = b.array(i.ids), b.array(i.positions)
        self.rows = b.array(i.rows)
        self.vt_index = {gd: b.array(a) for gd, a in i.vt_index.items()}
        self.masks = [[b.array(m) for m in masks] for masks in i.masks]
        self.logit_rows = None if i.logit_rows is None else b.array(i.logit_rows)
        self.group = None if i.group is None else _GroupLeaves(
            i.group.shape, b.array(i.group.query_rows), b.array(i.group.output_rows), b.array(i.group.step_rows),
            [b.array(m) for m in i.group.masks])
        self.cache_leaves = {i: self._cache_leaves(c) for i, c in enumerate(caches) if isinstance(c, CacheCopies)}
        self.state_leaves = {i: self._state_leaves(c) for i, c in enumerate(caches) if isinstance(c, DeltaNetPool)}

    def build(self) -> StepProgram:
        model, ctx, key = self.model, self.ctx, self.key
        embed = model.embed
        table = self.b.weight(GGMLWeight(embed.info.data, embed.info.qtype, embed.info.shape))
        x = ggml.ggml_get_rows(ctx, table, self.ids)  # [D, T]
        if model.cfg.embed_scale != 1.0:
            x = ggml.ggml_scale(ctx, x, model.cfg.embed_scale)
        last = len(model.blocks) - 1
        for i, block in enumerate(model.blocks):
            x = self._block(i, block, x, select=i == last and self.logit_rows is not None)
        x = self._norm(x, model.output_norm, model.cfg.rms_eps)
        logits = self._linear(model.output, x)  # [V, B]
        cap = model.cfg.final_logit_softcap
        if cap is not None:  # llama.cpp's order: scale, tanh, scale
            logits = ggml.ggml_scale(ctx, ggml.ggml_tanh(ctx, ggml.ggml_scale(ctx, logits, 1.0 / cap)), cap)
        n_logits = key.n_tokens if key.n_logits is None else key.n_logits
        first = torch.empty(n_logits, model.cfg.n_vocab, dtype=torch.float32)
        self.b.output(logits, first)
        return StepProgram(self.b.finish(), self.inputs, logits.contents)

    # -- a block ------------------------------------------------------------------------------------------
    def _block(self, i: int, block: Block, x: Tensor, select: bool) -> Tensor:
        ctx, eps = self.ctx, block.eps
        mixer, h = block.mixer, self._norm(x, block.mixer_norm, eps)
        h = self._delta_net(i, mixer, h) if isinstance(mixer, GatedDeltaNet) else self._attention(i, mixer, h)
        if select:  # the last layer goes on with the rows whose logits are wanted only, as llama.cpp's
            h = ggml.ggml_get_rows(ctx, h, self.logit_rows)
            x = ggml.ggml_get_rows(ctx, x, self.logit_rows)
        if block.post_mixer_norm is not None:
            h = self._norm(h, block.post_mixer_norm, eps)
        x = ggml.ggml_add(ctx, h, x)
        ffn = block.ffn
        if isinstance(ffn, ParallelFFN):  # dense(x) + routed(x), each normed after, as add_normed sums them
            dense = ffn.dense
            assert isinstance(dense, NormedFFN) and isinstance(dense.ffn, GatedMLP)
            h = self._mlp(dense.ffn, self._maybe_norm(x, dense.pre_norm, dense.eps))
            h = self._maybe_norm(h, dense.post_norm, dense.eps)
            sparse = ffn.sparse
            routed = self._moe(sparse, x, self._maybe_norm(x, sparse.expert_norm, sparse.eps))
            h = ggml.ggml_add(ctx, h, self._maybe_norm(routed, sparse.post_norm, sparse.eps))
        else:
            assert block.ffn_norm is not None
            h = self._norm(x, block.ffn_norm, eps)
            if isinstance(ffn, GatedMLP):
                h = self._mlp(ffn, h)
            elif isinstance(ffn, MoEWithSharedExpert):
                h = self._shared_moe(ffn, h)
            else:
                h = self._moe(ffn, h, h)
        if block.post_ffn_norm is not None:
            h = self._norm(h, block.post_ffn_norm, eps)
        x = ggml.ggml_add(ctx, h, x)
        return x if block.out_scale is None else ggml.ggml_mul(ctx, x, self.b.vector(block.out_scale))

    def _norm(self, x: Tensor, weight: torch.Tensor, eps: float) -> Tensor:
        return ggml.ggml_mul(self.ctx, ggml.ggml_rms_norm(self.ctx, x, eps), self.b.vector(weight))

    def _maybe_norm(self, x: Tensor, weight: torch.Tensor | None, eps: float) -> Tensor:
        return x if weight is None else self._norm(x, weight, eps)

    def _linear(self, linear: object, x: Tensor) -> Tensor:
        if isinstance(linear, BiasedLinear):
            return ggml.ggml_add(self.ctx, self._linear(linear.inner, x), self.b.vector(linear.bias))
        assert isinstance(linear, GGMLLinear)
        return ggml.ggml_mul_mat(self.ctx, self.b.weight(linear.weight), x)

    # -- attention ----------------------------------------------------------------------------------------
    def _cache_leaves(self, c: CacheCopies) -> tuple[Tensor, Tensor, Tensor]:
        """Leaves on the pool's K rows [G*Hd, N*R + its tail], V rows [G*Dv, N*R + its tail] and transposed values (one
        value per row, [1, N*G*Dv*C]): what the stores write and the attention's views read."""
        b = self.b
        n, r, g, d = c.pool.k.shape
        dv = c.pool.v.shape[-1]
        gtype = CACHE_TYPES[c.pool.k.dtype]
        return (b.leaf(gtype, (g * d, n * r + c.pool.tail), c.pool.k.data_ptr(), c.pool.k),
                b.leaf(gtype, (g * dv, n * r + c.pool.tail), c.pool.v.data_ptr(), c.pool.v),
                b.leaf(gtype, (1, c.vt.numel()), c.vt.data_ptr(), c.vt))  # fmt: skip

    def _attention(self, i: int, m: Attention | GatedAttention, h: Tensor) -> Tensor:
        ctx, s, t = self.ctx, m.shape, self.key.n_tokens
        hd, dv, nh, g = s.head_dim, s.value_dim, s.n_heads, s.n_kv_heads
        gate = None
        if isinstance(m, GatedAttention):  # per head Hd query rows, then Hd rows of the output gate
            q_gate = self._linear(m.q_gate, h)  # [2*Hd*H, T]
            q = ggml.ggml_view_3d(ctx, q_gate, hd, nh, t, 8 * hd, 8 * hd * nh, 0)  # [Hd, H, T]
            if m.q_norm is None:
                q = ggml.ggml_cont(ctx, q)
            gate = ggml.ggml_view_3d(ctx, q_gate, hd, nh, t, 8 * hd, 8 * hd * nh, 4 * hd)
            gate = ggml.ggml_cont_2d(ctx, gate, hd * nh, t)  # [H*Hd, T]
        else:
            q = ggml.ggml_reshape_3d(ctx, self._linear(m.q, h), hd, nh, t)  # [Hd, H, T]
        k_proj = self._linear(m.k, h)  # [G*Hd, T]
        k = ggml.ggml_reshape_3d(ctx, k_proj, hd, g, t)  # [Hd, G, T]
        v = k_proj if m.v is None else self._linear(m.v, h)  # [G*Dv, T]; none: the keys' projection (Gemma 4)
        if getattr(m, "v_norm", False):  # per head, without a weight, as llama.cpp's ggml_rms_norm of the values
            v = ggml.ggml_reshape_2d(ctx, ggml.ggml_rms_norm(ctx, ggml.ggml_reshape_3d(ctx, v, dv, g, t), m.norm_eps),
                                     g * dv, t)  # fmt: skip
        scale_queries, kq_scale = query_scaling(s)
        q_norm = m.q_norm
        if scale_queries and q_norm is not None and math.frexp(s.scale)[0] == 0.5:
            # a power of two: scaling the norm's weight scales the rotated queries by it exactly (rope is linear)
            q_norm, scale_queries = q_norm.float() * s.scale, False
        q, k = self._norm_rope(q, q_norm, m), self._norm_rope(k, m.k_norm, m)
        self._store(i, k, v, g, dv)
        kind = self.kinds[self.windows[i]]
        sinks = getattr(m, "sinks", None)
        sinks = None if sinks is None else self.b.vector(sinks)  # [H]
        nb1, nb2 = q.contents.nb[1], q.contents.nb[2]
        members = () if self.group is None else self.group.shape.members
        blocks = [(j, seq.slot, block) for j, seq in enumerate(self.key.seqs) for block in seq.blocks]
        # the blocks' outputs [Dv, H, N] and the group's go to their rows of one [H*Dv, T] tensor
        parts: list[tuple[int, int, Tensor]] = []  # (first row, or -1 for the group; rows; output)
        for n_block, (j, slot, block) in enumerate(blocks):
            if j in members:
                continue
            qs = ggml.ggml_view_3d(ctx, q, hd, nh, block.n, nb1, nb2, block.offset * nb2)  # the block's rows
            if scale_queries:
                qs = ggml.ggml_scale(ctx, qs, s.scale)
            # the permuted view itself, as llama.cpp multiplies it: the product picks its kernel by the operands'
            # layout (an f16 cache's converts the queries to f16 first, an f32 cache's sums each q.k by itself)
            qs = ggml.ggml_permute(ctx, qs, 0, 2, 1, 3)  # [Hd, N, H]
            first, n_keys = block.views[kind]
            if self.key.flash:
                parts.append((block.offset, block.n, self._flash(i, qs, slot, first, n_keys, n_block, kind, kq_scale,
                                                                 sinks)))  # fmt: skip
                continue
            keys, values_t = self._cache_views(i, slot, first, n_keys, 1, g, hd, dv)
            kq = ggml.ggml_mul_mat(ctx, keys, qs)  # [S, N, H]
            kq = self._softmax(kq, self.masks[n_block][kind], kq_scale, sinks)
            out = ggml.ggml_mul_mat(ctx, values_t, kq)  # [Dv, N, H]
            # [Dv, H, N]: for one row the same memory, else a permuted view
            out = ggml.ggml_reshape_3d(ctx, out, dv, nh, 1) if block.n == 1 else ggml.ggml_permute(ctx, out, 0, 2, 1, 3)
            parts.append((block.offset, block.n, out))
        if self.group is not None:  # its rows [Dv*H, members]: the step's when every sequence is a member
            parts.append((-1, len(members), self._group_attention(i, q, kind, scale_queries, kq_scale, sinks)))
        if len(parts) == 1 and parts[0][1] == t:  # one block, or the group, of every row
            offset, _, out = parts[0]
            if offset == 0 and t > 1:
                out = ggml.ggml_cont(ctx, out)
            attn = ggml.ggml_reshape_2d(ctx, out, dv * nh, t)
        else:
            attn = self.b.scratch(ggml.GGML_TYPE_F32, (dv * nh, t))
            for offset, n, out in parts:
                if offset < 0:  # the group's rows, each to its member's row of the step
                    assert self.group is not None
                    self.b.expand(ggml.ggml_set_rows(ctx, attn, out, self.group.step_rows))
                else:
                    rows = ggml.ggml_view_3d(ctx, attn, dv, nh, n, 4 * dv, 4 * dv * nh, 4 * dv * nh * offset)
                    self.b.expand(ggml.ggml_cpy(ctx, out, rows))
        if gate is not None:
            attn = ggml.ggml_mul(ctx, attn, ggml.ggml_sigmoid(ctx, gate))
        return self._linear(m.o, attn)  # [D, T]

    def _group_attention(
        self, i: int, q: Tensor, kind: int, scale_queries: bool, kq_scale: float, sinks: Tensor | None
    ) -> Tensor:
        """The decode group's attention (DecodeGroup): each slot of its range with its member's query, over the
        range's keys, as the members' blocks compute it one by one -> [Dv*H, members], in the members' order."""
        ctx, s, group = self.ctx, self.model.blocks[i].mixer.shape, self.group
        assert group is not None
        hd, dv, nh, g, n = s.head_dim, s.value_dim, s.n_heads, s.n_kv_heads, group.shape.n_slots
        qs = ggml.ggml_get_rows(ctx, ggml.ggml_reshape_2d(ctx, q, hd * nh, self.key.n_tokens), group.query_rows)
        qs = ggml.ggml_reshape_4d(ctx, qs, hd, 1, nh, n)  # [Hd, 1, H, slots]
        if scale_queries:
            qs = ggml.ggml_scale(ctx, qs, s.scale)
        first, n_keys = group.shape.views[kind]
        keys, values_t = self._cache_views(i, group.shape.lo, first, n_keys, n, g, hd, dv)
        kq = ggml.ggml_mul_mat(ctx, keys, qs)  # [S, 1, H, slots]
        kq = self._softmax(kq, group.masks[kind], kq_scale, sinks)
        out = ggml.ggml_mul_mat(ctx, values_t, kq)  # [Dv, 1, H, slots]
        return ggml.ggml_get_rows(ctx, ggml.ggml_reshape_2d(ctx, out, dv * nh, n), group.output_rows)

    def _flash(self, i: int, qs: Tensor, slot: int, first: int, n_keys: int, n_block: int, kind: int,
               kq_scale: float, sinks: Tensor | None) -> Tensor:  # fmt: skip
        """A sequence's attention (its queries qs [Hd, N, H]) as llama.cpp's graph with flash attention builds it:
        one FLASH_ATTN_EXT node over its view of the keys and values where they lie (f16; an f32 cache's cast to
        f16 first, as llama.cpp casts them), the f16 mask, the sinks in its denominator -> [Dv, H, N]. A decode
        row over 512 keys or more, or 64 rows and more, take tandem's kernel of the same bits where it runs
        (quant/flash_attention)."""
        ctx, c, s = self.ctx, self.caches[i], self.model.blocks[i].mixer.shape
        k_rows, v_rows, _ = self.cache_leaves[i]
        keys = self._rows_view(i, k_rows, s.head_dim, slot, first, n_keys, 1)
        values = self._rows_view(i, v_rows, s.value_dim, slot, first, n_keys, 1)
        if c.pool.k.dtype != torch.float16:
            keys = ggml.ggml_cast(ctx, keys, ggml.GGML_TYPE_F16)
            values = ggml.ggml_cast(ctx, values, ggml.GGML_TYPE_F16)
        mask = self.masks[n_block][kind]
        if flash_kernel.takes(qs.contents.ne[1], n_keys, keys, values, s.n_heads, mask):
            return flash_kernel.attention(ctx, qs, keys, values, mask, float(kq_scale), sinks, self.n_threads,
                                          self.b.keep)  # fmt: skip
        out = ggml.ggml_flash_attn_ext(ctx, qs, keys, values, mask, float(kq_scale), 0.0, 0.0)
        if sinks is not None:
            ggml.ggml_flash_attn_ext_add_sinks(out, sinks)
        return out  # [Dv, H, N]

    def _softmax(self, kq: Tensor, mask: Tensor, kq_scale: float, sinks: Tensor | None) -> Tensor:
        """soft_max_ext over the keys (dimension 0), with each head's sink logit (heads: dimension 2) in the
        denominator where the model has them, as llama.cpp's graph adds them to the same node."""
        kq = ggml.ggml_soft_max_ext(self.ctx, kq, mask, float(kq_scale), 0.0)
        if sinks is not None:
            ggml.ggml_soft_max_add_sinks(kq, sinks)
        return kq

    def _norm_rope(self, x: Tensor, norm: torch.Tensor | None, m: Attention) -> Tensor:
        ctx = self.ctx
        if norm is not None:
            x = self._norm(x, norm, m.norm_eps)
        spec, y = m.rope.spec, m.rope.spec.yarn
        factors = None
        if spec.freq_factors is not None:  # per rotated pair, its frequency divided by it (Gemma 4's global layers)
            factors = self.b.vector(torch.tensor(spec.freq_factors[: spec.dim // 2], dtype=torch.float32))
        if y is None:
            return ggml.ggml_rope_ext(ctx, x, self.pos, factors, spec.dim, _ROPE_NEOX, self.model.cfg.context_length,
                                      spec.base, spec.scale, 0.0, 1.0, 32.0, 1.0)  # fmt: skip
        return ggml.ggml_rope_ext(ctx, x, self.pos, factors, spec.dim, _ROPE_NEOX, y.n_ctx_orig, spec.base,
                                  spec.scale, y.ext_factor, y.attn_factor, y.beta_fast, y.beta_slow)  # fmt: skip

    def _store(self, i: int, k: Tensor, v: Tensor, g: int, dv: int) -> None:
        """The step's keys and values into the pool's rows and, without flash attention, its values into the
        transposed ones (each rounded to the cache's type there), as part of the graph now: the attention's views of
        the cache come after them. (The layer path transposes again what it finds out of date: LayerKV.forget.)"""
        ctx, b, t = self.ctx, self.b, self.key.n_tokens
        k_rows, v_rows, vt = self.cache_leaves[i]
        b.expand(ggml.ggml_set_rows(ctx, k_rows, _flat(ctx, k, t), self.rows))  # [G*Hd, T]
        b.expand(ggml.ggml_set_rows(ctx, v_rows, v, self.rows))
        if not self.key.flash:
            b.expand(ggml.ggml_set_rows(ctx, vt, ggml.ggml_reshape_2d(ctx, v, 1, g * dv * t), self.vt_index[(g, dv)]))

    def _cache_views(
        self, i: int, slot: int, first: int, n_keys: int, n_slots: int, g: int, hd: int, dv: int
    ) -> tuple[Tensor, Tensor]:
        """Keys [Hd, S, G, slots] and transposed values [S, Dv, G, slots] of positions first .. first + S - 1 of
        slots slot .. slot + n_slots - 1 (strided views, as llama.cpp's graph reads its cache; a padded view of a
        slot's last rows reads on into the next slot's, or the pool's tail: masked)."""
        ctx, c = self.ctx, self.caches[i]
        k_rows, _, vt = self.cache_leaves[i]
        columns, size = c.columns, c.pool.k.element_size()
        keys = self._rows_view(i, k_rows, hd, slot, first, n_keys, n_slots)
        values_t = ggml.ggml_view_4d(ctx, vt, n_keys, dv, g, n_slots, size * columns, size * columns * dv,
                                     size * columns * dv * g, size * (slot * g * dv * columns + first))  # fmt: skip
        return keys, values_t

    def _rows_view(self, i: int, leaf: Tensor, d: int, slot: int, first: int, n_keys: int, n_slots: int) -> Tensor:
        """[D, S, G, slots] of a pool's rows leaf (keys, or values untransposed), positions first .. first + S - 1
        of slots slot .. slot + n_slots - 1, as llama.cpp's graph views its cache."""
        c = self.caches[i]
        rows, size, g = c.rows, c.pool.k.element_size(), int(c.pool.k.shape[2])
        return ggml.ggml_view_4d(self.ctx, leaf, d, n_keys, g, n_slots, size * d * g, size * d,
                                 size * d * g * rows, size * d * g * (slot * rows + first))  # fmt: skip

    # -- delta-net ----------------------------------------------------------------------------------------
    def _state_leaves(self, pool: DeltaNetPool) -> tuple[Tensor, Tensor]:
        """Leaves on a delta-net layer's pool: every slot's last K-1 conv inputs [C, N*(K-1)] and recurrent states
        [D*D*Hv, N] (each head's S transposed in memory: ggml's layout, the CPU pool's)."""
        n, k1, c = pool.conv.shape
        _, hv, dk, dv = pool.ssm.shape
        f32 = ggml.GGML_TYPE_F32
        return (self.b.leaf(f32, (c, n * k1), pool.conv.data_ptr(), pool.conv),
                self.b.leaf(f32, (dk * dv * hv, n), pool.ssm.data_ptr(), pool.ssm))  # fmt: skip

    def _delta_net(self, i: int, m: GatedDeltaNet, h: Tensor) -> Tensor:
        """The gated delta-net of the step's rows, as llama.cpp's qwen35moe / qwen3next graphs: the projections of
        every row, then per sequence the causal conv over the inputs its slot kept and ggml's fused delta rule on
        its slot's state (both written back into the pool, nodes after those that read them), then the gated
        norm and the out projection."""
        ctx, b, s, t = self.ctx, self.b, m.shape, self.key.n_tokens
        hk, hv, d = s.n_k_heads, s.n_v_heads, s.head_v_dim
        c, k1 = s.conv_channels, s.conv_kernel - 1
        qkv = self._linear(m.qkv, h)  # [C, T]
        z = self._linear(m.gate, h)  # [Hv*D, T]
        ba = m.beta_alpha
        if isinstance(ba, SplitBetaAlpha):
            beta, alpha = self._linear(ba.beta, h), self._linear(ba.alpha, h)  # [Hv, T]
        else:  # per key head Hv/Hk betas, then Hv/Hk alphas
            r = hv // hk
            fused = self._linear(ba.proj, h)  # [2*Hv, T]
            beta = ggml.ggml_view_3d(ctx, fused, r, hk, t, 8 * r, 8 * hv, 0)
            alpha = ggml.ggml_cont_2d(ctx, ggml.ggml_view_3d(ctx, fused, r, hk, t, 8 * r, 8 * hv, 4 * r), hv, t)
        beta = ggml.ggml_sigmoid(ctx, beta)  # contiguous [Hv, T]
        biased = ggml.ggml_add(ctx, alpha, b.vector(m.dt_bias))
        decay = ggml.ggml_mul(ctx, ggml.ggml_softplus(ctx, biased), b.vector(m.a))  # log decay, <= 0 [Hv, T]
        conv_weight = b.vector(m.conv_weight)  # [K, C]
        conv_states, ssm_states = self.state_leaves[i]
        parts: list[tuple[int, int, Tensor]] = []  # (first row, rows, output [Hv*D, N])
        for seq in self.key.seqs:
            n, first, slot = seq.n, seq.offset, seq.slot
            kept = ggml.ggml_view_2d(ctx, conv_states, c, k1, 4 * c, 4 * c * k1 * slot)  # [C, K-1]
            rows = ggml.ggml_view_2d(ctx, qkv, c, n, 4 * c, 4 * c * first)  # [C, N]
            window = ggml.ggml_concat(ctx, ggml.ggml_transpose(ctx, kept), ggml.ggml_transpose(ctx, rows), 0)
            # its last K-1 inputs are what the slot keeps next
            last = ggml.ggml_view_2d(ctx, window, k1, c, int(window.contents.nb[1]), 4 * n)  # [K-1, C]
            b.expand(ggml.ggml_cpy(ctx, ggml.ggml_transpose(ctx, last), kept))
            conv = ggml.ggml_ssm_conv(ctx, ggml.ggml_reshape_3d(ctx, window, k1 + n, c, 1), conv_weight)
            conv = ggml.ggml_silu(ctx, conv)  # [C, N, 1]: q, k, v of each row
            q = ggml.ggml_view_3d(ctx, conv, d, hk, n, 4 * d, 4 * c, 0)
            k = ggml.ggml_view_3d(ctx, conv, d, hk, n, 4 * d, 4 * c, 4 * s.key_dim)
            v = ggml.ggml_view_4d(ctx, conv, d, hv, n, 1, 4 * d, 4 * c, 4 * c * n, 8 * s.key_dim)
            q, k = (self._delta_heads(s, self._l2_norm(x, m.eps), n) for x in (q, k))
            g_seq, beta_seq = (ggml.ggml_view_4d(ctx, x, 1, hv, n, 1, 4, 4 * hv, 4 * hv * n, 4 * hv * first)
                               for x in (decay, beta))  # fmt: skip
            state = ggml.ggml_view_4d(ctx, ssm_states, d, d, hv, 1, 4 * d, 4 * d * d, 4 * d * d * hv,
                                      4 * d * d * hv * slot)  # fmt: skip
            out = ggml.ggml_gated_delta_net(ctx, q, k, v, g_seq, beta_seq, state, 1)  # [Hv*D, N + D]
            final = ggml.ggml_view_1d(ctx, out, d * d * hv, 4 * d * hv * n)  # after the rows' outputs
            b.expand(ggml.ggml_cpy(ctx, final, ggml.ggml_view_1d(ctx, ssm_states, d * d * hv, 4 * d * d * hv * slot)))
            parts.append((first, n, ggml.ggml_view_2d(ctx, out, d * hv, n, 4 * d * hv, 0)))
        if len(parts) == 1:
            o = parts[0][2]
        else:
            o = b.scratch(ggml.GGML_TYPE_F32, (d * hv, t))
            for first, n, part in parts:
                b.expand(ggml.ggml_cpy(ctx, part, ggml.ggml_view_2d(ctx, o, d * hv, n, 4 * d * hv, 4 * d * hv * first)))
        # the gated norm: rms_norm(o) * w * silu(z), per value head
        o = ggml.ggml_mul(ctx, ggml.ggml_rms_norm(ctx, ggml.ggml_reshape_3d(ctx, o, d, hv, t), m.eps), b.vector(m.norm))
        o = ggml.ggml_mul(ctx, o, ggml.ggml_silu(ctx, ggml.ggml_reshape_3d(ctx, z, d, hv, t)))
        return self._linear(m.out, ggml.ggml_reshape_2d(ctx, o, d * hv, t))

    def _l2_norm(self, x: Tensor, eps: float) -> Tensor:
        """x / sqrt(sum(x^2) + eps) per row, as llama.cpp's graph writes it: rms_norm(x, eps / n) / sqrt(n)."""
        n = int(x.contents.ne[0])
        return ggml.ggml_scale(self.ctx, ggml.ggml_rms_norm(self.ctx, x, eps / n), 1.0 / math.sqrt(n))

    def _delta_heads(self, s: DeltaNetShape, x: Tensor, n: int) -> Tensor:
        """Queries or keys [D, Hk, N] as the fused rule reads them, [D, heads, N, 1]: value head j reads key head
        j % Hk by itself (the "tiled" layout), the "grouped" one (j // (Hv/Hk)) takes them repeated."""
        ctx, d, hk, hv = self.ctx, s.head_k_dim, s.n_k_heads, s.n_v_heads
        if hk == hv or s.head_layout == "tiled":
            return ggml.ggml_reshape_4d(ctx, x, d, hk, n, 1)
        repeated = ggml.ggml_repeat_4d(ctx, ggml.ggml_reshape_4d(ctx, x, d, 1, hk, n), d, hv // hk, hk, n)
        return ggml.ggml_reshape_4d(ctx, repeated, d, hv, n, 1)

    # -- feed-forward -------------------------------------------------------------------------------------
    def _mlp(self, mlp: GatedMLP, h: Tensor) -> Tensor:
        """down(glu(gate(h), up(h)))."""
        ctx = self.ctx
        gate, up = self._linear(mlp.gate, h), self._linear(mlp.up, h)
        if mlp.act is GELU_TANH:
            hidden = ggml.ggml_mul(ctx, _gelu_tanh(ctx, gate), up)  # [F, T]
        else:
            hidden = GLU_OPS[mlp.act](ctx, gate, up)
        return self._linear(mlp.down, hidden)

    def _shared_moe(self, ffn: MoEWithSharedExpert, h: Tensor) -> Tensor:
        """routed(h) + sigmoid(w . h) * shared(h), h the normed x, as llama.cpp's qwen35moe graph."""
        ctx, shared = self.ctx, ffn.shared
        scale = ggml.ggml_sigmoid(ctx, ggml.ggml_mul_mat(ctx, self.b.vector(shared.gate), h))  # [1, T]
        return ggml.ggml_add(ctx, self._moe(ffn.routed, h, h), ggml.ggml_mul(ctx, self._mlp(shared.mlp, h), scale))

    def _moe(self, moe: MoE | RoutedFFN, x: Tensor, h: Tensor) -> Tensor:
        """The routing of x and the gated experts of h (`expert_ffn_nodes`, the nodes of the layer path's expert
        graph), as llama.cpp's build_moe_ffn: x and h are the same but in Gemma 4's branch, whose experts read
        their own norm of x."""
        ctx, t = self.ctx, int(h.contents.ne[1])
        router = moe.router
        a = router.n_active
        if isinstance(router, TopKSoftmaxRouter):  # the top-k logits (+ bias), then a softmax over those
            logits = self._linear(router.proj, x)  # [E, T]
            if router.bias is not None:
                logits = ggml.ggml_add(ctx, logits, self.b.vector(router.bias))
            ids = ggml.ggml_argsort_top_k(ctx, logits, a)  # [A, T] int32
            top = ggml.ggml_get_rows(ctx, ggml.ggml_reshape_3d(ctx, logits, 1, int(logits.contents.ne[0]), t), ids)
            weights = ggml.ggml_soft_max(ctx, ggml.ggml_reshape_2d(ctx, top, a, t))  # [A, T]
        else:  # a softmax over every expert, then the top k (renormalised where the model says so)
            if isinstance(router, NormedSoftmaxTopKRouter):  # Gemma 4: the logits of rms_norm(x) * input_scale
                x = self._norm(x, router.input_scale, router.eps)
            else:
                assert isinstance(router, SoftmaxTopKRouter)
            probs = ggml.ggml_soft_max(ctx, self._linear(router.proj, x))  # [E, T]
            ids = ggml.ggml_argsort_top_k(ctx, probs, a)  # [A, T] int32
            weights = ggml.ggml_get_rows(ctx, ggml.ggml_reshape_3d(ctx, probs, 1, int(probs.contents.ne[0]), t), ids)
            if isinstance(router, NormedSoftmaxTopKRouter) or router.renormalize:  # [1, A, T] / the sum over A
                flat = ggml.ggml_reshape_2d(ctx, weights, a, t)
                weights = ggml.ggml_div(ctx, flat, ggml.ggml_sum_rows(ctx, flat))
        mix = ggml.ggml_reshape_3d(ctx, weights, 1, a, t)
        ffn = self.experts[id(moe)]
        w = {}
        for name, (gtype, ne, ptr, _) in ffn.inputs.items():
            value = getattr(ffn, name)
            w[name] = self.b.weight(value) if isinstance(value, GGMLWeight) else self.b.leaf(gtype, ne, ptr, value)
        out = expert_ffn_nodes(ctx, ffn, w, ggml.ggml_reshape_3d(ctx, h, int(h.contents.ne[0]), 1, t), ids, mix)
        return ggml.ggml_reshape_2d(ctx, out, int(out.contents.ne[0]), t)  # [D, T]


def _gelu_tanh(ctx: int, x: Tensor) -> Tensor:
    """0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), the formula transformers computes (ggml's own GELU reads
    its f16 table)."""
    inner = ggml.ggml_add(ctx, x, ggml.ggml_scale(ctx, ggml.ggml_mul(ctx, ggml.ggml_mul(ctx, x, x), x), 0.044715))
    t = ggml.ggml_tanh(ctx, ggml.ggml_scale(ctx, inner, math.sqrt(2.0 / math.pi)))
    return ggml.ggml_mul(ctx, x, ggml.ggml_scale_bias(ctx, t, 0.5, 0.5))


def _flat(ctx: int, x: Tensor, t: int) -> Tensor:
    """x [a, b, T] (contiguous) as [a*b, T]."""
    ne = x.contents.ne
    return ggml.ggml_reshape_2d(ctx, x, int(ne[0]) * int(ne[1]), t)
