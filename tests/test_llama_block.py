"""The one explicit Llama block against transformers' own ``LlamaDecoderLayer`` forward.

Tiny random configurations in float32, with grouped-query attention and positions that do not start at zero: the
block, run through the layer-major prefill's attention hook in chunks, must give the layer's output and the K/V it
caches to float32 rounding.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from docfuse.runtime.kv import TieredCache
from docfuse.runtime.layer_prefill import DocumentAttention, layer_major_prefill
from docfuse.runtime.llama_block import LlamaBlock

TIGHT = {"rtol": 1e-5, "atol": 1e-5}


def tiny(seed: int = 0, **overrides) -> LlamaForCausalLM:
    """Two layers, 8 query heads over 2 KV heads, norms and biases that are not the identity."""
    torch.manual_seed(seed)
    config = LlamaConfig(**{"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 8,
                            "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 128,
                            "rms_norm_eps": 1e-5, "rope_theta": 500.0, "attention_bias": True, **overrides})
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
    return model


def explicit(layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, chunks: list[int]
             ) -> tuple[torch.Tensor, DocumentAttention]:
    """The block over ``x`` [B, L, hidden], chunk by chunk through the prefill's hook; its output and the hook."""
    block = LlamaBlock(layer)
    b, length, _ = x.shape
    keys = x.new_zeros(b, block.kv_heads, length, block.head_dim)
    attend = DocumentAttention(keys, torch.zeros_like(keys), cos.unsqueeze(1), sin.unsqueeze(1), block.scaling, 4)
    outs, start = [], 0
    for size in chunks:
        outs.append(block(x[:, start: start + size], attend))
        start += size
    assert start == length
    return torch.cat(outs, dim=1), attend


@pytest.mark.parametrize("offset,chunks", [(0, [45]), (300, [45]), (1000, [20, 1, 24])])
def test_block_equals_transformers_decoder_layer_with_gqa_and_offset_positions(offset: int, chunks: list[int]
                                                                               ) -> None:
    model = tiny()
    layer = model.model.layers[1]
    x = torch.randn(2, sum(chunks), 64)
    positions = torch.arange(offset, offset + x.shape[1]).unsqueeze(0)
    cos, sin = model.model.rotary_emb(x, position_ids=positions)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        want = layer(x, position_embeddings=(cos, sin), cache=cache, use_cache=True)
        got, attend = explicit(layer, x, cos, sin, chunks)
    torch.testing.assert_close(got, want, **TIGHT)
    torch.testing.assert_close(attend.keys, cache.layers[1].keys, **TIGHT)  # K after RoPE at those positions
    torch.testing.assert_close(attend.values, cache.layers[1].values, **TIGHT)


def test_one_token_after_a_prefix_equals_the_layer_over_its_cache() -> None:
    model = tiny(seed=3)
    layer = model.model.layers[0]
    x = torch.randn(1, 31, 64)
    cos, sin = model.model.rotary_emb(x, position_ids=torch.arange(31).unsqueeze(0))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        layer(x[:, :30], position_embeddings=(cos[:, :30], sin[:, :30]), cache=cache, use_cache=True)
        want = layer(x[:, 30:], position_embeddings=(cos[:, 30:], sin[:, 30:]), cache=cache, use_cache=True)
        got, _ = explicit(layer, x, cos, sin, [30, 1])
    torch.testing.assert_close(got[:, 30:], want, **TIGHT)


def test_the_block_skips_its_mlp_only_when_asked() -> None:
    model = tiny(seed=1)
    block = LlamaBlock(model.model.layers[0])
    x = torch.randn(1, 9, 64)
    cos, sin = model.model.rotary_emb(x, position_ids=torch.arange(9).unsqueeze(0))

    def hook() -> DocumentAttention:
        keys = x.new_zeros(1, block.kv_heads, 9, block.head_dim)
        return DocumentAttention(keys, torch.zeros_like(keys), cos.unsqueeze(1), sin.unsqueeze(1), block.scaling, 4)

    with torch.no_grad():
        full = sum(block.forward(x, None, hook()))
        attention_only = sum(block.forward(x, None, hook(), skip_mlp=True))
        mlp = model.model.layers[0].mlp(model.model.layers[0].post_attention_layernorm(attention_only))
    torch.testing.assert_close(full, attention_only + mlp, **TIGHT)


def test_layers_that_are_not_the_llama_block_are_refused() -> None:
    gelu = tiny(hidden_act="gelu")
    assert not LlamaBlock.fits(gelu.model.layers[0]) and LlamaBlock.fits(tiny().model.layers[0])
    with pytest.raises(ValueError, match="not the Llama block"):
        layer_major_prefill(gelu, TieredCache(gelu.config, {"query_tokens": 4}), torch.zeros(1, 8, dtype=torch.long))
