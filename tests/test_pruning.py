"""Runtime pruning: gates, decision head, ablation labels, safe mode, and the session's per-request switch."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from transformers import DynamicCache

from docfuse.runtime import loading
from docfuse.runtime.kv import TieredCache
from docfuse.runtime.pruning import DecisionHead, Pruner, PruningConfig, find_head
from docfuse.runtime.pruning.ablation import ablated_log_probs, dense_trace, kl_and_flip
from docfuse.runtime.pruning.calibrate import fidelity, labels_of, train_head
from docfuse.runtime.pruning.config import SHIPPED_HEADS
from docfuse.runtime.pruning.head import model_fingerprint
from docfuse.runtime.session import Session

TEXT = ("The lease runs for twelve months from the first of March. The tenant pays a monthly fee of 840 euros, "
        "due on the fifth day of each month, into the landlord's account. Either party may end the lease with "
        "three months' notice in writing. The deposit equals two monthly fees and is returned within thirty days.")


@pytest.fixture(scope="module")
def lm():
    # Its own copy, not conftest's shared smollm2: pruners wrap the model's blocks in gates that stay.
    return loading.load_model("default", dtype="float32", device="cpu")


def random_head(model, read_layer: int = 2, seed: int = 0) -> DecisionHead:
    """An untrained head whose biases make it skip roughly a third of the blocks it may skip, with small random
    substitutes (what a skipped block adds), so every path that skips also exercises them."""
    torch.manual_seed(seed)
    c = model.config
    head = DecisionHead(c.hidden_size, c.num_hidden_layers, read_layer, width=32)
    with torch.no_grad():
        head.out.weight.mul_(0.05)
        head.out.bias.copy_(torch.randn(2 * c.num_hidden_layers) * 2)
        head.substitute.copy_(torch.randn_like(head.substitute) * 0.02)
    head.meta = {"fingerprint": model_fingerprint(c), "seed": seed}
    return head.eval()


def ids_of(tokenizer, text: str = TEXT) -> torch.Tensor:
    return tokenizer(text, return_tensors="pt").input_ids[0]


def decode_logits(model, pruner: Pruner, ids: torch.Tensor, prefix: int, cache=None) -> tuple[torch.Tensor, list]:
    """Prefill ``ids[:prefix]`` dense, then feed the rest one token at a time with the pruner deciding."""
    cache = cache if cache is not None else DynamicCache(config=model.config)
    out, plans = [], []
    with torch.no_grad():
        pruner.mode = "off"
        out.append(model(input_ids=ids[None, :prefix], cache=cache, use_cache=True).logits[0, -1])
        pruner.mode = "decode"
        for t in range(prefix, len(ids)):
            out.append(model(input_ids=ids[None, t:t + 1], cache=cache, use_cache=True).logits[0, -1])
            plans.append(list(pruner._keep or []))
        pruner.mode = "off"
    return torch.stack(out[:-1]), plans


@pytest.mark.slow
def test_head_file_round_trips_and_stays_within_the_parameter_budget(lm, tmp_path):
    model, _ = lm
    head = random_head(model)
    head.save(tmp_path / "h.safetensors", model_fingerprint(model.config), {"command": "test"})
    back = DecisionHead.load(tmp_path / "h.safetensors")
    h = torch.randn(3, model.config.hidden_size)
    assert torch.allclose(head(h), back(h), atol=2e-3)  # weights are stored in float16
    assert back.meta["command"] == "test" and back.read_layer == 2
    full = DecisionHead(model.config.hidden_size, model.config.num_hidden_layers, 2)
    assert full.parameter_count() <= 0.003 * sum(p.numel() for p in model.parameters())
    (tmp_path / "bad.safetensors").write_bytes((tmp_path / "h.safetensors").read_bytes()[:100])
    with pytest.raises(Exception):
        DecisionHead.load(tmp_path / "bad.safetensors")


@pytest.mark.slow
def test_head_for_another_model_is_refused_with_the_fix(lm, tmp_path):
    model, _ = lm
    head = random_head(model)
    head.save(tmp_path / "h.safetensors", {**model_fingerprint(model.config), "hidden_size": 1}, {})
    with pytest.raises(ValueError, match="calibrate-pruning"):
        find_head(model, str(tmp_path / "h.safetensors"))


@pytest.mark.slow
def test_two_stream_labels_match_real_decode_step_ablation(lm):
    """The ablated stream (dense history, own key at t) must equal skipping the block at that decode step."""
    model, tokenizer = lm
    ids = ids_of(tokenizer)[:48]
    trace = dense_trace(model, ids)
    with torch.no_grad():
        reference = torch.log_softmax(model(input_ids=ids[None]).logits[0].float(), -1)
    assert (trace.log_probs - reference).abs().max() < 1e-3  # the explicit forward is the model's
    assert kl_and_flip(trace.log_probs, ablated_log_probs(model, trace, None))[0].max() < 1e-6
    for block in (("attn", 5), ("mlp", 9)):
        head = DecisionHead(model.config.hidden_size, model.config.num_hidden_layers, 0, width=8)
        with torch.no_grad():  # a head that skips exactly this block, whatever the token
            head.out.weight.zero_()
            head.out.bias.fill_(30.0)
            head.out.bias[2 * block[1] + (block[0] == "mlp")] = -30.0
        pruner = Pruner.for_model(model, head)
        two_stream = ablated_log_probs(model, trace, block)
        for t in (20, 40):
            cache = DynamicCache(config=model.config)
            with torch.no_grad():
                model(input_ids=ids[None, :t], cache=cache, use_cache=True)
                pruner.mode = "decode"
                real = torch.log_softmax(model(input_ids=ids[None, t:t + 1], cache=cache,
                                               use_cache=True).logits[0, -1].float(), -1)
                pruner.mode = "off"
            assert pruner.skipped == 1
            pruner.reset_counts()
            want = kl_and_flip(trace.log_probs[t][None], real[None])[0].item()
            got = kl_and_flip(trace.log_probs[t][None], two_stream[t][None])[0].item()
            assert abs(got - want) <= 1e-4 + 0.02 * want, (block, t, got, want)
    pruner.detach()


@pytest.mark.slow
def test_skipped_attention_still_writes_the_same_keys_and_values(lm):
    model, tokenizer = lm
    ids = ids_of(tokenizer)[:24]
    caches = []
    for skip in (False, True):
        pruner = Pruner.for_model(model, random_head(model, seed=1))
        pruner.reset_counts()
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=ids[None, :-1], cache=cache, use_cache=True)
            pruner.mode = "decode"
            pruner.threshold = 1.1 if skip else 0.0  # 1.1: every block after the read layer is skipped
            model(input_ids=ids[None, -1:], cache=cache, use_cache=True)
            pruner.mode = "off"
        assert pruner.skipped_fraction == (54 / 60 if skip else 0.0)  # layers 0-2 feed the head
        caches.append(cache)
    dense, skipped = caches
    # layer 3 is the first gated one: its input is unchanged, so the K/V it wrote must be exactly the dense ones
    assert torch.equal(dense.layers[3].keys, skipped.layers[3].keys)
    assert torch.equal(dense.layers[3].values, skipped.layers[3].values)
    assert skipped.get_seq_length() == len(ids)


@pytest.mark.slow
def test_mask_mode_equals_step_by_step_pruned_decoding(lm):
    """One teacher-forced forward in mask mode gives each position what pruned decoding would give it."""
    model, tokenizer = lm
    ids = ids_of(tokenizer)[:40]
    pruner = Pruner.for_model(model, random_head(model, seed=2), threshold=0.15)
    stepped, plans = decode_logits(model, pruner, ids, prefix=24)
    assert any(not k for plan in plans for k in plan), "the test head should skip something"
    with torch.no_grad():
        pruner.mode, pruner.dense_prefix = "mask", 24
        masked = model(input_ids=ids[None]).logits[0, 23:-1]
        keep = pruner.mask_keep[0, 24:]
        pruner.mode = "off"
    assert keep.tolist() == plans
    assert (masked - stepped).abs().max() < 1e-3


@pytest.mark.slow
def test_pruned_decoding_with_the_tiered_cache_keeps_the_cache_consistent(lm):
    model, tokenizer = lm
    ids = ids_of(tokenizer)
    pruner = Pruner.for_model(model, random_head(model, seed=3))
    cache = TieredCache(model.config, {"core_tokens": 16, "association_tokens": 16})
    logits, _ = decode_logits(model, pruner, ids[:60], prefix=40, cache=cache)
    assert all(layer.get_seq_length() == 60 for layer in cache.layers)  # skipped layers were written too
    assert torch.isfinite(logits).all()
    assert pruner.skipped_fraction > 0


@pytest.mark.slow
@pytest.mark.parametrize("request_override", [{"safe_mode": True}, {"threshold": 0.0}])
def test_safe_mode_and_threshold_zero_are_exactly_the_dense_model(lm, request_override, monkeypatch):
    model, tokenizer = lm
    head = random_head(model, seed=4)
    monkeypatch.setattr("docfuse.runtime.session.find_head", lambda *_: head)
    question = "What is the monthly fee?"
    dense = Session(model, tokenizer)
    dense.prefill(dense.fit_document(TEXT))
    want = dense.ask(question, max_new_tokens=12)
    pruned = Session(model, tokenizer, pruning={"threshold": 0.5})
    pruned.prefill(pruned.fit_document(TEXT))
    got = pruned.ask(question, max_new_tokens=12, **request_override)
    assert got.text == want.text and got.new_tokens == want.new_tokens and got.skipped_fraction == 0.0
    skipping = pruned.ask(question, max_new_tokens=12)  # the session's own setting: prune
    assert skipping.skipped_fraction > 0
    safe = Session(model, tokenizer, pruning=PruningConfig(safe_mode=True))
    safe.prefill(safe.fit_document(TEXT))
    assert safe.ask(question, max_new_tokens=12).text == want.text


@pytest.mark.slow
def test_a_model_without_a_head_decodes_dense_and_says_so_once(lm, monkeypatch, tmp_path, caplog):
    model, tokenizer = lm
    monkeypatch.setattr("docfuse.runtime.pruning.config.SHIPPED_HEADS", tmp_path)
    monkeypatch.setattr("docfuse.runtime.pruning.config._warned", set())
    with caplog.at_level(logging.WARNING, logger="docfuse.pruning"):
        first = Session(model, tokenizer, pruning={"threshold": 0.15})
        Session(model, tokenizer, pruning={"threshold": 0.15})
    assert first.pruner is None
    assert sum("no calibrated pruning head" in r.message for r in caplog.records) == 1


@pytest.mark.slow
def test_training_and_fidelity_run_on_real_labels(lm):
    """A head trained on two labelled windows runs the sweep; threshold 0 skips nothing and agrees fully."""
    from docfuse.runtime.pruning.ablation import window_labels

    model, tokenizer = lm
    ids = ids_of(tokenizer, TEXT * 2)[:80]
    window = window_labels(model, ids, [2])
    window = {k: v[16:] for k, v in window.items()}
    assert window["kl"].shape == (64, 60) and labels_of(window, 0.01).mean() > 0
    head = train_head([window, window], read_layer=2, label_kl=0.01, epochs=2)
    pruner = Pruner.for_model(model, head)
    zero = fidelity(model, pruner, [ids], threshold=0.0, dense_prefix=16)
    assert zero["skipped_fraction"] == 0.0 and zero["top1_agreement"] == 1.0 and zero["kl"] < 1e-6
    everything = fidelity(model, pruner, [ids], threshold=1.01, dense_prefix=16)
    assert everything["skipped_fraction"] == pytest.approx(54 / 60)
    pruner.detach()


@pytest.mark.slow
def test_shipped_head_fits_the_embedded_model_when_present(lm):
    model, _ = lm
    files = sorted(SHIPPED_HEADS.glob("*.safetensors"))
    if not files:
        pytest.skip("no head shipped yet")
    head = find_head(model)
    assert head is not None and "calibrate-pruning" in head.meta["command"]
    assert head.parameter_count() <= 0.003 * sum(p.numel() for p in model.parameters())


def test_pruning_block_is_validated_with_accepted_keys():
    from docfuse.stages.decode import DecodeParams

    with pytest.raises(ValueError, match="accepted keys: threshold, safe_mode, head"):
        DecodeParams(pruning={"treshold": 0.2})
    with pytest.raises(ValueError, match="threshold"):
        DecodeParams(pruning={"threshold": 2})
    assert DecodeParams(pruning={"safe_mode": True}).pruning["threshold"] == 0.15


@pytest.mark.slow
@pytest.mark.parametrize("context, skips", [({}, True), ({"safe_mode": True}, False)])
def test_pdf_qa_rows_carry_the_skipped_fraction_and_safe_mode_per_run(lm, monkeypatch, context, skips):
    import pyarrow as pa

    from docfuse.stages.decode import DecodeGenerate

    model, _ = lm
    head = random_head(model, seed=5)
    monkeypatch.setattr("docfuse.runtime.session.find_head", lambda *_: head)
    stage = DecodeGenerate(context={"question": "What is the monthly fee?", **context},
                           pruning={"threshold": 0.5}, max_new_tokens=8, dtype="float32", device="cpu")
    pages = pa.table({"doc_id": ["d"], "source": ["d.pdf"], "page": [1], "text": [TEXT]})
    row = stage.run(pages).to_pylist()[0]
    assert row["error"] is None
    assert (row["skipped_fraction"] > 0) == skips


@pytest.mark.slow
def test_a_skipped_block_adds_its_substitute_and_format_1_heads_add_zero(lm, tmp_path):
    """The substitute reaches the residual stream on a decode step; a head file without one loads with zeros."""
    from safetensors.torch import load_file, save_file

    model, tokenizer = lm
    ids = ids_of(tokenizer)[:24]
    head = random_head(model, seed=5)
    pruner = Pruner.for_model(model, head, threshold=1.1)  # skip every gated block

    def step() -> torch.Tensor:
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            pruner.mode = "off"
            model(input_ids=ids[None, :-1], cache=cache, use_cache=True)
            pruner.mode = "decode"
            out = model(input_ids=ids[None, -1:], cache=cache, use_cache=True).logits[0, -1]
            pruner.mode = "off"
        return out

    with_substitute = step()
    saved = head.substitute.detach().clone()
    with torch.no_grad():
        head.substitute.zero_()
    without = step()
    assert (with_substitute - without).abs().max() > 1e-3
    with torch.no_grad():
        head.substitute.copy_(saved)
    head.save(tmp_path / "h.safetensors", model_fingerprint(model.config), {"command": "test"})
    tensors = load_file(str(tmp_path / "h.safetensors"))
    assert torch.allclose(tensors["substitute"], saved)  # kept in float32
    from safetensors import safe_open

    with safe_open(str(tmp_path / "h.safetensors"), framework="pt") as f:
        meta = json.loads(f.metadata()["docfuse"])
    old = {k: v for k, v in tensors.items() if k != "substitute"}
    save_file(old, str(tmp_path / "old.safetensors"), metadata={"docfuse": json.dumps({**meta, "format": 1})})
    assert not DecisionHead.load(tmp_path / "old.safetensors").substitute.any()
    pruner.detach()


@pytest.mark.slow
def test_tune_mode_runs_the_hard_decisions_and_passes_gradients_to_the_head(lm):
    """Forward: exactly mask mode (hard flags, substitutes). Backward: the head's weights and substitutes get a
    gradient through the straight-through keep flags."""
    model, tokenizer = lm
    ids = ids_of(tokenizer)[:40]
    head = random_head(model, seed=6)
    pruner = Pruner.for_model(model, head, threshold=0.15)
    pruner.dense_prefix = 16
    with torch.no_grad():
        pruner.mode = "mask"
        masked = model(input_ids=ids[None]).logits[0]
        mask_keep = pruner.mask_keep.clone()
    pruner.mode = "tune"
    tuned = model(input_ids=ids[None]).logits[0]
    assert torch.equal(pruner.mask_keep, mask_keep) and (~mask_keep).any()
    assert (tuned.detach() - masked).abs().max() < 1e-4
    tuned[16:].float().logsumexp(-1).sum().backward()
    pruner.mode = "off"
    assert head.out.weight.grad is not None and head.out.weight.grad.abs().sum() > 0
    assert head.substitute.grad[pruner._always:].abs().sum() > 0
    assert not head.substitute.grad[: pruner._always].any()  # blocks that always run never use theirs
    head.zero_grad()
    model.zero_grad()
    pruner.detach()


@pytest.mark.slow
def test_tuning_raises_the_skip_rate_toward_its_target_and_refuses_bad_targets(lm):
    import copy

    from docfuse.runtime.pruning.tune import measure_substitutes, tune_head

    model, tokenizer = lm
    ids = ids_of(tokenizer, TEXT * 3)
    windows = [ids[i: i + 48] for i in (0, 30, 60, 90)]
    head = random_head(model, seed=7)
    with torch.no_grad():
        head.substitute.zero_()
        head.out.bias.fill_(3.0)  # keeps nearly everything at first
    with pytest.raises(ValueError, match="target_skip"):
        tune_head(model, head, windows, target_skip=1.5)
    Pruner.for_model(model, copy.deepcopy(head))  # an untuned twin (same metadata) already drives the model
    before = head.out.weight.detach().clone()
    history = tune_head(model, head, windows, target_skip=0.6, steps=6, batch=2, lr=0.05, dense_prefix=16,
                        log=lambda _m: None)
    assert len(history) == 6 and history[-1]["skipped"] > history[0]["skipped"]
    assert not torch.equal(before, head.out.weight.detach().cpu())  # the head handed in is the one tuned
    assert history[-1]["multiplier"] > 0
    pruner = Pruner.for_model(model, head)
    means = measure_substitutes(model, pruner, windows)
    assert means[pruner._always:].abs().sum() > 0 and not means[: pruner._always].any()
    assert head.substitute.detach()[pruner._always:].abs().sum() > 0  # started from the means, then tuned
    assert all(p.requires_grad for p in model.parameters())  # the model's own flags are restored
    pruner.detach()


@pytest.mark.slow
def test_calibrate_tunes_an_initial_head_without_labels_and_scores_every_candidate(lm, monkeypatch, tmp_path):
    import docfuse.runtime.pruning.calibrate as calibration

    model, tokenizer = lm
    short = calibration.text_windows
    monkeypatch.setattr(calibration, "text_windows", lambda tok, text, n: short(tok, text, n, tokens=64))
    monkeypatch.setattr(calibration, "MIN_HISTORY", 16)
    head = random_head(model, seed=8)
    head.meta["command"] = "docfuse calibrate-pruning --first-run"
    chosen, report = calibration.calibrate(model, tokenizer, TEXT * 6, tmp_path / "labels", windows=4,
                                           thresholds=(0.0, 0.15), tune_steps=2, skip_targets=(0.5,),
                                           tune_batch=2, init_head=head, log=lambda _m: None)
    assert not (tmp_path / "labels").exists()  # nothing labelled
    assert report["label_statistics"] is None and report["initial_head"] == "docfuse calibrate-pruning --first-run"
    assert [c.get("tuned_for_skip") for c in report["candidates"]] == [None, 0.5]
    assert report["train_windows"] == 3 and report["validation_windows"] == 1
    assert report["sweep"][0]["skipped_fraction"] == 0.0 and report["sweep"][0]["top1_agreement"] == 1.0
    assert chosen is head or report["chosen"]["tuned_for_skip"] == 0.5
    Pruner.for_model(model, chosen).detach()


@pytest.mark.parametrize("row,best,wins", [
    ({"top1_agreement": 0.96, "skipped_fraction": 0.05}, {"top1_agreement": 0.94, "skipped_fraction": 0.30}, True),
    ({"top1_agreement": 0.96, "skipped_fraction": 0.05}, {"top1_agreement": 0.97, "skipped_fraction": 0.04}, True),
    ({"top1_agreement": 0.88, "skipped_fraction": 0.09}, {"top1_agreement": 0.884, "skipped_fraction": 0.04}, True),
    ({"top1_agreement": 0.86, "skipped_fraction": 0.20}, {"top1_agreement": 0.88, "skipped_fraction": 0.04}, False),
    ({"top1_agreement": 0.89, "skipped_fraction": 0.01}, {"top1_agreement": 0.88, "skipped_fraction": 0.04}, True),
])
def test_candidate_rule_meets_the_target_first_then_skips_more_within_a_tie(row, best, wins):
    from docfuse.runtime.pruning.calibrate import _better

    assert _better(row, best, 0.95) is wins


@pytest.mark.slow
def test_a_pruner_is_reused_for_an_equal_head_but_not_for_a_changed_copy(lm, tmp_path):
    import copy

    model, _ = lm
    head = random_head(model, seed=9)
    head.save(tmp_path / "h.safetensors", model_fingerprint(model.config), {"command": "test"})
    first = Pruner.for_model(model, DecisionHead.load(tmp_path / "h.safetensors"))
    assert Pruner.for_model(model, DecisionHead.load(tmp_path / "h.safetensors")) is first  # same file again
    tuned = copy.deepcopy(first.head)
    with torch.no_grad():
        tuned.out.bias.add_(1.0)
    second = Pruner.for_model(model, tuned)
    assert second is not first and second.head is tuned
    second.detach()
