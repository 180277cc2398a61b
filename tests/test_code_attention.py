"""Decode attention over the packed codes (runtime.kv.code_attention): the same maths as dequantise-then-attend,
and its wiring into a model's one-token steps through ``reading_codes``."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from docfuse.runtime.gpu.reference import tiered_decode_reference
from docfuse.runtime.kv import TieredCache, prepare_question
from docfuse.runtime.kv import code_attention as ca
from docfuse.runtime.kv.association import AssociationStore
from docfuse.runtime.session import cache_kwarg


def tiers(b: int, hkv: int, d: int, n_core: int, n_assoc: int, bits: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    core_k = torch.randn(b, hkv, n_core + 3, d, generator=g)  # spare capacity, as in the cache
    core_v = torch.randn(b, hkv, n_core + 3, d, generator=g)
    channel_scale = torch.linspace(0.1, 4, d)  # outlier channels, as real keys have
    k = torch.randn(b, hkv, n_assoc, d, generator=g) * channel_scale + torch.randn(d, generator=g)
    v = torch.randn(b, hkv, n_assoc, d, generator=g)
    return core_k, core_v, AssociationStore.build(k, v, bits, 32)


# 8-bit tiers: the fused numba step, the scores and values kernels apart, and the torch path without them
@pytest.mark.parametrize("kernels", ["1", "split", "0"])
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("b,hkv,rep,d,n_core,n_assoc", [
    (1, 3, 3, 64, 50, 300),   # the embedded model's heads; a partial last key group
    (2, 2, 4, 32, 7, 64),     # batch rows, one channel group per value token
    (1, 1, 1, 128, 1, 33),
])
def test_code_attention_equals_dequantise_then_attend(bits, b, hkv, rep, d, n_core, n_assoc, kernels,
                                                      monkeypatch) -> None:
    if kernels != "1" and bits != 8:
        pytest.skip("only 8-bit tiers have the kernels")
    monkeypatch.setenv("DOCFUSE_CODE_KERNELS", kernels)
    core_k, core_v, assoc = tiers(b, hkv, d, n_core, n_assoc, bits)
    q = torch.randn(b, hkv * rep, d, generator=torch.Generator().manual_seed(9)) * 2
    ref = tiered_decode_reference(q, core_k, core_v, n_core, assoc, d ** -0.5)
    got = ca.code_attention(q, core_k, core_v, n_core, assoc, d ** -0.5)
    tol = 1e-3 if bits == 2 else 1e-4  # 2-bit planes reach 255 before the shifts cancel: float32 rounding grows
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("key_bits,value_bits", [(8, 4), (4, 8), (8, 2)])
def test_keys_and_values_at_different_bits(key_bits, value_bits) -> None:
    """``association_key_bits``: keys and values packed at their own widths, read by the same maths."""
    g = torch.Generator().manual_seed(3)
    k = torch.randn(1, 3, 300, 64, generator=g) * torch.linspace(0.1, 4, 64)
    v = torch.randn(1, 3, 300, 64, generator=g)
    assoc = AssociationStore.build(k, v, value_bits, 32, key_bits=key_bits)
    assert (assoc.keys.bits, assoc.values.bits) == (key_bits, value_bits)
    core_k, core_v = torch.randn(1, 3, 20, 64, generator=g), torch.randn(1, 3, 20, 64, generator=g)
    q = torch.randn(1, 9, 64, generator=g) * 2
    ref = tiered_decode_reference(q, core_k, core_v, 17, assoc, 0.125)
    torch.testing.assert_close(ca.code_attention(q, core_k, core_v, 17, assoc, 0.125), ref, rtol=1e-3, atol=1e-3)
    # eight-bit keys reconstruct far closer than four-bit ones: the point of spending the bits there
    err = (assoc.dequantize(torch.float32)[0] - k).abs().mean()
    err4 = (AssociationStore.build(k, v, value_bits, 32, key_bits=4).dequantize(torch.float32)[0] - k).abs().mean()
    assert key_bits != 8 or err < err4 / 8


def test_eight_bit_tiers_are_read_by_the_code_kernels_where_numba_is(monkeypatch) -> None:
    """numba is a dependency: on a CPU an 8-bit tier goes through ``code_kernels``' fused step (and with
    ``DOCFUSE_CODE_KERNELS=split``, its scores and values kernels). A broken import or a lost branch would fall back
    to the slower torch path silently; this catches it."""
    from docfuse.runtime.kv import code_kernels

    assert code_kernels.available(), "numba did not import: the 8-bit decode falls back to torch"
    calls = []
    for name in ("scores", "values", "step"):
        real = getattr(code_kernels, name)
        monkeypatch.setattr(code_kernels, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    core_k, core_v, assoc = tiers(1, 3, 64, 20, 100, 8)
    for core in ((core_k, core_v), (core_k.bfloat16(), core_v.bfloat16())):
        ca.code_attention(torch.randn(1, 9, 64), *core, 20, assoc, 0.125)
    monkeypatch.setenv("DOCFUSE_CODE_KERNELS", "split")
    ca.code_attention(torch.randn(1, 9, 64), core_k, core_v, 20, assoc, 0.125)
    assert calls == ["step", "step", "scores", "values"]


@pytest.mark.parametrize("core_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_core,n_assoc,hide", [
    (40, 2000, 0.1),  # several chunks; fixed codes with the core's positions hidden
    (0, 70, 0.0),     # no core at all
    (600, 64, 1.0),   # every code hidden: whole chunks without a visible token (their maxima are -inf)
    (5, 3000, 0.0),   # one partial key group at the end
])
def test_the_fused_step_equals_the_reference(core_dtype, n_core, n_assoc, hide) -> None:
    """``code_kernels.step``: one launch for scores, a chunked softmax and values, reading a bf16 or float32 core as
    stored and skipping hidden positions; the reference dequantises and attends in float32."""
    from docfuse.runtime.kv import code_kernels

    g = torch.Generator().manual_seed(5)
    core_k, core_v, assoc = tiers(2, 3, 64, n_core, n_assoc, 8)
    assoc.hidden = torch.rand(2, 3, n_assoc, generator=g) < hide
    core_k, core_v = core_k.to(core_dtype), core_v.to(core_dtype)
    q = torch.randn(2, 9, 64, generator=g) * 2
    assert code_kernels.fuses(core_k, assoc)
    k, v = assoc.dequantize(torch.float32)
    scores = torch.cat([k, core_k[:, :, :n_core].float()], 2).repeat_interleave(3, 1) @ q.unsqueeze(-1) * 0.125
    scores[:, :, :n_assoc].masked_fill_(assoc.hidden.repeat_interleave(3, 1).unsqueeze(-1), float("-inf"))
    values = torch.cat([v, core_v[:, :, :n_core].float()], 2).repeat_interleave(3, 1)
    ref = (scores.softmax(2) * values).sum(2)
    torch.testing.assert_close(ca.code_attention(q, core_k, core_v, n_core, assoc, 0.125), ref, rtol=1e-4, atol=1e-4)


def test_eight_bit_decodes_from_several_threads_at_once_agree() -> None:
    """Threads decoding side by side (a pipeline's stages, a server) share the kernels: each gets its own answer."""
    from concurrent.futures import ThreadPoolExecutor

    core_k, core_v, assoc = tiers(1, 3, 64, 20, 300, 8)
    queries = [torch.randn(1, 9, 64, generator=torch.Generator().manual_seed(i)) for i in range(8)]
    alone = [ca.code_attention(q, core_k, core_v, 20, assoc, 0.125) for q in queries]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda q: ca.code_attention(q, core_k, core_v, 20, assoc, 0.125), queries))
    assert all(torch.equal(a, b) for a, b in zip(alone, together))


def test_code_attention_bf16_tiers_and_no_association() -> None:
    core_k, core_v, assoc = tiers(1, 3, 64, 40, 200, 4)
    core_k, core_v = core_k.bfloat16(), core_v.bfloat16()
    q = torch.randn(1, 9, 64).bfloat16()
    for a in (assoc, None):
        ref = tiered_decode_reference(q, core_k, core_v, 40, a, 0.125)
        torch.testing.assert_close(ca.code_attention(q, core_k, core_v, 40, a, 0.125), ref, rtol=1e-4, atol=1e-4)


def test_supports_refuses_the_differential_encoding() -> None:
    k = torch.randn(1, 1, 40, 64)
    assert ca.supports(AssociationStore.build(k, k, 4, 32)) and ca.supports(None)
    assert not ca.supports(AssociationStore.build(k, k, 4, 32, torch.zeros(1, 1, 40, dtype=torch.long)))


def tiny(impl: str = "sdpa") -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=2, hidden_size=192, num_attention_heads=6, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=256, max_position_embeddings=2048)
    config._attn_implementation = impl
    return LlamaForCausalLM(config).eval()


def decode(model, kv: dict, steps: int, codes: bool, calls: list | None = None) -> torch.Tensor:
    """Prefill 300 tokens, re-tier for a question, then greedy one-token steps; their logits."""
    doc = torch.randint(0, 256, (1, 300), generator=torch.Generator().manual_seed(3))
    question = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(4))
    cache = TieredCache(model.config, kv)
    kw = {cache_kwarg(model): cache}
    out = []
    with torch.no_grad():
        model(input_ids=doc, **kw)
        prepare_question(model, cache, question)
        tok = model(input_ids=question, **kw).logits[:, -1:].argmax(-1)
        with ca.reading_codes(model, cache) if codes else _null() as on:
            assert on in (True, None)
            for _ in range(steps):
                logits = model(input_ids=tok, **kw).logits[:, -1]
                out.append(logits)
                tok = logits.argmax(-1, keepdim=True)
    return torch.stack(out)


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def test_reading_codes_gives_the_dequantising_paths_logits(monkeypatch) -> None:
    model = tiny()
    kv = {"core_tokens": 40, "association_tokens": 100, "recent_tokens": 8, "page_tokens": 16}
    plain = decode(model, kv, 4, codes=False)
    calls = []
    real = ca.code_attention
    monkeypatch.setattr(ca, "code_attention", lambda *a: calls.append(1) or real(*a))
    fused = decode(model, kv, 4, codes=True)
    assert len(calls) == 4 * 2  # every one-token step of every layer read the codes
    torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-4)
    assert model.config._attn_implementation == "sdpa"  # restored
    assert not getattr(ca._handover, "layers", {})


def test_reading_codes_leaves_eager_models_and_differential_tiers_on_the_dequantising_path(monkeypatch) -> None:
    calls = []
    real = ca.code_attention
    monkeypatch.setattr(ca, "code_attention", lambda *a: calls.append(1) or real(*a))
    model = tiny("eager")
    cache = TieredCache(model.config, {})
    with ca.reading_codes(model, cache) as on:
        assert not on and model.config._attn_implementation == "eager"
    sdpa = tiny()
    kv = {"core_tokens": 40, "association_tokens": 100, "recent_tokens": 8, "page_tokens": 16, "differential": True}
    torch.testing.assert_close(decode(sdpa, kv, 2, codes=True), decode(sdpa, kv, 2, codes=False))
    assert not calls


def test_overlapping_decodes_keep_the_swap_until_the_last_ends() -> None:
    model = tiny()
    first, second = TieredCache(model.config, {}), TieredCache(model.config, {})
    with ca.reading_codes(model, first):
        with ca.reading_codes(model, second) as on:
            assert on and model.config._attn_implementation == ca.ATTN_NAME
        assert model.config._attn_implementation == ca.ATTN_NAME  # the first decode still reads codes
        assert first.layers[0].read_codes and not second.layers[0].read_codes
    assert model.config._attn_implementation == "sdpa" and not first.layers[0].read_codes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_masked_pass_reads_grouped_heads_in_place_bit_for_bit(dtype, monkeypatch) -> None:
    """A question read over a document (several tokens, a mask) through docfuse's attention gives the logits of
    transformers' SDPA, which copies each KV head for its query heads, bit for bit, while SDPA reads the grouped
    heads in place (``enable_gqa``)."""
    from transformers import DynamicCache

    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=2, hidden_size=128, num_attention_heads=8, num_key_value_heads=2,
                         intermediate_size=96, vocab_size=256, max_position_embeddings=1024)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).eval().to(dtype)
    ids = torch.randint(0, 256, (1, 300), generator=torch.Generator().manual_seed(1))
    grouped = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        grouped.append(kwargs.get("enable_gqa", False))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    logits = []
    for swap in (False, True):
        cache = DynamicCache(config=config)
        with torch.no_grad():
            model(input_ids=ids[:, :280], **{cache_kwarg(model): cache}, use_cache=True)
            grouped.clear()
            if swap:
                with ca.swapped_attention(model) as on:
                    assert on
                    out = model(input_ids=ids[:, 280:], **{cache_kwarg(model): cache}, use_cache=True)
            else:
                out = model(input_ids=ids[:, 280:], **{cache_kwarg(model): cache}, use_cache=True)
        logits.append(out.logits)
        assert grouped and all(g == swap for g in grouped)  # transformers copied the heads; docfuse did not
    assert torch.equal(logits[0], logits[1])
    # the session's own forward (prefill chunks, a full cache's question) takes the same path
    import contextlib

    from docfuse.runtime import session

    last = []
    for swap in (False, True):
        with monkeypatch.context() as m:
            if not swap:
                m.setattr(session, "grouped_sdpa", lambda model, causal=False: contextlib.nullcontext())
            cache = DynamicCache(config=config)
            with torch.no_grad():
                session.forward_tokens(model, cache, ids[0, :280].tolist())
                grouped.clear()
                last.append(session.forward_tokens(model, cache, ids[0, 280:].tolist()))
        assert grouped and all(g == swap for g in grouped)
    assert torch.equal(last[0], last[1])


@pytest.mark.parametrize("cache_kind", ["dynamic", "tiered"])
def test_unpadded_passes_build_no_mask_and_give_the_masked_logits(cache_kind, monkeypatch) -> None:
    """On a GPU a prefill chunk over a cache and a question's exact read build no ``T x S`` mask: attention applies
    the bottom-right causal diagonal itself (flash attention there). Forced on here on the CPU, the chunks (the
    first one square, the later ones over a cache) and the question give the masked path's logits, and no mask
    reaches attention; a misaligned diagonal (top-left ``is_causal``) would change every chunk after the first."""
    from transformers import DynamicCache

    from docfuse.runtime import llama_block, session
    from docfuse.runtime.kv import read_question

    model = tiny()
    ids = torch.randint(0, 256, (1, 300), generator=torch.Generator().manual_seed(5))[0].tolist()
    question = torch.randint(0, 256, (1, 7), generator=torch.Generator().manual_seed(6))

    def run() -> tuple[list[torch.Tensor], torch.Tensor | None]:
        cache = DynamicCache(config=model.config) if cache_kind == "dynamic" else TieredCache(model.config, {})
        with torch.no_grad():
            chunks = [session.forward_tokens(model, cache, ids[i: i + 128]) for i in range(0, len(ids), 128)]
            read = read_question(model, cache, question) if cache_kind == "tiered" else None
        return chunks, read

    masked = run()
    seen: list[tuple[int, int, bool]] = []
    causal = llama_block.causal_attention

    def spy(q, k, v, scale):
        seen.append((q.shape[2], k.shape[2], ca._unpadded.on))
        return causal(q, k, v, scale)

    monkeypatch.setattr(ca, "causal_attention", spy)
    monkeypatch.setattr(ca, "_mask_free", lambda param: True)
    free = run()
    for a, b in zip(masked[0], free[0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    if cache_kind == "tiered":
        torch.testing.assert_close(masked[1], free[1], rtol=1e-5, atol=1e-5)
    layers = model.config.num_hidden_layers
    want = [(128, 128), (128, 256), (44, 300)] + ([(7, 307)] if cache_kind == "tiered" else [])
    assert [(t, s) for t, s, _ in seen] == [shape for shape in want for _ in range(layers)]
    assert all(on for *_, on in seen) and not getattr(ca._unpadded, "on", False)
    assert model.config._attn_implementation == "sdpa"  # the swap ended with the passes


def test_a_pass_with_its_own_mask_keeps_it_inside_the_mask_free_mode(monkeypatch) -> None:
    """``read_questions`` brings its own mask (each question sees the document and itself, not the others): even
    inside the mask-free mode its questions read as they read alone (attention keeps a mask it is given)."""
    from docfuse.runtime import session
    from docfuse.runtime.kv import read_question, read_questions

    monkeypatch.setattr(ca, "_mask_free", lambda param: True)
    model = tiny()
    ids = torch.randint(0, 256, (1, 200), generator=torch.Generator().manual_seed(7))[0].tolist()
    questions = [[5, 6, 7, 8], [9, 10, 11]]
    alone = []
    for q in questions:
        cache = TieredCache(model.config, {})
        with torch.inference_mode():
            session.fill_cache(model, cache, ids, 128)
            alone.append(read_question(model, cache, torch.tensor([q])))
    cache = TieredCache(model.config, {})
    with torch.inference_mode(), ca.unpadded_causal(model) as on:  # as if a caller had wrapped it
        assert on
        session.fill_cache(model, cache, ids, 128)
        together = read_questions(model, cache, questions)
    for a, read in zip(alone, together):
        torch.testing.assert_close(a, read.logits, rtol=1e-4, atol=1e-4)


def test_one_bf16_token_on_the_cpu_attends_through_two_matmuls_as_sdpa_does(monkeypatch) -> None:
    """A one-token bf16 step on the CPU (``Session``'s decode of a full cache) takes ``one_token_attention``: the
    output of transformers' SDPA within a bf16 step, heads in their grouped order, and the same greedy tokens over a
    long cache; float32 and several tokens keep the SDPA path."""
    from transformers import DynamicCache

    from docfuse.runtime import session

    torch.manual_seed(0)
    q = torch.randn(2, 9, 1, 64).bfloat16()
    k, v = torch.randn(2, 3, 700, 64).bfloat16(), torch.randn(2, 3, 700, 64).bfloat16()
    want = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True)
    got = ca.one_token_attention(q, k, v, None)
    assert got.shape == (2, 1, 9, 64)
    torch.testing.assert_close(got.float(), want.transpose(1, 2), rtol=0, atol=2e-2)

    model = tiny().to(torch.bfloat16)
    calls = []
    one = ca.one_token_attention
    monkeypatch.setattr(ca, "one_token_attention", lambda *a: calls.append(a[0].shape) or one(*a))
    ids = torch.randint(0, 256, (600,), generator=torch.Generator().manual_seed(8)).tolist()

    def steps(swap: bool, tokens: list[int] | None = None) -> tuple[list[int], list[torch.Tensor]]:
        """Greedy one-token steps (or ``tokens`` fed in turn); their tokens and logits."""
        cache = DynamicCache(config=model.config)
        out, logits = [], []
        with torch.inference_mode(), monkeypatch.context() as m:
            if not swap:
                m.setattr(session, "grouped_sdpa", lambda model, causal=False: _null())
            token = int(session.forward_tokens(model, cache, ids).argmax())
            for i in range(12):
                out.append(token if tokens is None else tokens[i])
                logits.append(session.forward_tokens(model, cache, [out[-1]]).float())
                token = int(logits[-1].argmax())
        return out, logits

    tokens, sdpa = steps(False)
    calls.clear()
    _, mine = steps(True, tokens)  # the same inputs: logits within bf16 noise (a random model's near ties flip)
    for a, b in zip(sdpa, mine):
        assert (a - b).abs().max() < 0.05
    assert len(calls) == 12 * model.config.num_hidden_layers  # every one-token step, no prefill chunk
    calls.clear()
    with torch.inference_mode():
        session.forward_tokens(tiny(), DynamicCache(config=tiny().config), ids[:5])
        session.forward_tokens(tiny(), DynamicCache(config=tiny().config), ids[:1])  # float32
    assert calls == []
