"""Conformance tests for :class:`~verl_core.contracts.RolloutEngine` implementations.

Subclass :class:`RolloutConformance` and provide three fixtures:

* ``engine``: a started engine (scope it to the module or class if starting is slow; the tests
  restore any weights they change);
* ``prompt_ids``: a few prompts as token-id lists, preferably of different lengths so the engine's
  padding is exercised;
* ``reference_model``: a float32 Hugging Face causal LM holding the engine's current weights, the
  ground truth for log-probs and the source of weights for :meth:`RolloutEngine.load_weights`.

::

    class TestMyEngine(RolloutConformance):
        @pytest.fixture(scope="class")
        def engine(self, model_dir): ...
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Iterator, Sequence

import pytest
import torch

from verl_core.contracts import RolloutEngine, RolloutOutput, SamplingParams

__all__ = ["RolloutConformance"]


class RolloutConformance:
    """Contract tests every rollout engine must pass.

    Attributes:
        max_new_tokens: response budget used by the tests.
        logprob_atol: largest allowed gap between the engine's log-probs and a float32 forward.
        perturb_scale: standard deviation of the noise added to weights in the weight-sync tests.
    """

    max_new_tokens = 8
    logprob_atol = 1e-3
    perturb_scale = 0.5

    @pytest.fixture
    def engine(self) -> RolloutEngine:
        """The engine under test; subclasses must override this fixture."""
        pytest.fail(f"{type(self).__name__} must provide an `engine` fixture")

    @pytest.fixture
    def prompt_ids(self) -> list[list[int]]:
        """Prompts as token ids; subclasses must override this fixture."""
        pytest.fail(f"{type(self).__name__} must provide a `prompt_ids` fixture")

    @pytest.fixture
    def reference_model(self) -> torch.nn.Module:
        """A float32 HF model with the engine's weights; subclasses must override this fixture."""
        pytest.fail(f"{type(self).__name__} must provide a `reference_model` fixture")

    # ------------------------------------------------------------------ helpers
    def sampling(self, **changes) -> SamplingParams:
        """Sampling parameters for the tests: temperature 1, no truncation, log-probs on."""
        params = dict(n=1, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=self.max_new_tokens, seed=0)
        params.update(changes)
        return SamplingParams(**params)

    @staticmethod
    def stop_ids(engine: RolloutEngine, sampling: SamplingParams) -> set[int]:
        """The tokenizer's eos id(s) plus ``sampling.stop_token_ids``."""
        eos = engine.tokenizer.eos_token_id
        eos_ids = set(eos) if isinstance(eos, (list, tuple)) else {eos}
        return {i for i in eos_ids if i is not None} | set(sampling.stop_token_ids)

    def check_output(self, engine: RolloutEngine, out: RolloutOutput, prompts: Sequence[Sequence[int]],
                     sampling: SamplingParams) -> None:
        """Asserts the count, grouping size, lengths and finish reasons of ``out``."""
        expected = len(prompts) * sampling.n
        assert isinstance(out, RolloutOutput)
        assert len(out.response_ids) == expected, f"{len(out.response_ids)} responses, expected {expected}"
        assert len(out.finish_reasons) == expected
        stops = self.stop_ids(engine, sampling)
        for i, (ids, reason) in enumerate(zip(out.response_ids, out.finish_reasons)):
            assert all(isinstance(t, int) for t in ids), f"response {i} holds non-int token ids"
            assert 0 < len(ids) <= sampling.max_new_tokens, (
                f"response {i} has {len(ids)} tokens; expected 1..{sampling.max_new_tokens}")
            assert reason in ("stop", "length"), f"finish reason {reason!r} is not 'stop' or 'length'"
            assert (reason == "stop") == (ids[-1] in stops), (
                f"response {i} ends with {ids[-1]} but its finish reason is {reason!r} (stop ids {sorted(stops)})")
            assert not stops & set(ids[:-1]), f"response {i} continues past a stop token: {ids}"
            if reason == "length":
                assert len(ids) == sampling.max_new_tokens, f"response {i} is 'length' but shorter than the budget"

    def greedy(self, engine: RolloutEngine, prompts: Sequence[Sequence[int]]) -> RolloutOutput:
        """One greedy response per prompt."""
        return engine.generate(prompts, sampling=self.sampling(greedy=True, seed=None))

    @staticmethod
    def reference_weights(reference_model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
        """A detached copy of the reference model's parameters, in HF names."""
        return [(name, p.detach().clone()) for name, p in reference_model.named_parameters()]

    def perturbed(self, weights: list[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """``weights`` plus seeded Gaussian noise, streamed like ``iter_weights``."""
        g = torch.Generator().manual_seed(11)
        for name, tensor in weights:
            noise = torch.randn(tensor.shape, generator=g, dtype=torch.float32).to(tensor.dtype)
            yield name, tensor + self.perturb_scale * noise

    # ------------------------------------------------------------------ tests
    def test_generate_n_grouped_by_prompt(self, engine: RolloutEngine, prompt_ids: list[list[int]]) -> None:
        """n samples per prompt come back grouped by prompt, prompt 0's first."""
        sampling = self.sampling(n=3)
        self.check_output(engine, engine.generate(prompt_ids, sampling=sampling), prompt_ids, sampling)
        # Greedy samples of one prompt are all the same, so their order shows the grouping.
        single = self.greedy(engine, prompt_ids)
        grouped = engine.generate(prompt_ids, sampling=self.sampling(n=3, greedy=True, seed=None))
        self.check_output(engine, grouped, prompt_ids, self.sampling(n=3))
        expected = [r for r in single.response_ids for _ in range(3)]
        assert grouped.response_ids == expected, "responses must be grouped by prompt (prompt 0's n samples first)"

    def test_finish_reasons_with_stop_tokens(self, engine: RolloutEngine, prompt_ids: list[list[int]]) -> None:
        """Extra ``stop_token_ids`` end a response, which then reports ``"stop"``."""
        # The second call must repeat the first up to the stop: by its seed, or greedily.
        seeded = engine.seeded_sampling
        base = dict(n=2, seed=1) if seeded else dict(n=2, greedy=True, seed=None)
        plain = engine.generate(prompt_ids, sampling=self.sampling(**base))
        special = self.stop_ids(engine, self.sampling()) | {engine.tokenizer.pad_token_id}
        # Stop on the most frequent ordinary token so that stop_token_ids really triggers.
        counts = Counter(t for ids in plain.response_ids for t in ids if t not in special)
        if not counts:
            pytest.skip("the model produced only special tokens; cannot pick an extra stop token")
        stop = counts.most_common(1)[0][0]
        sampling = self.sampling(**base, stop_token_ids=(stop,))
        out = engine.generate(prompt_ids, sampling=sampling)
        self.check_output(engine, out, prompt_ids, sampling)
        assert any(ids[-1] == stop for ids in out.response_ids), f"stop token {stop} never ended a response"

    def test_log_probs(self, engine: RolloutEngine, prompt_ids: list[list[int]]) -> None:
        """Log-probs line up with the tokens, are finite and <= 0, and are None when not asked for."""
        out = engine.generate(prompt_ids, sampling=self.sampling(n=2))
        assert out.log_probs is not None, "log-probs were requested but not returned"
        assert len(out.log_probs) == len(out.response_ids)
        for ids, lps in zip(out.response_ids, out.log_probs):
            assert len(lps) == len(ids), f"{len(lps)} log-probs for {len(ids)} tokens"
            assert all(math.isfinite(x) and x <= 1e-6 for x in lps), f"log-probs must be finite and <= 0: {lps}"
        silent = engine.generate(prompt_ids, sampling=self.sampling(logprobs=False))
        assert silent.log_probs is None, "log-probs must be None when not requested"

    def test_greedy_is_deterministic(self, engine: RolloutEngine, prompt_ids: list[list[int]]) -> None:
        """Two greedy calls give the same responses."""
        a, b = self.greedy(engine, prompt_ids), self.greedy(engine, prompt_ids)
        assert a.response_ids == b.response_ids
        assert a.finish_reasons == b.finish_reasons

    def test_seed_controls_sampling(self, engine: RolloutEngine, prompt_ids: list[list[int]]) -> None:
        """The same seed repeats the samples; another seed changes them."""
        if not engine.seeded_sampling:
            pytest.skip(f"{type(engine).__name__} says it cannot seed requests (seeded_sampling=False)")
        a = engine.generate(prompt_ids, sampling=self.sampling(n=3, seed=123))
        b = engine.generate(prompt_ids, sampling=self.sampling(n=3, seed=123))
        c = engine.generate(prompt_ids, sampling=self.sampling(n=3, seed=456))
        assert a.response_ids == b.response_ids, "the same seed must give the same samples"
        assert a.response_ids != c.response_ids, "different seeds gave identical samples"

    def test_load_weights_changes_and_restores_output(self, engine: RolloutEngine, prompt_ids: list[list[int]],
                                                      reference_model: torch.nn.Module) -> None:
        """load_weights with perturbed weights changes greedy output; the originals restore it."""
        if engine.shares_actor_weights:
            pytest.skip("the engine runs on the actor's own weights in-process; load_weights has nothing to do "
                        "(test_inplace_actor_update_changes_output covers weight sync)")
        original = self.reference_weights(reference_model)
        before = self.greedy(engine, prompt_ids)
        try:
            engine.load_weights(self.perturbed(original))
            changed = self.greedy(engine, prompt_ids)
        finally:
            engine.load_weights(iter(original))
        assert changed.response_ids != before.response_ids, "load_weights had no effect on greedy output"
        restored = self.greedy(engine, prompt_ids)
        assert restored.response_ids == before.response_ids, "restoring the original weights did not restore output"

    def test_inplace_actor_update_changes_output(self, engine: RolloutEngine, prompt_ids: list[list[int]]) -> None:
        """An engine sharing the actor's module sees in-place weight changes immediately."""
        if not engine.shares_actor_weights:
            pytest.skip("the engine keeps its own weights; test_load_weights_changes_and_restores_output covers it")
        if engine.actor is None:
            pytest.fail("shares_actor_weights is True but the engine has no actor")
        module = engine.actor.hf_module()
        before = self.greedy(engine, prompt_ids)
        params = [p for _, p in module.named_parameters()]
        saved = [p.detach().clone() for p in params]
        g = torch.Generator().manual_seed(11)
        try:
            with torch.no_grad():
                for p in params:
                    noise = torch.randn(p.shape, generator=g).to(device=p.device, dtype=p.dtype)
                    if _is_dtensor(p):
                        # A sharded parameter only accepts noise laid out the same way.
                        from torch.distributed.tensor import distribute_tensor

                        noise = distribute_tensor(noise, p.device_mesh, p.placements)
                    p.add_(self.perturb_scale * noise)
            changed = self.greedy(engine, prompt_ids)
        finally:
            with torch.no_grad():
                for p, s in zip(params, saved):
                    p.copy_(s)
        assert changed.response_ids != before.response_ids, "changing the actor's weights did not change output"
        assert self.greedy(engine, prompt_ids).response_ids == before.response_ids

    def test_log_probs_match_reference_forward(self, engine: RolloutEngine, prompt_ids: list[list[int]],
                                               reference_model: torch.nn.Module) -> None:
        """Engine log-probs of its own samples match a float32 HF forward within ``logprob_atol``."""
        sampling = self.sampling(n=2, seed=5)
        out = engine.generate(prompt_ids, sampling=sampling)
        assert out.log_probs is not None
        worst = 0.0
        with torch.no_grad():
            for k, (ids, lps) in enumerate(zip(out.response_ids, out.log_probs)):
                prompt = list(prompt_ids[k // sampling.n])
                # One unpadded sequence at a time: the plainest possible ground truth.
                seq = torch.tensor([prompt + list(ids)])
                logits = reference_model(input_ids=seq).logits[0].float()
                logp = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
                ref = logp.gather(-1, torch.tensor(ids).unsqueeze(-1)).squeeze(-1)
                worst = max(worst, float((ref - torch.tensor(lps)).abs().max()))
        assert worst <= self.logprob_atol, f"engine log-probs differ from a float32 forward by up to {worst:.2e}"


def _is_dtensor(t: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed support
        return False
    return isinstance(t, DTensor)
