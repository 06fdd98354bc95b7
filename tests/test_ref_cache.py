"""The reference cache (erpo/ref_cache.py, docs/method.md section 7): values, round trip,
atomic write, and one clear error per kind of mismatch."""
import os

import pytest
import torch

from erpo.ref_cache import (
    RefCacheError,
    build_ref_cache,
    fixed_by,
    model_fingerprint,
    query_id,
    read_ref_cache,
    save_ref_cache,
    tokenizer_fingerprint,
    validate_ref_cache,
)

REBUILD = "erpo ref-cache run_dir=RUN"


def tiny_model(seed=0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=30, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
    return Qwen2ForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def setup():
    from erpo.tiny import build_tokenizer

    tok = build_tokenizer()
    model = tiny_model()
    model.resize_token_embeddings(len(tok))
    prompts = [tok(t)["input_ids"] for t in ["12+3=", "4+40=", "7+7=", "12+3=", "0+0="]]  # one duplicate
    meta = {"model": "tiny-test", "model_fingerprint": model_fingerprint(model),
            "tokenizer_fingerprint": tokenizer_fingerprint(tok), "template": "plain"}
    return tok, model, prompts, meta


def check(cache, path, meta, prompts):
    with fixed_by(REBUILD):  # the caller names how its cache is rebuilt
        return validate_ref_cache(cache, path, expect=meta, prompt_ids=prompts, describe=lambda i: f"(query {i})")


def test_values_round_trip_and_lookup(setup, tmp_path):
    tok, model, prompts, meta = setup
    cache = build_ref_cache(model, prompts, meta, pad_token_id=0, batch_size=2)
    assert len(cache) == 4  # the duplicate prompt is stored once
    path = str(tmp_path / "ref_cache.safetensors")
    save_ref_cache(cache, path)
    assert os.listdir(tmp_path) == ["ref_cache.safetensors"]  # no temp file left
    loaded = read_ref_cache(path)
    rows = check(loaded, path, meta, prompts)
    assert rows[0] == rows[3]
    for name in ("query_id", "n_tokens", "ref_query_logp", "score"):
        assert torch.equal(getattr(loaded, name), getattr(cache, name))
    assert loaded.meta["model_fingerprint"] == meta["model_fingerprint"]
    assert loaded.meta["format"] == "erpo-ref-cache/1"
    for i, p in enumerate(prompts):
        r = int(rows[i])
        assert int(loaded.query_id[r]) == query_id(p)
        assert int(loaded.n_tokens[r]) == len(p) - 1
        with torch.no_grad():  # test-only reference: full logits, float64 log_softmax
            logits = model(torch.tensor([p])).logits[0].double()
        ref = torch.log_softmax(logits, -1)[torch.arange(len(p) - 1), torch.tensor(p[1:])].sum().item()
        assert loaded.ref_query_logp[r].item() == pytest.approx(ref, abs=1e-4)
        assert loaded.score[r].item() == pytest.approx(ref / (len(p) - 1), abs=1e-5)


def test_query_id_is_a_hash_of_the_token_ids():
    assert query_id([1, 2, 3]) == query_id([1, 2, 3])
    assert query_id([1, 2, 3]) != query_id([1, 2, 4])
    assert query_id([1, 2, 3]) != query_id([1, 2])
    assert 0 <= query_id(list(range(1000))) < 2**63


def test_atomic_write_keeps_the_old_file(setup, tmp_path, monkeypatch):
    tok, model, prompts, meta = setup
    cache = build_ref_cache(model, prompts, meta)
    path = str(tmp_path / "ref_cache.safetensors")
    save_ref_cache(cache, path)
    before = open(path, "rb").read()

    import safetensors.torch

    def broken(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", broken)
    cache.ref_query_logp = cache.ref_query_logp + 1.0
    with pytest.raises(OSError, match="disk full"):
        save_ref_cache(cache, path)
    assert open(path, "rb").read() == before
    assert os.listdir(tmp_path) == ["ref_cache.safetensors"]


def test_missing_and_corrupt_files(tmp_path):
    path = str(tmp_path / "nothing.safetensors")
    with pytest.raises(RefCacheError, match=f"does not exist; build it with: {REBUILD}$"), fixed_by(REBUILD):
        read_ref_cache(path)
    with pytest.raises(RefCacheError, match="does not exist$"):  # no fix given: the problem alone
        read_ref_cache(path)
    with open(path, "wb") as f:
        f.write(b"\x00garbage")
    with pytest.raises(RefCacheError, match=f"unreadable [(].*[)]; rebuild it with: {REBUILD}$"), fixed_by("outer"):
        with fixed_by(REBUILD):  # the innermost caller's fix is the one named, once
            read_ref_cache(path)


@pytest.mark.parametrize("what", ["model", "tokenizer", "template"])
def test_mismatch_is_a_clear_error(setup, tmp_path, what):
    tok, model, prompts, meta = setup
    path = str(tmp_path / "c.safetensors")
    save_ref_cache(build_ref_cache(model, prompts, meta), path)
    cache = read_ref_cache(path)
    expect = dict(meta)
    if what == "model":
        other = tiny_model(seed=1)
        other.resize_token_embeddings(len(tok))
        expect["model_fingerprint"] = model_fingerprint(other)
        label = "model weights"
    elif what == "tokenizer":
        from transformers import AutoTokenizer

        tok.save_pretrained(str(tmp_path / "tok"))
        other = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
        other.add_tokens(["<extra>"])
        expect["tokenizer_fingerprint"] = tokenizer_fingerprint(other)
        label = "tokenizer"
    else:
        expect["template"] = "Q: {prompt}\nA:"
        label = "prompt template"
    assert expect != meta
    with pytest.raises(RefCacheError) as err:
        check(cache, path, expect, prompts)
    msg = str(err.value)
    assert "\n" not in msg
    assert f"is stale: built for {label}" in msg and msg.endswith(f"rebuild it with: {REBUILD}")


def test_missing_query_names_it(setup, tmp_path):
    tok, model, prompts, meta = setup
    path = str(tmp_path / "c.safetensors")
    save_ref_cache(build_ref_cache(model, prompts[:2], meta), path)
    cache = read_ref_cache(path)
    with pytest.raises(RefCacheError) as err:
        check(cache, path, meta, prompts)
    msg = str(err.value)
    assert "no entry for training query 2 (query 2)" in msg
    assert f"{query_id(prompts[2]):016x}" in msg and "(and 1 more)" in msg
    assert msg.endswith(REBUILD)


def test_fingerprints_notice_any_change(setup):
    tok, model, _, _ = setup
    fp = model_fingerprint(model)
    assert fp == model_fingerprint(model)
    saved = model.model.norm.weight.detach().clone()
    with torch.no_grad():
        model.model.norm.weight[3] += 1e-3
    try:
        assert model_fingerprint(model) != fp
    finally:
        with torch.no_grad():
            model.model.norm.weight.copy_(saved)
    assert model_fingerprint(model) == fp
    assert tokenizer_fingerprint(tok) == tokenizer_fingerprint(tok)
