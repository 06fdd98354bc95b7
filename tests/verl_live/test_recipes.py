"""The recipes of `erpo train` against verl 0.9.1's own code: DAPO's overlong reward
shaping (erpo.rewards.overlong_penalty) against verl's DAPORewardManager, and the entropy
bonus's aggregation (entropy_coeff) against verl's agg_loss under its four modes, in float64."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch


@pytest.mark.parametrize("buffer, factor", [(4, 1.0), (3, 0.5), (10, 2.0)])
def test_overlong_penalty_is_verls_dapo_reward_manager(buffer, factor):
    """Responses of every length 1..max_resp_len, scored 0 by the task: the reward verl's
    DAPO manager puts on each response's last token is our penalty of its length."""
    from verl import DataProto
    from verl.workers.reward_manager.dapo import DAPORewardManager

    from erpo.rewards import overlong_penalty
    from erpo.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    max_len, prompt_len = 10, 3
    lengths = list(range(1, max_len + 1))
    prompts = torch.full((len(lengths), prompt_len), 5, dtype=torch.long)
    responses = torch.full((len(lengths), max_len), 6, dtype=torch.long)
    mask = torch.zeros(len(lengths), prompt_len + max_len, dtype=torch.long)
    mask[:, :prompt_len] = 1
    for i, n in enumerate(lengths):
        mask[i, prompt_len:prompt_len + n] = 1
    data = DataProto.from_dict(
        tensors={"prompts": prompts, "responses": responses, "attention_mask": mask},
        non_tensors={"reward_model": np.array([{"ground_truth": "1"}] * len(lengths), dtype=object),
                     "data_source": np.array(["sums"] * len(lengths), dtype=object)},
    )
    cfg = SimpleNamespace(enable=True, len=buffer, penalty_factor=factor, log=False)
    manager = DAPORewardManager(tokenizer, num_examine=0, compute_score=lambda **kw: 0.0, max_resp_len=max_len,
                                overlong_buffer_cfg=cfg)
    reward = manager(data)  # [B, max_len], the reward on each response's last token
    theirs = [float(reward[i, n - 1]) for i, n in enumerate(lengths)]
    ours = [overlong_penalty(n, max_len, buffer, factor) for n in lengths]
    assert ours == pytest.approx(theirs, abs=1e-6)  # verl holds rewards in fp32
    assert min(theirs) == pytest.approx(-factor) and (max(theirs) == 0.0) == (buffer < max_len - 1)


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                      "seq-mean-token-sum-norm"])
def test_entropy_bonus_is_aggregated_as_verls_agg_loss(loss_agg):
    """L(entropy_coeff) - L(0) = -entropy_coeff * agg_loss(entropy, response_mask, loss_agg),
    verl's entropy term (workers/utils/losses.py), loss and gradient in the entropies, float64."""
    from verl.trainer.ppo.core_algos import agg_loss

    from erpo.packing import pack
    from erpo_kernels import LossConfig, erpo_loss_from_logp

    g = torch.Generator().manual_seed(0)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    responses = [[[10, 11, 12], [13]], [[14, 15, 16, 17], [18, 19]], [[20], [21, 22, 23]]]
    packed = pack(prompts, responses, 0.7)
    n = packed.num_rows
    batch = packed.loss_batch(torch.randn(6, generator=g, dtype=torch.float64), torch.zeros(3, dtype=torch.float64),
                              torch.ones(3, dtype=torch.float64))
    logp = -torch.rand(n, generator=g, dtype=torch.float64)
    entropy = torch.rand(n, generator=g, dtype=torch.float64) * 3
    coeff = 0.25
    scale = {"loss_scale_factor": 8.0} if loss_agg == "seq-mean-token-sum-norm" else {}  # Dr. GRPO's constant
    h = entropy.clone().requires_grad_(True)
    plain, _ = erpo_loss_from_logp(logp, batch, LossConfig(algorithm="grpo", beta=0.0, loss_agg=loss_agg, **scale),
                                   entropy=entropy, backend="torch")
    loss, _ = erpo_loss_from_logp(logp, batch, LossConfig(algorithm="grpo", beta=0.0, loss_agg=loss_agg,
                                                          entropy_coeff=coeff, **scale), entropy=h, backend="torch")
    (grad,) = torch.autograd.grad(loss, h)

    rows = packed.response_token_rows()  # the row scoring each response token, sequence by sequence
    lengths = [len(r) for group in responses for r in group]
    width = max(lengths)
    e = entropy.clone().requires_grad_(True)
    mat = torch.zeros(len(lengths), width, dtype=torch.float64)
    mask = torch.zeros(len(lengths), width, dtype=torch.float64)
    at = 0
    for i, length in enumerate(lengths):
        mat[i, :length] = e[rows[at:at + length]]
        mask[i, :length] = 1
        at += length
    theirs = agg_loss(loss_mat=mat, loss_mask=mask, loss_agg_mode=loss_agg, **scale)
    (their_grad,) = torch.autograd.grad(-coeff * theirs, e)
    assert float((loss - plain).detach()) == pytest.approx(-coeff * float(theirs.detach()), rel=1e-7)
    torch.testing.assert_close(grad, their_grad, rtol=1e-7, atol=1e-12)
