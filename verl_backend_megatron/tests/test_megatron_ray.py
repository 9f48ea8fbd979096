"""Megatron at TP=2, PP=2 (1F1B), DP=2 (plain and distributed optimizer) and TP=2 x PP=2 on the Ray
executor: the same losses, log-probs and weights as one process and as the FSDP backend.

Each layout gets its own Ray executor (Megatron's parallel state is per process). The executor cuts
split calls over the mesh's data-parallel groups and reads one result per group (the mesh
contract), so a TP=2 run returns each sample once. The batch is not token-balanced
(``balance_batches=False``): DP ranks then hold the samples one process puts in each micro-batch,
the same objective either way.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
import torch
import torch.distributed as dist

from verl_backend_megatron.backend import MegatronBackend, MegatronConfig
from verl_core.contracts import ModelSpec, Role, WorldInfo
from verl_core.testing import make_batch, tiny_model_dir
from verl_core.testing._backend import simple_policy_loss
from verl_core.trainer import _create_worker

pytestmark = [pytest.mark.heavy, pytest.mark.megatron]

STEPS = 3
SETTINGS = dict(lr=1e-3, eps=1e-5, micro_batch_size=4, log_prob_micro_batch_size=4, grad_clip=1.0)
LAYOUTS = {  # name -> (processes, backend settings)
    "tp2": (2, dict(tensor_parallel_size=2)),
    "pp2": (2, dict(pipeline_parallel_size=2)),
    "dp2": (2, {}),
    "dp2_distributed_optimizer": (2, dict(use_distributed_optimizer=True)),
    "tp2_pp2": (4, dict(tensor_parallel_size=2, pipeline_parallel_size=2)),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_model_dir(tmp_path_factory.mktemp("megatron-ray"))


@pytest.fixture(scope="module")
def batch(model_dir: str):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return make_batch(batch_size=8, prompt_length=7, response_length=6, vocab_size=config.vocab_size,
                          group_size=4, pad_id=config.pad_token_id or 0, advantages=True)


def _train(group, batch, ckpt: Path | None = None, *, then: bool = False) -> dict:
    out = {"log_probs_before": group.compute_log_probs(batch).log_probs}
    out["metrics"] = [group.update_policy(batch, loss_fn=simple_policy_loss, mini_batch_size=0, epochs=1)
                      for _ in range(STEPS)]
    out["log_probs"] = group.compute_log_probs(batch).log_probs
    out["weights"] = {k: v.clone() for k, v in group.iter_weights()}
    if ckpt is not None:
        group.save_state(str(ckpt))
    if then:  # one more update after the save: what a run resumed from it must do next
        out["next_metrics"] = group.update_policy(batch, loss_fn=simple_policy_loss, mini_batch_size=0, epochs=1)
        out["next_weights"] = {k: v.clone() for k, v in group.iter_weights()}
    return out


@pytest.fixture(scope="module")
def one_process(model_dir: str, batch) -> Iterator[dict]:
    """Megatron and FSDP at world size 1, in this process."""
    from verl_backend_fsdp.backend import FSDPBackend, FSDPConfig

    was = dist.is_initialized()
    spec = ModelSpec(path=model_dir)
    mcore = MegatronBackend(MegatronConfig(**SETTINGS)).create_worker(role=Role.ACTOR, model=spec, world=WorldInfo(),
                                                                       seed=0)
    fsdp = FSDPBackend(FSDPConfig(**SETTINGS)).create_worker(role=Role.ACTOR, model=spec, world=WorldInfo(), seed=0)
    yield {"megatron": _train(mcore, batch), "fsdp": _train(fsdp, batch), "worker": mcore}
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if not was and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ray_session():
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def _run_layout(name: str, model_dir: str, batch, ckpt: Path, *, then: bool = False) -> tuple[dict, list]:
    from verl_executor_ray.config import RayExecutorConfig
    from verl_executor_ray.executor import RayExecutor

    procs, layout = LAYOUTS[name]
    config = RayExecutorConfig(world_size=procs, balance_batches=False, cpus_per_proc=1)
    config.validate()
    executor = RayExecutor(config)
    try:
        backend = MegatronBackend(MegatronConfig(**SETTINGS, **layout))
        group = executor.create_group(role=Role.ACTOR, factory=functools.partial(
            _create_worker, backend, Role.ACTOR, ModelSpec(path=model_dir), 0))
        return _train(group, batch, ckpt, then=then), [group.mesh.shard_of, group.mesh.readers]
    finally:
        executor.shutdown()


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_one_process_and_fsdp(name: str, ray_session, one_process, model_dir: str, batch,
                                             tmp_path: Path) -> None:
    distributed = LAYOUTS[name][1].get("use_distributed_optimizer", False)
    got, mesh = _run_layout(name, model_dir, batch, tmp_path / "ckpt", then=distributed)
    real = batch.response_attention_mask.bool()
    for reference in ("megatron", "fsdp"):
        ref = one_process[reference]
        assert got["log_probs_before"].shape == batch.response_ids.shape  # each sample once, not once per TP rank
        assert (got["log_probs_before"][real] - ref["log_probs_before"][real]).abs().max() <= 1e-5
        for mine, theirs in zip(got["metrics"], ref["metrics"]):
            assert abs(mine["test/loss"] - theirs["test/loss"]) <= 1e-4, (reference, mine, theirs)
            assert abs(mine["actor/grad_norm"] - theirs["actor/grad_norm"]) <= 1e-4, (reference, mine, theirs)
        assert (got["log_probs"][real] - ref["log_probs"][real]).abs().max() <= 1e-4
        assert _max_diff(got["weights"], ref["weights"]) <= 1e-4
    # The checkpoint written at this layout loads at one process (TP, PP and DP resharded by dist_checkpointing).
    if distributed:  # its optimizer state (sharded over the DP ranks) resumes with the distributed optimizer only
        worker = MegatronBackend(MegatronConfig(**SETTINGS, use_distributed_optimizer=True)).create_worker(
            role=Role.ACTOR, model=ModelSpec(path=model_dir), world=WorldInfo(), seed=0)
    else:
        worker = one_process["worker"]
    worker.load_state(str(tmp_path / "ckpt"))
    assert _max_diff(dict(worker.iter_weights()), got["weights"]) == 0.0
    if distributed:
        # Adam's moments and step, gathered from the two DP shards into one: the next update is the
        # group's, bit for bit on CPU (a lost moment or a wrong step count shows as >= 2e-4).
        after = worker.update_policy(batch, loss_fn=simple_policy_loss, mini_batch_size=0, epochs=1)
        weights = dict(worker.iter_weights())
        worker.close()
        for key in ("test/loss", "actor/grad_norm", "actor/lr"):
            assert abs(after[key] - got["next_metrics"][key]) <= 1e-4, (key, after, got["next_metrics"])
        resumed = _max_diff(weights, got["next_weights"])
        assert resumed == 0.0, f"the update after resuming differs from the group's by {resumed}"
        print(f"{name}: resumed at one process, next update's weights {resumed} from the group's")
    print(f"{name}: mesh {mesh}, losses {[m['test/loss'] for m in got['metrics']]}")


@pytest.mark.long  # ~25 s each after ~1 min of set-up; the layout tests check the same resharded load in CI
@pytest.mark.parametrize("name", ["tp2", "pp2", "tp2_pp2", "dp2_distributed_optimizer"])
def test_verl_export_of_a_multi_rank_checkpoint(name: str, ray_session, one_process, model_dir: str, batch,
                                                tmp_path: Path) -> None:
    """``verl export`` runs in one process: a checkpoint whose saved config says TP=2, PP=2, TP=2 x
    PP=2 or a distributed optimizer over DP=2 loads resharded there (its weights alone: the optimizer
    state is not read), and the HF directory it writes holds the trained weights exactly and its
    logits score the batch as the multi-rank group did."""
    from transformers import AutoModelForCausalLM

    from verl_run_store import CheckpointManager
    from verl_core.config import config_to_dict, dump_toml, resolve_config
    from verl_core.registry import PluginRegistry
    from verl_core.testing import BackendConformance

    got, _ = _run_layout(name, model_dir, batch, tmp_path / "state")
    cfg = resolve_config({"model": {"path": model_dir}, "backend": {"name": "megatron", **SETTINGS,
                                                                    **LAYOUTS[name][1]}}, PluginRegistry())

    def write(tmp: Path) -> None:
        shutil.copytree(tmp_path / "state", tmp / "actor")
        (tmp / "config.toml").write_text(dump_toml(config_to_dict(cfg)))

    CheckpointManager(tmp_path / "run").save(STEPS, write, info={})
    res = subprocess.run([sys.executable, "-m", "verl_cli", "export", str(tmp_path / "run"), str(tmp_path / "hf")],
                         capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    from safetensors.torch import load_file

    exported = {k: v for f in sorted((tmp_path / "hf").glob("*.safetensors")) for k, v in load_file(f).items()}
    common = exported.keys() & got["weights"].keys()
    assert "model.embed_tokens.weight" in common
    assert max((exported[k] - got["weights"][k]).abs().max().item() for k in common) == 0.0
    # The directory as a user loads it: a plain float32 Hugging Face forward, one unpadded row at a time.
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    assert {k for k, _ in hf.named_parameters()} <= got["weights"].keys()
    log_probs, _ = BackendConformance.reference_log_probs(hf, batch)
    real = batch.response_attention_mask.bool()
    diff = (log_probs[real] - got["log_probs"][real]).abs().max().item()
    assert diff <= 1e-5, diff
    print(f"{name}: exported {len(exported)} tensors, log-prob max diff {diff:.2e}")
