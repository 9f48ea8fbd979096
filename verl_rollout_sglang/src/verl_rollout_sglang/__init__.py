"""SGLang rollout engine for verl.

``sglang`` (:class:`~verl_rollout_sglang.engine.SGLangRollout`, registered under
``verl.rollouts``) runs a real SGLang server as a child process under SGLang's own Python
environment, and talks to it over HTTP: token ids in, token ids and log-probs out, weights synced
after every update. ``verl sglang setup`` builds that environment; ``verl sglang info`` says which
one the engine will use.

Importing this package never imports SGLang (it lives in another environment) or starts anything.
"""

__version__ = "0.1.0"

__all__ = ["SGLangRollout", "SGLangRolloutConfig"]


def __getattr__(name: str):
    if name in __all__:
        from verl_rollout_sglang import engine

        return getattr(engine, name)
    raise AttributeError(name)
