"""The lab's own decoder for the Llama family: the model code the engine runs instead of transformers' modules.

Transformers' ``LlamaModel`` is written for one request at a time, batch-first, with every projection its own
matrix product and every norm, rotary embedding and residual add its own handful of small operations, each a
Python module call. On a CPU at the engine's step sizes (64 decode rows of 256 features) those calls cost about
as much as the matrix products. vLLM does not run transformers' modules for the models it knows: it has its own model
code (``vllm/model_executor/models/llama.py``), written for the flattened tokens of a step, and so has this
module, for the architectures whose decoder layer is Llama's (:data:`ARCHITECTURES`):

==========================================  ===========================================================
lab (:class:`LlamaDecoder`)                 vLLM 0.26
==========================================  ===========================================================
``qkv_weight``: q, k, v in one matrix       ``QKVParallelLinear`` (``LlamaAttention.qkv_proj``)
``gate_up_weight`` + :func:`silu_and_mul`   ``MergedColumnParallelLinear`` (``LlamaMLP.gate_up_proj``),
                                            ``SiluAndMul`` (``layers/activation.py``)
:func:`rms_norm` with ``residual``          ``RMSNorm.forward_native`` (``layers/layernorm.py``: the
                                            residual add fused into the norm, ``fused_add_rms_norm``)
:func:`apply_rotary`                        ``RotaryEmbedding.forward_static``
                                            (``layers/rotary_embedding/base.py``): q and k of every token
                                            rotated together, the flattened ``[T, heads, D]`` layout
:meth:`LlamaDecoder.from_hf`                ``LlamaModel.hf_to_vllm_mapper`` (``orig_to_new_stacked``:
                                            ``.q_proj`` -> ``.qkv_proj`` shard ``"q"``, ``.gate_proj`` ->
                                            ``.gate_up_proj`` shard 0, ...) and ``load_weights``
``LlamaDecoder.forward``                    ``LlamaModel.forward`` / ``LlamaDecoderLayer.forward``
==========================================  ===========================================================

The weights are read from the transformers model the engine was given (nothing downloaded, nothing converted on
disk): the fused matrices are new tensors (concatenations), the others the model's own. So the runner built
from a model keeps the weights it had then; change the model's weights and build a new engine.

The arithmetic is transformers' own, operation for operation (RMSNorm in float32 then back to the model's dtype,
rotary as ``x·cos + rotate_half(x)·sin``, the same ``scaling``, each layer's ``sliding_window``): only the
matrix products differ, one over the fused columns where transformers makes three (q, k, v) or two (gate,
up). A fused product computes every output element as the same dot product, but the BLAS library may block the
reduction differently for a wider matrix, so logits can differ in the last bits; greedy tokens are tested
against ``generate`` as before. In float32 on a CPU, where the lab's compiled ops are built, the norms, rotary
and SiLU-and-multiply run as one C pass each (:mod:`pagedkv.engine.cpu_ops`, vLLM's ``fused_add_rms_norm``,
``rotary_embedding`` and ``silu_and_mul``): the same formulas, summed and rounded in another order, so again
the last bits only; :func:`rms_norm`, :func:`apply_rotary` and :func:`silu_and_mul` below, bit for bit
transformers', are what runs everywhere else. That path also keeps its activations in buffers reused every layer
and step (:class:`Workspace`, :func:`linear_into`, :func:`mlp_into`) instead of new tensors. Any other model
(Qwen3's q/k norms, Gemma 3, OLMo 3, a tensor-parallel shard) runs transformers' modules with the lab's attention
plugged in (``model_impl="transformers"``), and so does a model on a GPU unless ``model_impl="lab"``
(:func:`pagedkv.engine.model_runner.make_decoder` says why).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from pagedkv.engine import cpu_ops
from pagedkv.engine.attention import paged_attention

#: transformers classes whose decoder is Llama's, and how each names a layer's sliding window (Mistral: the
#: config's, every layer; Qwen2: the attention module's, set per layer from ``layer_types``; Llama: none).
ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
MODEL_IMPLS = ("auto", "lab", "transformers")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(x + residual), x + residual)``; without ``residual``, ``(norm(x), x)``. ``x [T, H]``. The sum is
    written into ``residual`` (it is the caller's running residual stream, as in vLLM's ``fused_add_rms_norm``,
    which adds in place). The norm is transformers' ``LlamaRMSNorm``: float32, ``x · rsqrt(mean(x²) + eps)``,
    back to the input dtype, times ``weight``."""
    if residual is not None:
        x = residual.add_(x)
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype), x


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x [T, heads, D]`` with ``cos``/``sin [T, D]`` (transformers' halves layout,
    ``rotate_half``): ``x·cos + rotate_half(x)·sin``, computed on the two halves, ``[x1·c - x2·s, x2·c + x1·s]``
    (the same products and sums, so the same bits). Mirrors ``RotaryEmbedding.forward_static`` with
    ``is_neox_style=True``."""
    half = x.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]  # [T, 1, D/2]: transformers' cos is cat(freqs, freqs)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) · up`` of ``x = [gate | up]``, ``[T, 2I]`` -> ``[T, I]``. Mirrors ``SiluAndMul``."""
    i = x.shape[-1] // 2
    return F.silu(x[:, :i]).mul_(x[:, i:])


def _cat_bias(*linears: torch.nn.Linear) -> torch.Tensor | None:
    biases = [m.bias for m in linears]
    if all(b is None for b in biases):
        return None
    return torch.cat([b if b is not None else m.weight.new_zeros(m.weight.shape[0])
                      for b, m in zip(biases, linears, strict=True)])


@dataclass
class DecoderLayerWeights:
    """One decoder layer's weights, fused as vLLM loads them: ``qkv_weight [(Hq + 2·Hkv)·D, H]``,
    ``gate_up_weight [2·I, H]``, the others the transformers model's own tensors."""

    input_norm: torch.Tensor  # [H]
    qkv_weight: torch.Tensor  # [(Hq + 2·Hkv)·D, H]
    qkv_bias: torch.Tensor | None
    o_weight: torch.Tensor  # [H, Hq·D]
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor  # [H]
    gate_up_weight: torch.Tensor  # [2·I, H]
    gate_up_bias: torch.Tensor | None
    down_weight: torch.Tensor  # [H, I]
    down_bias: torch.Tensor | None
    scaling: float
    sliding_window: int | None


def linear_into(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` written into ``out`` (``[T, N]``, contiguous) and returned: the same product
    (``mm``, or ``addmm`` with the bias, over ``weight.t()``, as ``F.linear`` calls it), into memory the caller
    keeps instead of a new tensor."""
    if bias is None:
        return torch.mm(x, weight.t(), out=out)
    return torch.addmm(bias, x, weight.t(), out=out)


class Workspace:
    """The decoder's activations, in buffers kept across layers and steps: :meth:`take` returns the first ``rows``
    rows of a named ``[capacity, cols]`` buffer, made (or grown) on first need.

    Why: on a CPU a new tensor of more than a few hundred kilobytes is fresh memory from the operating system, and
    every 4 KiB page of it faults on first touch. At a prefill step of 2,048 rows one layer's activations are some
    20 MB, so a forward that allocates them layer after layer spends a third of its MLP's time in page faults
    (measured: 54-65 ms for one layer's products at 2,048 rows, 5,600 faults, against 38-45 ms into kept
    buffers). vLLM keeps its persistent buffers for the same reason (Model Runner V2's ``InputBuffers``; on a GPU
    the CUDA caching allocator does the rest). A buffer's rows are valid until the next ``take`` of its name."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}

    def take(self, name: str, rows: int, cols: int, like: torch.Tensor) -> torch.Tensor:
        buf = self.buffers.get(name)
        if buf is None or buf.shape[0] < rows or buf.shape[1] != cols or buf.dtype != like.dtype \
                or buf.device != like.device:
            buf = torch.empty(max(rows, 64), cols, dtype=like.dtype, device=like.device)
            self.buffers[name] = buf
        return buf[:rows]


#: Rows of the MLP at a time in the compiled path: a 128-row chunk's ``[128, 2·I]`` gate/up output (0.7 MB in the
#: bench) is still in the core's caches when the SiLU and the down product read it; a 2,048-row step's would be
#: 11 MB. Measured on the bench, one process, four runs each: 128 rows 1.89 s, 256 1.96 s, 512 2.01 s, unchunked
#: 2.20 s (medians; the machine's speed moves by about 10% between runs).
MLP_CHUNK = 128


def mlp_into(x: torch.Tensor, w: DecoderLayerWeights, ws: Workspace, out: torch.Tensor) -> torch.Tensor:
    """The layer's MLP, ``down(silu(gate) · up)`` of ``x [T, H]``, into ``out [T, H]``, :data:`MLP_CHUNK` rows at a
    time, with the compiled SiLU-and-multiply (:func:`pagedkv.engine.cpu_ops.silu_and_mul`) and buffers from
    ``ws``. Mirrors ``LlamaMLP.forward`` (``vllm/model_executor/models/llama.py``)."""
    t = x.shape[0]
    rows = min(t, MLP_CHUNK)
    gate_up = ws.take("gate_up", rows, w.gate_up_weight.shape[0], x)  # [chunk, 2·I]
    act = ws.take("act", rows, w.gate_up_weight.shape[0] // 2, x)  # [chunk, I]
    for start in range(0, t, MLP_CHUNK):
        end = min(t, start + MLP_CHUNK)
        n = end - start
        g = linear_into(x[start:end], w.gate_up_weight, w.gate_up_bias, gate_up[:n])
        linear_into(cpu_ops.silu_and_mul(g, out=act[:n]), w.down_weight, w.down_bias, out[start:end])
    return out


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why :class:`LlamaDecoder` cannot run ``model`` (``None``: it can): its class is not one of
    :data:`ARCHITECTURES`, its activation is not SiLU, or a layer is not plain ``nn.Linear``/transformers' own
    (a tensor-parallel shard's layers all-reduce; a LoRA or quantised layer computes something else)."""
    name = type(model).__name__
    if name not in ARCHITECTURES:
        return f"{name} is not one of {ARCHITECTURES}"
    config = model.config
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r}, not silu"
    base = getattr(model, "model", None)
    if base is None or not hasattr(base, "layers") or not hasattr(base, "rotary_emb"):
        return "no model.layers / model.rotary_emb"
    for layer in base.layers:
        a, m = layer.self_attn, layer.mlp
        linears = (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj)
        if any(type(x) is not torch.nn.Linear for x in linears):
            return "a projection that is not a plain nn.Linear (a tensor-parallel shard, LoRA, quantised...)"
    if type(base.embed_tokens) is not torch.nn.Embedding:
        return "an embedding that is not a plain nn.Embedding"
    return None


class LlamaDecoder:
    """The decoder of a Llama-family model over one step's flattened tokens: ``forward(input_ids [T],
    positions [T], metadata) -> hidden [T, H]`` (after the final norm; the runner applies the LM head to the
    sampled rows). Each layer: fused residual add + RMSNorm, one q/k/v product, rotary on q and k together,
    the paged attention (:func:`pagedkv.engine.attention.paged_attention`), the output projection, fused add +
    RMSNorm, one gate/up product, SiLU-and-multiply, the down projection. Mirrors ``LlamaModel.forward``
    (``vllm/model_executor/models/llama.py``)."""

    def __init__(self, embed_weight: torch.Tensor, layers: list[DecoderLayerWeights], final_norm: torch.Tensor,
                 eps: float, rotary_emb: torch.nn.Module, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.embed_weight = embed_weight  # [V, H]
        self.layers = layers
        self.final_norm = final_norm  # [H]
        self.eps = eps
        self.rotary_emb = rotary_emb  # transformers' own: its inv_freq and rope scaling (llama3, ...)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.workspace = Workspace()  # the compiled path's activation buffers

    @classmethod
    def from_hf(cls, model: torch.nn.Module) -> LlamaDecoder:
        """Read the weights of a transformers model of :data:`ARCHITECTURES`, stacking q/k/v and gate/up as
        vLLM's ``LlamaModel.hf_to_vllm_mapper`` does. ``ValueError`` (with the reason) for any other model."""
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the lab's Llama decoder cannot run this model: {reason}")
        config, base = model.config, model.model
        mistral = type(model).__name__ == "MistralForCausalLM"
        layers = []
        with torch.no_grad():
            for layer in base.layers:
                a, m = layer.self_attn, layer.mlp
                window = getattr(config, "sliding_window", None) if mistral else getattr(a, "sliding_window", None)
                layers.append(DecoderLayerWeights(
                    input_norm=layer.input_layernorm.weight,
                    qkv_weight=torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
                    qkv_bias=_cat_bias(a.q_proj, a.k_proj, a.v_proj),
                    o_weight=a.o_proj.weight, o_bias=a.o_proj.bias,
                    post_norm=layer.post_attention_layernorm.weight,
                    gate_up_weight=torch.cat([m.gate_proj.weight, m.up_proj.weight]),
                    gate_up_bias=_cat_bias(m.gate_proj, m.up_proj),
                    down_weight=m.down_proj.weight, down_bias=m.down_proj.bias,
                    scaling=float(a.scaling), sliding_window=window,
                ))
        first = base.layers[0].self_attn
        return cls(base.embed_tokens.weight, layers, base.norm.weight, float(base.norm.variance_epsilon),
                   base.rotary_emb, config.num_attention_heads, config.num_key_value_heads, first.head_dim)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: Any) -> torch.Tensor:
        """``input_ids``, ``positions [T]`` -> the last hidden states ``[T, H]``. ``metadata``: the step's
        :class:`~pagedkv.engine.attention.AttentionMetadata`, or a dict from layer index to its group's."""
        t = input_ids.shape[0]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        h = F.embedding(input_ids, self.embed_weight)  # [T, H]
        cos, sin = self.rotary_emb(h[None], positions[None])  # [1, T, D] each, in h's dtype
        cos, sin = cos[0], sin[0]
        residual: torch.Tensor | None = None
        if cpu_ops.serves(h):
            # float32 on a CPU: the compiled norm, rotary and SiLU (pagedkv.engine.cpu_ops), one pass each, in place
            # where they can be, and every activation in the workspace's buffers (no page faults per layer)
            ws, hidden = self.workspace, h.shape[1]
            for i, w in enumerate(self.layers):
                first = ws.take("x", t, hidden, h) if residual is None else None  # later layers: over h
                x, residual = cpu_ops.fused_add_rms_norm(h, w.input_norm, self.eps, residual, out=first)
                qkv = linear_into(x, w.qkv_weight, w.qkv_bias, ws.take("qkv", t, w.qkv_weight.shape[0], h))
                qk = cpu_ops.rotary_embedding(qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d), cos, sin)  # in place
                v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
                attn = paged_attention(qk[:, :hq], qk[:, hq:], v, i, metadata, w.scaling, w.sliding_window,
                                       out=ws.take("attn", t, hq * d, h).view(t, hq, d))  # [T, Hq, D]
                h = linear_into(attn.view(t, hq * d), w.o_weight, w.o_bias, ws.take("o", t, hidden, h))  # [T, H]
                x, residual = cpu_ops.fused_add_rms_norm(h, w.post_norm, self.eps, residual)  # over h
                h = mlp_into(x, w, ws, ws.take("down", t, hidden, h))
            x, _ = cpu_ops.fused_add_rms_norm(h, self.final_norm, self.eps, residual, out=torch.empty_like(h))
            return x  # a tensor of its own: the workspace is overwritten by the next step
        for i, w in enumerate(self.layers):
            x, residual = rms_norm(h, w.input_norm, self.eps, residual)
            qkv = F.linear(x, w.qkv_weight, w.qkv_bias)  # [T, (Hq + 2·Hkv)·D]
            qk = apply_rotary(qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d), cos, sin)  # [T, Hq + Hkv, D]
            v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
            attn = paged_attention(qk[:, :hq], qk[:, hq:], v, i, metadata, w.scaling, w.sliding_window)  # [T, Hq, D]
            h = F.linear(attn.reshape(t, hq * d), w.o_weight, w.o_bias)  # [T, H]
            x, residual = rms_norm(h, w.post_norm, self.eps, residual)
            h = F.linear(silu_and_mul(F.linear(x, w.gate_up_weight, w.gate_up_bias)), w.down_weight, w.down_bias)
        x, _ = rms_norm(h, self.final_norm, self.eps, residual)
        return x

    __call__ = forward
