"""Schemes select what they say, bad input is rejected naming file/key/allowed values, and
writes are atomic."""
import numpy as np
import pytest

from pipelines.artifacts import atomic_dir, save_arrays
from pipelines.compose import compose_text, is_stale
from pipelines.config import ConfigError, load_profile
from pipelines.models import MobileNetV2
from stages.importer.layers import describe_layers
from stages.prune.scheme import select


@pytest.fixture(scope="module")
def layers():
    return describe_layers(MobileNetV2(width=0.35))


def scheme(*rules):
    return {"name": "test", "rules": list(rules)}


def test_mbv2_paper_selects_first_pointwise_of_last_blocks_and_classifier(layers):
    chosen = select(scheme({"name": "pw", "modules": ["features.*.conv.0.0"],
                            "kinds": ["conv_pointwise"], "blocks": {"last": 7},
                            "update": "weight"},
                           {"name": "head", "modules": ["classifier.*"], "update": "both"}),
                    layers)
    assert list(chosen) == [f"features.{i}.conv.0.0.weight" for i in range(11, 18)] + [
        "classifier.1.weight", "classifier.1.bias"]
    assert not any(chosen.values())  # whole parameters, no channel slices


def test_channel_ratios_lists_axes_and_regex(layers):
    chosen = select(scheme(
        {"name": "pw", "modules": ["re:features\\.1[67]\\.conv\\.0\\.0"], "channels": 0.25,
         "update": "weight"},
        {"name": "dw", "modules": ["features.17.conv.1.0"], "channels": [5, 2, 5]},
        {"name": "in", "modules": ["classifier.1"], "channels": 0.5, "axis": "input"}), layers)
    # 0.25 of 336 output channels: the first 84.
    assert chosen["features.16.conv.0.0.weight"] == {"axis": 0, "index": list(range(84))}
    assert chosen["features.17.conv.1.0.weight"] == {"axis": 0, "index": [2, 5]}
    assert chosen["classifier.1.weight"] == {"axis": 1, "index": list(range(640))}
    assert chosen["classifier.1.bias"] is None  # a bias has no input channels: whole
    assert "features.16.conv.0.1.weight" not in chosen  # a norm layer is not conv.0.0


def test_rules_add_up_whole_wins_and_channel_lists_merge(layers):
    chosen = select(scheme(
        {"name": "a", "modules": ["classifier.1"], "channels": [0, 1]},
        {"name": "b", "modules": ["classifier.1"], "channels": [1, 3], "update": "weight"},
        {"name": "c", "modules": ["features.18.0"], "channels": 0.5},
        {"name": "d", "modules": ["features.18.0"]}), layers)
    assert chosen["classifier.1.weight"] == {"axis": 0, "index": [0, 1, 3]}
    assert chosen["classifier.1.bias"] == {"axis": 0, "index": [0, 1]}
    assert chosen["features.18.0.weight"] is None


def test_bias_only_selects_norm_shifts_and_linear_bias(layers):
    chosen = select(scheme({"name": "b", "modules": ["*"], "update": "bias"}), layers)
    assert chosen and all(n.endswith(".bias") for n in chosen)
    assert "classifier.1.bias" in chosen and "features.0.1.bias" in chosen


@pytest.mark.parametrize("rule, message", [
    ({"name": "typo", "modules": ["feature.*"]}, "module pattern 'feature.*' matches no layer"),
    ({"name": "empty", "modules": ["classifier.*"], "kinds": ["conv_depthwise"]},
     "selects no parameter"),
    ({"name": "upd", "update": "weights"}, "allowed: ['bias', 'both', 'weight']"),
    ({"name": "blk", "blocks": {"last": 99}}, "allowed: 1..17"),
    ({"name": "kind", "kinds": ["lstm"]}, "kinds ['lstm'] unknown"),
    ({"name": "key", "channels": 0.5, "extra": 1}, "unknown keys"),
    ({"name": "ratio", "channels": 1.5}, "a ratio must be in (0, 1]"),
    ({"name": "list", "modules": ["classifier.1"], "channels": [3, 10]},
     "channels [10] out of range for 'classifier.1.weight'"),
    ({"name": "axis", "channels": 0.5, "axis": "inputs"}, "allowed: ['input', 'output']"),
    ({"name": "dwin", "kinds": ["conv_depthwise"], "channels": 0.5, "axis": "input"},
     "use axis: output"),
    ({"name": "regex", "modules": ["re:features.(1"]}, "not a valid regular expression"),
    ({"name": "mix", "modules": ["classifier.1"], "channels": "half"}, "allowed: a ratio"),
])
def test_bad_rules_are_rejected_naming_the_rule(layers, rule, message):
    with pytest.raises(ConfigError) as err:
        select(scheme(rule), layers)
    assert f"rule {rule['name']!r}" in str(err.value) and message in str(err.value)
    assert "params.yaml" in str(err.value)


def test_scheme_without_rules_is_rejected(layers):
    with pytest.raises(ConfigError, match="has no rules"):
        select({"name": "none", "rules": []}, layers)


def test_unknown_device_lists_the_profiles():
    with pytest.raises(ConfigError) as err:
        load_profile("rpi9")
    assert "'rpi9' has no profile; allowed: ['android_sd8g2', 'apple_m1', 'edge_x86', 'host'" in str(err.value)


def test_compose_rejects_unknown_scheme_and_device():
    with pytest.raises(ConfigError, match="mbv2_paper"):  # Hydra lists the options
        compose_text(["sparse=mbv2_papr"])
    with pytest.raises(ConfigError, match="'jetson9' has no profile; allowed: \\['android"):
        compose_text(["devices=[host,jetson9]"])


def test_committed_params_yaml_is_composed_from_conf():
    assert not is_stale(), "params.yaml is stale: run `pock compose` and commit it"


def test_atomic_dir_leaves_nothing_behind_on_failure(tmp_path):
    final = tmp_path / "stage"
    with atomic_dir(final) as tmp:
        (tmp / "a.txt").write_text("first")
    with pytest.raises(RuntimeError):
        with atomic_dir(final) as tmp:
            (tmp / "a.txt").write_text("partial")
            raise RuntimeError("killed half-way")
    assert (final / "a.txt").read_text() == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stage"]


def test_saved_arrays_are_byte_identical(tmp_path):
    arrays = {"w": np.arange(6, dtype="float32").reshape(2, 3), "b": np.ones(3)}
    save_arrays(tmp_path / "a.npz", arrays)
    save_arrays(tmp_path / "b.npz", arrays)
    assert (tmp_path / "a.npz").read_bytes() == (tmp_path / "b.npz").read_bytes()
    with np.load(tmp_path / "a.npz") as loaded:
        np.testing.assert_array_equal(loaded["w"], arrays["w"])


def test_unknown_optimizer_names_key_and_allowed_values():
    from stages.autodiff.optimizers import from_config

    with pytest.raises(ConfigError, match=r"optimizer.name='adagrad' is not one of "
                                          r"\['adam', 'adamw', 'sgd'\]"):
        from_config({"name": "adagrad", "lr": 0.1})
    with pytest.raises(ConfigError, match="optimizer.nesterov needs optimizer.momentum"):
        from_config({"name": "sgd", "lr": 0.1, "nesterov": True})
