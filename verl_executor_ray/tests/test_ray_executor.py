"""The Ray executor in-process: FSDP groups over two processes, placements, concurrency, a dead worker.

These tests share one local Ray instance (``ray_session``); each executor joins it, starts its
pools, and kills its workers on shutdown.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from verl_core.contracts import ExecutorConfig, ModelSpec, Role, SamplingParams, WorkerFailedError
from verl_core.trainer import _create_worker
from verl_executor_ray.config import RayExecutorConfig

pytestmark = pytest.mark.slow


def ray_executor(**settings):
    from verl_executor_ray.executor import RayExecutor

    config = RayExecutorConfig(**settings)
    config.validate()
    return RayExecutor(config)


@pytest.fixture(scope="module")
def builtin():
    """The built-in model directory, its tokenizer, and a GRPO batch sampled from it on the built-in task."""
    from transformers import AutoTokenizer

    from verl_algorithms.functional import scores_to_token_rewards
    from verl_algorithms.grpo import GRPO
    from verl_core.rollout_utils import build_batch
    from verl_rollout_hf import HFRollout, HFRolloutConfig
    from verl_task_arithmetic.addition import ensure_builtin_model, make_dataset, reward

    model_dir = str(ensure_builtin_model())
    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = make_dataset()[0][:8]
    prompts = [{"prompt_ids": tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True,
                                                      return_dict=False),
                "ground_truth": r["reward_model"]["ground_truth"]} for r in rows]
    engine = HFRollout(config=HFRolloutConfig(), model=ModelSpec(path=model_dir), tokenizer=tok)
    out = engine.generate([p["prompt_ids"] for p in prompts], sampling=SamplingParams(n=4, seed=3, max_new_tokens=6))
    batch = build_batch(prompts, out, n=4, pad_id=tok.pad_token_id)
    texts = tok.batch_decode(out.response_ids, skip_special_tokens=True)
    scores = torch.tensor([reward(t, gt) for t, gt in zip(texts, batch.meta["ground_truth"])])
    batch = batch.replace(scores=scores, token_rewards=scores_to_token_rewards(scores, batch.response_mask))
    algorithm = GRPO(GRPO.Config())
    advantages, returns = algorithm.compute_advantages(batch)
    return model_dir, tok, prompts, batch.replace(advantages=advantages, returns=returns), algorithm


def train_three_steps(executor, model_dir, batch, algorithm):
    """Old log-probs, then three policy updates on the same batch; returns losses and the final log-probs."""
    from verl_backend_fsdp.backend import FSDPBackend, FSDPConfig

    # micro_batch_size 4 divides both the 32-sample batch and each rank's 16: the same micro-batches
    # (and so the same objective) in one process and in two. eps=1e-5: Adam's first steps are ~lr x sign(g),
    # so a gradient at rounding level (different summation order on two ranks) would move a weight by lr.
    backend = FSDPBackend(FSDPConfig(lr=1e-3, eps=1e-5, micro_batch_size=4, log_prob_micro_batch_size=4))
    group = executor.create_group(role=Role.ACTOR, factory=functools.partial(
        _create_worker, backend, Role.ACTOR, ModelSpec(path=model_dir), 0))
    batch = batch.replace(old_log_probs=group.compute_log_probs(batch).log_probs)
    losses = [group.update_policy(batch, loss_fn=algorithm.policy_loss, mini_batch_size=0, epochs=1)["ppo/actor_loss"]
              for _ in range(3)]
    return losses, group.compute_log_probs(batch).log_probs, group.world_size


def test_two_fsdp_ranks_match_one_process(ray_session, builtin):
    from verl_executor_local import LocalExecutor

    model_dir, _, _, batch, algorithm = builtin
    one_losses, one_lp, _ = train_three_steps(LocalExecutor(ExecutorConfig(threads_per_worker=1)), model_dir, batch,
                                              algorithm)
    # Contiguous shards: each rank's micro-batches are the one-process ones, so GRPO's token-mean
    # loss is the same objective (token balancing regroups samples; see the multi-node test).
    executor = ray_executor(world_size=2, balance_batches=False)
    try:
        two_losses, two_lp, world = train_three_steps(executor, model_dir, batch, algorithm)
        infos = executor._pools["default"].info
    finally:
        executor.shutdown()
    pids = {info["pid"] for info in infos}
    assert world == 2 and len(pids) == 2 and os.getpid() not in pids
    # Each process gets its share of the CPUs as threads, set before torch started (no oversubscription).
    share = max(1, (os.cpu_count() or 2) // 2)
    assert [(i["threads"], i["omp_num_threads"]) for i in infos] == [(share, str(share))] * 2
    mask = batch.response_mask.bool()
    assert max(abs(a - b) for a, b in zip(one_losses, two_losses)) < 1e-5, (one_losses, two_losses)
    assert (one_lp - two_lp)[mask].abs().max() < 1e-5
    # The updates really moved the policy, so the match is not two copies of the initial model.
    assert one_losses[0] != one_losses[2]


def test_colocated_rollout_runs_in_the_actor_processes(ray_session, builtin):
    """World size 2, rollout on the actor's pool: the engine uses the local actor worker (no weight copy)."""
    from verl_backend_fsdp.backend import FSDPBackend, FSDPConfig
    from verl_rollout_hf import HFRollout, HFRolloutConfig

    model_dir, tok, prompts, _, _ = builtin
    ids = [p["prompt_ids"] for p in prompts[:3]]  # 3 prompts over 2 ranks: one padded prompt
    greedy = SamplingParams(n=2, greedy=True, max_new_tokens=6)
    expected = HFRollout(config=HFRolloutConfig(), model=ModelSpec(path=model_dir), tokenizer=tok).generate(
        ids, sampling=greedy)
    executor = ray_executor(world_size=2)
    try:
        backend = FSDPBackend(FSDPConfig())
        actor = executor.create_group(role=Role.ACTOR, factory=functools.partial(
            _create_worker, backend, Role.ACTOR, ModelSpec(path=model_dir), 0))
        rollout = executor.create_rollout(engine=HFRollout, config=HFRolloutConfig(), model=ModelSpec(path=model_dir),
                                          tokenizer=tok, actor=actor)
        assert rollout.colocated and rollout.shares_actor_weights and rollout.world_size == 2
        out = rollout.generate(ids, sampling=greedy)
        rollout.load_weights(actor.iter_weights())  # shares the weights: nothing to send
        with pytest.raises(TypeError, match="context manager, which cannot cross a process boundary"):
            actor.generation_module()
    finally:
        executor.shutdown()
    assert out.response_ids == expected.response_ids
    assert out.finish_reasons == expected.finish_reasons
    assert max(abs(a - b) for x, y in zip(out.log_probs, expected.log_probs) for a, b in zip(x, y)) < 1e-4


def test_split_placement_sends_the_updated_weights(ray_session, builtin):
    """Rollout on a pool of its own: after a sync its log-probs are the updated actor's, not the old ones."""
    from verl_backend_fsdp.backend import FSDPBackend, FSDPConfig
    from verl_core.rollout_utils import build_batch
    from verl_rollout_hf import HFRollout, HFRolloutConfig

    model_dir, tok, prompts, batch, algorithm = builtin
    executor = ray_executor(pools={"gen": 1}, placement={"rollout": "gen"})
    try:
        backend = FSDPBackend(FSDPConfig(lr=1e-2))
        actor = executor.create_group(role=Role.ACTOR, factory=functools.partial(
            _create_worker, backend, Role.ACTOR, ModelSpec(path=model_dir), 0))
        rollout = executor.create_rollout(engine=HFRollout, config=HFRolloutConfig(), model=ModelSpec(path=model_dir),
                                          tokenizer=tok, actor=actor)
        assert not rollout.colocated and not rollout.shares_actor_weights
        assert rollout.pool.info[0]["pid"] != actor.pool.info[0]["pid"]
        old = batch.replace(old_log_probs=actor.compute_log_probs(batch).log_probs)
        actor.update_policy(old, loss_fn=algorithm.policy_loss, mini_batch_size=0, epochs=1)

        def gap():
            greedy = SamplingParams(n=1, greedy=True, max_new_tokens=6)
            out = rollout.generate([p["prompt_ids"] for p in prompts], sampling=greedy)
            b = build_batch(prompts, out, n=1, pad_id=tok.pad_token_id)
            mask = b.response_mask.bool()
            engine_lp = b.rollout_log_probs[mask]
            return (actor.compute_log_probs(b).log_probs[mask] - engine_lp).abs().max().item()

        before = gap()
        rollout.load_weights(actor.iter_weights())
        after = gap()
        sent = executor.stats.by_method["rollout.load_weights"][0]
    finally:
        executor.shutdown()
    assert before > 1e-3, before  # the engine still had the initial weights
    assert after < 1e-4, after
    assert sent == 1


class Coordinator:
    """A worker that only coordinates through files, so the tests prove concurrency by construction.

    Every worker process runs on this machine and sees the test's ``tmp_path``. No assertion reads
    a clock: a missing overlap shows as a rendezvous that times out, an unwanted one as a call that
    finds another inside.
    """

    def __init__(self, world):
        self.world = world

    def rendezvous(self, directory, me, other, timeout):
        """Arrive as ``me`` and wait for ``other`` to arrive; True if it did within ``timeout`` s."""
        (Path(directory) / me).touch()
        return _wait_for_path(Path(directory) / other, timeout)

    def occupy(self, directory, me):
        """Enter as ``me`` and stay until the test writes ``directory/release``; False if another call
        was inside at the same time (it entered and had not left)."""
        here = Path(directory)
        (here / f"{me}.in").touch()

        def others_inside():
            return {p.stem for p in here.glob("*.in")} - {p.stem for p in here.glob("*.out")} - {me}

        alone = not others_inside() and _wait_for_path(here / "release", 120) and not others_inside()
        (here / f"{me}.out").touch()
        return alone

    def block(self, marker):
        """Say the call has started, then never return: only a failure can end the call."""
        Path(marker, f"rank{self.world.rank}").touch()
        threading.Event().wait()

    def pid(self):
        return os.getpid()

    def close(self):
        pass


def _wait_for_path(path, timeout):
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def make_coordinator(world):
    return Coordinator(world)


class _WatchedLock:
    """The pool's lock, unchanged, that also records when a call had to wait for another."""

    def __init__(self):
        self._lock = threading.Lock()
        self.contended = threading.Event()

    def __enter__(self):
        if not self._lock.acquire(blocking=False):
            self.contended.set()
            self._lock.acquire()
        return self

    def __exit__(self, *exc):
        self._lock.release()


def test_groups_on_different_pools_run_concurrently(ray_session, tmp_path):
    executor = ray_executor(pools={"a": 1, "b": 1}, placement={"actor": "a", "critic": "b", "reference": "a"})
    apart, together = tmp_path / "apart", tmp_path / "together"
    apart.mkdir(), together.mkdir()
    try:
        actor = executor.create_group(role=Role.ACTOR, factory=make_coordinator)
        critic = executor.create_group(role=Role.CRITIC, factory=make_coordinator)
        reference = executor.create_group(role=Role.REFERENCE, factory=make_coordinator)
        assert actor.pid() == reference.pid() != critic.pid()  # colocated roles share a process
        # Different pools: each call waits for the other to arrive, so run one after the other the
        # first would give up after its timeout (generous: a loaded machine only makes it slower).
        met = executor.run_parallel([lambda: critic.rendezvous(str(apart), "critic", "reference", 60),
                                     lambda: reference.rendezvous(str(apart), "reference", "critic", 60)])
        # Same processes: one after the other (their collectives would clash). The first call to
        # start stays inside until the second is seen queued behind it on the pool's lock; only then
        # may it leave, and neither call finds the other inside.
        pool = executor._pools["a"]
        pool.lock = _WatchedLock()
        releaser = threading.Thread(target=lambda: (pool.lock.contended.wait(120), (together / "release").touch()),
                                    daemon=True)
        releaser.start()
        alone = executor.run_parallel([lambda: actor.occupy(str(together), "actor"),
                                       lambda: reference.occupy(str(together), "reference")])
        queued = pool.lock.contended.is_set()
    finally:
        executor.shutdown()
    assert met == [True, True], met
    assert queued, "the second call on the shared pool never waited for the first"
    assert alone == [True, True], alone


def test_a_killed_worker_ends_the_call_with_role_rank_and_cause(ray_session, tmp_path):
    executor = ray_executor(world_size=2)
    errors = []
    try:
        group = executor.create_group(role=Role.ACTOR, factory=make_coordinator)
        victim = executor._pools["default"].info[1]["pid"]

        def call():
            try:
                group.block(str(tmp_path))  # never returns on its own
            except BaseException as exc:
                errors.append(exc)

        caller = threading.Thread(target=call, daemon=True)
        caller.start()
        # Kill only once both ranks are inside the call, so it is the call that must notice.
        assert _wait_for_path(tmp_path / "rank0", 120) and _wait_for_path(tmp_path / "rank1", 120)
        os.kill(victim, signal.SIGKILL)
        caller.join(timeout=120)  # a deadline against a hang, not a measurement
        hung = caller.is_alive()  # read before shutdown, which would end the call by killing rank 0 too
    finally:
        executor.shutdown()
    assert not hung and errors, "the call did not return after a worker was killed"
    exc = errors[0]
    assert isinstance(exc, WorkerFailedError), repr(exc)
    assert (exc.role, exc.rank) == ("actor", 1)
    assert "rank 1 of 2" in str(exc) and str(victim) in str(exc) and "killed by a signal" in str(exc)


def test_a_plugin_that_workers_cannot_import_fails_at_start_with_its_name(ray_session, monkeypatch):
    from verl_core.registry import PluginError

    executor = ray_executor(world_size=1)
    executor.use_plugins([("algorithm", "no-such-algorithm")])
    try:
        with pytest.raises(PluginError, match=r"(?s)no-such-algorithm.*Ray worker process of pool 'default', rank 0"):
            executor.create_group(role=Role.ACTOR, factory=make_coordinator)
    finally:
        executor.shutdown()


def test_roles_on_one_pool_share_their_backend_as_in_one_process(ray_session, builtin):
    """The FSDP backend gives a LoRA actor's reference the actor's own module; that holds on Ray too."""
    pytest.importorskip("peft")
    from verl_backend_fsdp.backend import FSDPBackend, FSDPConfig

    model_dir, _, _, batch, algorithm = builtin
    backend = FSDPBackend(FSDPConfig(lr=1e-2, lora_rank=4))
    executor = ray_executor(world_size=2)
    try:
        groups = {role: executor.create_group(role=role, factory=functools.partial(
            _create_worker, backend, role, ModelSpec(path=model_dir), 0)) for role in (Role.ACTOR, Role.REFERENCE)}
        actor, reference = groups[Role.ACTOR], groups[Role.REFERENCE]
        initial = reference.compute_log_probs(batch).log_probs
        old = batch.replace(old_log_probs=actor.compute_log_probs(batch).log_probs)
        actor.update_policy(old, loss_fn=algorithm.policy_loss, mini_batch_size=0, epochs=1)
        after_ref = reference.compute_log_probs(batch).log_probs
        after_actor = actor.compute_log_probs(batch).log_probs
    finally:
        executor.shutdown()
    assert reference.worker_cls.__name__ == "AdapterOffReference"  # no second copy of the model
    mask = batch.response_mask.bool()
    assert (after_ref - initial)[mask].abs().max() < 1e-5  # adapters off: still the initial policy
    assert (after_actor - initial)[mask].abs().max() > 1e-4  # while the actor moved
