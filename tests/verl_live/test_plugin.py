"""erpo is a verl plugin: found by entry point, loaded inside `import verl`, and the
config lines of docs/verl.md compose with verl's own trainer config."""
from __future__ import annotations

import os
import sys
from importlib.metadata import entry_points


def test_entry_point_loads_and_registers():
    eps = [ep for ep in entry_points(group="verl.plugins") if ep.name == "erpo"]
    assert [ep.value for ep in eps] == ["erpo.integrations.verl"]
    module = eps[0].load()  # verl swallows load errors at DEBUG: load it here so they show
    assert "erpo.integrations.verl" in sys.modules  # already imported by `import verl` (conftest)

    from verl.models.transformers import monkey_patch
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.workers import engine_workers
    from verl.workers.utils import losses

    assert get_policy_loss_fn("erpo") is module.compute_policy_loss_erpo
    assert monkey_patch.patch_forward_with_backends is module._patch_forward_with_backends
    assert losses.ppo_loss is module.erpo_ppo_loss
    assert engine_workers.ppo_loss is module.erpo_ppo_loss  # the name ActorRolloutRefWorker binds
    module.install()  # idempotent: verl's originals stay the wrapped ones
    assert module._VERL_PATCH_FORWARD is not module._patch_forward_with_backends
    assert module._VERL_PPO_LOSS is not module.erpo_ppo_loss


def test_docs_config_lines_compose_with_verls_trainer_config(tmp_path):
    import verl
    from hydra import compose, initialize_config_dir
    from verl.utils.config import omega_conf_to_dataclass

    from erpo.integrations.verl import ERPOPolicyLossConfig

    cache = str(tmp_path / "ref_cache.safetensors")
    overrides = [line.replace("CACHE", cache) for line in (
        "actor_rollout_ref.model.use_fused_kernels=True",
        "actor_rollout_ref.model.fused_kernel_options.impl_backend=erpo",
        "+actor_rollout_ref.model.fused_kernel_options.kernel_backend=torch",
        "actor_rollout_ref.actor.policy_loss._target_=erpo.integrations.verl.ERPOPolicyLossConfig",
        "actor_rollout_ref.actor.policy_loss.loss_mode=erpo",
        "+actor_rollout_ref.actor.policy_loss.alpha=0.05",
        "+actor_rollout_ref.actor.policy_loss.ref_cache=CACHE",
        "+actor_rollout_ref.actor.policy_loss.query_weighting=softmax",
        "+actor_rollout_ref.actor.policy_loss.weight_temperature=0.5",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    )]
    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose("ppo_trainer", overrides=overrides)
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    pl = actor.policy_loss
    assert isinstance(pl, ERPOPolicyLossConfig)
    assert (pl.loss_mode, pl.alpha, pl.ref_cache, pl.query_weighting, pl.weight_temperature) == (
        "erpo", 0.05, cache, "softmax", 0.5)
    assert dict(cfg.actor_rollout_ref.model.fused_kernel_options) == {"impl_backend": "erpo", "kernel_backend": "torch"}


def test_config_rejects_bad_values(tmp_path):
    import pytest

    from erpo.integrations.verl import ERPOPolicyLossConfig

    with pytest.raises(ValueError, match="ref_cache"):
        ERPOPolicyLossConfig(alpha=0.1)
    with pytest.raises(ValueError, match="query_weighting"):
        ERPOPolicyLossConfig(alpha=0.0, query_weighting="uniform")
    with pytest.raises(ValueError, match="alpha"):
        ERPOPolicyLossConfig(alpha=-1.0)
    with pytest.raises(ValueError, match="kl_guard"):
        ERPOPolicyLossConfig(alpha=0.0, kl_guard=0.0)
    # checked by the objects they configure, as ERPOConfig and TrainConfig: w_min by the weighter
    with pytest.raises(ValueError, match=r"^policy_loss.w_min must lie in \[0, 1\]"):
        ERPOPolicyLossConfig(alpha=0.0, w_min=2.0)
    with pytest.raises(ValueError, match="^policy_loss.kernel_backend must be one of auto, triton, torch, got 'fast'$"):
        ERPOPolicyLossConfig(alpha=0.0, kernel_backend="fast")
    with pytest.raises(ValueError, match="directory"):
        ERPOPolicyLossConfig(alpha=0.1, ref_cache=str(tmp_path))


def test_an_erpo_config_wraps_the_engines_train_batch():
    """The mini-batch fields come from verl's BaseEngine.train_batch, wrapped once an ERPO
    config exists (the worker builds its actor config before its engine)."""
    from verl.workers.engine.base import BaseEngine

    from erpo.integrations.verl import ERPOPolicyLossConfig

    ERPOPolicyLossConfig(alpha=0.0, query_weighting="none")
    assert getattr(BaseEngine.train_batch, "_erpo", False)


def test_erpo_settings_are_declared_once():
    """verl's ERPOPolicyLossConfig declares every ERPOSettings key with its default and
    refuses a bad one with ERPOSettings' own message (prefixed with policy_loss.); the
    inner policy loss is one of verl's."""
    import dataclasses

    import pytest

    from erpo.erpo_settings import SETTINGS_KEYS, ERPOSettings
    from erpo.integrations.verl import ERPOPolicyLossConfig

    declared = {f.name: f.default for f in dataclasses.fields(ERPOPolicyLossConfig) if f.name in SETTINGS_KEYS}
    assert declared == {f.name: f.default for f in dataclasses.fields(ERPOSettings)}
    with pytest.raises(ValueError) as direct:
        ERPOSettings(w_max=0.5).validate()
    with pytest.raises(ValueError) as verl_side:
        ERPOPolicyLossConfig(alpha=0.0, w_max=0.5)
    assert str(verl_side.value) == f"policy_loss.{direct.value}"
    assert ERPOPolicyLossConfig(alpha=0.0, inner_loss_mode="gspo").inner_loss_mode == "gspo"
    with pytest.raises(ValueError, match=r"^policy_loss.inner_loss_mode must be one of verl's policy losses"):
        ERPOPolicyLossConfig(alpha=0.0, inner_loss_mode="erpo")
