"""The recipes' pieces of `erpo train` (issue 27 item 3): DAPO's dynamic sampling
(filter_groups) and overlong reward shaping (overlong_buffer, overlong_penalty), each
checked against a hand-written reference and in a tiny trainer run with erpo and grpo."""
import os

import pytest
import torch

from erpo.cli import main
from erpo.config import ConfigError, TrainConfig
from erpo.data import step_indices
from erpo.dynamic_sampling import SampledGroups, refill_indices, uniform_groups
from erpo.rewards import overlong_penalty
from erpo.rollout import Rollout
from erpo.trainer import Trainer, group_advantages

from test_trainer import quiet, read_metrics, tiny


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("warmstart-cache")


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


# ---------------------------------------------------------------------- overlong reward shaping


def test_overlong_penalty_is_dapos_linear_ramp_over_the_buffer():
    """DAPO eq. 13 written out: L_max = 20, L_cache = 4, so the ramp starts after 16 tokens."""
    for length in range(1, 21):
        expected = 0.0 if length <= 16 else (16 - length) / 4  # ((L_max - L_cache) - |y|) / L_cache
        assert overlong_penalty(length, 20, 4, 1.0) == pytest.approx(expected, abs=1e-15)
    assert overlong_penalty(20, 20, 4, 0.5) == -0.5  # the penalty factor scales the ramp
    assert overlong_penalty(17, 20, 4, 2.0) == -0.5
    assert overlong_penalty(20, 20, 0, 1.0) == 0.0  # buffer 0: off
    assert overlong_penalty(3, 8, 8, 1.0) == pytest.approx(-3 / 8)  # a buffer of the whole length


@pytest.mark.parametrize("buffer, penalty, max_new, match", [
    (-1, 1.0, 8, "overlong_buffer=-1 must be an integer >= 0"),
    (9, 1.0, 8, "overlong_buffer=9 exceeds max_new_tokens=8"),
    (2, -0.5, 8, "overlong_penalty=-0.5 must be a finite number >= 0"),
    (2, float("inf"), 8, "overlong_penalty=inf"),
])
def test_overlong_penalty_refuses_bad_settings(buffer, penalty, max_new, match):
    with pytest.raises(ValueError, match=match):
        overlong_penalty(1, max_new, buffer, penalty)


def _one_line_error(capsys, argv, *needles):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("erpo: error:") and len(err.splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err


def test_recipe_keys_are_checked_with_a_one_line_error_naming_the_key(capsys):
    _one_line_error(capsys, ["train", "overlong_buffer=20"], "overlong_buffer=20 exceeds max_new_tokens=8")
    _one_line_error(capsys, ["train", "overlong_penalty=-1"], "overlong_penalty=-1.0")
    _one_line_error(capsys, ["train", "filter_groups_max_batches=-2"], "filter_groups_max_batches=-2")
    _one_line_error(capsys, ["train", "filter_groups=maybe"], "filter_groups='maybe' is not true or false")
    _one_line_error(capsys, ["train", "max_num_gen_batches=3"], "did you mean filter_groups_max_batches?")


def test_recipe_keys_are_in_the_help(capsys):
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    for key in ("filter_groups", "filter_groups_max_batches", "overlong_buffer", "overlong_penalty"):
        assert f"  {key} " in out, key


# ---------------------------------------------------------------------- dynamic sampling's pieces


def test_uniform_groups_are_those_whose_advantages_are_all_zero():
    r = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.25, 0.25, 0.25], [0.0, 0.0, 1e-9]])
    uniform = uniform_groups(r)
    assert uniform.tolist() == [True, False, True, False]
    a = group_advantages(r)
    assert a[uniform].eq(0).all() and a[~uniform].ne(0).any(dim=1).all()


def test_refill_batches_are_new_disjoint_and_reproducible():
    own = step_indices(30, 4, 3, seed=7)
    batches = [refill_indices(30, 4, 3, 7, d, own) for d in (1, 2, 3, 4, 5, 6)]
    assert all(len(b) == 4 for b in batches)  # 26 other queries: 6 whole batches of 4
    flat = [i for b in batches for i in b]
    assert len(set(flat)) == 24 and not set(flat) & set(own)
    assert refill_indices(30, 4, 3, 7, 7, own) == []  # 2 left: no whole batch
    assert batches[0] == refill_indices(30, 4, 3, 7, 1, own)  # the same on every start
    assert refill_indices(30, 4, 4, 7, 1, own) != batches[0]  # another step, other queries
    with pytest.raises(ValueError, match="draw must be >= 1"):
        refill_indices(30, 4, 3, 7, 0, own)


def test_sampled_groups_take_and_concat_keep_every_field_together():
    def groups(offset):
        idx = [offset, offset + 1, offset + 2]
        responses = [[[i] * (j + 1) for j in range(2)] for i in idx]
        logprobs = [[[-0.1 * i] * (j + 1) for j in range(2)] for i in idx]
        rewards = torch.tensor([[float(i), float(i) + 0.5] for i in idx])
        return SampledGroups(idx, [[i] for i in idx], responses, logprobs, rewards, torch.zeros(3, 2))

    both = SampledGroups.concat([groups(0), groups(10)])
    picked = both.take([4, 0])
    assert picked.idx == [11, 0] and picked.prompts == [[11], [0]]
    assert picked.responses == [[[11], [11, 11]], [[0], [0, 0]]]
    assert picked.logprobs[0] == [[-1.1], [-1.1, -1.1]]
    assert picked.rewards.tolist() == [[11.0, 11.5], [0.0, 0.5]] and picked.truncated.shape == (2, 2)
    assert picked.lengths().tolist() == [[1.0, 2.0], [1.0, 2.0]]
    no_logprobs = groups(20)
    no_logprobs.logprobs = None
    assert SampledGroups.concat([groups(0), no_logprobs]).logprobs is None


# ---------------------------------------------------------------------- in the trainer


class ScriptedRollout:
    """Answers every query with G responses written out: all correct for the queries
    `solved(i)` holds for (their rewards are all equal), half correct for the others;
    `filler`: x-es before the answer of response j (to exercise the overlong shaping)."""

    def __init__(self, trainer, solved, filler=()):
        self.tokenizer, self.examples, self.prompt_ids = trainer.tokenizer, trainer.examples, trainer.prompt_ids
        self.solved, self.filler, self.calls = solved, filler, []

    def generate(self, prompt_ids, n, temperature, max_new_tokens):
        idx = [self.prompt_ids.index(list(p)) for p in prompt_ids]
        self.calls.append(idx)
        out = []
        for i in idx:
            answer = self.examples[i].answer
            group = []
            for j in range(n):
                pad = "x" * (self.filler[j] if j < len(self.filler) else 0)
                text = pad + "\\boxed{" + (answer if self.solved(i) or j < n // 2 else answer + "1") + "}"
                ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
                group.append((ids + [self.tokenizer.eos_token_id])[:max_new_tokens])
            out.append(group)
        return Rollout(out)

    def sync_weights(self, model):
        pass


def scripted_trainer(tmp_path, cache_dir, name, solved, filler=(), **overrides):
    cfg = tiny(tmp_path, cache_dir, name, max_new_tokens=12, **overrides)
    trainer = Trainer(cfg, log=quiet)
    trainer.engine = ScriptedRollout(trainer, solved, filler)
    seen = []
    updates = trainer._updates

    def recording(idx, prompts, responses, advantages, logprobs=None):
        seen.append((list(idx), advantages.clone()))
        return updates(idx, prompts, responses, advantages, logprobs)

    trainer._updates = recording
    return trainer, seen


@pytest.mark.parametrize("algorithm", ["erpo", "grpo"])
def test_filter_groups_trains_only_on_groups_with_signal_refilled_from_new_queries(tmp_path, cache_dir, algorithm):
    solved = lambda i: i % 3 != 0  # two thirds of the queries: every response right, no signal
    trainer, seen = scripted_trainer(tmp_path, cache_dir, f"fg-{algorithm}", solved, algorithm=algorithm,
                                     filter_groups=True, filter_groups_max_batches=0)
    cfg = trainer.cfg
    metrics = trainer.step(1)
    own = step_indices(len(trainer.examples), cfg.queries_per_step, 1, cfg.seed)
    drawn = [own] + [refill_indices(len(trainer.examples), cfg.queries_per_step, 1, cfg.seed, d, own)
                     for d in range(1, len(trainer.engine.calls))]
    assert trainer.engine.calls == drawn  # the step's queries, then whole batches of new ones
    expected = [i for batch in drawn for i in batch if not solved(i)][:cfg.queries_per_step]
    (idx, advantages), = seen
    assert idx == expected and len(idx) == cfg.queries_per_step
    assert advantages.ne(0).any(dim=1).all()  # every trained group carries a policy gradient
    assert metrics["filter_groups/batches"] == len(drawn) > 1
    assert metrics["filter_groups/dropped_frac"] == pytest.approx(sum(map(solved, sum(drawn, []))) / (4 * len(drawn)))
    assert metrics["filter_groups/filled_frac"] == 0.0
    own_rewards_equal = sum(map(solved, own)) / len(own)
    assert metrics["reward/zero_std_frac"] == pytest.approx(own_rewards_equal)  # the step's own queries


def test_filter_groups_at_the_limit_fills_up_with_dropped_groups_and_warns(tmp_path, cache_dir, capsys):
    trainer, seen = scripted_trainer(tmp_path, cache_dir, "fg-limit", lambda i: True, filter_groups=True,
                                     filter_groups_max_batches=3, steps=2)
    trainer.log = print
    trainer.train(plot=False)
    rows = read_metrics(trainer.cfg.run_dir)
    assert [r["filter_groups/batches"] for r in rows] == [3.0, 3.0]
    assert [r["filter_groups/filled_frac"] for r in rows] == [1.0, 1.0]
    own = step_indices(len(trainer.examples), 4, 1, trainer.cfg.seed)
    assert seen[0][0] == own and seen[0][1].eq(0).all()  # filled with the step's own groups first
    warned = [line for line in capsys.readouterr().out.splitlines() if "filter_groups found fewer" in line]
    assert len(warned) == 1 and "filter_groups_max_batches=3" in warned[0]  # once a run


def test_overlong_shaping_enters_the_advantages_and_is_logged(tmp_path, cache_dir):
    filler = (0, 0, 4, 7)  # responses 2 and 3 (4 or 5 tokens and these) reach the last 6 before max_new_tokens=12
    trainer, seen = scripted_trainer(tmp_path, cache_dir, "overlong", lambda i: i % 2 == 0, filler=filler,
                                     overlong_buffer=6, overlong_penalty=0.5)
    metrics = trainer.step(1)
    (idx, advantages), = seen
    responses = trainer.engine.generate([trainer.prompt_ids[i] for i in idx], 4, 1.0, 12).responses
    task = torch.tensor([[trainer.reward_fn(trainer.tokenizer.decode(r, skip_special_tokens=True),
                                            trainer.examples[i].answer) for r in group]
                         for i, group in zip(idx, responses)])
    ramp = torch.tensor([[min(-(len(r) - 6) / 6 * 0.5, 0.0) for r in group] for group in responses])
    assert (ramp < 0).any() and (ramp == 0).any() and task.eq(1).any()
    torch.testing.assert_close(advantages, group_advantages(task + ramp), rtol=0, atol=0)
    assert metrics["reward/overlong_frac"] == pytest.approx(float((ramp < 0).float().mean()))
    assert metrics["reward/overlong_penalty"] == pytest.approx(float(ramp.mean()))
    assert metrics["reward/mean"] == pytest.approx(float(task.mean()))  # the task's reward, unshaped


@pytest.mark.parametrize("algorithm", ["erpo", "grpo"])
def test_a_tiny_run_trains_with_filter_groups_and_overlong_shaping(tmp_path, cache_dir, algorithm):
    cfg = tiny(tmp_path, cache_dir, f"dapo-{algorithm}", algorithm=algorithm, steps=2, filter_groups=True,
               filter_groups_max_batches=2, overlong_buffer=2)
    summary = Trainer(cfg, log=quiet).train(plot=False)
    rows = read_metrics(cfg.run_dir)
    assert summary["steps"] == 2 and len(rows) == 2
    for row in rows:
        assert 1 <= row["filter_groups/batches"] <= 2 and 0 <= row["filter_groups/dropped_frac"] <= 1
        assert -1 <= row["reward/overlong_penalty"] <= 0 and all(v == v for v in row.values())
    assert os.path.isdir(os.path.join(cfg.run_dir, "checkpoints"))
