import pytest

from elixir_ray.config import config_from_dict, load_config, parse_overrides, resolve_model_shape
from elixir_ray.errors import ConfigError


def test_defaults_and_overrides():
    cfg = config_from_dict({"model": {"size": "tiny"}}, ["train.steps=7", "optim.lr=1e-4", "cluster.num_workers=3"])
    assert cfg.train.steps == 7 and cfg.optim.lr == pytest.approx(1e-4) and cfg.cluster.num_workers == 3
    assert resolve_model_shape(cfg.model)["d_model"] == 128


def test_activation_checkpointing_takes_a_switch_or_a_mode():
    assert config_from_dict({"model": {"activation_checkpointing": True}}).model.activation_checkpointing is True
    cfg = config_from_dict({}, ["model.activation_checkpointing=selective"])
    assert cfg.model.activation_checkpointing == "selective"


def test_explicit_fields_override_named_size():
    cfg = config_from_dict({"model": {"size": "gpt-1.5b", "n_layers": 2}})
    shape = resolve_model_shape(cfg.model)
    assert shape["n_layers"] == 2 and shape["d_model"] == 1600


@pytest.mark.parametrize("data, needle", [
    ({"train": {"stepz": 3}}, "unknown config key 'train.stepz'"),
    ({"bogus": 1}, "unknown config key 'bogus'"),
    ({"train": {"micro_batch": 0}}, "train.micro_batch must be a positive number"),
    ({"model": {"d_model": -8}}, "model.d_model must be a positive number"),
    ({"model": {"size": "huge"}}, "model.size 'huge' is unknown"),
    ({"train": {"steps": "many"}}, "train.steps: expected an integer"),
    ({"train": {"dtype": "int8"}}, "train.dtype 'int8' is unknown"),
    ({"model": {"d_model": 100, "n_heads": 3}}, "must be divisible by model.n_heads"),
    ({"engine": {"device_memory": "lots"}}, "engine.device_memory"),
    ({"cluster": {"num_workers": 0}}, "cluster.num_workers must be a positive number"),
    ({"model": {"activation_checkpointing": "some"}}, "model.activation_checkpointing must be true, false, selective"),
    ({"model": {"activation_checkpointing": None}}, "model.activation_checkpointing: expected true or false or a string"),
    ({"checkpoint": {"via": "disk"}}, "checkpoint.via must be auto, object_store or storage, got 'disk'"),
    ({"eval": {"windows": 0}}, "eval.windows must be a positive number"),
    ({"eval": {"every_steps": -1}}, "eval.every_steps must be >= 0"),
])
def test_bad_values_name_the_field(data, needle):
    with pytest.raises(ConfigError) as exc:
        config_from_dict(data)
    assert needle in str(exc.value)
    assert "\n" not in str(exc.value)


def test_override_syntax_error():
    with pytest.raises(ConfigError, match="expected key=value"):
        parse_overrides(["train.steps"])


def test_load_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(bad))


def test_shipped_configs_load():
    for path in ("jobs/configs/tiny.yaml", "jobs/configs/demo.yaml"):
        load_config(path)


def test_shipped_configs_load_by_name_outside_the_checkout(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # an installed package has no jobs/ folder beside the user
    assert load_config("tiny").name == "tiny" and load_config("demo").name == "demo"
    for path in ("jobs/configs/tiny.yaml", "tiny.yaml"):  # a path is what the user meant: never swapped
        with pytest.raises(ConfigError, match="ships by name: demo, tiny"):
            load_config(path)
    (tmp_path / "tiny.yaml").write_text("name: mine\n")  # the user's own copy beside them is never shadowed
    with pytest.raises(ConfigError, match=r"there is a tiny.yaml here too: give its path \(./tiny.yaml\) for yours"):
        load_config("tiny")
    assert load_config("./tiny.yaml").name == "mine"


@pytest.mark.parametrize("steps, warmup", [(20, 10), (50, 0), (11, 10)])
def test_the_learning_rate_warms_up_to_lr_and_decays_to_min_lr_ratio_at_the_last_step(steps, warmup):
    from elixir_ray.trainer import lr_at
    cfg = config_from_dict({}, [f"train.steps={steps}", f"optim.warmup_steps={warmup}", "optim.lr=1e-3",
                                "optim.min_lr_ratio=0.1"])
    rates = [lr_at(step, cfg) for step in range(steps)]
    assert rates[max(0, warmup - 1)] == pytest.approx(1e-3)  # the last warm-up step (or the first step) is lr
    assert rates[-1] == pytest.approx(1e-4) if steps - 1 > warmup else rates[-1] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(rates[warmup:], rates[warmup + 1:]))  # decays, never rises
