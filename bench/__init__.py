"""bench: speed and memory of the erpo_kernels ops and of a whole training step.

    python -m bench kernels --device cpu|cuda [--quick]   # ops vs PyTorch and the peers
    python -m bench step    --device cpu|cuda [--quick]   # one GRPO/ERPO training step
    python -m bench cost                                   # counted GPU cost model of ours and the peers (CPU)
    python -m bench aot                                    # every kernel compiled for six GPUs: smem, registers, spills
    python -m bench calibrate --device cuda                # the linear op and lm_head GEMMs timed beside the model
    python -m bench demo-vllm                              # configs/demo-vllm.yaml on the HF and vLLM backends
    python -m bench replay                                 # configs/demo.yaml at top_p=0.8, support replayed or not
    python -m bench report                                 # README table + plots from bench/results/*.json
    python -m bench merge FILE.json                        # fold a results file (e.g. from a GPU run) in

Definitions used everywhere (and written into every results file):
  speed   median wall time over repeats after warm-up; CUDA events on GPU,
          time.perf_counter on CPU.
  memory  peak extra memory of the measured region: on GPU the peak of
          torch.cuda.max_memory_allocated during the region minus
          torch.cuda.memory_allocated just before it; on CPU, in a fresh subprocess per
          measurement, the peak resident set size (VmHWM, reset just before the region)
          minus the resident set size just before it.
"""

__all__ = ["kernels", "step", "report", "peers", "measure", "cost", "cost_model", "cost_subjects", "calibrate", "rollout",
           "demo_vllm", "replay"]
