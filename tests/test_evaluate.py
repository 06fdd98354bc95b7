"""The evaluation protocol: unbiased Pass@k, evaluate() on a tiny random Qwen2 with a
char-level tokenizer built here (nothing from a hub), and the report files."""
import copy
import itertools
import json
import math
import re

import pytest
import torch

from erpo.eval_report import compare_report, format_table, write_report
from erpo.evaluate import TEMPERATURES, EvalResult, evaluate, evaluate_sampler, pass_at_k

# ----------------------------------------------------------------------------- pass@k


def _pass_at_k_brute(n: int, c: int, k: int) -> float:
    """Fraction of the k-subsets of n samples (the first c correct) holding a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7])
def test_pass_at_k_matches_enumeration(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(_pass_at_k_brute(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_k_edges():
    assert pass_at_k(8, 0, 1) == 0.0 and pass_at_k(8, 0, 8) == 0.0
    assert pass_at_k(8, 8, 1) == 1.0 and pass_at_k(8, 8, 3) == 1.0
    assert pass_at_k(8, 1, 8) == 1.0                      # k = n: any correct sample is drawn
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)      # Pass@1 = c / n
    # large n: the product form stays finite and in [0, 1] where C(n, k) is astronomically large
    p = pass_at_k(2000, 3, 500)
    assert p == pytest.approx(1 - math.comb(1997, 500) / math.comb(2000, 500), rel=1e-12)
    assert 0.0 <= p <= 1.0


@pytest.mark.parametrize("n, c, k, name", [(4, 1, 5, "k"), (4, 5, 1, "c"), (4, -1, 1, "c"), (4, 1, 0, "k"),
                                           (0, 0, 1, "n")])
def test_pass_at_k_rejects_bad_input(n, c, k, name):
    with pytest.raises(ValueError, match=f"^{name}:"):
        pass_at_k(n, c, k)


# ----------------------------------------------------------------------------- a stubbed sampler


class PatternSampler:
    """A sampler whose correctness is known in advance: at temperature index t, the j-th
    sample of problem i is "right" iff j < CORRECT[t][i]; greedily, problem i is right iff
    GREEDY[i]. It records each call (problems, temperature)."""

    TEMPS = (0.2, 0.8, 1.4)
    CORRECT = ([5, 0, 2, 1], [3, 5, 0, 0], [0, 1, 4, 5])   # [temperature][problem], n = 5
    GREEDY = [1, 0, 1, 1]

    def __init__(self):
        self.calls, self.drawn = [], {}

    def __call__(self, problems, temperature):
        self.calls.append((list(problems), temperature))
        if temperature == 0.0:
            return ["right" if self.GREEDY[i] else "wrong" for i in problems]
        t = self.TEMPS.index(temperature)
        out = []
        for i in problems:
            j = self.drawn.get((t, i), 0)
            self.drawn[(t, i)] = j + 1
            out.append("right" if j < self.CORRECT[t][i] else "wrong")
        return out


def test_evaluate_sampler_aggregates_a_known_pattern():
    sampler, n, problems = PatternSampler(), 5, 4
    result = evaluate_sampler(sampler, ["right"] * problems, reward_fn=lambda c, a: float(c == a),
                              temperatures=PatternSampler.TEMPS, n_samples=n, batch_size=3, seed=0,
                              order=[2, 0, 3, 1], progress=False)
    assert result.k_values == [1, 2, 3, 4, 5]      # k_values=None: every k <= n
    for t, row in enumerate(result.rows):
        counts = PatternSampler.CORRECT[t]
        assert row.temperature == PatternSampler.TEMPS[t]
        assert row.n_correct == counts
        assert row.avg_at_n == pytest.approx(sum(counts) / (problems * n), abs=1e-12)
        for k in range(1, n + 1):
            brute = sum(_pass_at_k_brute(n, c, k) for c in counts) / problems
            assert row.pass_at_k[k] == pytest.approx(brute, abs=1e-12), (t, k)
    assert result.greedy_correct == PatternSampler.GREEDY and result.greedy_pass_at_1 == 0.75
    # the means over temperatures, by hand: Avg@5 = (8 + 8 + 10) / 3 / 20; Pass@5 = (3/4 + 2/4 + 3/4) / 3
    assert result.mean_avg_at_n == pytest.approx(26 / 60, abs=1e-12)
    assert result.mean_pass_at_k[5] == pytest.approx(2 / 3, abs=1e-12)
    assert result.mean_pass_at_k[1] == pytest.approx(result.mean_avg_at_n, abs=1e-12)   # Pass@1 = Avg@n
    # greedy first, then each temperature; batches of at most 3, problems in the given order
    temps = [t for _, t in sampler.calls]
    assert temps == sorted(temps) and set(temps) == {0.0, *PatternSampler.TEMPS}
    assert all(len(p) <= 3 for p, _ in sampler.calls)
    assert [i for p, t in sampler.calls if t == 0.0 for i in p] == [2, 0, 3, 1]
    assert [i for p, t in sampler.calls if t == 0.8 for i in p] == [i for i in [2, 0, 3, 1] for _ in range(n)]
    # the terminal table holds these numbers
    table = _table(format_table(result))
    assert table["0.8"] == pytest.approx([result.rows[1].avg_at_n] + [result.rows[1].pass_at_k[k] for k in range(1, 6)],
                                         abs=5e-5)
    assert "Greedy Pass@1: 0.7500" in format_table(result)


def test_kept_samples_and_samples_jsonl(tmp_path):
    """keep_samples: every completion with its problem, temperature and grade, in the
    pattern's counts; write_report puts them in samples.jsonl with question and answer."""
    answers = ["right"] * 4
    kw = dict(reward_fn=lambda c, a: float(c == a), temperatures=PatternSampler.TEMPS, n_samples=5, progress=False)
    assert evaluate_sampler(PatternSampler(), answers, **kw).samples == []     # off by default
    result = evaluate_sampler(PatternSampler(), answers, keep_samples=True, **kw)
    assert len(result.samples) == 4 * (1 + 3 * 5)
    for t_index, t in enumerate(PatternSampler.TEMPS):
        for i in range(4):
            mine = [s for s in result.samples if s["temperature"] == t and s["problem"] == i]
            assert len(mine) == 5 and sum(s["correct"] for s in mine) == PatternSampler.CORRECT[t_index][i]
            assert all(s["correct"] == (s["completion"] == "right") for s in mine)
    greedy = sorted((s["problem"], s["correct"]) for s in result.samples if s["temperature"] == 0.0)
    assert greedy == list(enumerate(PatternSampler.GREEDY))

    paths = write_report(result, tmp_path, questions=[f"q{i}" for i in range(4)], answers=answers,
                         prompts=[f"Q: q{i} A:" for i in range(4)])
    lines = [json.loads(line) for line in paths["samples"].read_text().splitlines()]
    assert len(lines) == len(result.samples)
    assert all(line["question"] == f"q{line['problem']}" and line["answer"] == "right" for line in lines)
    assert all(line["prompt"] == f"Q: q{line['problem']} A:" for line in lines)   # the template applied
    assert "samples" not in json.loads(paths["json"].read_text())   # eval.json stays small
    write_report(evaluate_sampler(PatternSampler(), answers, **kw), tmp_path)   # a later report without samples
    assert not (tmp_path / "samples.jsonl").exists()                           # leaves no stale ones beside it


def test_progress_bar_counts_temperatures_times_problems(monkeypatch):
    """The bar runs over (greedy + each temperature) x problems, advancing as problems finish."""
    import tqdm.auto

    bars = []

    class Bar:
        def __init__(self, total, **kw):
            self.total, self.n, self.steps, self.stages = total, 0, [], []
            bars.append(self)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def update(self, k):
            self.n += k
            self.steps.append(self.n)

        def set_postfix_str(self, text):
            self.stages.append((text, self.n))

    monkeypatch.setattr(tqdm.auto, "tqdm", Bar)
    evaluate_sampler(PatternSampler(), ["right"] * 4, reward_fn=lambda c, a: float(c == a),
                     temperatures=PatternSampler.TEMPS, n_samples=5, batch_size=3, progress=True)
    (bar,) = bars
    assert bar.total == 4 * (1 + 3) and bar.n == bar.total
    assert bar.stages == [("greedy", 0), ("T=0.2", 4), ("T=0.8", 8), ("T=1.4", 12)]
    # 20 samples per temperature in batches of 3: a problem counts once its 5 samples are done
    # (after 3, 6, 9, ..., 18, 20 samples: 0, 1, 1, 2, 3, 3, 4 problems done)
    assert bar.steps[bar.steps.index(4) + 1:bar.steps.index(8) + 1] == [4, 5, 5, 6, 7, 7, 8]


def test_evaluate_sampler_rejects_bad_input():
    kw = dict(reward_fn=lambda c, a: 0.0, temperatures=(1.0,), n_samples=2, progress=False)
    with pytest.raises(ValueError, match="^sampler:"):
        evaluate_sampler(lambda problems, t: ["x"], ["a", "b"], **kw)   # one completion for two sequences
    with pytest.raises(ValueError, match="^order:"):
        evaluate_sampler(lambda problems, t: ["x"] * len(problems), ["a", "b"], order=[0, 0], **kw)
    with pytest.raises(ValueError, match="^answers:"):
        evaluate_sampler(lambda problems, t: [], [], **kw)
    with pytest.raises(ValueError, match="^temperatures: a temperature is listed twice"):
        evaluate_sampler(lambda problems, t: ["x"] * len(problems), ["a"], **{**kw, "temperatures": (0.5, 1.0, 0.5)})
    for temperatures in [(0.0,), (-0.5, 1.0), (float("inf"),), ()]:
        with pytest.raises(ValueError, match="^temperatures: need finite temperatures > 0"):
            evaluate_sampler(lambda problems, t: ["x"] * len(problems), ["a"], **{**kw, "temperatures": temperatures})


def test_math_style_data_graded_by_math_verify(tmp_path):
    """A MATH-style JSONL (problem, solution with a \\boxed{} answer) reads as it is, and
    math-verify grades equivalent forms that exact match misses."""
    from erpo.data import read_examples
    from erpo.rewards import get_reward_fn

    rows = [{"problem": "Half of one?", "solution": "One over two: $\\boxed{\\frac{1}{2}}$.", "level": "Level 1"},
            {"problem": "Two squared?", "solution": "$2^2 = \\boxed{4}$"}]
    path = tmp_path / "math.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    examples = read_examples(str(path), "prompt", "answer")
    assert [(e.prompt, e.answer) for e in examples] == [("Half of one?", "\\frac{1}{2}"), ("Two squared?", "4")]

    said = {0: "so the answer is \\boxed{0.5}", 1: "\\boxed{4.0}"}
    sampler = lambda problems, t: [said[i] for i in problems]
    answers = [e.answer for e in examples]
    kw = dict(temperatures=(1.0,), n_samples=2, progress=False)
    verified = evaluate_sampler(sampler, answers, reward_fn=get_reward_fn("math_verify"), **kw)
    exact = evaluate_sampler(sampler, answers, reward_fn=get_reward_fn("exact_match"), **kw)
    assert verified.greedy_pass_at_1 == 1.0 and verified.rows[0].avg_at_n == 1.0
    assert exact.greedy_pass_at_1 == 0.0 and exact.rows[0].avg_at_n == 0.0


# ----------------------------------------------------------------------------- a tiny model

_CHARS = "0123456789+-*/=?.,:; abcdefghijklmnopqrstuvwxyz\\{}"


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """The model is tiny: one intra-op thread avoids thread hand-offs that cost more than
    the maths, especially on a busy machine."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def tiny():
    """A random 2-layer Qwen2 (hidden 32) and a char-level tokenizer, both built locally."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    for ch in _CHARS:
        vocab[ch] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")   # one token per character
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                        unk_token="<unk>")
    config = Qwen2Config(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         pad_token_id=0, eos_token_id=1, bos_token_id=1, tie_word_embeddings=True)
    torch.manual_seed(1234)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():   # sharper logits than the default init, so sampling depends on temperature
        model.lm_head.weight.mul_(5.0)
    return model, tokenizer


# prompts of different lengths, so the length sort and the left padding both matter
PROMPTS = ["what is 1+1? ", "q: 12*3 = ", "compute 7-2, then box it: ", "2/4 ="]
ANSWERS = ["yes", "no", "yes", "no"]


class Recorder:
    """A reward_fn that remembers every (completion, answer) it scores."""

    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __call__(self, completion, answer):
        self.calls.append((completion, answer))
        return self.fn(completion, answer)


def _run(tiny, reward_fn, **kw):
    model, tokenizer = tiny
    args = dict(reward_fn=reward_fn, temperatures=(0.5, 1.0, 1.5), n_samples=4, k_values=(1, 2, 4),
                max_new_tokens=6, batch_size=5, seed=0, progress=False)
    args.update(kw)
    return evaluate(model, tokenizer, PROMPTS, ANSWERS, **args)


def test_evaluate_all_or_nothing_rewards(tiny):
    ones = _run(tiny, lambda c, a: 1.0, temperatures=TEMPERATURES, batch_size=16, max_new_tokens=3)
    assert [r.temperature for r in ones.rows] == list(TEMPERATURES)
    assert (ones.n_samples, ones.n_problems) == (4, len(PROMPTS))
    for row in ones.rows:
        assert row.avg_at_n == 1.0
        assert row.pass_at_k == {1: 1.0, 2: 1.0, 4: 1.0}
        assert row.n_correct == [4] * len(PROMPTS)
    assert ones.greedy_pass_at_1 == 1.0
    assert ones.mean_avg_at_n == 1.0 and ones.mean_pass_at_k == {1: 1.0, 2: 1.0, 4: 1.0}

    zeros = _run(tiny, lambda c, a: 0.0)
    assert all(r.avg_at_n == 0.0 and set(r.pass_at_k.values()) == {0.0} for r in zeros.rows)
    assert zeros.greedy_pass_at_1 == 0.0 and zeros.mean_avg_at_n == 0.0


def test_evaluate_scores_each_problem_against_its_answer(tiny):
    """Half the gold answers are "yes": per-problem counts land on the right problems."""
    rec = Recorder(lambda c, a: float(a == "yes"))
    result = _run(tiny, rec)
    for row in result.rows:
        assert row.n_correct == [4, 0, 4, 0]
        assert row.avg_at_n == pytest.approx(0.5)
        assert row.pass_at_k == {1: pytest.approx(0.5), 2: pytest.approx(0.5), 4: pytest.approx(0.5)}
    assert result.greedy_correct == [1, 0, 1, 0] and result.greedy_pass_at_1 == 0.5
    # every problem scored once greedily and n_samples times per temperature
    assert len(rec.calls) == len(PROMPTS) * (1 + 4 * 3)
    # only new tokens are decoded, without special tokens
    for completion, _ in rec.calls:
        assert len(completion) <= 6
        assert "<pad>" not in completion and "<eos>" not in completion


def test_evaluate_greedy_matches_unpadded_decoding(tiny):
    """Left padding + attention mask: each greedy completion in a padded batch equals
    the greedy decode of that prompt alone."""
    model, tokenizer = tiny
    rec = Recorder(lambda c, a: 0.0)
    _run(tiny, rec, temperatures=(1.0,), n_samples=1, k_values=(1,))
    greedy_texts = sorted(c for c, _ in rec.calls[:len(PROMPTS)])
    expected = []
    for prompt in PROMPTS:
        ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=6, pad_token_id=0, eos_token_id=1)
        new = out[0, ids.shape[1]:].tolist()
        new = new[:new.index(1)] if 1 in new else new
        expected.append(tokenizer.decode(new, skip_special_tokens=True))
    assert greedy_texts == sorted(expected)


def test_evaluate_deterministic_and_side_effect_free(tiny, device):
    """On the test device (CUDA when present): same seed, same samples; the caller's RNG
    state, the model's mode and generation_config are left as they were."""
    model, tokenizer = tiny
    model = copy.deepcopy(model).to(device)
    model.train()
    saved_config = model.generation_config
    rng_before = torch.get_rng_state()
    cuda_rng_before = torch.cuda.get_rng_state() if device == "cuda" else None

    first, second, other = Recorder(lambda c, a: 0.0), Recorder(lambda c, a: 0.0), Recorder(lambda c, a: 0.0)
    r1 = _run((model, tokenizer), first)
    r2 = _run((model, tokenizer), second)
    _run((model, tokenizer), other, seed=1)
    assert first.calls == second.calls and r1.to_dict() == r2.to_dict()
    assert first.calls != other.calls            # the seed matters
    sampled = [c for c, _ in first.calls[len(PROMPTS):]]
    assert len(set(sampled)) > len(PROMPTS)      # samples of one problem differ from each other

    assert torch.equal(torch.get_rng_state(), rng_before)   # caller's RNG untouched
    if cuda_rng_before is not None:
        assert torch.equal(torch.cuda.get_rng_state(), cuda_rng_before)
    assert model.training and model.generation_config is saved_config


def test_evaluate_takes_prompt_token_ids(tiny):
    """Token-id prompts (what `erpo eval` passes: the training prompts, BOS included) are
    used as they are: the same ids as the strings give the same completions."""
    model, tokenizer = tiny
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    from_text, from_ids = Recorder(lambda c, a: 0.0), Recorder(lambda c, a: 0.0)
    _run(tiny, from_text, temperatures=(1.0,), n_samples=2, k_values=(1,))
    evaluate(model, tokenizer, ids, ANSWERS, reward_fn=from_ids, temperatures=(1.0,), n_samples=2, k_values=(1,),
             max_new_tokens=6, batch_size=5, seed=0, progress=False)
    assert from_ids.calls == from_text.calls
    with pytest.raises(ValueError, match="^prompts:"):
        evaluate(model, tokenizer, [ids[0], []], ANSWERS[:2], reward_fn=lambda c, a: 0.0, progress=False)


def test_evaluate_temperature_changes_samples(tiny):
    """Low temperature concentrates on the greedy completion; high temperature does not."""
    rec = Recorder(lambda c, a: 0.0)
    _run(tiny, rec, temperatures=(0.1, 1.5), n_samples=6, k_values=(1,), max_new_tokens=4)
    p = len(PROMPTS)
    greedy, cold, hot = rec.calls[:p], rec.calls[p:p + 6 * p], rec.calls[p + 6 * p:]
    greedy_set = {c for c, _ in greedy}
    cold_hits = sum(c in greedy_set for c, _ in cold)
    hot_hits = sum(c in greedy_set for c, _ in hot)
    assert cold_hits > hot_hits


@pytest.mark.parametrize("kw, name", [
    (dict(k_values=(1, 8)), "k_values"),
    (dict(temperatures=(0.0, 1.0)), "temperatures"),
    (dict(n_samples=0), "n_samples"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(batch_size=0), "batch_size"),
])
def test_evaluate_rejects_bad_arguments(tiny, kw, name):
    with pytest.raises(ValueError, match=f"^{name}[:=]"):  # the message starts with the argument
        _run(tiny, lambda c, a: 0.0, **kw)
    model, tokenizer = tiny
    with pytest.raises(ValueError, match="^answers:"):
        evaluate(model, tokenizer, PROMPTS, ANSWERS[:2], reward_fn=lambda c, a: 0.0, progress=False)


# ----------------------------------------------------------------------------- reports


def _fake_result(offset: float = 0.0) -> EvalResult:
    from erpo.evaluate import TemperatureRow

    rows = [TemperatureRow(temperature=t, avg_at_n=0.1 + offset + 0.05 * i,
                           pass_at_k={1: 0.1 + offset + 0.05 * i, 4: 0.3 + offset + 0.04 * i},
                           n_correct=[i % 5, 4 - i % 5])
            for i, t in enumerate(TEMPERATURES)]
    return EvalResult(rows=rows, greedy_pass_at_1=0.375 + offset, n_samples=4, n_problems=2,
                      greedy_correct=[1, 0])


def _table(md: str) -> dict[str, list[float]]:
    """The markdown table's rows: first cell -> the numbers of the other cells."""
    out = {}
    for line in md.splitlines():
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        try:
            out.setdefault(cells[0], [float(x) for x in cells[1:]])   # first table wins
        except ValueError:
            pass   # a header or separator row
    return out


def test_write_report(tmp_path):
    result = _fake_result()
    paths = write_report(result, tmp_path / "run", title="tiny eval")
    assert set(paths) == {"json", "md", "png"}
    assert all(p.exists() and p.stat().st_size > 0 for p in paths.values())
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list((tmp_path / "run").glob("*.tmp"))       # no temp files left behind

    loaded = EvalResult.load(paths["json"])
    assert loaded.to_dict() == result.to_dict()
    assert json.loads(paths["json"].read_text())["mean"]["avg_at_n"] == pytest.approx(result.mean_avg_at_n)

    md = paths["md"].read_text()
    assert md.startswith("# tiny eval")
    assert "| temperature | Avg@4 | Pass@1 | Pass@4 |" in re.sub(r" +", " ", md)
    table = _table(md)
    assert len(table) == len(TEMPERATURES) + 1
    for row in result.rows:
        got = table[repr(row.temperature)]   # "0.1", "1.0", ...
        assert got == pytest.approx([row.avg_at_n, row.pass_at_k[1], row.pass_at_k[4]], abs=5e-5)
    mean = result.mean_pass_at_k
    assert table["mean"] == pytest.approx([result.mean_avg_at_n, mean[1], mean[4]], abs=5e-5)
    greedy = re.search(r"Greedy Pass@1: ([0-9.]+)", md)
    assert greedy and float(greedy.group(1)) == pytest.approx(0.375, abs=5e-5)


def test_write_report_from_evaluate(tmp_path, tiny):
    result = _run(tiny, lambda c, a: float(a == "yes"), temperatures=(0.7, 1.3))
    md = write_report(result, tmp_path)["md"].read_text()
    assert _table(md)["0.7"] == pytest.approx([0.5, 0.5, 0.5, 0.5], abs=5e-5)


def test_compare_report(tmp_path):
    runs = {"grpo": _fake_result(), "erpo": _fake_result(offset=0.2)}
    path = compare_report(runs, tmp_path)
    assert path.name == "compare.md" and (tmp_path / "compare.png").stat().st_size > 0
    md = path.read_text()
    assert "| temperature | grpo Avg@4 | erpo Avg@4 |" in re.sub(r" +", " ", md)
    assert set(json.loads((tmp_path / "compare.json").read_text())) == {"grpo", "erpo"}
    table = _table(md)
    assert table["1.5"] == pytest.approx([runs["grpo"].rows[-1].avg_at_n, runs["erpo"].rows[-1].avg_at_n],
                                         abs=5e-5)
    assert table["mean"] == pytest.approx([runs["grpo"].mean_avg_at_n, runs["erpo"].mean_avg_at_n], abs=5e-5)
    with pytest.raises(ValueError, match="^results:"):
        compare_report({}, tmp_path)
