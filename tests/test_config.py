import importlib.util

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
    ({"engine": {"memory_margin": 1.0}}, "engine.memory_margin must be a fraction in [0, 1)"),
    ({"engine": {"memory_margin": False}}, "engine.memory_margin: expected a number, got False"),
    ({"model": {"activation_checkpointing": "some"}}, "model.activation_checkpointing must be true, false, selective"),
    ({"model": {"activation_checkpointing": None}}, "model.activation_checkpointing: expected true or false or a string"),
    ({"checkpoint": {"via": "disk"}}, "checkpoint.via must be auto, object_store or storage, got 'disk'"),
    ({"eval": {"windows": 0}}, "eval.windows must be a positive number"),
    ({"eval": {"every_steps": -1}}, "eval.every_steps must be >= 0"),
    ({"train": {"seed": -1}}, "train.seed must be a whole number from 0 to 2**63 - 1, got -1"),
    ({"train": {"seed": 2**63}}, "train.seed must be a whole number from 0"),
    ({"train": 5}, "train: expected a mapping, got 5"),
])
def test_bad_values_name_the_field(data, needle):
    with pytest.raises(ConfigError) as exc:
        config_from_dict(data)
    assert needle in str(exc.value)
    assert "\n" not in str(exc.value)


def test_a_config_that_is_not_a_mapping_is_one_line():
    with pytest.raises(ConfigError, match=r"^config: expected a mapping of sections \(model:, train:, ...\), got \[1, 2\]$"):
        config_from_dict([1, 2])


def test_override_syntax_error():
    with pytest.raises(ConfigError, match="expected key=value"):
        parse_overrides(["train.steps"])


def test_load_config_file_errors(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "missing.yaml"))
    with pytest.raises(ConfigError, match="is a directory: give a YAML file in it"):
        load_config(str(tmp_path))
    (tmp_path / "tiny").mkdir()  # a run's folder named as a shipped config (output_dir=.) does not hide it
    monkeypatch.chdir(tmp_path)
    assert load_config("tiny").name == "tiny"
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing set yet\n")
    with pytest.warns(UserWarning, match="is empty: every setting is its default"):
        assert load_config(str(empty)).name == "run"
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(bad))


def test_shipped_configs_load():
    for path in ("jobs/configs/tiny.yaml", "jobs/configs/demo.yaml"):
        load_config(path)
    if importlib.util.find_spec("transformers") is not None:
        assert load_config("jobs/configs/llama-tiny.yaml").model.hf["model_type"] == "llama"


def test_shipped_configs_load_by_name_outside_the_checkout(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # an installed package has no jobs/ folder beside the user
    assert load_config("tiny").name == "tiny" and load_config("demo").name == "demo"
    for path in ("jobs/configs/tiny.yaml", "tiny.yaml"):  # a path is what the user meant: never swapped
        with pytest.raises(ConfigError, match="ships by name: demo, llama-tiny, tiny"):
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
    # the last step is at min_lr_ratio * lr, also where it is the only step after the warm-up (11 steps,
    # 10 of warm-up: it was at lr)
    assert rates[-1] == pytest.approx(1e-4)
    assert all(a >= b for a, b in zip(rates[warmup:], rates[warmup + 1:]))  # decays, never rises


LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             vocab_size=300, max_position_embeddings=128)


@pytest.mark.parametrize("model, needle", [
    ({"hf": {**LLAMA, "hiden_size": 32}}, "model.hf.hiden_size is not a field of LlamaConfig (did you mean hidden_size"),
    ({"hf": {**LLAMA, "model_type": "lama"}}, "model.hf.model_type 'lama' is no causal language model this "
                                              "transformers"),
    ({"hf": {k: v for k, v in LLAMA.items() if k != "model_type"}}, "model.hf needs model_type"),
    ({"hf": LLAMA, "n_layers": 4}, "model.n_layers shapes the built-in GPT; with model.hf, set the model's own field"),
    ({"hf": LLAMA, "dropout": 0.1}, "model.dropout is the built-in GPT's; with model.hf, set the model's own dropout"),
    ({"hf": LLAMA, "activation_checkpointing": "selective"}, "selective is the built-in GPT's"),
    ({"hf": LLAMA, "seq_len": 256}, "model.seq_len=256 is longer than the 128 positions model.hf's model covers"),
    ({"hf": [1]}, "model.hf: expected a mapping or a string, got [1]"),
    ({"hf": {**LLAMA, "hidden_size": 66}}, "model.hf: LlamaConfig refused these fields: "),  # 66 heads of 4
    ({"hf": LLAMA}, "train.dtype float16 is for the built-in GPT"),
    ({"hf": {**LLAMA, "attn_implementation": "bogus"}}, "model.hf: transformers could not build the model from these "
                                                        "fields: ValueError: Specified `attn_implementation=\"bogus\"`"),
    ({"hf": 2024}, "model.hf: '2024' is no config.json file"),
    ({"hf": "no/such/config.json"}, "model.hf: 'no/such/config.json' is no config.json file"),
])
def test_a_hugging_face_model_config_is_checked_before_any_worker_starts(model, needle):
    pytest.importorskip("transformers")
    train = {"dtype": "float16"} if "float16" in needle else {}
    with pytest.raises(ConfigError) as exc:
        config_from_dict({"model": model, "train": train})
    assert needle in str(exc.value)
    assert "\n" not in str(exc.value)


def test_a_hugging_face_model_whose_step_fails_is_refused_with_the_models_error():
    """transformers builds a Llama whose key/value heads do not divide its heads; it fails only in
    forward. One step traced on meta finds it on the driver, as one line."""
    pytest.importorskip("transformers")
    from elixir_ray.model.factory import check_model_step

    cfg = config_from_dict({"model": {"hf": {**LLAMA, "num_key_value_heads": 3}, "seq_len": 64}})
    with pytest.raises(ConfigError) as exc:
        check_model_step(cfg)
    assert str(exc.value).startswith("model.hf: transformers builds LlamaForCausalLM from these fields, but one "
                                     "training step of it fails, traced on the meta device (64 tokens, float32): "
                                     "RuntimeError: The size of tensor a (4) must match"), exc.value
    with pytest.raises(ConfigError, match=r"\(64 tokens, bfloat16\)"):  # a GPU run's compute dtype
        check_model_step(cfg, "cuda")
    assert "\n" not in str(exc.value)
    check_model_step(config_from_dict({"model": {"hf": {**LLAMA, "num_key_value_heads": 2}, "seq_len": 8}}))
    check_model_step(config_from_dict({"model": {"size": "tiny"}}))  # the built-in GPT: nothing to trace


def test_a_hugging_face_model_is_given_by_its_fields_or_its_config_json(tmp_path, monkeypatch):
    import json

    pytest.importorskip("transformers")
    cfg = config_from_dict({"model": {"hf": {**LLAMA, "rms_norm_eps": "1e-5"}, "seq_len": 64,
                                      "activation_checkpointing": True}},
                           ["model.hf.num_hidden_layers=3", "model.hf.attn_implementation=eager"])
    assert cfg.model.hf["num_hidden_layers"] == 3
    assert cfg.model.hf["rms_norm_eps"] == 1e-5  # YAML 1.1 reads 1e-5 as a string; transformers wants a float
    nested = config_from_dict({"model": {"hf": {**LLAMA, "rope_parameters": {"rope_type": "default",
                                                                            "rope_theta": "1e6"}}}})
    assert nested.model.hf["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e6}
    assert resolve_model_shape(cfg.model) == {"vocab_size": 300, "seq_len": 64}  # the model's vocabulary
    (tmp_path / "m").mkdir()
    # keys transformers wrote are taken as written, even one this version's config class does not take
    (tmp_path / "m" / "config.json").write_text(json.dumps({**LLAMA, "rope_theta": 5e5, "architectures": ["X"],
                                                            "quantization_config": None}))
    monkeypatch.chdir(tmp_path)
    for path in ("m", "m/config.json"):  # a folder holding one, or the file; taken from where the command runs
        cfg = config_from_dict({"model": {"hf": path}})
        assert cfg.model.hf["hidden_size"] == 64 and cfg.model.hf["rope_theta"] == 5e5
        assert cfg.model.hf["_name_or_path"] == str(tmp_path / "m" / "config.json")
        assert config_from_dict(cfg.to_dict()).model.hf == cfg.model.hf  # as a sweep or a resume reads it back
        assert resolve_model_shape(cfg.model)["seq_len"] == 128  # model.size's, as for the GPT
    # one field of the file's changed from the command line; the others stay the file's
    cfg = config_from_dict({"model": {"hf": "m"}}, ["model.hf.num_hidden_layers=5"])
    assert cfg.model.hf["num_hidden_layers"] == 5 and cfg.model.hf["hidden_size"] == 64


def test_overrides_given_as_one_string_are_refused_naming_the_list_they_should_be():
    """A string is iterable: read as overrides, 'train.steps=3' was refused at its first character."""
    with pytest.raises(ConfigError, match=r"overrides 'train.steps=3': give a list of key=value strings, for example "
                                          r"\['train.steps=3'\]"):
        config_from_dict({}, "train.steps=3")
    assert config_from_dict({}, ["train.steps=3"]).train.steps == 3


def test_an_option_that_is_a_config_key_is_refused_naming_the_set_that_was_meant(capsys):
    """`train --steps 20 CONFIG`: argparse takes 20 for the config, so the value is read from the
    words as typed; an option of the command spelt with underscores is named."""
    from elixir_ray.cli import main

    for argv, hint in [(["train", "--steps", "20", "tiny"], "--set train.steps=20)"),
                       (["train", "tiny", "--steps=20"], "--set train.steps=20)"),
                       (["plan", "tiny", "--world_size", "2"], "(did you mean --world-size?)")]:
        with pytest.raises(SystemExit) as exc:
            main(argv)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and f"elixir-ray {argv[0]}: error: unrecognized arguments" in err, err
        assert err.rstrip().endswith(hint), err


def test_the_command_prints_its_own_warnings_as_one_line_and_a_librarys_as_python_does():
    import os
    import warnings

    import torch

    from elixir_ray import cli

    ours = os.path.join(os.path.dirname(cli.__file__), "run", "preflight.py")
    assert cli._format_warning("a run ...", UserWarning, ours, 3) == "elixir-ray: warning: a run ...\n"
    theirs = os.path.join(os.path.dirname(torch.__file__), "storage.py")
    assert cli._format_warning("deprecated", UserWarning, theirs, 7) == warnings.formatwarning(
        "deprecated", UserWarning, theirs, 7)


@pytest.mark.parametrize("override, needle", [
    ("optim.lr=nan", "optim.lr must be a finite positive number, got nan"),
    ("optim.lr=.inf", "optim.lr must be a finite positive number, got inf"),
    ("optim.lr=0", "optim.lr must be a positive number, got 0.0"),
    ("optim.weight_decay=.nan", "optim.weight_decay must be a finite number >= 0, got nan"),
    ("optim.weight_decay=.inf", "optim.weight_decay must be a finite number >= 0, got inf"),
    ("optim.max_grad_norm=.nan", "optim.max_grad_norm must be a finite positive number, got nan"),
    ("optim.max_grad_norm=-1", "optim.max_grad_norm must be a positive number, got -1.0"),
    ("optim.eps=.nan", "optim.eps must be a finite positive number, got nan"),
    ("fault.detect_timeout_s=.nan", "fault.detect_timeout_s must be a finite positive number, got nan"),
    ("fault.detect_timeout_s=.inf", "fault.detect_timeout_s must be a finite positive number, got inf"),
    ("fault.wait_for_resources_s=.nan", "fault.wait_for_resources_s must be a finite number >= 0, got nan"),
    ("fault.wait_for_resources_s=.inf", "fault.wait_for_resources_s must be a finite number >= 0, got inf"),
    ("cluster.placement_timeout_s=.inf", "cluster.placement_timeout_s must be a finite positive number, got inf"),
    ("cluster.init_timeout_s=.nan", "cluster.init_timeout_s must be a finite positive number, got nan"),
    ("data.path=foo://x", "data.path 'foo://x': pyarrow has no filesystem for the scheme 'foo://' (give a local "
                          "path, or a URI of file://"),
    ("eval.path=foo://x", "eval.path 'foo://x': pyarrow has no filesystem for the scheme 'foo://'"),
    ("checkpoint.uri=mock://x", "checkpoint.uri 'mock://x': pyarrow has no filesystem for the scheme 'mock://'"),
    ("output_dir=ftp://host/runs", "output_dir 'ftp://host/runs': pyarrow has no filesystem for the scheme 'ftp://'"),
])
def test_values_a_run_cannot_use_are_refused_before_ray_in_one_line_naming_the_field(override, needle):
    """NaN compares false with everything, so `lr <= 0` let `lr: .nan` by to fail in the workers, and
    `.inf` trained to a NaN loss; an unknown URI scheme ended in a pyarrow traceback."""
    with pytest.raises(ConfigError) as exc:
        config_from_dict({}, [override])
    assert str(exc.value).startswith(needle) and "\n" not in str(exc.value), str(exc.value)
    assert config_from_dict({}, ["fault.wait_for_resources_s=0", "optim.max_grad_norm=null", "optim.weight_decay=0",
                                 "checkpoint.uri=s3://bucket/ckpt", "data.path=gs://bucket/data.arrow",
                                 "eval.path=file:///data/eval.arrow"])


def test_a_filesystem_pyarrow_cannot_make_is_refused_naming_the_field_and_the_cause():
    """`check_storage` makes each URI's filesystem as the run will (an S3 bucket's region is looked
    up there), so an object store without network or credentials, hdfs:// without Java or a bad
    option is one line before the run starts; `validate` itself contacts nothing."""
    from elixir_ray.config import check_storage

    cfg = config_from_dict({"checkpoint": {"uri": "s3://bucket/ckpt?no_such_option=1"}})
    with pytest.raises(ConfigError) as exc:
        check_storage(cfg)
    assert str(exc.value) == ("checkpoint.uri 's3://bucket/ckpt?no_such_option=1': pyarrow cannot open its "
                              "filesystem: Unexpected query parameter in S3 URI: 'no_such_option'")
    check_storage(config_from_dict({"data": {"path": "gs://bucket/data.arrow"},
                                    "eval": {"path": "file:///data/eval.arrow"}, "output_dir": "/data/runs"}))


def test_a_key_given_twice_in_a_config_file_is_refused_naming_it_and_its_lines(tmp_path):
    """YAML keeps the last of two values silently: `lr` set twice trained at the second."""
    path = tmp_path / "twice.yaml"
    path.write_text("optim:\n  lr: 1.0e-3\n  weight_decay: 0.1\n  lr: 3.0e-4\n")
    with pytest.raises(ConfigError) as exc:
        load_config(str(path))
    assert str(exc.value) == (f"config file '{path}': the key 'lr' is given twice in one mapping (lines 2 and 4): "
                              f"give it once")
    path.write_text("train: {steps: 3, steps: 4}\n")
    with pytest.raises(ConfigError, match=r"the key 'steps' is given twice in one mapping \(line 1\)"):
        load_config(str(path))
    with pytest.raises(ConfigError, match=r"^--set 'model.hf=\{a: 1, a: 2\}': the key 'a' is given twice: give it once$"):
        parse_overrides(["model.hf={a: 1, a: 2}"])
    # a merge may be overridden by the mapping's own key: that is YAML's, not a repeat
    path.write_text("train:\n  <<: {steps: 3, log_every: 1}\n  steps: 5\n")
    assert load_config(str(path)).train.steps == 5


@pytest.mark.parametrize("override, line", [
    ("optim.lr=nan", "optim.lr must be a finite positive number, got nan"),
    # the filesystem pyarrow cannot make, from train()'s own checks, before the dataset is opened
    ("checkpoint.uri=s3://bucket/ckpt?no_such_option=1", "checkpoint.uri 's3://bucket/ckpt?no_such_option=1': "
     "pyarrow cannot open its filesystem: Unexpected query parameter in S3 URI: 'no_such_option'"),
], ids=["lr", "storage"])
def test_the_command_refuses_a_bad_value_before_ray_starts(override, line):
    """`elixir-ray train tiny --set optim.lr=nan`: exit 2 with one line, before Ray or a dataset."""
    import os
    import subprocess
    import sys
    import time

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "elixir_ray", "train", "tiny", "--set", override], cwd=root,
                          env={**env, "PYTHONPATH": root}, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - start
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr == f"elixir-ray: error: {line}\n", proc.stderr
    assert "Ray" not in proc.stdout + proc.stderr and took < 60, took
