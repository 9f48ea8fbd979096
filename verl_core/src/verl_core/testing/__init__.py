"""Conformance suites every plugin implementation runs, first- or third-party.

Like ``fsspec``'s ``tests/abstract``, each suite is a plain class of pytest test methods. A test
module subclasses it with a ``Test`` name and provides the fixtures the suite documents; pytest
then runs the whole contract against that implementation::

    import pytest
    from verl_core.testing import AlgorithmConformance

    class TestMyAlgorithm(AlgorithmConformance):
        @pytest.fixture
        def algorithm(self):
            return MyAlgorithm(MyAlgorithm.Config())

Suites:
    :class:`AlgorithmConformance`: fixture ``algorithm``.
    :class:`RolloutConformance`: fixtures ``engine``, ``prompt_ids``, ``reference_model``.
    :class:`BackendConformance`: fixtures ``backend``, ``model_dir``.
    :class:`EnvironmentConformance`: fixtures ``environment`` (a factory), ``task_row``.
    :class:`ScorerConformance`: fixtures ``scorer``, ``cases`` (and ``tokenizer``).
    :class:`ExecutorConformance`: fixture ``executor``.
    :class:`StepSourceConformance`: fixture ``overrides`` (selecting ``trainer.mode``).
    :class:`RunStoreConformance`: fixture ``store`` (a callable ``(run_dir, keep=0)``).

Helpers:
    :func:`make_batch`: a small synthetic :class:`~verl_core.batch.Batch`.
    :func:`config_field_problems`: the config fields of an algorithm that change nothing it trains
    on, run through an :class:`EffectHarness` (the algorithm's dataflow on :func:`config_effect_batch`,
    with stand-ins for the rollout and the models) that measures each config's :class:`ConfigEffect`.
    :func:`tiny_model_dir`: a tiny Qwen2 shaped like the built-in addition model, written to a directory.
    :func:`tiny_text_model_dir`, :func:`tiny_reward_model_dir`: tiny Qwen2 causal LM / reward model.
    All three use a byte-level tokenizer (:func:`build_byte_tokenizer`) that encodes any text.
    :func:`chat_prompt_ids`: short user turns through a chat template, as token ids for an engine.

Importing this package needs pytest (it is a test-time dependency, ``verl-core[test]``).
"""

from verl_core.testing._algorithm import AlgorithmConformance
from verl_core.testing._backend import BackendConformance
from verl_core.testing._environment import EnvironmentConformance
from verl_core.testing._executor import ExecutorConformance
from verl_core.testing._step_source import StepSourceConformance
from verl_core.testing._run_store import RunStoreConformance
from verl_core.testing._config_effects import ConfigEffect, EffectHarness, config_effect_batch, config_field_problems
from verl_core.testing._factories import chat_prompt_ids, make_batch, tiny_model_dir
from verl_core.testing._rollout import RolloutConformance
from verl_core.testing._scorer import ScorerConformance
from verl_core.testing._text_models import build_byte_tokenizer, tiny_reward_model_dir, tiny_text_model_dir

__all__ = ["AlgorithmConformance", "BackendConformance", "EnvironmentConformance", "RolloutConformance",
           "ScorerConformance", "ExecutorConformance", "StepSourceConformance", "RunStoreConformance", "make_batch", "tiny_model_dir", "chat_prompt_ids",
           "build_byte_tokenizer", "tiny_text_model_dir", "tiny_reward_model_dir", "ConfigEffect", "EffectHarness",
           "config_effect_batch", "config_field_problems"]
