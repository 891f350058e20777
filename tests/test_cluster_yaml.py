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


def _cluster_yaml() -> tuple[dict, str]:
    path = os.path.join(os.path.dirname(__file__), "..", "cluster.yaml")
    with open(path) as f:
        text = f.read()
    return yaml.safe_load(text), text


def test_every_node_starts_with_token_authentication_and_no_open_metrics():
    """A node started without RAY_AUTH_MODE=token (a fresh machine, no token file) took jobs and
    tasks from anyone on its network; per-node Prometheus metrics listened on 0.0.0.0."""
    cfg, _ = _cluster_yaml()
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        starts = [c for c in cfg[key] if "ray start" in c]
        assert starts, key
        for command in starts:
            before = command.split("ray start", 1)[0]
            assert "RAY_AUTH_MODE=token" in before and "RAY_enable_metrics_collection=0" in before, command
            assert "--metrics-export-port" not in command and "0.0.0.0" not in command, command
    (head,) = [c for c in cfg["head_start_ray_commands"] if "ray start" in c]
    assert "--dashboard-host=127.0.0.1" in head and "--port=6379" in head
    # shells on the nodes (ray attach, ray status) send the token too
    assert any("export RAY_AUTH_MODE=token" in c and ".bashrc" in c for c in cfg["setup_commands"])


def test_the_token_is_copied_from_the_home_directory_never_from_the_checkout():
    import subprocess

    cfg, _ = _cluster_yaml()
    mounts = cfg["file_mounts"]
    assert mounts["~/.ray/auth_token"] == "~/.ray/auth_token"
    assert any(c.strip() == "chmod 600 ~/.ray/auth_token" for c in cfg["setup_commands"])
    root = os.path.join(os.path.dirname(__file__), "..")
    tracked = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True).stdout.split()
    assert not [p for p in tracked if "auth_token" in os.path.basename(p)], "a token file is committed"


def test_the_comments_say_what_listens_where_and_what_a_firewall_opens():
    """The table in cluster.yaml's header matches the flags and Ray 2.60's listeners (measured with
    `ss -ltnp` on a head started by these commands): each port named with where it listens."""
    _, text = _cluster_yaml()
    header = [line for line in text.splitlines() if line.startswith("#")]
    rows = {line.split()[2]: line for line in header if line.startswith("#   head  ")}
    assert "every interface" in rows["6379"] and "token" in rows["6379"]
    assert "127.0.0.1 only" in rows["8265"] and "ray dashboard" in rows["8265"]
    assert "node address" in rows["52365"] and "token" in rows["52365"]
    assert "NO authentication" in rows["44217,"]
    assert any("rendezvous store" in line for line in header) and any("gloo" in line for line in header)
    assert any("all TCP between the cluster's nodes" in line for line in header)
    assert any("SSH (22) only" in line for line in header)
