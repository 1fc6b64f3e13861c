"""The fast runner: the Llama family's forward pass in plain torch over the checkpoint's own weights.

Covers LlamaForCausalLM and its close kin (SmolLM2, Llama 2/3, Mistral, Qwen2 with its q/k/v bias): pre-norm
decoder layers of RMSNorm, grouped-query attention with rotary positions, and a SiLU-gated MLP. What it does
that Hugging Face's eager modules do not:
- q/k/v are one fused projection, gate/up are fused into the MLP's kernels (docs/kernels.md);
- every projection's weight is packed once at load for the runner's own GEMM kernel (model_runner/gemm.py), and
  elementwise work rides on the GEMM as a post-op (SiLU on gate, the product with up, the residual adds);
- a decode layer is 9 kernel calls: two RMSNorms, rotary positions with the KV store, attention, five GEMMs;
- decode attention reads each sequence's paged KV only to its own length (model_runner/attention.py);
- logits only for the rows that sample.
The reference runner (the Hugging Face modules, `--runner hf`) stays for verification and other architectures.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from model_runner import gemm, host_memory, prefill_attention
from model_runner.attention import DecodeOps, decode_layers_op, decode_ops, reference_decode_attention
from model_runner.cuda_graphs import DecodeGraphs
from model_runner.prefill_attention import causal_attention

log = logging.getLogger(__name__)

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


def supports(model_dir: Path) -> str:
    """'' when the fast runner can serve this checkpoint, else why not."""
    config = json.loads((model_dir / "config.json").read_text())
    arch = (config.get("architectures") or ["?"])[0]
    if arch not in ARCHITECTURES:
        return f"architecture {arch} (the fast runner covers {', '.join(ARCHITECTURES)})"
    if config.get("sliding_window") and config.get("use_sliding_window", arch == "MistralForCausalLM"):
        return "sliding-window attention"
    if config.get("hidden_act", "silu") != "silu":
        return f"hidden_act {config.get('hidden_act')}"
    if not list(model_dir.glob("*.safetensors")):
        return "no safetensors weights"
    return ""


class Linear:
    """y = x @ W.T (+ bias), W packed once at load for the runner's own GEMM kernel (model_runner/gemm.py: it
    streams the weight once for up to 16 rows, at 1.5-2.3x oneDNN's rate at decode shapes, and as fast as oneDNN
    at prefill shapes; docs/kernels.md). SiLU, the gate-up product and the residual adds ride on the GEMM as
    post-ops. Each output is reduced over K in one fixed order, so a row gets the same bits alone or in any batch,
    in decode and prefill alike. Where the kernel cannot run (another device, no compiler) F.linear serves."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 arena: host_memory.Arena | None = None, few_prompt_rows: bool = False) -> None:
        self.bias = bias
        self.weight = gemm.pack(weight, arena, few_prompt_rows)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes

    def __call__(self, x: torch.Tensor, prompt: bool = False) -> torch.Tensor:
        return gemm.linear(x, self.weight, self.bias, prompt=prompt)

    def silu(self, x: torch.Tensor, prompt: bool = False) -> torch.Tensor:
        return gemm.linear(x, self.weight, self.bias, post="silu", prompt=prompt)

    def times(self, x: torch.Tensor, other: torch.Tensor, prompt: bool = False) -> torch.Tensor:
        """(x @ W.T) * other"""
        return gemm.linear(x, self.weight, self.bias, post="mul", other=other, prompt=prompt)

    def plus(self, x: torch.Tensor, other: torch.Tensor, prompt: bool = False) -> torch.Tensor:
        """(x @ W.T) + other: a residual add"""
        return gemm.linear(x, self.weight, self.bias, post="add", other=other, prompt=prompt)


@dataclass
class Layer:
    input_norm: torch.Tensor
    qkv: Linear
    o: Linear
    post_norm: torch.Tensor
    gate: Linear
    up: Linear
    down: Linear


@dataclass
class DecodeBatch:
    """One decode step's rows: each sequence's block table and how many tokens it attends to (its new one
    included, already written to the cache by the step)."""

    positions: torch.Tensor  # (B,) long: where each new token goes
    slots: torch.Tensor  # (B,) long: its slot in the paged cache (block * block_size + offset)
    block_tables: torch.Tensor  # (B, max_blocks) int32
    context_lens: torch.Tensor  # (B,) int32 = positions + 1
    meta: torch.Tensor | None = None  # on a GPU: the (B, 3 + max_blocks) int64 tensor the fields above view

    @staticmethod
    def packed(meta: torch.Tensor) -> DecodeBatch:
        """Views of rows (position, slot, context length, block table...): how a GPU step's metadata travels."""
        return DecodeBatch(positions=meta[:, 0], slots=meta[:, 1], context_lens=meta[:, 2],
                           block_tables=meta[:, 3:], meta=meta)


class LlamaRunner:
    """The fast runner, behind the runner protocol (loading.Runner)."""

    name = "fast"

    def __init__(self, config: Any, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device, max_model_len: int) -> None:
        self.dtype, self.device = dtype, device
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.eps = config.rms_norm_eps
        self.scale = self.head_dim ** -0.5
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim

        def take(name: str) -> torch.Tensor:
            return weights.pop(name).to(device=device, dtype=dtype).contiguous()

        self.embed = take("model.embed_tokens.weight")
        # on the CPU the packed weights go onto huge pages, one after another in the order a step reads them
        arena = host_memory.Arena() if device.type == "cpu" else None
        self.layers = []
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            qkv = torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
            bias = None
            if p + "self_attn.q_proj.bias" in weights:  # Qwen2
                bias = torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
            self.layers.append(Layer(
                input_norm=take(p + "input_layernorm.weight"),
                qkv=Linear(qkv, bias, arena),
                o=Linear(take(p + "self_attn.o_proj.weight"), arena=arena),
                post_norm=take(p + "post_attention_layernorm.weight"),
                gate=Linear(take(p + "mlp.gate_proj.weight"), arena=arena),
                up=Linear(take(p + "mlp.up_proj.weight"), arena=arena),
                down=Linear(take(p + "mlp.down_proj.weight"), arena=arena),
            ))
        self.norm = take("model.norm.weight")
        head = weights.pop("lm_head.weight", None)
        self.lm_head = Linear((self.embed if head is None else head.to(device=device, dtype=dtype)).contiguous(),
                              arena=arena, few_prompt_rows=True)  # a prompt pass's logits: its last rows only
        self.cos, self.sin = _rope_tables(config, max_model_len, dtype, device)
        self._layer_weights = _layer_weights(self.layers, dtype)
        # the prompt-attention kernel where it runs (its SDPA fallback is not chunk-invariant: used wholly or not)
        self._causal_kernel = device.type == "cpu" and prefill_attention.kernel_path(self.head_dim, dtype) != "torch"
        # decode steps replay CUDA graphs where the attention kernel reads each row to its own length (a padded
        # row then costs nothing); PDSERVE_CUDA_GRAPHS=0 runs them eagerly
        self.graphs = None
        if device.type == "cuda" and decode_ops(device, dtype).attend is not reference_decode_attention and (
                os.environ.get("PDSERVE_CUDA_GRAPHS", "1") != "0"):
            self.graphs = DecodeGraphs(self._decode, DecodeBatch.packed, max_model_len, device)

    @classmethod
    def load(cls, model_dir: Path, dtype: torch.dtype, device: torch.device, max_model_len: int) -> LlamaRunner:
        from safetensors.torch import load_file
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_dir)
        weights: dict[str, torch.Tensor] = {}
        for path in sorted(model_dir.glob("*.safetensors")):
            weights.update(load_file(path))
        return cls(config, weights, dtype, device, max_model_len)

    def weight_bytes(self) -> int:
        """Bytes of weights a decode step reads: all but the embedding table, of which it reads one row a token."""
        norms = [self.norm] + [norm for layer in self.layers for norm in (layer.input_norm, layer.post_norm)]
        linears = [self.lm_head] + [lin for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate,
                                                                             layer.up, layer.down)]
        return sum(t.numel() * t.element_size() for t in norms) + sum(lin.nbytes for lin in linears)

    # Prefill: right-padded prompts over a Hugging Face-style cache (model_runner/forward.py's WatchedCache).
    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor, lengths: list[int], start: int, cache: Any) -> torch.Tensor:
        """input_ids (B, T): prompts of `lengths` tokens, right-padded, at positions start..start+T-1 (start > 0
        only for one prompt continuing its cache); `cache.update(keys, values, layer)` takes (B, Hkv, T, D) and
        returns the whole cached (B, Hkv, start+T, D). Returns each prompt's last position's logits (B, vocab)."""
        batch, width = input_ids.shape
        tokens = batch * width
        ops = decode_ops(self.device, self.dtype)
        x = F.embedding(input_ids.reshape(-1), self.embed)  # (B*T, H)
        positions = torch.arange(start, start + width, device=self.device)
        cos, sin = self.cos[positions], self.sin[positions]  # (T, D)
        # On the CPU, the decode step's rotary kernel (_rope_rows), ~3x torch's ops here
        fresh = None
        if self.device.type == "cpu":
            cos, sin = cos.repeat(batch, 1), sin.repeat(batch, 1)  # (B*T, D)
            fresh = self._fresh_rows(tokens)
        # bottom-right causal mask: query t (absolute start + t) sees keys 0..start + t
        mask = None
        if start:
            mask = torch.ones(width, start + width, dtype=torch.bool, device=self.device).tril(start)

        def attend(index: int, qkv: torch.Tensor) -> torch.Tensor:
            if fresh is not None:
                q = self._rope_rows(ops, qkv, cos, sin, fresh).view(batch, width, self.num_heads, -1).transpose(1, 2)
                k, v = (rows[0].view(batch, width, self.num_kv_heads, -1).transpose(1, 2) for rows in fresh)
            else:
                rotated, _ = _rope(qkv.view(batch, width, -1), self.q_size + self.kv_size, cos, sin, self.head_dim)
                q = rotated[:, :, : self.num_heads].transpose(1, 2)  # (B, Hq, T, D)
                k = rotated[:, :, self.num_heads :].transpose(1, 2)  # (B, Hkv, T, D)
                v = qkv.view(batch, width, -1)[..., self.q_size + self.kv_size :].view(
                    batch, width, self.num_kv_heads, self.head_dim).transpose(1, 2)
            keys, values = cache.update(k.contiguous(), v.contiguous(), index)
            return self._prompt_attention(q, keys, values, lengths, start, mask).view(tokens, -1)

        x = self._layers(ops, x, attend, prompt=True)
        rows = torch.tensor([row * width + length - 1 for row, length in enumerate(lengths)], device=self.device)
        return self.lm_head(ops.rms_norm(x[rows], self.norm, self.eps), prompt=True)

    @property
    def replays(self) -> bool:
        """Whether `replay` serves: on the CPU, where a decode step's arithmetic is a function of the row alone
        (its GEMMs are batch invariant: F.linear, where the kernel cannot be built, is not)."""
        return self.device.type == "cpu" and self.lm_head.weight.blocked

    # Replay: tokens that decode steps generated (a migrated stream's), run again with a decode step's arithmetic.
    @torch.inference_mode()
    def replay(self, input_ids: torch.Tensor, start: int, cache: Any) -> torch.Tensor:
        """input_ids (T,): one sequence's tokens at positions start..start+T-1, after the `start` positions
        `cache` holds (prefill's WatchedCache protocol). Each row is computed as the decode step that read it
        computed it: the same GEMM kernel (a row's bits never depend on its company), the decode step's RMSNorm
        and rotary kernels, and decode attention reading the sequence up to the row's own position. So a stream
        migrated to another worker continues from the bits an uninterrupted run holds, where prefill's
        arithmetic (its own attention kernel) rounds differently. Returns the last
        position's logits (1, vocab). Only where `replays`."""
        ops = decode_ops(self.device, self.dtype)
        width = input_ids.shape[0]
        positions = torch.arange(start, start + width, device=self.device)
        cos, sin = self.cos[positions], self.sin[positions]
        fresh = self._fresh_rows(width)
        # the whole cache as one block of a paged cache: row i reads positions 0..start+i
        tables = torch.zeros(width, 1, dtype=torch.int32, device=self.device)
        lengths = (positions + 1).to(torch.int32)

        def attend(index: int, qkv: torch.Tensor) -> torch.Tensor:
            q = self._rope_rows(ops, qkv, cos, sin, fresh)
            keys, values = cache.update(fresh[0, 0].transpose(0, 1)[None], fresh[1, 0].transpose(0, 1)[None], index)
            # (1, Hkv, start + T, D) -> (1 block, start + T tokens, Hkv, D), strided
            return ops.attend(q, keys[0].transpose(0, 1)[None], values[0].transpose(0, 1)[None], tables, lengths,
                              self.scale).view(width, self.q_size)

        x = self._layers(ops, F.embedding(input_ids, self.embed), attend)  # (T, H)
        return self.lm_head(ops.rms_norm(x[-1:], self.norm, self.eps))

    # Decode: one token per sequence over the paged cache.
    @torch.inference_mode()
    def decode(self, input_ids: torch.Tensor, batch: DecodeBatch, kv: torch.Tensor) -> torch.Tensor:
        """input_ids (B,); kv (layers, 2, num_blocks, block_size, Hkv, D). Returns logits (B, vocab); on a GPU
        with CUDA graphs they live in the graph's output buffer, valid until the next step."""
        if self.graphs is not None and batch.meta is not None:
            return self.graphs(input_ids, batch.meta, kv)
        return self._decode(input_ids, batch, kv)

    def step(self, input_ids: torch.Tensor, batch: DecodeBatch, cache: Any) -> torch.Tensor:
        """`decode` over a paged_cache.PagedKVCache (the runner protocol's step)."""
        return self.decode(input_ids, batch, cache.kv)

    def _decode(self, input_ids: torch.Tensor, batch: DecodeBatch, kv: torch.Tensor) -> torch.Tensor:
        ops = decode_ops(self.device, self.dtype)
        x = F.embedding(input_ids, self.embed)  # (B, H)
        cos, sin = self.cos[batch.positions], self.sin[batch.positions]  # (B, D)
        weights = self._layer_weights
        layers = decode_layers_op(self.device, self.dtype) if weights is not None else None
        if weights is not None and layers is not None:  # the loop below in C++: same kernels and order, ~1 ms less
            tensors, biases, out_features, gemm_path = weights
            x = layers(x, cos, sin, kv, batch.slots, batch.block_tables, batch.context_lens, tensors, biases,
                       out_features, self.eps, self.scale, self.num_heads, self.num_kv_heads, gemm_path)
            return self.lm_head(ops.rms_norm(x, self.norm, self.eps))

        def attend(index: int, qkv: torch.Tensor) -> torch.Tensor:
            key_cache, value_cache = kv[index, 0], kv[index, 1]
            q = ops.rope_and_store(qkv, cos, sin, key_cache, value_cache, batch.slots, self.num_heads,
                                   self.num_kv_heads)
            attn = ops.attend(q, key_cache, value_cache, batch.block_tables, batch.context_lens, self.scale)
            return attn.view(qkv.shape[0], self.q_size)

        x = self._layers(ops, x, attend)
        return self.lm_head(ops.rms_norm(x, self.norm, self.eps))

    def _prompt_attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: list[int],
                          start: int, mask: torch.Tensor | None) -> torch.Tensor:
        """Causal attention of each prompt over its own positions only, never its padding. q (B, Hq, T, D),
        keys/values (B, Hkv, start + T, D); returns (B, T, Hq * D).

        On the CPU the C++ kernel (model_runner/prefill_attention.py) gives row t the same bits whatever the
        chunking or the batch. SDPA (elsewhere) picks its blocking from the sequence length, so there a prompt is
        at least never attended within a wider padded batch."""
        batch, _, width, _ = q.shape
        if self._causal_kernel:
            out = q.new_zeros(batch, width, self.q_size)
            for row, length in enumerate(lengths):
                one = causal_attention(q[row, :, :length], keys[row, :, : start + length],
                                       values[row, :, : start + length], self.scale, start)  # (Hq, T_row, D)
                out[row, :length] = one.transpose(0, 1).reshape(length, -1)
            return out
        if batch == 1 and lengths[0] == width:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=mask is None,
                                                 scale=self.scale, enable_gqa=True)
            return out.transpose(1, 2).reshape(1, width, -1)
        out = q.new_zeros(batch, width, self.q_size)
        for row, length in enumerate(lengths):
            one = F.scaled_dot_product_attention(q[row : row + 1, :, :length], keys[row : row + 1, :, :length],
                                                 values[row : row + 1, :, :length], is_causal=True,
                                                 scale=self.scale, enable_gqa=True)  # (1, Hq, T_row, D)
            out[row, :length] = one[0].transpose(0, 1).reshape(length, -1)
        return out

    def _layers(self, ops: DecodeOps, x: torch.Tensor, attend: Callable[[int, torch.Tensor], torch.Tensor],
                prompt: bool = False) -> torch.Tensor:
        """The decoder layers over rows x (R, H), written once for every pass: each pass brings its own attention,
        `attend(layer index, qkv (R, ...))` -> (R, Hq * D), which places its rows' keys and values where that pass
        keeps them. The rest is every pass's, so a replayed row gets a decode step's bits. `prompt`: the GEMMs take
        a prompt's path (gemm.linear)."""
        for index, layer in enumerate(self.layers):
            qkv = layer.qkv(ops.rms_norm(x, layer.input_norm, self.eps), prompt=prompt)
            x = layer.o.plus(attend(index, qkv), x, prompt=prompt)
            h = ops.rms_norm(x, layer.post_norm, self.eps)
            x = layer.down.plus(layer.up.times(h, layer.gate.silu(h, prompt), prompt), x, prompt)
        return x

    def _fresh_rows(self, rows: int) -> torch.Tensor:
        """Scratch for _rope_rows: `rows` rows' keys and values, (2, 1 block, rows, Hkv, D)."""
        return torch.empty(2, 1, rows, self.num_kv_heads, self.head_dim, dtype=self.dtype, device=self.device)

    def _rope_rows(self, ops: DecodeOps, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   fresh: torch.Tensor) -> torch.Tensor:
        """The decode step's rotary kernel over rows that are not in a paged cache: q (R, Hq, D) rotated is
        returned, the rows' rotated keys and their values land in `fresh` (_fresh_rows(R)), row i at slot i."""
        slots = torch.arange(qkv.shape[0], device=self.device)
        return ops.rope_and_store(qkv, cos, sin, fresh[0], fresh[1], slots, self.num_heads, self.num_kv_heads)


def _layer_weights(layers: list[Layer], dtype: torch.dtype) -> tuple[list[torch.Tensor], list[torch.Tensor | None],
                                                                      list[int], str] | None:
    """What decode_layers takes for the layers (per layer: input norm, qkv, o, post norm, gate, up, down; the
    five linears' biases and rows; their one kernel mode), or None where a linear is not packed for the kernel
    in this dtype (the Python loop serves then)."""
    linears = [lin for layer in layers for lin in (layer.qkv, layer.o, layer.gate, layer.up, layer.down)]
    modes = {lin.weight.mode for lin in linears}
    if len(modes) != 1 or None in modes or any(lin.weight.data.dtype != dtype for lin in linears):
        return None
    tensors = [t for layer in layers for t in (layer.input_norm, layer.qkv.weight.data, layer.o.weight.data,
                                               layer.post_norm, layer.gate.weight.data, layer.up.weight.data,
                                               layer.down.weight.data)]
    return (tensors, [lin.bias for lin in linears], [lin.weight.out_features for lin in linears],
            str(modes.pop()))


def _rope(qkv: torch.Tensor, width: int, cos: torch.Tensor, sin: torch.Tensor,
          head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary positions on q and k together: qkv (B, T, ...), its first `width` columns are q then k heads;
    cos/sin (T, D) or (B, 1, D). Returns the rotated (B, T, Hq + Hkv, D) twice (q and k are slices of it)."""
    x = qkv[..., :width].unflatten(-1, (-1, head_dim))  # (B, T, Hq + Hkv, D)
    half = x.unflatten(-1, (2, head_dim // 2))
    # rotate_half(x) = cat(-x2, x1): swap the halves, and the sign lives in `sin` (its first half negated)
    swapped = half.flip(-2).flatten(-2)
    out = torch.addcmul(x * cos.unsqueeze(-2), swapped, sin.unsqueeze(-2))
    return out, out


def _rope_tables(config: Any, max_len: int, dtype: torch.dtype,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (max_len, D) exactly as the Hugging Face rotary embedding computes them (its own class, so
    every rope scaling it knows is covered), with sin's first half negated for _rope's swapped halves."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(config)
    positions = torch.arange(max_len)[None]
    cos, sin = rotary(torch.empty((), dtype=dtype), positions)
    cos, sin = cos[0], sin[0]
    half = sin.shape[-1] // 2
    sin = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)
    return cos.to(device), sin.to(device)
