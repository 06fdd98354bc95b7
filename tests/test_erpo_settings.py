"""ERPO's settings in one place (erpo.erpo_settings.ERPOSettings): `erpo train`'s
TrainConfig and TRL's ERPOConfig declare every one of its keys with its default, build
their settings from it by name, and refuse a bad value with the same message (verl's
ERPOPolicyLossConfig: tests/verl_live/test_plugin.py)."""
import dataclasses
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from erpo.config import ConfigError, TrainConfig  # noqa: E402
from erpo.erpo_settings import SETTINGS_KEYS, ERPOSettings  # noqa: E402


def _defaults(cls):
    return {f.name: f.default for f in dataclasses.fields(cls) if f.name in SETTINGS_KEYS}


def test_train_config_and_erpo_config_declare_every_key_with_its_default():
    from erpo.integrations.trl import ERPOConfig

    expected = {f.name: f.default for f in dataclasses.fields(ERPOSettings)}
    assert set(SETTINGS_KEYS) == {"alpha", "query_weighting", "bins", "gamma", "weight_temperature", "w_min", "w_max",
                                  "kl_guard"}
    assert _defaults(TrainConfig) == expected
    assert _defaults(ERPOConfig) == expected
    assert ERPOSettings.of(TrainConfig()) == ERPOSettings()


@pytest.mark.parametrize("key,bad,message", [
    ("alpha", -1.0, "^alpha must be finite and >= 0"),
    ("kl_guard", 100.0, r"^kl_guard must lie in \(0, "),
    ("w_min", 2.0, "w_min"),
    ("bins", 0, "bins"),
])
def test_one_check_for_every_config(tmp_path, key, bad, message):
    from erpo.integrations.trl import ERPOConfig

    with pytest.raises(ValueError, match=message) as direct:
        ERPOSettings(**{key: bad}).validate()
    with pytest.raises(ConfigError) as train:
        TrainConfig(**{key: bad}).validate()
    with pytest.raises(ValueError) as trl:
        ERPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], **{key: bad})
    assert str(train.value) == str(trl.value) == str(direct.value)
