"""The order prompts are drawn in, and its position in a checkpoint (scheduler work: the data reader
only hands the rows over)."""

from __future__ import annotations

import torch

from verl_core.contracts import DataError

__all__ = ["PromptSampler"]


class PromptSampler:
    """Seeded, epoch-wise shuffled batches of prompt indices whose position can be saved.

    The order of epoch ``e`` depends only on ``(seed, e)``, so a resumed run draws exactly the
    prompts the uninterrupted run would have, including across an epoch boundary. A short last
    batch is dropped.
    """

    def __init__(self, size: int, batch_size: int, *, seed: int, shuffle: bool = True) -> None:
        if batch_size > size:
            raise DataError(f"data.batch_size={batch_size} is larger than the {size} training prompts; set "
                            f"data.batch_size <= {size} (each prompt is still sampled rollout.n times), or give "
                            f"more training data")
        self.size, self.batch_size, self.seed, self.shuffle = size, batch_size, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order = self._make_order()

    def _make_order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.size))
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(self.size, generator=g).tolist()

    def next_batch(self) -> list[int]:
        if self.position + self.batch_size > self.size:
            self.epoch += 1
            self.position = 0
            self._order = self._make_order()
        idx = self._order[self.position:self.position + self.batch_size]
        self.position += self.batch_size
        return idx

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "size": self.size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("size") != self.size:
            raise DataError(f"checkpoint was taken with {state.get('size')} training prompts; the data now has "
                            f"{self.size}; resume with the same data")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._make_order()
