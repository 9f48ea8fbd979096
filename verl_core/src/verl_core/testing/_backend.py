"""Conformance tests for :class:`~verl_core.interfaces.TrainingBackend` implementations.

Subclass :class:`BackendConformance` and provide two fixtures:

* ``backend``: the backend instance, e.g. ``FSDPBackend(FSDPConfig(lr=1e-3))``; the learning rate
  must be large enough for one step to move float32 weights;
* ``model_dir``: a local Hugging Face causal-LM directory (:func:`~verl_core.testing.tiny_model_dir`).

Workers are built on one rank (:class:`~verl_core.interfaces.WorldInfo` defaults), several per
test, so a backend that sets up ``torch.distributed`` must reuse an existing process group. The
ground truth is always a plain float32 Hugging Face forward of ``model_dir``.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterator

import pytest
import torch

from verl_core.batch import Batch
from verl_core.interfaces import LogProbs, ModelSpec, Role, TrainingBackend, TrainingWorker, WorldInfo
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
    """

    batch_size = 6
    prompt_length = 7
    response_length = 6
    logprob_atol = 1e-5

    @pytest.fixture
    def backend(self) -> TrainingBackend:
        """The backend under test; subclasses must override this fixture."""
        pytest.fail(f"{type(self).__name__} must provide a `backend` fixture")

    @pytest.fixture
    def model_dir(self) -> str:
        """A local HF causal-LM directory; subclasses must override this fixture."""
        pytest.fail(f"{type(self).__name__} must provide a `model_dir` fixture")

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
