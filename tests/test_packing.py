"""Packing (erpo/packing.py): the row layout the objective reads, and hidden states of
packed rows equal to those of each sequence run alone."""
import pytest
import torch

from erpo.packing import IGNORE_INDEX as IGN
from erpo.packing import (
    forward_hidden,
    forward_hidden_padded,
    lm_head_of,
    pack,
    prompt_lengths,
    resolve_attn_implementation,
    row_layout,
    set_attn_implementation,
)
from erpo.rollout import cut_at_eos
from erpo_kernels import linear_token_logprobs, query_logp_from_logp, segment_sum


def tiny_model(vocab=23, hidden=16, layers=2, seed=0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    return Qwen2ForCausalLM(cfg).eval()


PROMPTS = [[2, 5, 6], [2, 7, 8, 9, 10]]  # T = 3 and 5
RESPONSES = [[[11, 12], [13], [14, 15, 1]], [[16, 17, 18], [19, 1]]]  # G_0 = 3, G_1 = 2


def test_hand_packed_layout():
    p = pack(PROMPTS[:1], RESPONSES[:1], temperature=0.5)
    # three copies of [2 5 6 | r]: 5, 4 and 6 rows
    assert p.input_ids.tolist() == [2, 5, 6, 11, 12, 2, 5, 6, 13, 2, 5, 6, 14, 15, 1]
    assert p.position_ids.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2, 3, 4, 5]
    assert p.seq_cu_seqlens.tolist() == [0, 5, 9, 15]
    # copy 0 scores its prompt (5, 6), copies 1 and 2 ignore their prompt rows
    assert p.targets.tolist() == [5, 6, 11, 12, IGN, IGN, IGN, 13, IGN, IGN, IGN, 14, 15, 1, IGN]
    # prompt span T - 1 = 2 rows, response span L + 1 rows
    assert p.span_cu_seqlens.tolist() == [0, 2, 5, 7, 9, 11, 15]
    assert p.inv_temperature.tolist() == [1, 1, 2, 2, 2, 1, 1, 2, 2, 1, 1, 2, 2, 2, 2]
    assert p.group_index.tolist() == [0, 0, 0]


@pytest.mark.parametrize("once", [True, False])
def test_targets_never_cross_sequences(once):
    p = pack(PROMPTS, RESPONSES, temperature=0.7, score_prompt_once=once)
    cu = p.seq_cu_seqlens.tolist()
    seen = [0, 0]
    b = 0
    for q, group in enumerate(RESPONSES):
        for copy, resp in enumerate(group):
            seq = PROMPTS[q] + resp
            start, end = cu[b], cu[b + 1]
            assert p.input_ids[start:end].tolist() == seq
            tg = p.targets[start:end].tolist()
            assert tg[-1] == IGN  # the last row predicts nothing
            for t in range(len(seq) - 1):
                prompt_row = t < len(PROMPTS[q]) - 1
                if prompt_row and once and copy > 0:
                    assert tg[t] == IGN
                else:
                    assert tg[t] == seq[t + 1]
            seen[q] += 1
            b += 1
    assert seen == [3, 2]
    assert p.group_index.tolist() == [0, 0, 0, 1, 1]
    # spans alternate prompt/response, each sequence's two spans tile it
    span = p.span_cu_seqlens.tolist()
    assert span[0::2] == cu
    is_resp = torch.zeros(p.num_rows, dtype=torch.bool)
    for b in range(p.num_sequences):
        is_resp[span[2 * b + 1]:span[2 * b + 2]] = True
    assert p.inv_temperature[is_resp].tolist() == pytest.approx([1 / 0.7] * int(is_resp.sum()))
    assert p.inv_temperature[~is_resp].tolist() == [1.0] * int((~is_resp).sum())
    # position ids restart at 0 in every sequence
    for b in range(p.num_sequences):
        assert p.position_ids[cu[b]:cu[b + 1]].tolist() == list(range(cu[b + 1] - cu[b]))


def test_prompt_scored_once_per_group_gives_the_same_query_logp():
    model = tiny_model()
    once = pack(PROMPTS, RESPONSES, 0.8, score_prompt_once=True)
    every = pack(PROMPTS, RESPONSES, 0.8, score_prompt_once=False)
    w, _ = lm_head_of(model)
    with torch.no_grad():
        hidden = forward_hidden(model, once.input_ids, once.position_ids)
    lp_once = linear_token_logprobs(hidden, w, once.targets, inv_temperature=once.inv_temperature)
    lp_every = linear_token_logprobs(hidden, w, every.targets, inv_temperature=every.inv_temperature)
    n = torch.zeros(2)
    batch = once.loss_batch(torch.zeros(5), n, torch.ones(2))
    batch_every = every.loss_batch(torch.zeros(5), n, torch.ones(2))
    q_once = query_logp_from_logp(lp_once, batch)
    q_every = query_logp_from_logp(lp_every, batch_every)
    torch.testing.assert_close(q_once, q_every, rtol=1e-5, atol=1e-5)
    # and it is the prompt's own log-likelihood at temperature 1
    for q, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            logits = model(torch.tensor([prompt])).logits[0].double()  # test-only reference
        ref = torch.log_softmax(logits, -1)[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])].sum()
        assert q_once[q].item() == pytest.approx(float(ref), abs=1e-4)


# mixed lengths: a 1-token prompt alone, long and short responses, one sequence of a single row
MIXED_PROMPTS = [[2, 5, 6], [2, 7, 8, 9, 10, 11, 12], [3]]
MIXED_RESPONSES = [[[11, 12], [13], [14, 15, 16, 17, 18, 19, 20, 21, 1]], [[16, 17, 18], []], [[], [4, 4, 4, 4]]]


@pytest.mark.parametrize("attn", ["sdpa_varlen", "sdpa", "eager"])
def test_packed_hidden_states_equal_padded_and_each_sequence_alone(attn):
    """One packed row [1, N] (no mask, no cache) = the right-padded [B, Lmax] batch = each
    sequence forwarded alone, fp32 1e-5, with the attentions CPU runs (sdpa_varlen: auto's)."""
    model = tiny_model(layers=2)
    assert set_attn_implementation(model, attn) == attn
    p = pack(MIXED_PROMPTS, MIXED_RESPONSES, 1.0)
    with torch.no_grad():
        hidden = forward_hidden(model, p.input_ids, p.position_ids)  # [N, D]
        padded = forward_hidden_padded(model, p.input_ids, p.seq_cu_seqlens, pad_token_id=0)  # [N, D]
        assert hidden.shape == padded.shape == (p.num_rows, 16)
        torch.testing.assert_close(hidden, padded, rtol=1e-5, atol=1e-5)
        cu = p.seq_cu_seqlens.tolist()
        for b in range(p.num_sequences):
            alone = model.model(input_ids=p.input_ids[cu[b]:cu[b + 1]][None], use_cache=False).last_hidden_state[0]
            torch.testing.assert_close(hidden[cu[b]:cu[b + 1]], alone, rtol=1e-5, atol=1e-5)
    # the packing is what keeps sequences apart: the same row with positions 0..N-1 (one
    # long sequence) differs, so the comparison above could fail
    with torch.no_grad():
        joined = forward_hidden(model, p.input_ids, torch.arange(p.num_rows))
    assert (joined - hidden).abs().max() > 1e-2


@pytest.mark.parametrize("algorithm,attn", [("erpo", "sdpa_varlen"), ("grpo", "sdpa_varlen"), ("erpo", "sdpa"),
                                            ("erpo", "sdpa_varlen+prompts"), ("grpo", "sdpa_varlen+prompts")])
def test_training_step_packed_equals_padded(algorithm, attn):
    """The loss, its metrics and every parameter's gradient of one step are those of the
    padded forward (fp32, 1e-5); +prompts: with the prompt lengths the trainer passes (each
    prompt attended alone, its responses under a lower-right causal mask)."""
    from erpo_kernels import LossConfig, erpo_loss

    p = pack(MIXED_PROMPTS, MIXED_RESPONSES, 0.7)
    g = torch.Generator().manual_seed(0)
    batch = p.loss_batch(torch.randn(p.num_sequences, generator=g), torch.tensor([-9.0, -20.0, -1.0]),
                         torch.tensor([0.5, 1.0, 1.5]),
                         ref_logp=-3 * torch.rand(p.num_rows, generator=g) if algorithm == "grpo" else None)
    config = LossConfig(algorithm=algorithm, alpha=0.1, beta=0.1)
    results = []
    for forward in ("packed", "padded"):
        model = tiny_model(layers=2, seed=4)
        set_attn_implementation(model, attn.split("+")[0])
        if forward == "packed":
            lengths = prompt_lengths(p.span_cu_seqlens) if attn.endswith("+prompts") else None
            hidden = forward_hidden(model, p.input_ids, p.position_ids, lengths)
        else:
            hidden = forward_hidden_padded(model, p.input_ids, p.seq_cu_seqlens)
        loss, metrics = erpo_loss(hidden, model.lm_head.weight, batch, config, backend="torch")
        loss.backward()
        results.append((loss.detach(), metrics, {n: q.grad for n, q in model.named_parameters()}))
    (loss_a, met_a, grad_a), (loss_b, met_b, grad_b) = results
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-5, atol=1e-6)
    assert met_a.keys() == met_b.keys()
    for key in met_a:
        assert met_a[key] == pytest.approx(met_b[key], rel=1e-5, abs=1e-6), key
    assert grad_a.keys() == grad_b.keys()
    for name in grad_a:
        assert grad_a[name] is not None and float(grad_a[name].abs().max()) > 0, name
        torch.testing.assert_close(grad_a[name], grad_b[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_prompt_rows_are_the_prompt_alone_bit_for_bit(dtype):
    """With the prompt lengths (what the trainer passes), sdpa_varlen gives every prompt row the
    hidden state of the prompt forwarded alone (the reference cache's forward), bit for bit,
    whatever response follows and whatever else is packed, in every dtype (autocast on CPU):
    l(q) at the starting weights is the cached l_0(q) exactly (issue 19.7). The response rows
    are those of the whole sequence (1e-5 in fp32); under autocast sdpa's bf16 / fp16 output is
    kept (it crashed, issue 19.2)."""
    from erpo.models import autocast

    model = tiny_model(vocab=101, hidden=64, layers=2)
    set_attn_implementation(model, "sdpa_varlen")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 101, (30 + 7 * i,), generator=g).tolist() for i in range(4)]
    responses = [[torch.randint(3, 101, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
                  for _ in range(3)] for _ in prompts]
    alone, packed = pack(prompts, [[[]] for _ in prompts], 1.0), pack(prompts, responses, 1.0)
    with torch.no_grad(), autocast(torch.device("cpu"), dtype):
        ref = forward_hidden(model, alone.input_ids, alone.position_ids)
        split = forward_hidden(model, packed.input_ids, packed.position_ids, prompt_lengths(packed.span_cu_seqlens))
        whole = forward_hidden(model, packed.input_ids, packed.position_ids)
        first = forward_hidden(model, packed.input_ids[:55], packed.position_ids[:55], torch.tensor([30]))
    assert torch.equal(first[:30], ref[:30])   # a sequence cut short: its prompt rows still the prompt's
    seq = packed.seq_cu_seqlens.tolist()
    for q, prompt in enumerate(prompts):
        a = int(alone.seq_cu_seqlens[q])
        for b in range(3 * q, 3 * q + 3):   # every copy of the prompt
            assert torch.equal(split[seq[b]:seq[b] + len(prompt)], ref[a:a + len(prompt)]), (q, b)
    if dtype == torch.float32:
        torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-5)


def test_attn_implementation_choice(monkeypatch):
    import importlib.util

    assert resolve_attn_implementation("auto", "cpu") == "sdpa_varlen"
    assert resolve_attn_implementation("eager", "cpu") == "eager"
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "flash_attn" else real(name, *a))
    assert resolve_attn_implementation("auto", "cuda") == "flex_attention"
    with pytest.raises(ValueError, match="flash-attn"):
        resolve_attn_implementation("flash_attention_2", "cuda")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "flash_attn" else real(name, *a))
    assert resolve_attn_implementation("auto", "cuda") == "flash_attention_2"
    with pytest.raises(ValueError, match="CUDA"):
        resolve_attn_implementation("flash_attention_2", "cpu")
    with pytest.raises(ValueError, match="flex_attention trains on CUDA only .*use attn_implementation=auto"):
        resolve_attn_implementation("flex_attention", "cpu")   # no backward on CPU (issue 19.6)
    assert resolve_attn_implementation("flex_attention", "cuda") == "flex_attention"
    with pytest.raises(ValueError, match="attn_implementation"):
        resolve_attn_implementation("flash", "cpu")


def test_response_logprobs_match_the_sampler():
    """The rows the loss scores at 1/tau are the sampler's distribution: generate's own
    logits (left-padded batch, KV cache) give the same log-probs of the sampled tokens."""
    model = tiny_model(layers=2, seed=3)
    tau = 0.7
    prompts = [[2, 5, 6, 7], [2, 8]]
    width = 4
    ids = torch.tensor([[2, 5, 6, 7], [0, 0, 2, 8]])
    mask = (ids != 0).long()
    torch.manual_seed(0)
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=tau, top_k=0, top_p=1.0,
                         max_new_tokens=5, pad_token_id=0, eos_token_id=[1], output_logits=True,
                         return_dict_in_generate=True)
    responses = [[cut_at_eos(out.sequences[i, width:].tolist(), [1])] for i in range(2)]
    p = pack(prompts, responses, tau)
    w, _ = lm_head_of(model)
    with torch.no_grad():
        hidden = forward_hidden(model, p.input_ids, p.position_ids)
    lp = linear_token_logprobs(hidden, w, p.targets, inv_temperature=p.inv_temperature)
    for i in range(2):
        r = responses[i][0]
        sampler = [torch.log_softmax(out.logits[t][i].double() / tau, -1)[r[t]].item() for t in range(len(r))]
        start = int(p.span_cu_seqlens[2 * i + 1])
        assert lp[start:start + len(r)].tolist() == pytest.approx(sampler, abs=1e-5)


def test_response_token_rows():
    p = pack(PROMPTS[:1], RESPONSES[:1], temperature=0.5)
    # rows of y: copy 0 rows 2, 3 (targets 11, 12); copy 1 row 7 (13); copy 2 rows 11, 12, 13 (14, 15, 1)
    assert p.response_token_rows().tolist() == [2, 3, 7, 11, 12, 13]
    assert p.targets[p.response_token_rows()].tolist() == [11, 12, 13, 14, 15, 1]
    mixed = pack(MIXED_PROMPTS, MIXED_RESPONSES, 1.0)
    tokens = [t for group in MIXED_RESPONSES for r in group for t in r]
    assert mixed.targets[mixed.response_token_rows()].tolist() == tokens
    rows = mixed.rows_from_response_tokens(torch.arange(1.0, len(tokens) + 1))  # [N]
    assert rows[mixed.response_token_rows()].tolist() == list(range(1, len(tokens) + 1))
    assert int((rows != 0).sum()) == len(tokens)
    with pytest.raises(ValueError, match="one per response token"):
        mixed.rows_from_response_tokens(torch.zeros(len(tokens) + 1))


def test_prompt_alone_and_segment_sums():
    p = pack([[2, 5, 6]], [[[]]], 1.0)
    assert p.targets.tolist() == [5, 6, IGN]
    assert p.span_cu_seqlens.tolist() == [0, 2, 3]
    vals = torch.tensor([1.0, 2.0, 4.0])
    assert segment_sum(vals, p.span_cu_seqlens).tolist() == [3.0, 4.0]
    seq, off, width = row_layout(p.seq_cu_seqlens)
    assert seq.tolist() == [0, 0, 0] and off.tolist() == [0, 1, 2] and width == 3


def test_bad_pack_input():
    with pytest.raises(ValueError, match="responses"):
        pack([[1, 2]], [], 1.0)
    with pytest.raises(ValueError, match="temperature"):
        pack([[1, 2]], [[[3]]], 0.0)
    with pytest.raises(ValueError, match="no response"):
        pack([[1, 2]], [[]], 1.0)


def test_cut_at_eos():
    assert cut_at_eos([5, 6, 1, 0, 0], [1]) == [5, 6, 1]
    assert cut_at_eos([5, 6, 7], [1]) == [5, 6, 7]
    assert cut_at_eos([3, 9, 4], [9, 4]) == [3, 9]


def test_generation_with_varlen_sdpa_is_sdpas():
    """The trained model keeps its attention for the HF rollout: sdpa_varlen hands generate's
    padded, cached calls to sdpa, so the samples and their log-probs do not change."""
    from erpo.rollout import generate_ids_with_logprobs

    model = tiny_model(layers=2, seed=6)
    prompts = [[2, 5, 6, 7], [2, 8], [3]]
    kw = dict(temperature=0.8, max_new_tokens=6, pad_token_id=0, eos_token_ids=[1])
    out = {}
    for attn in ("sdpa", "sdpa_varlen"):
        set_attn_implementation(model, attn)
        torch.manual_seed(2)
        out[attn] = generate_ids_with_logprobs(model, prompts * 2, **kw)
    assert out["sdpa"][0] == out["sdpa_varlen"][0]
    for a, b in zip(out["sdpa"][1], out["sdpa_varlen"][1]):
        assert a == pytest.approx(b, abs=1e-6)


def test_sampling_ignores_the_models_generation_config():
    """generate_ids (the rollout's and the evaluation's one generate call) samples from
    softmax(logits / tau) alone: a model whose generation_config asks for top_k=1, min_p and a
    repetition penalty samples exactly as one with a neutral config, and keeps its config."""
    from erpo.rollout import HFRolloutEngine, generate_ids

    model = tiny_model(layers=1, seed=5)
    prompts = [[2, 5, 6], [2, 8]]
    kw = dict(temperature=1.0, max_new_tokens=6, pad_token_id=0, eos_token_ids=[1])
    torch.manual_seed(11)
    plain = generate_ids(model, prompts * 4, **kw)
    assert len({tuple(r) for r in plain[0::2]}) > 1  # sampling, not greedy
    doctored = model.generation_config
    doctored.top_k, doctored.min_p, doctored.repetition_penalty, doctored.do_sample = 1, 0.99, 5.0, False
    torch.manual_seed(11)
    assert generate_ids(model, prompts * 4, **kw) == plain
    assert model.generation_config is doctored
    # the rollout engine samples through the same call: [m][G] responses
    torch.manual_seed(11)
    grouped = HFRolloutEngine(model, 0, [1]).generate(prompts * 4, 1, 1.0, 6).responses
    assert [g[0] for g in grouped] == plain
    rollout = HFRolloutEngine(model, 0, [1], batch_size=3).generate(prompts, 4, 1.0, 6)
    grouped = rollout.responses
    assert [len(g) for g in grouped] == [4, 4] and all(len(r) <= 6 for g in grouped for r in g)
    assert [[len(x) for x in g] for g in rollout.logprobs] == [[len(r) for r in g] for g in grouped]
