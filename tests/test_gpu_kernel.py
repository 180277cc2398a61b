"""GPU fast path: the fused tier kernel against the fp32 reference, and its wiring into TieredCache decode.

CPU tests cover the reference math and the wiring (the attention function uses the reference off-GPU); the kernel
tests skip cleanly where Triton or CUDA is missing (CI).
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from docfuse.runtime.gpu import attention_kernel as ak
from docfuse.runtime.gpu.kernel_cache import KernelTieredCache, register_attention
from docfuse.runtime.gpu.reference import tiered_decode_reference
from docfuse.runtime.kv import TieredCache, code_attention
from docfuse.runtime.kv.association import AssociationStore
from docfuse.runtime.session import cache_kwarg

GPU = pytest.mark.skipif(not (ak.HAS_TRITON and torch.cuda.is_available()), reason="needs Triton and a CUDA GPU")


def tiers(b: int, hkv: int, d: int, n_core: int, n_assoc: int, device: str, dtype=torch.bfloat16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    core_k = torch.randn(b, hkv, n_core + 5, d, generator=g).to(device, dtype)  # spare capacity, as in the cache
    core_v = torch.randn(b, hkv, n_core + 5, d, generator=g).to(device, dtype)
    assoc = None
    if n_assoc:
        ak_ = (torch.randn(b, hkv, n_assoc, d, generator=g) * torch.linspace(0.2, 3, d)).to(device, dtype)
        av_ = torch.randn(b, hkv, n_assoc, d, generator=g).to(device, dtype)
        assoc = AssociationStore.build(ak_, av_, 4, 32)
    return core_k, core_v, assoc


def naive(q, core_k, core_v, n_core, assoc, scale):
    """Independent oracle: dequantise, repeat KV heads, plain softmax in float64."""
    k, v = core_k[:, :, :n_core].double(), core_v[:, :, :n_core].double()
    if assoc is not None:
        dk, dv = assoc.dequantize(torch.float32)
        k, v = torch.cat([dk.double(), k], 2), torch.cat([dv.double(), v], 2)
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    w = torch.softmax((q.double().unsqueeze(2) @ k.transpose(-1, -2)) * scale, -1)
    return (w @ v).squeeze(2)


@pytest.mark.parametrize("n_core,n_assoc", [(40, 77), (70, 0), (3, 300)])
def test_reference_matches_naive_attention(n_core: int, n_assoc: int) -> None:
    core_k, core_v, assoc = tiers(2, 2, 64, n_core, n_assoc, "cpu", torch.float32)
    q = torch.randn(2, 8, 64)
    ref = tiered_decode_reference(q, core_k, core_v, n_core, assoc, 0.125)
    torch.testing.assert_close(ref.double(), naive(q, core_k, core_v, n_core, assoc, 0.125), rtol=1e-5, atol=1e-5)


def test_kernel_support_rules() -> None:
    _, _, assoc = tiers(1, 1, 64, 4, 40, "cpu")
    assert ak.kernel_supports(assoc, 64) and ak.kernel_supports(None, 128)
    assert not ak.kernel_supports(assoc, 96)  # head size not a power of two
    k = torch.randn(1, 1, 40, 64)
    assert not ak.kernel_supports(AssociationStore.build(k, k, 8, 32), 64)  # only 4-bit codes are fused
    assert not ak.kernel_supports(AssociationStore.build(k, k, 4, 32, key_bits=8), 64)  # keys 8-bit: reference path
    pages = torch.zeros(1, 1, 40, dtype=torch.long)
    assert not ak.kernel_supports(AssociationStore.build(k, k, 4, 32, pages), 64)  # differential: reference path


def tiny(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(num_hidden_layers=2, hidden_size=256, num_attention_heads=8, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=256, max_position_embeddings=2048)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).eval()


def greedy_logits(model, cache, ids: torch.Tensor, steps: int) -> torch.Tensor:
    with torch.no_grad():
        kw = {cache_kwarg(model): cache}
        model(input_ids=ids, **kw)
        cache.retier()
        tok, out = ids[:, -1:], []
        for _ in range(steps):
            logits = model(input_ids=tok, **kw).logits[:, -1]
            out.append(logits)
            tok = logits.argmax(-1, keepdim=True)
    return torch.stack(out)


def fused_vs_plain(device: str, dtype: torch.dtype, monkeypatch) -> tuple[torch.Tensor, torch.Tensor, int]:
    model = tiny().to(device, dtype)
    ids = torch.randint(0, 256, (1, 300), generator=torch.Generator().manual_seed(3)).to(device)
    kv = {"core_tokens": 40, "association_tokens": 100, "recent_tokens": 8, "page_tokens": 16,
          "association_bits": 4}  # the kernel reads 4-bit codes only
    plain = greedy_logits(model, TieredCache(model.config, kv), ids, 3)
    calls = []
    from docfuse.runtime.gpu import kernel_cache

    real = kernel_cache.KernelTieredLayer.decode_attention
    monkeypatch.setattr(kernel_cache.KernelTieredLayer, "decode_attention",
                        lambda self, q, s: calls.append(self.layer_idx) or real(self, q, s))
    model.config._attn_implementation = register_attention()
    fused = greedy_logits(model, KernelTieredCache(model.config, kv), ids, 3)
    return plain, fused, len(calls)


def test_fused_decode_path_matches_tiered_cache_on_cpu(monkeypatch) -> None:
    """Off-GPU the fused path attends through the fp32 reference: same logits as TieredCache's own decode."""
    plain, fused, calls = fused_vs_plain("cpu", torch.float32, monkeypatch)
    assert calls == 3 * 2  # every decode step of every layer went through the fused path
    torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-4)
    assert not getattr(code_attention._handover, "layers", {})  # no layer left waiting for an attention call


def test_multi_token_steps_fall_back_to_sdpa() -> None:
    model = tiny()
    model.config._attn_implementation = register_attention()
    ids = torch.randint(0, 256, (1, 50), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        cache = KernelTieredCache(model.config, {"core_tokens": 1.0})
        a = model(input_ids=ids, **{cache_kwarg(model): cache}).logits
        assert cache.get_seq_length() == 50
        model.config._attn_implementation = "sdpa"
        b = model(input_ids=ids).logits
    torch.testing.assert_close(a, b)


# ---- GPU: the Triton kernel -------------------------------------------------------------------------------------
@GPU
@pytest.mark.parametrize("b,hkv,group,d,n_core,n_assoc", [
    (1, 8, 4, 128, 1000, 2500), (2, 2, 4, 128, 77, 301), (1, 4, 1, 64, 513, 0), (1, 2, 8, 128, 5, 4096),
    (3, 1, 2, 64, 64, 33)])
def test_kernel_matches_fp32_reference(b, hkv, group, d, n_core, n_assoc) -> None:
    torch.manual_seed(n_core + n_assoc)
    core_k, core_v, assoc = tiers(b, hkv, d, n_core, n_assoc, "cuda", seed=n_core)
    q = torch.randn(b, hkv * group, d, device="cuda", dtype=torch.bfloat16)
    ref = tiered_decode_reference(q, core_k, core_v, n_core, assoc, d ** -0.5)
    for splits in (None, 1, 7):
        out = ak.tiered_decode_attention(q, core_k, core_v, n_core, assoc, d ** -0.5, splits=splits)
        torch.cuda.synchronize()
        assert out.shape == q.shape and out.dtype == torch.bfloat16 and torch.isfinite(out).all()
        rel = ((out.float() - ref).norm() / ref.norm()).item()
        assert rel <= 1e-2, (splits, rel)


@GPU
def test_fused_decode_path_matches_tiered_cache_on_gpu(monkeypatch) -> None:
    plain, fused, calls = fused_vs_plain("cuda", torch.bfloat16, monkeypatch)
    assert calls == 3 * 2
    rel = ((fused.float() - plain.float()).norm() / plain.float().norm()).item()
    assert rel <= 2e-2, rel


@GPU
def test_cuda_graph_decode_matches_eager_fused_decode() -> None:
    from docfuse.runtime.gpu.decode_graph import GraphDecoder

    model = tiny().to("cuda", torch.bfloat16)
    model.config._attn_implementation = register_attention()
    ids = torch.randint(0, 256, (1, 300), generator=torch.Generator().manual_seed(5)).to("cuda")
    kv = {"core_tokens": 40, "association_tokens": 100, "recent_tokens": 8, "page_tokens": 16,
          "association_bits": 4}  # the kernel reads 4-bit codes only
    eager = greedy_logits(model, KernelTieredCache(model.config, kv), ids, 6)
    cache = KernelTieredCache(model.config, kv)
    with torch.no_grad():
        first = model(input_ids=ids, **{cache_kwarg(model): cache}).logits[:, -1:].argmax(-1)
    cache.retier()
    dec = GraphDecoder(model, cache, max_new=8, first_token=ids[:, -1:], warmup=2)
    got = []
    for _ in range(4):
        dec.step()
        got.append(dec.logits.clone())
    dec.close()
    assert cache.get_seq_length() == 306 and cache.tier_tokens()["core"] == 46
    rel = ((torch.stack(got).float() - eager[2:].float()).norm() / eager[2:].float().norm()).item()
    assert rel <= 2e-2, rel
    assert first.shape == (1, 1)
