"""`python -m erpo.integrations.verl ref-cache OVERRIDES`: the reference cache built from a
run's own verl overrides holds exactly the prompts the loss meets in that run (verl's
dataset and collate_fn, the rollout's chat template, erpo's query-id path) with the starting
model's prompt log-likelihood; an existing cache is replaced only with --overwrite; a run
whose prompts differ (a chat-template kwarg, a shorter prompt length) is stopped by the
loss with the command, and that command, run with the run's overrides, rebuilds the cache."""
from __future__ import annotations

import runpy
import shlex
import shutil
import subprocess
import sys

import pytest
import torch

from _setup import chat_model_dir, make_batch, to_engine, write_train_parquet

# six rows, five distinct prompts (rows 0 and 2 are the same question without a system message)
QUESTIONS = ["what is 2+3?", "what is 12+30?", "what is 2+3?", "how much is 7 times 6?", "9-4?", "what is 1+2+3+4?"]
COMMAND = "python -m erpo.integrations.verl ref-cache"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("ref_cache")
    model_dir = chat_model_dir(str(root))
    train = write_train_parquet(str(root / "train.parquet"), QUESTIONS, system="Answer with a number.")
    return model_dir, train


def run_overrides(files, cache, *extra):
    """A run's verl overrides (docs/verl.md's lines; fp32 actor on this CPU)."""
    model_dir, train = files
    return [
        f"data.train_files={train}", f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.rollout.name=vllm",
        "data.max_prompt_length=96", "+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32",
        "actor_rollout_ref.model.use_fused_kernels=True", "actor_rollout_ref.model.fused_kernel_options.impl_backend=erpo",
        "actor_rollout_ref.actor.policy_loss._target_=erpo.integrations.verl.ERPOPolicyLossConfig",
        "actor_rollout_ref.actor.policy_loss.loss_mode=erpo", "+actor_rollout_ref.actor.policy_loss.alpha=0.05",
        f"+actor_rollout_ref.actor.policy_loss.ref_cache={cache}", *extra,
    ]


@pytest.fixture(scope="module")
def built(files, tmp_path_factory):
    """The cache of the base run, built by the command (in this process)."""
    from erpo.integrations.verl import cache_command

    cache = str(tmp_path_factory.mktemp("built") / "ref_cache.safetensors")
    args = run_overrides(files, cache)
    assert cache_command.main(args + ["--device", "cpu"]) == 0
    return cache, args


def _compose(args):
    import os

    import verl
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer", "config"),
                               version_base=None):
        return compose("ppo_trainer", overrides=args)


def run_prompts(args):
    """The prompts of the run `args` as verl's trainer makes them: its dataset and collate_fn,
    then the single-turn rollout's chat template (the run's apply_chat_template_kwargs), cut
    to rollout.prompt_length from the left."""
    from torch.utils.data import DataLoader
    from verl.trainer.ppo.utils import create_rl_dataset
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.dataset.rl_dataset import collate_fn

    cfg = _compose(args)
    model = omega_conf_to_dataclass(cfg.actor_rollout_ref.model)
    dataset = create_rl_dataset(cfg.data.train_files, cfg.data, model.tokenizer, model.processor)
    kwargs = dict(cfg.data.apply_chat_template_kwargs)
    keep = int(cfg.actor_rollout_ref.rollout.prompt_length)
    prompts = []
    for batch in DataLoader(dataset, batch_size=4, collate_fn=collate_fn):
        for messages in batch["raw_prompt"]:
            ids = model.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True,
                                                      return_dict=False, **kwargs)
            prompts.append([int(t) for t in ids][-keep:])
    return prompts


def loss_fields(prompts, cache):
    """A mini-batch of these prompts in the engine's layout, with ERPO's fields added as the
    engine's train_batch adds them (erpo's query ids of the prompts, l_0 from the cache)."""
    from erpo.integrations import verl as ev

    data = to_engine(make_batch(prompts, [[5, 6, 7]] * len(prompts)), 1.0)
    ev.add_mini_batch_fields(data, ev.ERPOPolicyLossConfig(alpha=0.05, ref_cache=cache))
    return data


def hf_prompt_logp(model_dir, prompts):
    """[B] float64 l_0 of each prompt: the starting model's logits, log-softmax, gathered, summed."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            logp = model(input_ids=ids).logits[0, :-1].log_softmax(-1)
            out.append(logp.gather(1, ids[0, 1:, None]).sum())
    return torch.stack(out).double()


def assert_l0(data, model_dir, prompts):
    from erpo.integrations.verl import REF_KEY

    expected = hf_prompt_logp(model_dir, prompts)
    diff = float((data[REF_KEY] - expected).abs().max())
    print(f"l_0 max |cache - HF| {diff:.3g} nats (l_0 {float(expected.min()):.1f} .. {float(expected.max()):.1f})")
    torch.testing.assert_close(data[REF_KEY], expected, rtol=1e-6, atol=2e-5)  # fp32 rounding over ~40 tokens


def test_the_cache_holds_the_runs_prompts_and_their_log_likelihood(files, built):
    from erpo.integrations.verl import prompt_token_lists
    from erpo.ref_cache import query_id, read_ref_cache

    cache, args = built
    prompts = run_prompts(args)
    assert len(prompts) == len(QUESTIONS) and len({tuple(p) for p in prompts}) == 5
    data = loss_fields(prompts, cache)  # a prompt the cache lacks would raise here
    stored = read_ref_cache(cache)
    assert sorted(stored.query_id.tolist()) == sorted({query_id(p) for p in prompt_token_lists(data)})
    torch.testing.assert_close(stored.n_tokens, torch.tensor([len(p) - 1 for p in dict.fromkeys(map(tuple, prompts))]))
    assert stored.meta["compute_dtype"] == "float32" and stored.meta["verl_command"].startswith(COMMAND)
    assert_l0(data, files[0], prompts)


def test_an_existing_cache_is_replaced_only_with_overwrite(built, capsys, monkeypatch):
    cache, args = built
    before = open(cache, "rb").read()
    monkeypatch.setattr(sys, "argv", ["erpo.integrations.verl", "ref-cache", *args, "--device", "cpu"])
    with pytest.raises(SystemExit) as stopped:
        runpy.run_module("erpo.integrations.verl", run_name="__main__")  # python -m erpo.integrations.verl ...
    err = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == 2 and len(err) == 1 and err[0].startswith("erpo: error: reference cache")
    assert "--overwrite" in err[0] and cache in err[0]
    assert open(cache, "rb").read() == before


@pytest.mark.parametrize("case, extra, in_process", [
    ("chat-template kwarg", ["+data.apply_chat_template_kwargs.enable_thinking=false"], False),
    ("truncated", ["data.max_prompt_length=16"], True),
])
def test_a_run_with_other_prompts_stops_with_the_command_that_rebuilds_the_cache(files, built, tmp_path, case,
                                                                                extra, in_process):
    from erpo.integrations.verl import cache_command
    from erpo.ref_cache import RefCacheError

    cache = str(tmp_path / "ref_cache.safetensors")
    shutil.copy(built[0], cache)  # the base run's cache, for this run
    run = run_overrides(files, cache, *extra)
    prompts = run_prompts(run)
    assert all(p != q for p, q in zip(prompts, run_prompts(built[1])))  # every prompt of this run differs
    with pytest.raises(RefCacheError) as stopped:
        loss_fields(prompts, cache)
    message = str(stopped.value)
    assert cache in message and "not in the reference cache" in message and f"built by: {COMMAND}" in message
    named = message.rsplit("trains with: ", 1)[1]
    assert named == f"{COMMAND} <the overrides> --overwrite"
    argv = shlex.split(named.replace("<the overrides>", shlex.join(run + ["--device", "cpu"])))
    if in_process:
        assert cache_command.main(argv[4:]) == 0
    else:
        done = subprocess.run([sys.executable] + argv[1:], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        assert f"erpo: wrote {cache}: 6 training rows, 5 distinct prompts" in done.stdout
    data = loss_fields(prompts, cache)
    assert_l0(data, files[0], prompts)


def test_bad_input_is_one_line_naming_the_fix(files, tmp_path, capsys):
    from erpo.integrations.verl import cache_command

    cache = str(tmp_path / "ref_cache.safetensors")
    args = run_overrides(files, cache)
    cases = [
        (args[:-1], "+actor_rollout_ref.actor.policy_loss.ref_cache=PATH"),  # no cache path
        (args + ["data.no_such_key=1"], "does not compose"),
        ([a for a in args if not a.startswith("data.train_files")] + [f"data.train_files={tmp_path}/none.parquet"],
         "none.parquet does not exist"),
        (args + ["--batch-size", "0"], "--batch-size"),
        (args + ["--device", "gpu0"], "--device=gpu0 is not a device"),
    ]
    for argv, says in cases:
        assert cache_command.main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("erpo: error: ") and says in err[0], err
