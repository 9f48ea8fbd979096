"""Conformance tests for :class:`~verl_core.contracts.Algorithm` implementations.

Subclass :class:`AlgorithmConformance` in a test module and provide an ``algorithm`` fixture::

    from verl_core.testing import AlgorithmConformance

    class TestMyAlgorithm(AlgorithmConformance):
        @pytest.fixture
        def algorithm(self):
            return MyAlgorithm(MyAlgorithm.Config())

The tests feed the algorithm synthetic batches (:func:`~verl_core.testing.make_batch`) with
padding, tool tokens and degenerate groups, and check the parts of the contract the controller
relies on: shapes, finiteness, masking, gradients, the declared dataflow and the rollout request.

One test checks the config itself: every field, moved off its default, must change what the step
trains on (advantages, losses, update settings, rollout request), or be declared as not doing so
with a reason (``inert_fields`` / ``inert_when`` on the config class). It runs the algorithm's own
dataflow on a fixed batch with stand-ins for the rollout and the models;
:mod:`verl_core.testing._config_effects` explains how.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from verl_core.batch import Batch
from verl_core.contracts import Algorithm, Requirements, RolloutRequest
from verl_core.testing._config_effects import EffectHarness, config_effect_batch, config_field_problems
from verl_core.testing._factories import make_batch

__all__ = ["AlgorithmConformance"]


class AlgorithmConformance:
    """Contract tests every algorithm must pass.

    Attributes:
        batch_size: samples in the synthetic batches.
        group_size: samples per prompt (group) in the synthetic batches.
        prompt_length: prompt width of the synthetic batches.
        response_length: response width of the synthetic batches.
        effect_max_new_tokens: the response budget (``info["max_new_tokens"]``) of the config
            check's fixed batch, whose responses are 1 to 8 tokens long. Raise it for an
            algorithm whose length knobs only act on a longer budget (DAPO's 4096-token overlong
            buffer); see :meth:`effect_harness`.
    """

    batch_size = 8
    group_size = 4
    prompt_length = 5
    response_length = 8
    effect_max_new_tokens = 8

    @pytest.fixture
    def algorithm(self) -> Algorithm:
        """The algorithm under test; subclasses must override this fixture."""
        pytest.fail(f"{type(self).__name__} must provide an `algorithm` fixture")

    # ------------------------------------------------------------------ helpers
    def make_batch(self, algorithm: Algorithm, **overrides: Any) -> Batch:
        """A batch holding every field the algorithm may read before computing advantages.

        Reference log-probs are only present when the algorithm's requirements ask for the
        reference role, so an algorithm that reads them without declaring it fails loudly. Critic
        values are only present when the algorithm declares a critic. Subclasses add the fields
        their algorithm's own nodes produce (``extras``) by overriding this method.
        """
        needs = algorithm.requirements()
        kwargs: dict[str, Any] = dict(
            batch_size=self.batch_size, group_size=self.group_size, prompt_length=self.prompt_length,
            response_length=self.response_length, ref_log_probs=needs.reference, values=needs.critic,
        )
        kwargs.update(overrides)
        return make_batch(**kwargs)

    def scored_batch(self, algorithm: Algorithm, **overrides: Any) -> Batch:
        """:meth:`make_batch` with the algorithm's own advantages and returns filled in."""
        batch = self.make_batch(algorithm, **overrides)
        advantages, returns = algorithm.compute_advantages(batch)
        return batch.replace(advantages=advantages, returns=returns)

    @staticmethod
    def policy_inputs(batch: Batch, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Current log-probs near the old ones (so the clip is partly active) and an entropy."""
        g = torch.Generator().manual_seed(seed)
        log_probs = (batch.old_log_probs + 0.3 * torch.randn(batch.old_log_probs.shape, generator=g)).clamp(max=0.0)
        entropy = torch.rand(batch.old_log_probs.shape, generator=g) * 2.0
        return log_probs.requires_grad_(True), entropy.requires_grad_(True)

    @staticmethod
    def check_metrics(metrics: Any) -> None:
        """Metrics are a dict of finite floats keyed by name."""
        assert isinstance(metrics, dict), f"metrics must be a dict of floats, got {type(metrics).__name__}"
        for key, value in metrics.items():
            assert isinstance(key, str), f"metric name {key!r} is not a string"
            assert math.isfinite(float(value)), f"metric {key!r} is {value}"

    def check_advantages(self, batch: Batch, out: Any) -> None:
        """``out`` is ``(advantages, returns)``, each ``[B, R]``, finite and 0 where masked."""
        assert isinstance(out, tuple) and len(out) == 2, "compute_advantages must return (advantages, returns)"
        masked = batch.response_mask == 0
        for name, tensor in zip(("advantages", "returns"), out):
            assert isinstance(tensor, torch.Tensor), f"{name} must be a tensor"
            assert tensor.shape == batch.response_ids.shape, (
                f"{name} has shape {tuple(tensor.shape)}, expected [B, R] = {tuple(batch.response_ids.shape)}")
            assert torch.isfinite(tensor).all(), f"{name} has non-finite entries"
            assert (tensor[masked] == 0).all(), f"{name} must be 0 where response_mask is 0 (padding, tool tokens)"

    @staticmethod
    def scramble_masked(batch: Batch, log_probs: torch.Tensor, entropy: torch.Tensor, seed: int = 7,
                        ) -> tuple[Batch, torch.Tensor, torch.Tensor]:
        """The same inputs with garbage wherever ``response_mask`` is 0.

        The garbage is realistic: padded log-probs come from a softmax over pad tokens, so they are
        finite but arbitrary, and nothing guarantees an upstream node zeroed advantages or values
        there. An implementation must not let any of it leak into a loss or its gradient.

        Returns:
            ``(batch, log_probs, entropy)``; the two tensors are new leaves that require grad.
        """
        g = torch.Generator().manual_seed(seed)
        masked = batch.response_mask == 0
        shape = batch.response_ids.shape

        def scramble(t: torch.Tensor | None, garbage: torch.Tensor) -> torch.Tensor | None:
            return None if t is None else torch.where(masked, garbage, t.detach())

        scrambled = batch.replace(
            old_log_probs=scramble(batch.old_log_probs, -20 * torch.rand(shape, generator=g)),
            ref_log_probs=scramble(batch.ref_log_probs, -20 * torch.rand(shape, generator=g)),
            advantages=scramble(batch.advantages, 10 * torch.randn(shape, generator=g)),
            values=scramble(batch.values, 10 * torch.randn(shape, generator=g)),
            returns=scramble(batch.returns, 10 * torch.randn(shape, generator=g)),
        )
        lp = scramble(log_probs, -20 * torch.rand(shape, generator=g)).requires_grad_(True)
        ent = scramble(entropy, 5 * torch.rand(shape, generator=g)).requires_grad_(True)
        return scrambled, lp, ent

    def check_policy_loss(self, algorithm: Algorithm, batch: Batch, *, expect_gradient: bool) -> torch.Tensor:
        """Loss is a finite scalar; its gradient reaches log_probs and is exactly 0 where masked.

        Masked positions hold garbage (:meth:`scramble_masked`), so a loss that forgets the mask
        anywhere shows up as a gradient there.
        """
        batch, log_probs, entropy = self.scramble_masked(batch, *self.policy_inputs(batch))
        loss, metrics = algorithm.policy_loss(batch=batch, log_probs=log_probs, entropy=entropy)
        assert isinstance(loss, torch.Tensor) and loss.dim() == 0, "policy_loss must return a scalar tensor"
        assert torch.isfinite(loss), f"policy loss is {float(loss)}"
        self.check_metrics(metrics)
        loss.backward()
        grad = log_probs.grad
        assert grad is not None, "the policy loss does not depend on log_probs (no gradient reached them)"
        assert torch.isfinite(grad).all(), "the gradient w.r.t. log_probs has non-finite entries"
        masked = batch.response_mask == 0
        assert (grad[masked] == 0).all(), (
            "the gradient w.r.t. log_probs must be exactly 0 where response_mask is 0 (padding and tool tokens)")
        if entropy.grad is not None:
            assert (entropy.grad[masked] == 0).all(), "the gradient w.r.t. entropy must be 0 where response_mask is 0"
        if expect_gradient:
            assert grad[~masked].abs().sum() > 0, "no gradient reaches the policy tokens"
        return loss

    # ------------------------------------------------------------------ advantages
    def test_compute_advantages_shapes_finite_masked(self, algorithm: Algorithm) -> None:
        """Advantages and returns are [B, R], finite, and 0 at padding and tool tokens."""
        batch = self.make_batch(algorithm)
        self.check_advantages(batch, algorithm.compute_advantages(batch))

    # ------------------------------------------------------------------ rollout request
    def test_rollout_request(self, algorithm: Algorithm) -> None:
        """rollout_request() is a RolloutRequest; its filter keeps whole groups of its input, same width."""
        if not hasattr(algorithm, "rollout_request"):
            pytest.skip("the algorithm has no rollout_request()")
        request = algorithm.rollout_request()
        assert isinstance(request, RolloutRequest), "rollout_request() must return a verl_core.contracts.RolloutRequest"
        assert isinstance(request.max_extra_rounds, int) and request.max_extra_rounds >= 0, (
            f"RolloutRequest.max_extra_rounds must be an int >= 0, got {request.max_extra_rounds!r}")
        if request.filter is None:
            return
        B = self.batch_size
        batches = [self.make_batch(algorithm),
                   # Half the groups with equal rewards, so a filter of uninformative groups drops some.
                   self.make_batch(algorithm, scores=[float(i % 2) if i < B // 2 else 1.0 for i in range(B)]),
                   config_effect_batch()]
        for batch in batches:
            out = request.filter(batch)
            assert isinstance(out, Batch), "RolloutRequest.filter must return a Batch"
            assert len(out) <= len(batch), "the filter returned more samples than it was given"
            assert out.response_ids.shape[1] == batch.response_ids.shape[1], "the filter changed the response width"
            for group in out.group_ids.unique().tolist():
                rows_in = sorted(map(tuple, batch.response_ids[batch.group_ids == group].tolist()))
                rows_out = sorted(map(tuple, out.response_ids[out.group_ids == group].tolist()))
                assert rows_out == rows_in, (
                    f"the filter must keep whole groups of its input: group {group} has {len(rows_in)} samples in "
                    f"and {len(rows_out)} out, or different ones")

    # ------------------------------------------------------------------ policy loss
    def test_policy_loss_finite_with_masked_gradient(self, algorithm: Algorithm) -> None:
        """The policy loss is a finite scalar whose gradient reaches policy tokens only."""
        self.check_policy_loss(algorithm, self.scored_batch(algorithm), expect_gradient=True)

    def test_policy_loss_ignores_masked_positions(self, algorithm: Algorithm) -> None:
        """Garbage at masked positions of any input leaves the loss unchanged."""
        batch = self.scored_batch(algorithm)
        assert (batch.response_mask == 0).any(), "the synthetic batch should contain padding and tool tokens"
        log_probs, entropy = self.policy_inputs(batch)
        loss, _ = algorithm.policy_loss(batch=batch, log_probs=log_probs, entropy=entropy)
        scrambled, lp2, ent2 = self.scramble_masked(batch, log_probs, entropy)
        loss2, _ = algorithm.policy_loss(batch=scrambled, log_probs=lp2, entropy=ent2)
        torch.testing.assert_close(loss2.detach(), loss.detach(), rtol=1e-6, atol=1e-7,
                                   msg="the policy loss changed when only masked positions changed")

    # ------------------------------------------------------------------ edge cases
    @pytest.mark.parametrize("case", ["equal_rewards", "single_sample_groups", "one_empty_response",
                                      "all_empty_responses"])
    def test_edge_cases_stay_finite(self, algorithm: Algorithm, case: str) -> None:
        """Degenerate groups and empty responses give finite advantages, losses and gradients."""
        B = self.batch_size
        overrides: dict[str, Any] = {
            # Every group gets one score, different between groups: zero within-group variance.
            "equal_rewards": dict(scores=[float(i // self.group_size) for i in range(B)]),
            "single_sample_groups": dict(group_size=1),
            "one_empty_response": dict(empty_rows=(B - 1,)),
            "all_empty_responses": dict(empty_rows=tuple(range(B))),
        }[case]
        batch = self.make_batch(algorithm, **overrides)
        out = algorithm.compute_advantages(batch)
        self.check_advantages(batch, out)
        batch = batch.replace(advantages=out[0], returns=out[1])
        self.check_policy_loss(algorithm, batch, expect_gradient=False)
        if algorithm.requirements().critic:
            self.check_value_loss(algorithm, batch)

    # ------------------------------------------------------------------ declarations
    def test_requirements(self, algorithm: Algorithm) -> None:
        """requirements() returns Requirements and asks for a reference when a KL term is on."""
        needs = algorithm.requirements()
        assert isinstance(needs, Requirements), "requirements() must return a verl_core.contracts.Requirements"
        if _kl_coef(algorithm) > 0:
            assert needs.reference, "a KL coefficient > 0 needs the reference role"

    def test_build_dataflow(self, algorithm: Algorithm) -> None:
        """The declared dataflow validates, starts from the rollout stage or the data, and updates the actor."""
        from verl_core.dataflow import Dataflow

        df = EffectHarness().declare(algorithm)  # a DataflowBuilder that records where the batch comes from
        flow = df.build()  # validates: unique names, producers for every read, no cycles
        assert isinstance(flow, Dataflow)
        names = [n.name for n in flow.nodes]
        assert "update_actor" in names, f"the dataflow needs an 'update_actor' node (df.update_actor); has {names}"
        assert "sync_weights" not in names, (
            "the trainer syncs the rollout engine's weights after every step; remove the 'sync_weights' node")
        # The rollout stage, or a node building the batch from data (offline algorithms), comes first.
        assert flow.nodes and flow.nodes[0].name in df.sources, (
            f"the first node must produce the batch with df.rollout(...) or df.batch_from_data(...); it is "
            f"{flow.nodes[0].name!r}")
        roles = {n.role for n in flow.nodes}
        needs = algorithm.requirements()
        if needs.critic:
            assert "critic" in roles, "requirements() asks for a critic but no dataflow node runs on it"
        if needs.reference:
            assert "reference" in roles, "requirements() asks for a reference but no dataflow node runs on it"

    # ------------------------------------------------------------------ critic
    def check_value_loss(self, algorithm: Algorithm, batch: Batch) -> None:
        """Value loss is a finite scalar whose gradient reaches values, 0 where masked."""
        g = torch.Generator().manual_seed(3)
        values = batch.values + 0.5 * torch.randn(batch.values.shape, generator=g)
        batch, values, _ = self.scramble_masked(batch, values, torch.zeros_like(values))
        loss, metrics = algorithm.value_loss(batch=batch, values=values)
        assert isinstance(loss, torch.Tensor) and loss.dim() == 0, "value_loss must return a scalar tensor"
        assert torch.isfinite(loss), f"value loss is {float(loss)}"
        self.check_metrics(metrics)
        loss.backward()
        assert values.grad is not None, "the value loss does not depend on values"
        assert torch.isfinite(values.grad).all()
        assert (values.grad[batch.response_mask == 0] == 0).all(), (
            "the gradient w.r.t. values must be 0 where response_mask is 0")

    def test_value_loss(self, algorithm: Algorithm) -> None:
        """Algorithms with a critic have a finite value loss with a masked gradient."""
        if not algorithm.requirements().critic:
            pytest.skip("the algorithm has no critic")
        self.check_value_loss(algorithm, self.scored_batch(algorithm))

    # ------------------------------------------------------------------ config
    def effect_harness(self, algorithm: Algorithm) -> EffectHarness:
        """The harness of :meth:`test_config_fields_change_advantages_or_loss` (override to change its batch)."""
        return EffectHarness(config_effect_batch(max_new_tokens=self.effect_max_new_tokens))

    def test_config_fields_change_advantages_or_loss(self, algorithm: Algorithm) -> None:
        """Every config field, moved off its default, changes what the step trains on, or is declared inert.

        Runs the algorithm's own dataflow on a fixed batch, once per config, and compares the
        advantages, returns, losses and their gradients, update settings and rollout request
        (:func:`~verl_core.testing._config_effects.config_field_problems`).
        """
        problems = config_field_problems(algorithm, self.effect_harness(algorithm))
        assert not problems, (f"{len(problems)} config field problem(s) of {type(algorithm).__name__}:\n"
                              + "\n".join(problems))


def _kl_coef(algorithm: Algorithm) -> float:
    return float(getattr(algorithm.config, "kl_coef", 0.0) or 0.0)
