"""verl-kit: the helpers verl's plugins share, which the core itself does not use.

One module per concern, imported by name (this package imports none of them, so ``import verl_kit``
costs no torch)::

    from verl_kit.sharding import split_call, gather_split, Mesh   # an executor, a training backend
    from verl_kit.training import micro_batch_weights, trim_padding # a training backend
    from verl_kit.engine import stop_token_ids, RetryingClient      # a rollout engine
    from verl_kit.builtin import build_once, byte_level_tokenizer   # a plugin that builds a model locally
    from verl_kit.multimodal import vision_forward_inputs           # a backend or engine running a VLM
    from verl_kit.progress import Progress                          # long work before a run: a bar or lines

:mod:`verl_kit.sharding`: a ``"split"`` call cut into per-rank shards and joined again, the data-parallel
mesh, joining the process group, ``autocast``. :mod:`verl_kit.training`: micro-batches (token-budget
packing, padding trimmed), a rank's share of the mini-batch and each micro-batch's loss weight, the length
check. :mod:`verl_kit.engine`: stop ids, per-sample seeds,
safetensors shards, JSON over HTTP with retries. :mod:`verl_kit.builtin`: the ``builtin:`` model cache and
a byte-level tokenizer. :mod:`verl_kit.multimodal`: a vision-language model's forward inputs, vision
token ids and auto class. :mod:`verl_kit.progress`: a bar with ETA (plain lines in a CI log) for long
work outside an RL step. What the core itself uses stays the core's (``verl_core.kit``).
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
