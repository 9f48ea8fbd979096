"""Batch pickling: what executors send between processes must come back exactly."""

import dataclasses
import pickle

import torch

from verl_core.batch import Batch
from verl_core.testing import make_batch


def test_pickle_round_trip_is_exact_and_narrows_integer_tensors():
    batch = make_batch(batch_size=64, prompt_length=14, response_length=6, vocab_size=16, group_size=8,
                       advantages=True, seed=0)
    big_ids = batch.response_ids.clone()
    big_ids[0, 0] = 151_000  # a real vocabulary: still fits int32
    batch = batch.replace(response_ids=big_ids, extras={"flag": torch.ones(64, dtype=torch.int64),
                                                        "huge": torch.full((64,), 2**40, dtype=torch.int64)})
    back = pickle.loads(pickle.dumps(batch))
    assert isinstance(back, Batch)
    for f in dataclasses.fields(Batch):
        a, b = getattr(batch, f.name), getattr(back, f.name)
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b), f.name
    for name, value in batch.extras.items():
        assert back.extras[name].dtype == value.dtype and torch.equal(back.extras[name], value), name
    assert back.meta == batch.meta
    # Masks go as bool and ids as int32: well under half the bytes of plain int64 tensors.
    plain = pickle.dumps({k: v for k, v in batch.__dict__.items()})
    assert len(pickle.dumps(batch)) < 0.6 * len(plain)


def test_to_moves_every_tensor_and_shares_metadata():
    batch = make_batch(batch_size=8, advantages=True, seed=1).replace(extras={"x": torch.ones(8)})
    moved = batch.to("meta")  # a device every machine has
    assert all(t.device.type == "meta" for t in moved.tensors().values())
    assert moved.extras["x"].device.type == "meta"
    assert moved.meta is batch.meta and batch.prompt_ids.device.type == "cpu"
