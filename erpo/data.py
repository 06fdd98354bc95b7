"""Datasets, prompt templates and the data order.

A dataset is a list of Example(prompt, answer): the embedded arithmetic task, or a
local JSONL / JSON / Parquet file with a prompt and an answer field. A template turns
the question into the text the model sees. The data order is a pure function of
(seed, step), so a resumed run draws exactly the batches the uninterrupted one would.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Sequence, Tuple

import torch

from .config import MIXED_LEVELS, ConfigError, TrainConfig
from .errors import ErpoError
from .rewards import extract_boxed


class DataError(ErpoError):
    """A missing or malformed dataset."""


@dataclass(frozen=True)
class Example:
    prompt: str  # the question, before the template
    answer: str  # the gold answer the reward compares against


# The paper's format: reasoning inside <think></think>, the final answer inside \boxed{}.
R1_INSTRUCTION = (
    "The assistant answers the user's question. It first reasons step by step inside "
    "<think> </think>, then writes the final answer inside \\boxed{}."
)
R1_TEMPLATE = R1_INSTRUCTION + "\nUser: {prompt}\nAssistant: <think>"


# ---------------------------------------------------------------------- the embedded task


def arithmetic_split(max_operand: int, train_size: int, eval_size: int, seed: int) -> Tuple[List[Example], List[Example]]:
    """Disjoint (train, eval) sets of "a+b=" -> "a + b" problems, a, b in [0, max_operand].

    The pairs are shuffled with `seed`; eval takes the first `eval_size`, train the next
    `train_size`.
    """
    n_pairs = (max_operand + 1) ** 2
    if train_size + eval_size > n_pairs:
        raise ConfigError(
            f"task_train_size={train_size} + task_eval_size={eval_size} exceeds the {n_pairs} distinct problems of "
            f"task_max_operand={max_operand}; raise task_max_operand or lower the sizes"
        )
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(n_pairs, generator=g).tolist()
    side = max_operand + 1
    problems = [Example(f"{k // side}+{k % side}=", str(k // side + k % side)) for k in order[: eval_size + train_size]]
    return problems[eval_size:], problems[:eval_size]


# The harder family (task=mixed): six difficulty levels "<digits of a><op><digits of b>"; a
# d-digit operand lies in [10^(d-1), 10^d - 1], a - b has a >= b. The demo model's warm start
# (2000 steps) solves a few to a third of each level at temperature 1, and many more in 8
# tries: room for RL to learn, and for high temperatures to lose. The levels: MIXED_LEVELS.
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def difficulty_of(prompt: str) -> str:
    """The level of a mixed-task question: "123-45=" -> "3-2"."""
    match = re.fullmatch(r"(\d+)([+*-])(\d+)=", prompt)
    if match is None:
        raise ValueError(f"prompt: {prompt!r} is not a question of the embedded task (a<op>b=)")
    return f"{len(match.group(1))}{match.group(2)}{len(match.group(3))}"


def _level_problems(level: str, count: int, g: torch.Generator) -> List[Example]:
    """`count` distinct problems of one level, in the order of a permutation drawn from `g`."""
    da, op, db = int(level[0]), level[1], int(level[2])
    lo_a, lo_b = 10 ** (da - 1), 10 ** (db - 1)
    side = 10 ** db - lo_b  # values of b
    out: List[Example] = []
    for k in torch.randperm((10 ** da - lo_a) * side, generator=g).tolist():
        a, b = lo_a + k // side, lo_b + k % side
        if op == "-" and a < b:
            continue
        out.append(Example(f"{a}{op}{b}=", str(_OPS[op](a, b))))
        if len(out) == count:
            return out
    raise ConfigError(f"task=mixed: level {level} has fewer than {count} distinct problems; lower task_train_size "
                      f"or task_eval_size")


def mixed_split(train_size: int, eval_size: int, seed: int) -> Tuple[List[Example], List[Example]]:
    """Disjoint (train, eval) sets of the mixed task: each level of MIXED_LEVELS gives
    train_size // 6 training and eval_size // 6 held-out problems (the held-out split has
    every difficulty in equal parts, so accuracy can be read per level), drawn with `seed`."""
    levels = len(MIXED_LEVELS)
    if eval_size < levels or train_size < levels:
        raise ConfigError(f"task=mixed needs task_train_size and task_eval_size of at least {levels} (one problem "
                          f"per difficulty level), got {train_size} and {eval_size}")
    g = torch.Generator().manual_seed(derived_seed(seed, "mixed-task"))
    train: List[Example] = []
    held_out: List[Example] = []
    for level in MIXED_LEVELS:
        problems = _level_problems(level, eval_size // levels + train_size // levels, g)
        held_out += problems[: eval_size // levels]
        train += problems[eval_size // levels:]
    return train, held_out


# ---------------------------------------------------------------------- files


def _read_records(path: str) -> List[Dict[str, Any]]:
    ext = os.path.splitext(path)[1].lower()
    if ext == ".jsonl":
        records = []
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise DataError(f"dataset {path} line {line_no} is not valid JSON ({exc.msg})") from None
        return records
    if ext == ".json":
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except json.JSONDecodeError as exc:
            raise DataError(f"dataset {path} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
        if not isinstance(data, list):
            raise DataError(f"dataset {path} must hold a JSON list of records (or use .jsonl, one record a line)")
        return data
    if ext == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            try:
                import pandas as pd
            except ImportError:
                raise DataError(f"reading {path} needs pyarrow: pip install pyarrow (or convert it to .jsonl)") from None
            return pd.read_parquet(path).to_dict(orient="records")
        return pq.read_table(path).to_pylist()
    raise DataError(f"dataset {path}: unsupported file type {ext or '(none)'}; use .jsonl, .json or .parquet")


# Where a MATH-style record keeps what the default fields name: the question under
# "problem" or "question", the answer only as the last \boxed{} of its "solution".
DEFAULT_PROMPT_FIELD, DEFAULT_ANSWER_FIELD = "prompt", "answer"  # prompt_field's and answer_field's defaults
PROMPT_FALLBACKS = ("problem", "question")
SOLUTION_FIELD = "solution"


def _record_example(rec: Dict[str, Any], prompt_field: str, answer_field: str) -> Tuple[Any, Any]:
    """(question, answer) of one record, or None for a field it lacks. With the default
    field names a MATH-style record (problem, solution with a \\boxed{} answer) works too."""
    prompt = rec.get(prompt_field)
    if prompt is None and prompt_field == DEFAULT_PROMPT_FIELD:
        prompt = next((rec[k] for k in PROMPT_FALLBACKS if rec.get(k) is not None), None)
    answer = rec.get(answer_field)
    if answer is None and answer_field == DEFAULT_ANSWER_FIELD and isinstance(rec.get(SOLUTION_FIELD), str):
        answer = extract_boxed(rec[SOLUTION_FIELD])
    return prompt, answer


def read_examples(path: str, prompt_field: str, answer_field: str, key: str = "dataset") -> List[Example]:
    """Examples from a local file; a missing file, field or empty set is a DataError.

    With the default fields (prompt, answer), a record without them may give its question
    as "problem" or "question" and its answer as the last \\boxed{} of "solution", so a
    MATH-style JSONL reads as it is. ``key`` names the setting in messages (dataset, data).
    """
    if not os.path.exists(path):
        raise DataError(f"dataset {path!r} does not exist (give a local .jsonl/.parquet file, or {key}=arithmetic)")
    if os.path.isdir(path):
        raise DataError(f"dataset {path!r} is a directory; give one .jsonl, .json or .parquet file")
    try:
        records = _read_records(path)
    except (OSError, ValueError) as exc:  # unreadable: permissions, not UTF-8, a corrupt Parquet file
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(f"dataset {path} could not be read ({first})") from None
    if not records:
        raise DataError(f"dataset {path} holds no records")
    examples = []
    for i, rec in enumerate(records):
        if not isinstance(rec, dict):
            raise DataError(f"dataset {path} record {i} is not an object with fields")
        prompt, answer = _record_example(rec, prompt_field, answer_field)
        for value, field, flag in ((prompt, prompt_field, "prompt_field"), (answer, answer_field, "answer_field")):
            if value is None:
                fields = ", ".join(sorted(map(str, rec))) or "none"
                also = ""
                if flag == "answer_field" and answer_field == DEFAULT_ANSWER_FIELD:
                    also = (f" and its {SOLUTION_FIELD!r} holds no \\boxed{{}} answer" if SOLUTION_FIELD in rec
                            else f" nor a {SOLUTION_FIELD!r} with a \\boxed{{}} answer")
                if field in rec:  # the field is there, its value is null
                    raise DataError(f"dataset {path} record {i} has {field!r}: null{also.replace(' nor a ', ' and no ')}; give it a value or "
                                    f"remove the record")
                raise DataError(
                    f"dataset {path} record {i} has no {field!r} field{also} (its fields: {fields}); "
                    f"set {flag}=NAME to the field that holds it"
                )
        examples.append(Example(str(prompt), str(answer)))
    return examples


def rl_subset(train: Sequence[Example], rl_size: int, task: str) -> List[Example]:
    """The RL prompts of the embedded task: the first `rl_size` of its training problems
    (task=mixed: the first rl_size / 6 of each level's); rl_size 0 = all of them."""
    if not rl_size:
        return list(train)
    if task != "mixed":
        return list(train[:rl_size])
    per_level, share = len(train) // len(MIXED_LEVELS), rl_size // len(MIXED_LEVELS)
    return [ex for k in range(len(MIXED_LEVELS)) for ex in train[k * per_level:k * per_level + share]]


def _read_eval_examples(cfg: TrainConfig) -> List[Example]:
    """The evaluation file's examples under the run's prompt_field / answer_field, else (a
    file without them, e.g. MATH-style records evaluated after a run on q / gold fields)
    read as it is: prompt / answer, or problem and the \\boxed{} of solution."""
    key = cfg.eval.key("dataset")
    try:
        return read_examples(cfg.eval.dataset, cfg.prompt_field, cfg.answer_field, key=key)
    except DataError as exc:
        if (cfg.prompt_field, cfg.answer_field) == (DEFAULT_PROMPT_FIELD, DEFAULT_ANSWER_FIELD):
            raise
        try:
            return read_examples(cfg.eval.dataset, DEFAULT_PROMPT_FIELD, DEFAULT_ANSWER_FIELD, key=key)
        except DataError:
            raise exc from None


def load_examples(cfg: TrainConfig, split: str = "train") -> List[Example]:
    """The examples the config names: "train" (the RL prompts), "eval" (held out) or
    "warmstart" (the demo model's demonstrations: every training problem of the embedded
    task, of which task_rl_size picks the RL prompts; for a dataset file, its examples)."""
    if split == "eval" and cfg.eval.dataset and cfg.eval.dataset != "arithmetic":
        return _read_eval_examples(cfg)
    if cfg.is_demo_task or (split == "eval" and cfg.eval.dataset == "arithmetic"):
        demo = cfg.demo
        if demo.task == "mixed":
            train, held_out = mixed_split(demo.task_train_size, demo.task_eval_size, cfg.seed)
        else:
            train, held_out = arithmetic_split(demo.task_max_operand, demo.task_train_size, demo.task_eval_size, cfg.seed)
        if split == "eval":
            return held_out
        return train if split == "warmstart" else rl_subset(train, demo.task_rl_size, demo.task)
    return read_examples(cfg.dataset, cfg.prompt_field, cfg.answer_field)


def examples_fingerprint(examples: Sequence[Example]) -> str:
    h = hashlib.sha256()
    for ex in examples:
        h.update(json.dumps([ex.prompt, ex.answer]).encode())
    return h.hexdigest()[:16]


# ---------------------------------------------------------------------- templates


def render_prompt(template: str, question: str, tokenizer: Any = None) -> str:
    """The text the model sees for `question` under `template` (r1, chat, plain or a {prompt} string)."""
    if template == "plain":
        return question
    if template == "r1":
        return R1_TEMPLATE.replace("{prompt}", question)
    if template == "chat":
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ConfigError("template=chat needs a tokenizer with a chat template; use template=r1 instead")
        messages = [{"role": "user", "content": f"{question}\n\n{R1_INSTRUCTION}"}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return template.replace("{prompt}", question)


def template_text(template: str) -> str:
    """The template as stored in the reference cache metadata (what changes l_0 when it changes)."""
    return {"r1": R1_TEMPLATE, "chat": "chat:" + R1_INSTRUCTION}.get(template, template)


def encode_prompts(tokenizer: Any, examples: Sequence[Example], template: str) -> List[List[int]]:
    """Prompt token ids of each example (the tokenizer's special tokens, e.g. BOS, included;
    a chat template already carries its own)."""
    add_special = template != "chat"
    texts = [render_prompt(template, ex.prompt, tokenizer) for ex in examples]
    ids = tokenizer(texts, add_special_tokens=add_special)["input_ids"]
    return [list(map(int, x)) for x in ids]


def check_prompts(prompt_ids: Sequence[Sequence[int]], examples: Sequence[Example], max_tokens: int) -> None:
    """DataError naming the first prompt that scores no token or is too long."""
    for i, ids in enumerate(prompt_ids):
        if len(ids) < 2:
            raise DataError(
                f"query {i} ({examples[i].prompt!r}) has {len(ids)} prompt token(s), so its log-likelihood scores "
                f"nothing; use a longer template (template=r1) or a tokenizer that adds BOS"
            )
        if max_tokens and len(ids) > max_tokens:
            raise DataError(
                f"query {i} ({examples[i].prompt[:40]!r}...) has {len(ids)} prompt tokens, more than "
                f"max_prompt_tokens={max_tokens}; raise max_prompt_tokens (0 = no limit) or filter the dataset"
            )


# ---------------------------------------------------------------------- data order


def batches_per_epoch(num_examples: int, queries_per_step: int) -> int:
    if num_examples < queries_per_step:
        raise DataError(
            f"the dataset has {num_examples} queries but queries_per_step={queries_per_step}; "
            f"lower queries_per_step or use a larger dataset"
        )
    return num_examples // queries_per_step


def step_indices(num_examples: int, queries_per_step: int, step: int, seed: int) -> List[int]:
    """The m dataset indices of step `step` (1-based): epoch e is a permutation seeded by
    (seed, e), cut into batches of m (the remainder is dropped); no query repeats in a step."""
    per_epoch = batches_per_epoch(num_examples, queries_per_step)
    epoch, k = divmod(step - 1, per_epoch)
    g = torch.Generator().manual_seed(derived_seed(seed, "epoch", epoch))
    order = torch.randperm(num_examples, generator=g)
    return order[k * queries_per_step:(k + 1) * queries_per_step].tolist()


def derived_seed(seed: int, *parts: Any) -> int:
    """A 63-bit seed derived from `seed` and a purpose, e.g. derived_seed(0, "rollout", 7)."""
    digest = hashlib.sha256(json.dumps([seed, *parts]).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
