"""vLLM rollout engines for verl.

Two engines, registered under ``verl.rollouts``:

* ``vllm`` (:class:`~verl_rollout_vllm.engine.VLLMRollout`): a real vLLM ``LLM`` in the worker's
  process, with the trainer's weights streamed into it in place after every update.
* ``openai`` (:class:`~verl_rollout_vllm.external.OpenAIRollout`): a client for an already
  running OpenAI-compatible server (a vLLM server, say); the server owns its weights.

:class:`~verl_rollout_vllm.client.ExternalInferenceClient` puts the ``openai`` engine in a user's
hands (``from verl import ExternalInferenceClient``): generation on its own, a run's rollout, or a
dataflow node (:func:`~verl_rollout_vllm.client.external_generate`).

Importing this package (or either engine module) never imports vLLM: config resolution imports
the engine classes, and listing or validating a config must not pay for (or fail on) vLLM.
"""

__version__ = "0.1.0"

__all__ = ["VLLMRollout", "VLLMRolloutConfig", "OpenAIRollout", "OpenAIRolloutConfig", "ExternalInferenceClient",
           "external_generate"]


def __getattr__(name: str):
    if name in ("VLLMRollout", "VLLMRolloutConfig"):
        from verl_rollout_vllm import engine

        return getattr(engine, name)
    if name in ("OpenAIRollout", "OpenAIRolloutConfig"):
        from verl_rollout_vllm import external

        return getattr(external, name)
    if name in ("ExternalInferenceClient", "external_generate"):
        from verl_rollout_vllm import client

        return getattr(client, name)
    raise AttributeError(name)
