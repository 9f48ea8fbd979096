"""Cutting a call's arguments into per-rank shards and joining the ranks' results.

The functions live in :mod:`verl_kit.sharding`, shared with the other multi-process executors;
this module keeps the names the Ray executor (and its tests) import.
"""

from verl_kit.sharding import Mesh, Shards, balance_batch, gather_split, pad_and_shard, split_call

__all__ = ["Mesh", "Shards", "balance_batch", "split_call", "pad_and_shard", "gather_split"]
