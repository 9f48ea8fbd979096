"""The Hugging Face rollout engine for verl.

``hf`` (:class:`~verl_rollout_hf.engine.HFRollout`, registered under ``verl.rollouts``, the default
``rollout.name``) generates with ``transformers``' ``generate`` on the actor's own module, so weight
sync is free. It is the reference implementation of the rollout contract and the engine that needs
nothing beyond the trainer's own environment.

Importing this package imports neither torch nor transformers; the engine module does.
"""

__version__ = "0.1.0"

__all__ = ["HFRollout", "HFRolloutConfig"]


def __getattr__(name: str):
    if name in __all__:
        from verl_rollout_hf import engine

        return getattr(engine, name)
    raise AttributeError(name)
