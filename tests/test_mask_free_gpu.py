"""On a GPU, prefill chunks and a question's read build no mask and give the masked path's logits (skips without
CUDA). The CPU test of the same routing is tests/test_code_attention.py; this one runs the real kernels: flash
attention's bottom-right diagonal in bfloat16, the fallback (an explicit mask with grouped heads) in float32."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from docfuse.runtime import session
from docfuse.runtime.kv import TieredCache, read_question
from docfuse.runtime.kv import code_attention as ca

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the mask-free path runs on a CUDA device")


def model(dtype: torch.dtype) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=2, hidden_size=512, num_attention_heads=8, num_key_value_heads=2,
                         intermediate_size=1024, vocab_size=512, max_position_embeddings=8192)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).eval().to("cuda", dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cache_kind", ["dynamic", "tiered"])
def test_chunks_and_a_question_without_a_mask_give_the_masked_logits(dtype, cache_kind, monkeypatch) -> None:
    m = model(dtype)
    ids = torch.randint(0, 512, (3000,), generator=torch.Generator().manual_seed(1)).tolist()
    question = torch.randint(0, 512, (1, 23), generator=torch.Generator().manual_seed(2)).cuda()
    masks: list[object] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        masks.append(kwargs.get("attn_mask"))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)

    def run(free: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(ca, "MASK_FREE_ON_ACCELERATORS", free)
        cache = DynamicCache(config=m.config) if cache_kind == "dynamic" else TieredCache(m.config, {})
        with torch.inference_mode():
            out = [session.forward_tokens(m, cache, ids[i: i + 1024]).float() for i in range(0, len(ids), 1024)]
            if cache_kind == "tiered":
                out.append(read_question(m, cache, question).float())
        return out

    masked = run(False)
    assert any(isinstance(x, torch.Tensor) for x in masks)  # the anchor built masks
    masks.clear()
    free = run(True)
    assert masks and not any(type(x) is torch.Tensor and x.dim() == 4 for x in masks)  # no mask of transformers
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for a, b in zip(masked, free):
        assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 1 - tol
        assert a.argmax() == b.argmax()
