"""The prompt sampler: a seeded order per epoch, resumable from a checkpoint at any position."""

import json

import pytest

from verl_core.contracts import DataError
from verl_core.sampler import PromptSampler


def test_sampler_resumes_mid_epoch_and_at_an_epoch_boundary():
    def draws(sampler, n):
        return [sampler.next_batch() for _ in range(n)]

    full = PromptSampler(10, 5, seed=3)
    expected = draws(full, 6)  # 3 epochs of 2 batches
    assert sorted(expected[0] + expected[1]) == list(range(10))
    assert expected[:2] != expected[2:4]  # each epoch is reshuffled

    for stop in (1, 2, 4):  # mid-epoch, exactly at the end of epoch 0, at the end of epoch 1
        first = PromptSampler(10, 5, seed=3)
        draws(first, stop)
        state = json.loads(json.dumps(first.state_dict()))  # as written to trainer_state.json
        resumed = PromptSampler(10, 5, seed=3)
        resumed.load_state_dict(state)
        rest = draws(resumed, 6 - stop)
        assert rest == expected[stop:], stop
        assert rest, "resuming at an epoch boundary must continue, not run zero steps"
    assert resumed.epoch == 2

    with pytest.raises(DataError, match="resume with the same data"):
        PromptSampler(12, 5, seed=3).load_state_dict(state)


def test_a_batch_larger_than_the_data_says_what_to_set():
    with pytest.raises(DataError, match=r"data.batch_size=64 is larger than the 10 training prompts; set "
                                        r"data.batch_size <= 10 \(each prompt is still sampled rollout.n times\)"):
        PromptSampler(10, 64, seed=0)
    assert len(PromptSampler(10, 10, seed=0).next_batch()) == 10
