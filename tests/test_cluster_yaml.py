"""cluster.yaml cannot be launched here; check it against what Ray's local provider requires."""

import os

import yaml


def test_cluster_yaml_has_the_launcher_keys():
    with open(os.path.join(os.path.dirname(__file__), "..", "cluster.yaml")) as f:
        cfg = yaml.safe_load(f)
    assert cfg["cluster_name"]
    provider = cfg["provider"]
    assert provider["type"] == "local"
    assert provider["head_ip"] and isinstance(provider["worker_ips"], list) and provider["worker_ips"]
    assert cfg["auth"]["ssh_user"]
    # the local provider refuses explicit node types
    assert not cfg.get("available_node_types") and "head_node" not in cfg and "worker_nodes" not in cfg
    assert any("pip install" in c for c in cfg["setup_commands"])
    assert any("ray start --head" in c for c in cfg["head_start_ray_commands"])
    assert any("ray start --address" in c for c in cfg["worker_start_ray_commands"])
    assert cfg["max_workers"] >= len(provider["worker_ips"])
    # the checkout's own virtualenv (this machine's paths, maybe a CPU torch) is not copied to the nodes
    assert ".gitignore" in cfg["rsync_filter"] and any(".venv" in p for p in cfg["rsync_exclude"])


def test_cluster_yaml_validates_against_rays_schema():
    import json

    import jsonschema
    import ray.autoscaler

    schema_path = os.path.join(os.path.dirname(ray.autoscaler.__file__), "ray-schema.json")
    with open(schema_path) as f:
        schema = json.load(f)
    with open(os.path.join(os.path.dirname(__file__), "..", "cluster.yaml")) as f:
        cfg = yaml.safe_load(f)
    jsonschema.validate(cfg, schema)
