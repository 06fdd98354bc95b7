"""Adapters that put erpo into other training libraries. Each imports its library
lazily, only when the adapter module itself is imported:

    erpo.integrations.trl   TRL's GRPOTrainer with our fused log-prob kernel
                            (use_erpo_kernels), and ERPO as a TRL trainer
                            (ERPOConfig, ERPOTrainer). Needs `pip install erpo[trl]`.
"""
