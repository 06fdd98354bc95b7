from setuptools import find_packages, setup

setup(
    name="erpo",
    version="0.1.0",
    description="Fused Triton kernels for the RL fine-tuning loss of large-vocabulary LMs, and a lean GRPO/ERPO trainer",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # the benchmark suite installs as erpo_bench (python -m erpo_bench), never as a top-level `bench`
    # that any other bench module would collide with; in a checkout it stays bench/ (python -m bench)
    # configs/*.yaml ship as erpo/configs (package data): `erpo train demo` runs them by name from an install
    packages=find_packages(include=["erpo_kernels", "erpo_kernels.*", "erpo", "erpo.*"]) + ["erpo_bench", "erpo.configs"],
    package_dir={"erpo_bench": "bench", "erpo.configs": "configs"},
    package_data={"erpo.configs": ["*.yaml"]},
    install_requires=[
        "torch>=2.4",
        "triton>=3.0; platform_system == 'Linux'",
        "numpy",
    ],
    extras_require={
        # the trainer: models, tokenizers, rewards, config, progress and plots
        "train": [
            "transformers>=4.45",
            "tokenizers",
            "safetensors",
            "math-verify",
            "pyyaml",
            "tqdm",
            "matplotlib",
            "pyarrow",
        ],
        # the peers the benchmark compares against (each optional at run time), at the versions whose
        # code paths bench/cost_subjects.py counts (e.g. Liger's chunk rule)
        "bench": ["liger-kernel==0.8.5", "cut-cross-entropy==25.1.1", "matplotlib"],
        # setuptools >= 70.1 builds wheels itself (tests/test_packaging.py builds one, offline);
        # pytest-xdist: make test runs the main suite on both cores (-n 2, whole files per worker);
        # liger-kernel: tests/test_cost.py runs Liger's own GRPO loss (bench cost's liger-grpo subject)
        "dev": ["pytest", "pytest-timeout", "pytest-xdist", "hypothesis", "setuptools>=70.1", "liger-kernel==0.8.5"],
        # erpo.integrations.trl: our kernel inside TRL's GRPOTrainer, and ERPOTrainer (tested with this TRL)
        "trl": ["trl==1.16.0"],
        # rollout_backend=vllm (CUDA only): the version erpo.rollout's vLLM engine is written and tested against
        "vllm": ["vllm==0.33.0"],
        # erpo.integrations.verl: impl_backend=erpo and loss_mode=erpo inside verl (tested with this verl)
        "verl": ["verl==0.9.1"],
    },
    entry_points={
        "console_scripts": ["erpo=erpo.cli:main"],
        # verl imports these inside `import verl` (driver and every worker): registers impl_backend=erpo, loss_mode=erpo
        "verl.plugins": ["erpo=erpo.integrations.verl"],
    },
)
