"""Configuration: conf/ composes (every experiment) into a params.yaml the schema accepts, bad
input is refused at compose time naming the file, key and allowed values, schemes select what
they say, and outputs are written atomically and byte-identically."""
import numpy as np
import pytest
import yaml

from conftest import compose_params
from pipelines.compose import compose_text, is_stale
from pipelines.config import validate
from pipelines.schema import ConfigError
from pipelines.frontends.layers import describe_layers
from pipelines.io import atomic_dir, save_arrays
from pipelines.models.mobilenetv2 import MobileNetV2
from pipelines.training.optimizers import from_config
from pipelines.training.scheme import lr_scales, select


@pytest.fixture(scope="module")
def layers():
    return describe_layers(MobileNetV2(width=0.35))


def test_committed_params_yaml_is_composed_from_conf():
    assert not is_stale(), "params.yaml is stale: run `pock compose` and commit it"


@pytest.mark.parametrize("overrides", [
    [], ["experiment=ci_lane"], ["experiment=paper_tables"],
    ["experiment=model", "model@models.model=onnx"],
    ["experiment=model", "model@models.model=pt2", "models.model.source=net.pt2"],
    ["experiment=model", "model@models.model=torch", "models.model.source=net.py"],
    ["experiment=model", "model@models.model=jax"],
    ["experiment=model", "model@models.model=keras"]], ids=" ".join)
def test_every_experiment_composes_and_validates(overrides):
    params = validate(yaml.safe_load(compose_text(overrides)))
    assert params.cases
    for case in params.cases.values():  # every case names what exists
        assert {case.model} <= set(params.models) and case.scheme in params.schemes


def test_the_ci_lane_is_a_subset_of_the_default_pipeline():
    default, lane = compose_params(), compose_params("experiment=ci_lane")
    assert set(lane.cases) < set(default.cases)
    assert set(lane.devices) <= set(default.devices) and lane.deploy == default.deploy


@pytest.mark.parametrize("override, message", [
    ("+cases.mbv2.colour=red", "cases.mbv2 (from conf/experiment): unknown keys ['colour']; allowed: ['evaluate'"),
    ("models.mbv2.batch_size=eight", "models.mbv2.batch_size='eight' (from conf/model/mbv2.yaml)"),
    ("experiment=finetune models.model.batch_size=x",  # a model the experiment defines
     "models.model.batch_size='x' (from conf/experiment): Input should be a valid integer"),
    ("cases.mbv2.scheme=mbv2_papr", "cases.mbv2.scheme='mbv2_papr' (from conf/experiment): no such scheme; allowed: ['bias_only'"),
    ("optimizers.sgd.lr=-1", "optimizers.sgd.lr=-1 (from conf/optimizer/sgd.yaml)"),
    ("deploy=[mbv3]", "deploy='mbv3' (from conf/experiment): no such case; allowed: ['llama_full'"),
    ("profile=[mbv3]", "profile='mbv3' (from conf/experiment): no such case; allowed: ['llama_full'"),
    ("devices=[host]", "devices='host' (from conf/experiment): every case is built for the host already"),
    ("devices=[rpi4,rpi9]", "'rpi9' has no profile; allowed: ['android_sd8g2'"),
    ("devices=[edge_x86]", "package.devices='rpi4' (from conf/config.yaml): not built (not in devices); "
                           "allowed: ['host', 'edge_x86']"),
    ("sparse@schemes.mbv2_paper=mbv2_papr", "Could not find 'sparse/mbv2_papr'"),
    # a misspelt key without +: the keys allowed there, not Hydra's advice to append it
    ("models.mbv2.batchsize=8", "models.mbv2.batchsize: conf/ has no such key\nparams.yaml: "
                                "models.mbv2 (from conf/model/mbv2.yaml): unknown keys "
                                "['batchsize']; allowed: ['batch_size', 'blocks'"),
    # a new case without +: Hydra's advice, which is right
    ("cases.mine={model:mbv2,scheme:full,optimizer:sgd}", "To append to your config use "
                                                         "+cases.mine="),
])
def test_bad_config_is_refused_at_compose_naming_key_and_allowed(override, message):
    with pytest.raises(ConfigError) as err:
        compose_text(override.split())
    assert message in str(err.value)


def test_a_case_name_that_cannot_be_a_stage_name_is_refused():
    with pytest.raises(ConfigError, match=r"cases='my-case' \(from conf/experiment\): not a "
                                          "name; allowed: letters, digits and _"):
        compose_text(["+cases.my-case={model: mbv2, scheme: full, optimizer: sgd}"])


def test_mbv2_paper_selects_first_pointwise_of_last_blocks_and_classifier(layers):
    chosen = select([{"name": "pw", "modules": ["features.*.conv.0.0"],
                      "kinds": ["conv_pointwise"], "blocks": {"last": 7}, "update": "weight"},
                     {"name": "head", "modules": ["classifier.*"], "update": "both"}], layers)
    assert list(chosen) == [f"features.{i}.conv.0.0.weight" for i in range(11, 18)] + [
        "classifier.1.weight", "classifier.1.bias"]
    assert not any(chosen.values())  # whole parameters, no channel slices


def test_the_committed_mbv2_paper_scheme_is_the_papers(params, layers):
    chosen = select(params.schemes["mbv2_paper"].rules, layers)
    assert "classifier.1.weight" in chosen and "features.0.0.weight" not in chosen


def test_channel_ratios_lists_axes_and_regex(layers):
    chosen = select([
        {"name": "pw", "modules": ["re:features\\.1[67]\\.conv\\.0\\.0"], "channels": 0.25,
         "update": "weight"},
        {"name": "dw", "modules": ["features.17.conv.1.0"], "channels": [5, 2, 5]},
        {"name": "in", "modules": ["classifier.1"], "channels": 0.5, "axis": "input"}], layers)
    # 0.25 of 336 output channels: the first 84.
    assert chosen["features.16.conv.0.0.weight"] == {"axis": 0, "index": list(range(84))}
    assert chosen["features.17.conv.1.0.weight"] == {"axis": 0, "index": [2, 5]}
    assert chosen["classifier.1.weight"] == {"axis": 1, "index": list(range(640))}
    assert chosen["classifier.1.bias"] is None  # a bias has no input channels: whole
    assert "features.16.conv.0.1.weight" not in chosen  # a norm layer is not conv.0.0


def test_rules_add_up_whole_wins_and_channel_lists_merge(layers):
    chosen = select([
        {"name": "a", "modules": ["classifier.1"], "channels": [0, 1]},
        {"name": "b", "modules": ["classifier.1"], "channels": [1, 3], "update": "weight"},
        {"name": "c", "modules": ["features.18.0"], "channels": 0.5},
        {"name": "d", "modules": ["features.18.0"]}], layers)
    assert chosen["classifier.1.weight"] == {"axis": 0, "index": [0, 1, 3]}
    assert chosen["classifier.1.bias"] == {"axis": 0, "index": [0, 1]}
    assert chosen["features.18.0.weight"] is None


def test_bias_only_selects_norm_shifts_and_linear_bias(layers):
    chosen = select([{"name": "b", "modules": ["*"], "update": "bias"}], layers)
    assert chosen and all(n.endswith(".bias") for n in chosen)
    assert "classifier.1.bias" in chosen and "features.0.1.bias" in chosen


def test_a_rules_lr_scale_is_its_parameters_and_two_scales_for_one_are_refused(layers):
    paper = [{"name": "pw", "modules": ["features.17.conv.0.0"], "update": "weight"},
             {"name": "head", "modules": ["classifier.*"]},
             {"name": "biases", "modules": ["*"], "update": "bias", "lr_scale": 5}]
    scales = lr_scales(paper, layers)
    assert set(scales.values()) == {5} and set(scales) == {
        n for n in select(paper[2:], layers)}  # the head's bias too: no scale of its own
    assert "classifier.1.weight" not in scales
    with pytest.raises(ConfigError, match=r"rule 'head': gives 'classifier.1.bias' lr_scale 2"
                                          r"(.0)?, rule 'biases' gives it 5"):
        lr_scales(paper[2:] + [{"name": "head", "modules": ["classifier.*"], "lr_scale": 2}],
                  layers)


@pytest.mark.parametrize("rule, message", [
    ({"name": "typo", "modules": ["feature.*"]}, "module pattern 'feature.*' matches no layer"),
    ({"name": "empty", "modules": ["classifier.*"], "kinds": ["conv_depthwise"]},
     "its modules match: classifier.1 (linear, bias), classifier.1 (linear, weight)"),
    ({"name": "blk", "blocks": {"last": 99}}, "allowed: 1..17"),
    ({"name": "ratio", "channels": 1.5}, "a ratio must be in (0, 1]"),
    ({"name": "list", "modules": ["classifier.1"], "channels": [3, 10]},
     "channels [10] out of range for 'classifier.1.weight'"),
    ({"name": "dwin", "kinds": ["conv_depthwise"], "channels": 0.5, "axis": "input"},
     "use axis: output"),
    ({"name": "regex", "modules": ["re:features.(1"]}, "not a valid regular expression"),
])
def test_bad_rules_are_rejected_naming_the_rule(layers, rule, message):
    with pytest.raises(ConfigError) as err:
        select([rule], layers)
    assert f"rule {rule['name']!r}" in str(err.value) and message in str(err.value)
    assert "params.yaml" in str(err.value)


@pytest.mark.parametrize("rule, message", [
    ({"name": "upd", "update": "weights"}, "Input should be 'weight', 'bias' or 'both'"),
    ({"name": "kind", "kinds": ["lstm"]}, "Input should be 'conv'"),
    ({"name": "key", "channels": 0.5, "extra": 1}, "unknown keys ['extra']"),
    ({"name": "axis", "channels": 0.5, "axis": "inputs"}, "Input should be 'output' or 'input'"),
    ({"name": "mix", "modules": ["classifier.1"], "channels": "half"}, "channels"),
    ({"name": "lr", "modules": ["classifier.1"], "lr_scale": 0}, "greater than 0"),
])
def test_bad_rule_keys_and_values_are_refused_by_the_schema(rule, message):
    with pytest.raises(ConfigError) as err:
        compose_text([f"schemes.full.rules=[{yaml.safe_dump(rule, default_flow_style=True).strip()}]"])
    assert "schemes.full.rules.0" in str(err.value) and "conf/sparse/full.yaml" in str(err.value)
    assert message in str(err.value)


def test_scheme_without_rules_is_rejected(layers):
    with pytest.raises(ConfigError, match="has no rules"):
        select([], layers)
    with pytest.raises(ConfigError, match="a scheme has rules, or a search"):
        compose_text(["schemes.full.rules=[]"])


def test_unknown_optimizer_and_bad_nesterov_are_named():
    with pytest.raises(ConfigError, match=r"optimizers.sgd \(from conf/optimizer/sgd.yaml\): Input tag 'adagrad' found "
                                        r"using 'kind' does not match any of the expected tags: "
                                        r"'sgd', 'adam', 'adamw'"):
        compose_text(["optimizers.sgd.kind=adagrad"])
    with pytest.raises(ConfigError, match="nesterov needs momentum"):
        compose_text(["optimizers.sgd.nesterov=true", "optimizers.sgd.momentum=0"])
    assert from_config(compose_params().optimizers["sgd"]).torch_kwargs()["lr"] > 0


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
