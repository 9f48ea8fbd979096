"""Conformance tests for :class:`~verl_core.contracts.TrainingBackend` implementations.

Subclass :class:`BackendConformance` and provide two fixtures:

* ``backend``: the backend instance, e.g. ``FSDPBackend(FSDPConfig(lr=1e-3))``; the learning rate
  must be large enough for one step to move float32 weights;
* ``model_dir``: a local Hugging Face causal-LM directory (:func:`~verl_core.testing.tiny_model_dir`).

Workers are built on one rank (:class:`~verl_core.contracts.WorldInfo` defaults), several per
test, so a backend that sets up ``torch.distributed`` must reuse an existing process group. The
ground truth is always a plain float32 Hugging Face forward of ``model_dir``.

One case runs several ranks: a backend opts in by overriding the ``multi_rank_backend`` fixture
with the backend laid out over :attr:`BackendConformance.multi_rank_world_size` processes (FSDP
sharded two ways, Megatron at TP=2 or DP=2; parametrize the fixture for several layouts). The
case starts that many processes (gloo on CPU, ``torch.multiprocessing`` standing in for an
executor), places them in the mesh their workers report, and checks them against the same backend
at one rank. It is marked ``heavy``.

That case and the micro-batching one train GRPO's loss, which comes from the verl-algorithms
distribution (the core ships no algorithm): they load it through the registry, as a run does, and
skip, naming the package, where it is not installed. The multi-rank case cuts and joins the batch
with the executors' own functions (``verl_kit.sharding``, the verl-kit library every multi-rank
backend depends on), imported when it runs so that the other suites need no verl-kit.
"""

from __future__ import annotations

import math
import os
import pickle
import socket
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch

from verl_core.batch import Batch
from verl_core.contracts import LogProbs, ModelSpec, Role, TrainingBackend, TrainingWorker, WorldInfo
from verl_core.testing._factories import make_batch

__all__ = ["BackendConformance"]

WorkerFactory = Callable[..., TrainingWorker]


def simple_policy_loss(*, batch: Batch, log_probs: torch.Tensor | None = None, entropy: torch.Tensor | None = None,
                       values: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """``-mean(log_probs * advantages)`` over ``response_mask``: a loss with a gradient everywhere."""
    mask = batch.response_mask.to(log_probs.device, log_probs.dtype)
    adv = batch.advantages.to(log_probs.device, log_probs.dtype)
    loss = -(log_probs * adv * mask).sum() / mask.sum().clamp(min=1.0)
    return loss, {"test/loss": float(loss.detach())}


def simple_value_loss(*, batch: Batch, values: torch.Tensor | None = None, log_probs: torch.Tensor | None = None,
                      entropy: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Masked mean squared error between values and returns."""
    mask = batch.response_mask.to(values.device, values.dtype)
    ret = batch.returns.to(values.device, values.dtype)
    loss = ((values - ret).square() * mask).sum() / mask.sum().clamp(min=1.0)
    return loss, {"test/value_loss": float(loss.detach())}


def sample_mean_policy_loss(*, batch: Batch, log_probs: torch.Tensor | None = None,
                            entropy: torch.Tensor | None = None, values: torch.Tensor | None = None,
                            ) -> tuple[torch.Tensor, dict[str, float]]:
    """The mean over samples of each sample's masked mean of ``-log_probs * advantages``.

    Micro-batches weighted by their share of samples, and data-parallel shards of equal size
    averaged over ranks, compose into exactly this loss of the whole batch (a token mean over the
    batch would not: shards hold different numbers of tokens).
    """
    mask = batch.response_mask.to(log_probs.device, log_probs.dtype)
    adv = batch.advantages.to(log_probs.device, log_probs.dtype)
    per_sample = -(log_probs * adv * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    loss = per_sample.mean()
    return loss, {"test/loss": float(loss.detach())}


def nan_loss(*, batch: Batch, log_probs: torch.Tensor | None = None, entropy: torch.Tensor | None = None,
             values: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """A loss that diverged: NaN but still attached to the graph."""
    return log_probs.sum() * float("nan"), {}


class BackendConformance:
    """Contract tests every training backend must pass.

    Attributes:
        batch_size: samples in the test batches.
        prompt_length: prompt width (prompts are left-padded).
        response_length: response width (responses are right-padded, with tool tokens).
        logprob_atol: largest allowed gap between the backend's log-probs and a float32 HF forward.
        multi_rank_world_size: processes the multi-rank case starts (it must divide ``batch_size``).
        multi_rank_weight_atol: largest allowed gap between the weights after one update at
            ``multi_rank_world_size`` ranks and after the same update at one rank.
        multi_rank_deadline_s: the multi-rank case fails (and kills its processes) after this long;
            ranks that disagree on a collective would otherwise wait forever.
    """

    batch_size = 6
    prompt_length = 7
    response_length = 6
    logprob_atol = 1e-5
    multi_rank_world_size = 2
    multi_rank_weight_atol = 1e-4
    multi_rank_deadline_s = 600

    @pytest.fixture
    def backend(self) -> TrainingBackend:
        """The backend under test; subclasses must override this fixture."""
        pytest.fail(f"{type(self).__name__} must provide a `backend` fixture")

    @pytest.fixture
    def model_dir(self) -> str:
        """A local HF causal-LM directory; subclasses must override this fixture."""
        pytest.fail(f"{type(self).__name__} must provide a `model_dir` fixture")

    @pytest.fixture
    def multi_rank_backend(self) -> TrainingBackend | None:
        """The backend laid out over :attr:`multi_rank_world_size` ranks, for
        :meth:`test_multi_rank_matches_one_rank`; ``None`` (the default) skips that case.

        It is pickled into the spawned processes. Its one-rank twin is
        ``type(backend)(backend.config.for_single_process())``.
        """
        return None

    @pytest.fixture
    def micro_batching_backends(self) -> dict[str, TrainingBackend] | None:
        """The backend under test configured to cut one mini-batch in different ways (one micro-batch,
        several, by token budget, packed, ...), keyed by a name, for
        :meth:`test_gradient_does_not_depend_on_micro_batching`; the first is the reference. ``None``
        (the default) skips that case. Give them an Adam ``eps`` well above the gradients (1.0): the
        first step is then close to linear in the gradient, so the weights it writes compare
        gradients, where at a small ``eps`` they would compare only their signs.
        """
        return None

    @pytest.fixture
    def make_worker(self, backend: TrainingBackend, model_dir: str) -> Iterator[WorkerFactory]:
        """Builds workers of ``model_dir`` on one rank and closes them after the test."""
        workers: list[TrainingWorker] = []

        def factory(role: Role = Role.ACTOR, *, seed: int = 0) -> TrainingWorker:
            worker = backend.create_worker(role=role, model=ModelSpec(path=model_dir), world=WorldInfo(threads=1),
                                           seed=seed)
            workers.append(worker)
            return worker

        yield factory
        for worker in workers:
            worker.close()

    @pytest.fixture
    def hf_model(self, model_dir: str) -> torch.nn.Module:
        """The plain float32 Hugging Face model: the ground truth."""
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    @pytest.fixture
    def batch(self, hf_model: torch.nn.Module) -> Batch:
        """Left-padded prompts, right-padded responses with tool tokens, random advantages and returns."""
        return make_batch(batch_size=self.batch_size, prompt_length=self.prompt_length,
                          response_length=self.response_length, vocab_size=hf_model.config.vocab_size,
                          group_size=self.batch_size // 2, pad_id=hf_model.config.pad_token_id or 0,
                          advantages=True, values=True)

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def reference_log_probs(model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs and entropy ``[B, R]`` from one unpadded forward per row (0 at padding)."""
        out_lp = torch.zeros(batch.response_ids.shape)
        out_ent = torch.zeros(batch.response_ids.shape)
        with torch.no_grad():
            for i in range(len(batch)):
                prompt = batch.prompt_ids[i][batch.prompt_mask[i].bool()]
                length = int(batch.response_attention_mask[i].sum())
                if length == 0:
                    continue
                response = batch.response_ids[i, :length]
                logits = model(input_ids=torch.cat([prompt, response]).unsqueeze(0)).logits[0].float()
                logp = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
                out_lp[i, :length] = logp.gather(-1, response.unsqueeze(-1)).squeeze(-1)
                out_ent[i, :length] = -(logp.exp() * logp).sum(-1)
        return out_lp, out_ent

    @staticmethod
    def weights(worker: TrainingWorker) -> dict[str, torch.Tensor]:
        """A CPU copy of everything ``iter_weights`` yields."""
        return {name: t.detach().cpu().clone() for name, t in worker.iter_weights()}

    @staticmethod
    def check_metrics(metrics: Any, required: str) -> None:
        """Metrics are a dict of finite floats that includes ``required``."""
        assert isinstance(metrics, dict)
        assert required in metrics, f"metrics lack {required!r}: {sorted(metrics)}"
        for key, value in metrics.items():
            assert math.isfinite(float(value)), f"metric {key!r} is {value}"

    # ------------------------------------------------------------------ actor
    def test_compute_log_probs_matches_hf(self, make_worker: WorkerFactory, hf_model: torch.nn.Module,
                                          batch: Batch) -> None:
        """Log-probs and entropy match an unpadded float32 HF forward, despite left padding."""
        assert not batch.prompt_mask.all(), "the test batch should contain left-padded prompts"
        out = make_worker(Role.ACTOR).compute_log_probs(batch, with_entropy=True)
        assert isinstance(out, LogProbs)
        assert out.log_probs.shape == batch.response_ids.shape
        assert out.entropy is not None and out.entropy.shape == batch.response_ids.shape
        ref_lp, ref_ent = self.reference_log_probs(hf_model, batch)
        real = batch.response_attention_mask.bool()
        torch.testing.assert_close(out.log_probs.cpu().float()[real], ref_lp[real], rtol=0, atol=self.logprob_atol)
        torch.testing.assert_close(out.entropy.cpu().float()[real], ref_ent[real], rtol=0,
                                   atol=10 * self.logprob_atol)

    def test_update_policy_changes_weights(self, make_worker: WorkerFactory, batch: Batch) -> None:
        """One update moves the weights and reports finite metrics including the grad norm."""
        worker = make_worker(Role.ACTOR)
        before = self.weights(worker)
        lp_before = worker.compute_log_probs(batch).log_probs
        metrics = worker.update_policy(batch, loss_fn=simple_policy_loss, mini_batch_size=0, epochs=1)
        self.check_metrics(metrics, "actor/grad_norm")
        assert metrics["actor/grad_norm"] > 0
        after = self.weights(worker)
        assert any(not torch.equal(before[k], after[k]) for k in before), "update_policy did not change any weight"
        assert not torch.equal(worker.compute_log_probs(batch).log_probs, lp_before), (
            "compute_log_probs does not see the updated weights")

    def test_iter_weights_full_hf_names(self, make_worker: WorkerFactory, hf_model: torch.nn.Module) -> None:
        """iter_weights yields every HF parameter, unsharded, with the checkpoint's values."""
        got = self.weights(make_worker(Role.ACTOR))
        expected = dict(hf_model.named_parameters())
        missing = sorted(set(expected) - set(got))
        assert not missing, f"iter_weights does not yield {missing[:5]}"
        extra = sorted(set(got) - set(hf_model.state_dict()))
        assert not extra, f"iter_weights yields names the HF model does not have: {extra[:5]}"
        for name, param in expected.items():
            assert got[name].shape == param.shape, f"{name}: {tuple(got[name].shape)} != full {tuple(param.shape)}"
            torch.testing.assert_close(got[name].float(), param.detach().float(), rtol=0, atol=0,
                                       msg=f"{name} differs from the checkpoint")

    def test_save_load_state_roundtrip(self, make_worker: WorkerFactory, batch: Batch, tmp_path) -> None:
        """A fresh worker that loads saved state computes and updates bit-identically."""
        first = make_worker(Role.ACTOR)
        # One step first, so there is optimizer state (Adam moments, step count) worth restoring.
        first.update_policy(batch, loss_fn=simple_policy_loss, mini_batch_size=0, epochs=1)
        first.save_state(str(tmp_path / "state"))
        second = make_worker(Role.ACTOR, seed=1)
        second.load_state(str(tmp_path / "state"))
        assert torch.equal(second.compute_log_probs(batch).log_probs, first.compute_log_probs(batch).log_probs)
        m1 = first.update_policy(batch, loss_fn=simple_policy_loss, mini_batch_size=0, epochs=1)
        m2 = second.update_policy(batch, loss_fn=simple_policy_loss, mini_batch_size=0, epochs=1)
        w1, w2 = self.weights(first), self.weights(second)
        differ = sorted(k for k in w1 if not torch.equal(w1[k], w2[k]))
        assert not differ, f"the update after load_state is not bit-identical: {differ[:5]}"
        # Memory readings are measurements of the process, not training state.
        m1, m2 = ({k: v for k, v in m.items() if not k.startswith("memory/")} for m in (m1, m2))
        assert m1 == m2, f"metrics after load_state differ: {m1} vs {m2}"

    def test_nan_loss_raises_and_keeps_weights(self, make_worker: WorkerFactory, batch: Batch) -> None:
        """A NaN loss raises FloatingPointError and applies nothing."""
        worker = make_worker(Role.ACTOR)
        before = self.weights(worker)
        with pytest.raises(FloatingPointError):
            worker.update_policy(batch, loss_fn=nan_loss, mini_batch_size=0, epochs=1)
        after = self.weights(worker)
        assert all(torch.equal(before[k], after[k]) for k in before), "a NaN loss changed the weights"
        # The worker must still be usable: the next good step applies.
        metrics = worker.update_policy(batch, loss_fn=simple_policy_loss, mini_batch_size=0, epochs=1)
        self.check_metrics(metrics, "actor/grad_norm")

    @pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                               "seq-mean-token-sum-norm"])
    def test_gradient_does_not_depend_on_micro_batching(self, micro_batching_backends: dict[str, TrainingBackend]
                                                        | None, model_dir: str, hf_model: torch.nn.Module,
                                                        loss_agg_mode: str) -> None:
        """One update of a GRPO loss (PPO-clip, KL and entropy terms) on a batch whose samples have
        different numbers of loss tokens gives the same gradient (grad norm, and the weights an
        ``eps``-dominated Adam step writes), loss and entropy however the backend cuts the batch into
        micro-batches: each aggregation mode is a mean over the whole mini-batch, not over each
        micro-batch."""
        if not micro_batching_backends:
            pytest.skip(f"{type(self).__name__} provides no `micro_batching_backends` fixture")
        batch = make_batch(batch_size=16, prompt_length=self.prompt_length, response_length=12,
                           vocab_size=hf_model.config.vocab_size, group_size=4, pad_id=hf_model.config.pad_token_id or 0,
                           advantages=True, ref_log_probs=True, empty_rows=(5,), seed=3)
        batch.info["max_new_tokens"] = 12
        lengths = batch.response_mask.sum(-1)
        assert len(set(lengths.tolist())) > 3, "the batch must hold samples with different numbers of loss tokens"
        # Old log-probs near the policy's own, so the PPO ratio sits inside and outside the clip range.
        current = self.reference_log_probs(hf_model, batch)[0]
        batch.old_log_probs = current + 0.3 * (torch.rand(current.shape, generator=torch.Generator().manual_seed(1)) - 0.5)
        loss_fn = _grpo_loss(loss_agg_mode=loss_agg_mode, kl_coef=0.05, entropy_coef=0.01)

        outcome: dict[str, tuple[dict[str, float], dict[str, torch.Tensor]]] = {}
        for name, backend in micro_batching_backends.items():
            worker = backend.create_worker(role=Role.ACTOR, model=ModelSpec(path=model_dir),
                                           world=WorldInfo(threads=1), seed=0)
            try:
                before = self.weights(worker)
                metrics = worker.update_policy(batch, loss_fn=loss_fn, mini_batch_size=0, epochs=1)
                moved = {k: v - before[k] for k, v in self.weights(worker).items()}
            finally:
                worker.close()
            outcome[name] = (metrics, moved)
        (first, (expected, reference)), *others = outcome.items()
        scale = max(t.abs().max().item() for t in reference.values())
        assert scale > 0, "the update moved no weight"
        for name, (metrics, moved) in others:
            for key in ("actor/grad_norm", "ppo/pg_loss", "ppo/kl_loss", "ppo/entropy", "ppo/actor_loss"):
                assert math.isclose(metrics[key], expected[key], rel_tol=1e-4, abs_tol=1e-6), (
                    f"{loss_agg_mode}: {key} is {metrics[key]:.7g} with {name} and {expected[key]:.7g} with {first}")
            gap = max((moved[k] - reference[k]).abs().max().item() for k in reference)
            assert gap <= 1e-3 * scale, (
                f"{loss_agg_mode}: the update with {name} differs from {first} by {gap:.3g} (updates of {scale:.3g})")

    # ------------------------------------------------------------------ other roles
    def test_reference_role_is_frozen(self, make_worker: WorkerFactory, batch: Batch) -> None:
        """The reference role has no optimizer, refuses updates and scores like the initial actor."""
        actor = make_worker(Role.ACTOR)
        reference = make_worker(Role.REFERENCE)
        assert getattr(reference, "optimizer", None) is None, "the reference role must not hold an optimizer"
        with pytest.raises(NotImplementedError):
            reference.update_policy(batch, loss_fn=simple_policy_loss, mini_batch_size=0, epochs=1)
        torch.testing.assert_close(reference.compute_log_probs(batch).log_probs,
                                   actor.compute_log_probs(batch).log_probs, rtol=0, atol=self.logprob_atol)

    def test_critic_values(self, make_worker: WorkerFactory, batch: Batch) -> None:
        """The critic returns finite [B, R] values and update_values changes them."""
        critic = make_worker(Role.CRITIC)
        values = critic.compute_values(batch)
        assert isinstance(values, torch.Tensor)
        assert values.shape == batch.response_ids.shape, f"values {tuple(values.shape)}, expected [B, R]"
        assert torch.isfinite(values).all()
        metrics = critic.update_values(batch, loss_fn=simple_value_loss, mini_batch_size=0, epochs=1)
        self.check_metrics(metrics, "critic/grad_norm")
        assert not torch.equal(critic.compute_values(batch), values), "update_values did not change the values"

    # ------------------------------------------------------------------ mesh
    def test_world_names_a_consistent_mesh(self, make_worker: WorkerFactory) -> None:
        """The worker's ``world`` (what executors read to split calls over data-parallel groups), when it
        keeps one, is this rank's, with a mesh that multiplies out to the world size and one output rank."""
        world = getattr(make_worker(Role.ACTOR), "world", None)
        if world is None:
            return  # executors then treat every rank as its own data-parallel group
        assert isinstance(world, WorldInfo)
        assert (world.rank, world.world_size) == (0, 1)
        assert world.dp_size * world.tp_size * world.pp_size == world.world_size
        assert (world.dp_rank, world.tp_rank, world.pp_rank) == (0, 0, 0) and world.is_output_rank

    # ------------------------------------------------------------------ several ranks
    @pytest.mark.heavy
    def test_multi_rank_matches_one_rank(self, multi_rank_backend: TrainingBackend | None, model_dir: str,
                                         hf_model: torch.nn.Module, batch: Batch, tmp_path: Path) -> None:
        """At several ranks (processes on a gloo group), placed in data-parallel groups by the mesh
        their workers report as an executor would: every rank's ``world`` is its own and the ranks
        form one consistent mesh; ``compute_log_probs`` of the batch, read from each group's output
        rank, equals the one-rank result; one ``update_policy`` on the batch gives the one-rank
        update's loss, grad norm and weights; ``iter_weights`` yields every HF parameter at full
        shape on the output ranks, the same on each of them."""
        if multi_rank_backend is None:
            pytest.skip(f"{type(self).__name__} provides no `multi_rank_backend` fixture")
        size = self.multi_rank_world_size
        single = type(multi_rank_backend)(multi_rank_backend.config.for_single_process())
        losses = _aggregation_losses()
        batch.info["max_new_tokens"] = batch.response_length
        one: dict[str, tuple[dict[str, float], dict[str, torch.Tensor]]] = {}
        for mode, loss_fn in losses.items():
            worker = single.create_worker(role=Role.ACTOR, model=ModelSpec(path=model_dir),
                                          world=WorldInfo(threads=1), seed=0)
            try:
                if not one:
                    one_lp = worker.compute_log_probs(batch, with_entropy=True)
                one[mode] = (worker.update_policy(batch, loss_fn=loss_fn, mini_batch_size=0, epochs=1),
                             self.weights(worker))
            finally:
                worker.close()

        ranks = run_ranks(_multi_rank_scenario, size, multi_rank_backend, model_dir, batch, losses,
                          out_dir=str(tmp_path), deadline_s=self.multi_rank_deadline_s)
        places = [r["place"] for r in ranks]
        for rank, place in enumerate(places):
            assert isinstance(place, WorldInfo), f"rank {rank}: `world` is a {type(place).__name__}, not a WorldInfo"
            assert (place.rank, place.world_size) == (rank, size), f"rank {rank} of {size} reports {place}"
            assert place.dp_size * place.tp_size * place.pp_size == size, f"rank {rank}: mesh {place} != {size} ranks"
            for axis in ("dp", "tp", "pp"):
                index, extent = getattr(place, f"{axis}_rank"), getattr(place, f"{axis}_size")
                assert 0 <= index < extent, f"rank {rank}: {axis}_rank {index} outside {axis}_size {extent}"
        coordinates = [(p.dp_rank, p.tp_rank, p.pp_rank) for p in places]
        assert len(set(coordinates)) == size, f"two ranks claim the same place in the mesh: {coordinates}"
        from verl_kit.sharding import Mesh, gather_split

        mesh = Mesh.of(places)  # one output rank per data-parallel group, every rank agreeing on dp_size
        assert all(p.is_output_rank == (rank in mesh.readers) for rank, p in enumerate(places))

        real = batch.response_attention_mask.bool()
        shards = ranks[0]["shards"]
        got = gather_split(mesh.read([r["log_probs"] for r in ranks]), real=shards[0], padded=shards[1],
                           order=shards[2])
        assert got.log_probs.shape == batch.response_ids.shape, (
            f"log-probs {tuple(got.log_probs.shape)} for a batch of {tuple(batch.response_ids.shape)}: each "
            f"data-parallel group's output rank must return its shard's rows once")
        torch.testing.assert_close(got.log_probs.float()[real], one_lp.log_probs.float()[real], rtol=0,
                                   atol=self.logprob_atol)
        torch.testing.assert_close(got.entropy.float()[real], one_lp.entropy.float()[real], rtol=0,
                                   atol=self.logprob_atol)

        # Every aggregation mode is a mean over the whole batch, not a mean of the ranks' means: the data-
        # parallel shards hold different numbers of loss tokens and sequences.
        for mode in losses:
            metrics = gather_split(mesh.read([r["updates"][mode][0] for r in ranks]), real=shards[0],
                                   padded=shards[1])
            self.check_metrics(metrics, "actor/grad_norm")
            one_metrics, one_weights = one[mode]
            for key, atol in (("ppo/pg_loss", self.logprob_atol), ("ppo/entropy", self.logprob_atol),
                              ("actor/grad_norm", self.multi_rank_weight_atol)):
                assert abs(metrics[key] - one_metrics[key]) <= atol, (
                    f"{mode}: {key} is {metrics[key]} at {size} ranks, {one_metrics[key]} at one")
            weights = ranks[mesh.readers[0]]["updates"][mode][1]
            assert weights.keys() == one_weights.keys()
            gaps = {k: (weights[k].float() - one_weights[k].float()).abs().max().item() for k in weights}
            worst = max(gaps, key=gaps.get)
            assert gaps[worst] <= self.multi_rank_weight_atol, (
                f"{mode}: after one update {worst} differs from the one-rank update by {gaps[worst]:.3g}")

        expected = dict(hf_model.named_parameters())
        first = ranks[mesh.readers[0]]["updates"]["token-mean"][1]
        for reader in mesh.readers:
            weights = ranks[reader]["updates"]["token-mean"][1]
            missing = sorted(set(expected) - set(weights))
            assert not missing, f"rank {reader}: iter_weights does not yield {missing[:5]}"
            for name, param in expected.items():
                assert weights[name].shape == param.shape, (
                    f"rank {reader}: {name} is {tuple(weights[name].shape)}, not the full {tuple(param.shape)}")
            differ = sorted(k for k in weights if not torch.equal(weights[k], first[k]))
            assert not differ, f"output ranks {mesh.readers[0]} and {reader} yield different {differ[:5]}"
        assert any(not torch.equal(first[k], expected[k].detach()) for k in expected), "the update changed nothing"


# ----------------------------------------------------------------------------- several ranks
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, payload: bytes, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    scenario, args = pickle.loads(payload)
    torch.save(scenario(rank, world_size, *args), os.path.join(out_dir, f"rank{rank}.pt"))


def run_ranks(scenario: Callable[..., dict[str, Any]], world_size: int, *args: Any, out_dir: str,
              deadline_s: float = 600) -> list[dict[str, Any]]:
    """``scenario(rank, world_size, *args)`` in ``world_size`` spawned processes that share an
    ``env://`` rendezvous (``ensure_process_group`` joins it); returns what each rank returned, in
    rank order, passed through files in ``out_dir``.

    ``scenario`` and ``args`` are pickled (a module-level function, importable objects). A rank that
    raises fails the test with its traceback (the others are stopped); ranks still running after
    ``deadline_s`` are killed and the test fails.
    """
    import torch.multiprocessing as mp

    # Plain pickle, by value: torch.multiprocessing's own pickler would hand tensors over as shared-memory
    # file descriptors, which spawning more than one process from the same arguments does not survive.
    payload = pickle.dumps((scenario, args))
    ctx = mp.start_processes(_rank_main, args=(world_size, _free_port(), payload, out_dir),
                             nprocs=world_size, join=False, start_method="spawn")
    deadline = time.monotonic() + deadline_s
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for process in ctx.processes:
                process.kill()
            pytest.fail(f"{world_size} ranks still running after {deadline_s} s: they disagree on a collective")
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]


def _grpo_loss(**config: Any) -> Any:
    """GRPO's actor loss with ``config``, as the dataflow hands it to a backend.

    The core ships no algorithm: GRPO comes from the verl-algorithms distribution and is loaded here
    the way a run loads it, through the registry, when a test needs it. Without it the test skips
    and says what to install.
    """
    from verl_core.contracts import AlgorithmLoss
    from verl_core.registry import PluginError, PluginRegistry

    try:
        cls = PluginRegistry().load("algorithm", "grpo")
    except PluginError as exc:
        pytest.skip(f"this case trains GRPO's loss, and no usable `grpo` algorithm plugin is installed "
                    f"(pip install verl-algorithms): {exc}")
    return AlgorithmLoss(cls(cls.Config(**config)))


def _aggregation_losses() -> dict[str, Any]:
    """GRPO's loss in each aggregation mode, token-mean first (as the dataflow hands it to a backend)."""
    modes = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
    return {mode: _grpo_loss(loss_agg_mode=mode) for mode in modes}


def _multi_rank_scenario(rank: int, world_size: int, backend: TrainingBackend, model_dir: str,
                         batch: Batch, losses: dict[str, Any]) -> dict[str, Any]:
    """One rank of :meth:`BackendConformance.test_multi_rank_matches_one_rank`: what an executor does
    with a worker group, on this rank."""
    import torch.distributed as dist
    from verl_kit.sharding import Mesh, split_call

    def make_worker() -> TrainingWorker:
        return backend.create_worker(role=Role.ACTOR, model=ModelSpec(path=model_dir),
                                     world=WorldInfo(rank=rank, world_size=world_size, threads=1), seed=0)

    worker = make_worker()
    try:
        # Like the executors: the worker's own `world` when it keeps one, else pure data parallel.
        place = getattr(worker, "world", None)
        if place is None:
            place = WorldInfo(rank=rank, world_size=world_size)
        places: list[Any] = [None] * world_size
        dist.all_gather_object(places, place)
        mesh = Mesh.of(places)
        shards = split_call((batch,), {}, mesh.dp_size, method="compute_log_probs")
        (shard,), _ = mesh.per_rank(shards)[rank]
        out: dict[str, Any] = {"place": place, "shards": (shards.real, shards.padded, shards.order), "updates": {}}
        out["log_probs"] = worker.compute_log_probs(shard, with_entropy=True)
        for index, (mode, loss_fn) in enumerate(losses.items()):
            if index:
                worker.close()
                worker = make_worker()
            metrics = worker.update_policy(shard, loss_fn=loss_fn, mini_batch_size=0, epochs=1)
            weights = {name: t.detach().cpu().clone() for name, t in worker.iter_weights()}  # collective: every rank
            out["updates"][mode] = (metrics, weights if place.is_output_rank else None)
        dist.barrier()  # no rank leaves while a peer is still inside a collective
    finally:
        worker.close()
    dist.destroy_process_group()
    return out
