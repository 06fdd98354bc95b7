"""Models that transform their logits (Gemma 2's soft cap, Cohere's logit_scale, Granite's
logits_scaling) are scored under the distribution they sample from: the kernels get the
same transform (erpo.packing.lm_head_options), and loading them is no longer refused."""
import pytest
import torch
import transformers

from erpo.models import load_model
from erpo.packing import lm_head_options
from erpo.ref_cache import compute_ref_query_logp

SMALL = dict(vocab_size=53, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, head_dim=8, max_position_embeddings=64)


def _model(kind):
    if kind == "gemma2":
        cfg = transformers.Gemma2Config(**SMALL, final_logit_softcapping=0.7, attn_logit_softcapping=None,
                                        query_pre_attn_scalar=8, sliding_window=64)
        return transformers.Gemma2ForCausalLM(cfg), {"softcap": 0.7, "logit_scale": None}
    if kind == "cohere":
        cfg = transformers.CohereConfig(**SMALL, logit_scale=3.0)
        return transformers.CohereForCausalLM(cfg), {"softcap": None, "logit_scale": 3.0}
    cfg = transformers.GraniteConfig(**SMALL, logits_scaling=4.0)
    return transformers.GraniteForCausalLM(cfg), {"softcap": None, "logit_scale": 0.25}


@pytest.mark.parametrize("kind", ["gemma2", "cohere", "granite"])
def test_prompt_logp_is_the_models_own_log_likelihood(kind):
    torch.manual_seed(0)
    model, expected = _model(kind)
    model = model.double().eval()
    with torch.no_grad():  # larger weights so the transform matters
        model.get_output_embeddings().weight.mul_(40.0)
    assert lm_head_options(model) == expected
    prompts = [[1, 5, 9, 4, 7], [2, 8, 3]]
    with torch.no_grad():
        ours = compute_ref_query_logp(model, prompts, backend="torch", compute_dtype=torch.float64)
        truth = []
        for p in prompts:
            ids = torch.tensor([p])
            logits = model(ids, use_cache=False).logits[0].double()  # the model's own transformed logits
            lp = torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[0, 1:, None]).sum()
            truth.append(lp)
        plain = []  # what scoring hidden @ W.T without the transform gives: must differ
        for p in prompts:
            ids = torch.tensor([p])
            hidden = model.model(ids, use_cache=False).last_hidden_state[0]
            raw = hidden[:-1] @ model.get_output_embeddings().weight.T
            plain.append(torch.log_softmax(raw, -1).gather(1, ids[0, 1:, None]).sum())
    truth, plain = torch.stack(truth), torch.stack(plain)
    assert torch.allclose(ours.double(), truth, rtol=0, atol=1e-5), (ours, truth)
    assert not torch.allclose(plain, truth, rtol=0, atol=1e-3)


def test_a_softcapped_model_loads(tmp_path):
    model, _ = _model("gemma2")
    model.save_pretrained(tmp_path / "gemma2")
    loaded = load_model(str(tmp_path / "gemma2"), torch.device("cpu"))
    assert lm_head_options(loaded)["softcap"] == 0.7
