"""The Ray executor's settings: sizes, pools, placement, and errors that name the key (no Ray needed)."""

import json
import subprocess
import sys

import pytest

from verl_core.config import ConfigError, apply_overrides, resolve_config
from verl_core.registry import PluginRegistry


def resolve(*overrides):
    return resolve_config(apply_overrides({}, ["executor.name=\"ray\"", *overrides]), PluginRegistry()).executor.config


def test_nnodes_and_procs_per_node_set_the_world_size():
    cfg = resolve("executor.nnodes=2", "executor.procs_per_node=3")
    assert cfg.world_size == 6 and cfg.pool_sizes() == {"default": 3}
    cfg = resolve("executor.world_size=4", "executor.nnodes=2")
    assert cfg.procs_per_node == 2


def test_placement_maps_roles_to_pools():
    cfg = resolve("executor.world_size=2", "executor.pools={gen=1}", 'executor.placement={rollout="gen"}')
    assert cfg.pool_sizes() == {"default": 2, "gen": 1}
    assert cfg.pool_of("rollout") == "gen" and cfg.pool_of("actor") == "default"


@pytest.mark.parametrize("overrides, key", [
    (["executor.world_size=3", "executor.nnodes=2"], "executor.world_size"),
    (["executor.world_size=2", "executor.procs_per_node=3"], "executor.world_size"),
    (['executor.placement={actr="default"}'], "executor.placement.actr"),
    (['executor.placement={rollout="gen"}'], "executor.placement.rollout"),
    (["executor.pools={gen=0}"], "executor.pools.gen"),
    (['executor.device="tpu"'], "executor.device"),
    (["executor.nodes=2"], "executor.nodes"),
])
def test_bad_settings_name_the_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        resolve(*overrides)
    assert err.value.path == key, str(err.value)


def test_cli_flags_reach_the_executor_config(run_verl):
    res = run_verl("config", "show", "--executor", "ray", "--nnodes", "1", "--procs-per-node", "2")
    assert res.returncode == 0, res.stderr
    assert 'name = "ray"' in res.stdout and "world_size = 2" in res.stdout and "procs_per_node = 2" in res.stdout
    res = run_verl("config", "show", "--nnodes", "2")  # the local executor has no nodes to spread over
    assert res.returncode == 2 and "executor.nnodes" in res.stderr


def test_selecting_the_executor_does_not_import_ray():
    code = ("import sys; from verl_core.registry import PluginRegistry; "
            "cls = PluginRegistry().load('executor', 'ray'); cls.Config(world_size=2).validate(); "
            "print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_local_executor_never_imports_ray():
    code = ("import sys; from verl_core.config import resolve_config; from verl_core.registry import PluginRegistry;"
            "resolve_config({}, PluginRegistry()); print(json.dumps('ray' in sys.modules))")
    out = subprocess.run([sys.executable, "-c", "import json;" + code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) is False
