"""The static decode step: the explicit Llama forward and its fused ops against transformers' own modules.

CPU tests run the torch paths of :mod:`runtime.gpu.fused_ops` and the whole explicit step against the model's own
forward over the same tiers; one test runs the Triton kernels themselves under ``TRITON_INTERPRET=1`` (in a
subprocess: the interpreter is chosen at import). The GPU tests (bf16, CUDA graphs) skip cleanly without CUDA.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from docfuse.runtime.gpu import attention_kernel as ak
from docfuse.runtime.gpu import fused_ops
from docfuse.runtime.gpu.decode_step import StaticDecode, explicit_supported
from docfuse.runtime.gpu.kernel_cache import KernelTieredCache, register_attention
from docfuse.runtime.layer_prefill import layer_major_prefill
from docfuse.runtime.session import cache_kwarg

GPU = pytest.mark.skipif(not (ak.HAS_TRITON and torch.cuda.is_available()), reason="needs Triton and a CUDA GPU")
KV = {"core_tokens": 0.1, "association_tokens": 0.25, "recent_tokens": 16, "query_tokens": 24,
      "association_bits": 4}  # the fused kernel reads 4-bit codes only
ROOT = Path(__file__).resolve().parents[1]


def tiny(seed: int = 0, layers: int = 3) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(num_hidden_layers=layers, hidden_size=128, num_attention_heads=8, num_key_value_heads=2,
                         intermediate_size=96, vocab_size=256, max_position_embeddings=4096, rms_norm_eps=1e-5)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).eval()


def prefilled(model, length: int = 700, device: str = "cpu"):
    ids = torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(2)).to(device)
    model.config._attn_implementation = register_attention()
    cache = KernelTieredCache(model.config, KV)
    tok = layer_major_prefill(model, cache, ids, chunk=256).argmax(-1, keepdim=True)
    return cache, tok


def static_logits(model, cache, tok, steps: int, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    prefix = cache.get_seq_length()
    dec = StaticDecode(model, cache, max_new=steps + 2, first_token=tok, **kw)
    logits, toks = [], []
    for _ in range(steps):
        toks.append(dec.step().clone())
        logits.append(dec.logits.clone())
    dec.close()
    assert cache.get_seq_length() == prefix + steps
    cache.rollback(prefix)
    return torch.stack(logits), torch.cat(toks, 1)


def eager_logits(model, cache, tok, steps: int) -> torch.Tensor:
    prefix = cache.get_seq_length()
    out = []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(input_ids=tok, use_cache=True, **{cache_kwarg(model): cache}).logits[:, -1]
            out.append(logits)
            tok = logits.argmax(-1, keepdim=True)
    cache.rollback(prefix)
    return torch.stack(out)


def test_explicit_step_equals_the_models_own_forward_over_the_same_tiers() -> None:
    model = tiny()
    cache, tok = prefilled(model)
    assert explicit_supported(model)
    explicit, toks = static_logits(model, cache, tok, 5)
    through_model, toks_model = static_logits(model, cache, tok, 5, explicit=False)
    eager = eager_logits(model, cache, tok, 5)
    torch.testing.assert_close(explicit, through_model, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(explicit, eager, rtol=1e-4, atol=1e-4)
    assert torch.equal(toks, toks_model)
    assert model.config._attn_implementation == "docfuse_tiered"  # restored on close
    assert all(l.graph_slot is None and l.graph_count is None for l in cache.layers)


def test_skip_set_means_the_same_on_both_paths_and_the_model_comes_back() -> None:
    model = tiny(seed=1)
    cache, tok = prefilled(model, 600)
    mlps = [b.mlp for b in model.model.layers]
    full, _ = static_logits(model, cache, tok, 3)
    explicit, _ = static_logits(model, cache, tok, 3, skip_mlp=[1])
    through_model, _ = static_logits(model, cache, tok, 3, skip_mlp=[1], explicit=False)
    torch.testing.assert_close(explicit, through_model, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(explicit, full, atol=1e-3)  # the skip set really changes the step
    assert [b.mlp for b in model.model.layers] == mlps
    with pytest.raises(ValueError, match="skip_mlp names layers"):
        StaticDecode(model, cache, max_new=4, first_token=tok, skip_mlp=[9])


def test_a_static_decoder_refuses_more_tokens_than_it_was_sized_for() -> None:
    model = tiny(layers=2)
    cache, tok = prefilled(model, 300)
    dec = StaticDecode(model, cache, max_new=2, first_token=tok)
    dec.step(), dec.step()
    with pytest.raises(RuntimeError, match="sized for 2 tokens"):
        dec.step()
    dec.close()
    with pytest.raises(RuntimeError, match="closed"):
        dec.step()
    assert cache.get_seq_length() == 302 and cache.tier_tokens()["core"] == cache.layers[0].n_core


def test_models_whose_blocks_differ_are_refused_by_the_explicit_step() -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, intermediate_size=64, vocab_size=256)
    model = Qwen3ForCausalLM(config).eval()  # q_norm / k_norm: not the Llama block
    assert not explicit_supported(model)
    cache, tok = prefilled(model, 200)
    with pytest.raises(ValueError, match="explicit=False"):
        StaticDecode(model, cache, max_new=2, first_token=tok, explicit=True)
    dec = StaticDecode(model, cache, max_new=2, first_token=tok)  # falls back to the model's forward
    assert not dec.explicit
    dec.step()
    dec.close()


def test_fused_op_reference_paths_match_transformers_modules() -> None:
    torch.manual_seed(0)
    norm = LlamaRMSNorm(64, eps=1e-5)
    norm.weight.data.uniform_(0.5, 1.5)
    x, delta = torch.randn(3, 1, 64), torch.randn(3, 1, 64)
    normed, res = fused_ops.add_rms_norm(x, delta, norm.weight, 1e-5)
    torch.testing.assert_close(res, x + delta)
    torch.testing.assert_close(normed, norm(x + delta))
    q, k, v = torch.randn(2, 8, 32), torch.randn(2, 2, 32), torch.randn(2, 2, 32)
    angle = torch.rand(1, 32) * 6
    cos, sin = angle.cos(), angle.sin()
    core_k, core_v = torch.zeros(2, 2, 10, 32), torch.zeros(2, 2, 10, 32)
    q_rot = fused_ops.rope_write(q, k, v, cos, sin, core_k, core_v, torch.tensor([7]))
    ref_q, ref_k = apply_rotary_pos_emb(q.unsqueeze(2), k.unsqueeze(2), cos.unsqueeze(1), sin.unsqueeze(1))
    torch.testing.assert_close(q_rot, ref_q[:, :, 0])
    torch.testing.assert_close(core_k[:, :, 7], ref_k[:, :, 0])
    assert torch.equal(core_v[:, :, 7], v) and core_k[:, :, :7].abs().sum() == 0
    g, u = torch.randn(4, 50), torch.randn(4, 50)
    torch.testing.assert_close(fused_ops.silu_mul(g, u), torch.nn.functional.silu(g) * u)
    # split merge: three splits of one softmax, one of them empty
    scores, vals = torch.randn(2, 4, 9), torch.randn(2, 4, 9, 16)
    parts = [slice(0, 4), slice(4, 4), slice(4, 9)]
    m = torch.stack([scores[..., p].amax(-1) if p.stop > p.start else torch.full((2, 4), float("-inf"))
                     for p in parts], -1)
    l = torch.stack([torch.exp2(scores[..., p] - m[..., i: i + 1]).sum(-1) for i, p in enumerate(parts)], -1)
    acc = torch.stack([(torch.exp2(scores[..., p] - m[..., i: i + 1]).unsqueeze(-1) * vals[..., p, :]).sum(-2)
                       for i, p in enumerate(parts)], 2)
    want = (torch.softmax(scores * torch.log(torch.tensor(2.0)), -1).unsqueeze(-1) * vals).sum(-2)
    torch.testing.assert_close(fused_ops.combine_splits(m, l, acc, torch.float32), want, rtol=1e-5, atol=1e-5)


INTERPRETED = textwrap.dedent("""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def _probe(OUT, n):
        total = 0
        for i in tl.range(0, n, 1):
            total += i
        tl.store(OUT, total)

    try:  # older interpreters (Triton 3.6) cannot loop up to a kernel argument, as every kernel here does
        _probe[(1,)](torch.zeros(1, dtype=torch.int32), 3)
    except Exception as e:
        print(f"SKIP: Triton {triton.__version__}'s interpreter cannot run a loop bounded by an argument ({e})")
        raise SystemExit(0)
    from docfuse.runtime.gpu import fused_ops
    from docfuse.runtime.gpu.fused_ops import _use_triton
    assert _use_triton(torch.zeros(1)), "the interpreter did not take the Triton path"
    torch.manual_seed(0)
    def both(fn, *args):
        got = fn(*args)
        fused_ops.HAS_TRITON = False
        want = fn(*args)
        fused_ops.HAS_TRITON = True
        return got, want
    x, delta, w = torch.randn(3, 1, 96), torch.randn(3, 1, 96), torch.rand(96) + 0.5
    for (a, b) in zip(*both(fused_ops.add_rms_norm, x, delta, w, 1e-5)):
        torch.testing.assert_close(a, b)
    for (a, b) in zip(*both(fused_ops.add_rms_norm, x, None, w, 1e-5)):
        torch.testing.assert_close(a, b)
    q, k, v = torch.randn(2, 8, 32), torch.randn(2, 2, 32), torch.randn(2, 2, 32)
    angle = torch.rand(1, 32) * 6
    outs = []
    for flag in (True, False):
        fused_ops.HAS_TRITON = flag
        ck, cv = torch.zeros(2, 2, 10, 32), torch.zeros(2, 2, 10, 32)
        outs.append((fused_ops.rope_write(q, k, v, angle.cos(), angle.sin(), ck, cv, torch.tensor([3])), ck, cv))
    fused_ops.HAS_TRITON = True
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b)
    g, u = torch.randn(5, 3000), torch.randn(5, 3000)
    torch.testing.assert_close(*both(fused_ops.silu_mul, g, u))
    m = torch.randn(2, 3, 40); m[..., 5] = float("-inf")
    l, acc = torch.rand(2, 3, 40) + 0.1, torch.randn(2, 3, 40, 16)
    torch.testing.assert_close(*both(fused_ops.combine_splits, m, l, acc, torch.float32), rtol=1e-5, atol=1e-5)
    # the tier kernel itself (packed 4-bit association tier + core), static and device-side core lengths
    from docfuse.runtime.gpu import attention_kernel as ak
    from docfuse.runtime.gpu.reference import tiered_decode_reference
    from docfuse.runtime.kv.association import AssociationStore
    ck, cv = torch.randn(2, 2, 75, 64), torch.randn(2, 2, 75, 64)
    assoc = AssociationStore.build(torch.randn(2, 2, 300, 64) * 2, torch.randn(2, 2, 300, 64), 4, 32)
    q = torch.randn(2, 8, 64)
    for compact in (True, False):
        out = ak.tiered_decode_attention(q, ck, cv, 70, assoc, 0.125, block_n=32, num_warps=4, compact=compact)
        torch.testing.assert_close(out, tiered_decode_reference(q, ck, cv, 70, assoc, 0.125), rtol=1e-4, atol=1e-4)
    out = ak.tiered_decode_attention(q, ck, cv, 75, assoc, 0.125, core_count=torch.tensor([67], dtype=torch.int32),
                                     block_n=32, num_warps=4)
    torch.testing.assert_close(out, tiered_decode_reference(q, ck, cv, 67, assoc, 0.125), rtol=1e-4, atol=1e-4)
    print("ok")
""")


@pytest.mark.skipif(not ak.HAS_TRITON, reason="needs Triton (its interpreter runs on CPU)")
def test_every_decode_kernel_under_the_triton_interpreter_matches_its_torch_path(tmp_path) -> None:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    script = tmp_path / "interpreted.py"  # a file: triton.jit reads its kernels' source
    script.write_text(INTERPRETED)
    run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    if run.returncode == 0 and run.stdout.startswith("SKIP: "):
        pytest.skip(run.stdout.strip()[6:])
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]


@GPU
@pytest.mark.parametrize("explicit", [True, False])
def test_graph_decode_matches_eager_decode_on_gpu(explicit: bool) -> None:
    from docfuse.runtime.gpu.decode_graph import GraphDecoder

    model = tiny(seed=5).to("cuda", torch.bfloat16)
    cache, tok = prefilled(model, 900, "cuda")
    eager = eager_logits(model, cache, tok, 6)
    prefix = cache.get_seq_length()
    dec = GraphDecoder(model, cache, max_new=8, first_token=tok, warmup=2, explicit=explicit)
    got = []
    for _ in range(4):
        dec.step()
        got.append(dec.logits.clone())
    dec.close()
    assert cache.get_seq_length() == prefix + 6
    rel = ((torch.stack(got).float() - eager[2:].float()).norm() / eager[2:].float().norm()).item()
    assert rel <= 2e-2, rel


@GPU
def test_fused_kernels_match_the_torch_paths_on_gpu() -> None:
    torch.manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    x, delta, w = (torch.randn(2, 1, 4096, device=dev, dtype=bf), torch.randn(2, 1, 4096, device=dev, dtype=bf),
                   torch.rand(4096, device=dev, dtype=bf) + 0.5)
    got = fused_ops.add_rms_norm(x, delta, w, 1e-5)
    want = fused_ops.add_rms_norm(x.cpu(), delta.cpu(), w.cpu(), 1e-5)
    assert torch.equal(got[1].cpu(), want[1])
    torch.testing.assert_close(got[0].cpu(), want[0], rtol=1e-2, atol=1e-2)
    g, u = torch.randn(2, 14336, device=dev, dtype=bf), torch.randn(2, 14336, device=dev, dtype=bf)
    torch.testing.assert_close(fused_ops.silu_mul(g, u).cpu(), fused_ops.silu_mul(g.cpu(), u.cpu()),
                               rtol=1e-2, atol=1e-2)
