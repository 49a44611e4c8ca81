"""An endless batch loader whose position can be saved and restored exactly (for resume)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import numpy as np

logger = logging.getLogger("hybridrl.data")

T = TypeVar("T")

STATE_KEYS = ("epoch", "index", "seed", "batch_size", "dataset_size")


class StatefulLoader(Generic[T]):
    """Batches of items from `dataset`, epoch after epoch, without end.

    Epoch `e` visits the items in the order `default_rng([seed, e]).permutation(len(dataset))`
    (or in order, without shuffling), so the order depends only on (seed, epoch), never on global
    RNG state, and the position is just (epoch, index): `index` counts the items of the current
    epoch already handed out. With `drop_last`, the `len(dataset) % batch_size` items left at the
    end of an epoch are skipped (they are different items each epoch when shuffling).
    """

    def __init__(
        self,
        dataset: Sequence[T],
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
    ) -> None:
        if len(dataset) == 0:
            raise ValueError("StatefulLoader got an empty dataset; check the data source.")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
        if drop_last and batch_size > len(dataset):
            raise ValueError(
                f"batch_size ({batch_size}) is larger than the dataset ({len(dataset)} items), "
                "so with drop_last=True no batch can be made. Lower the batch size, add data, "
                "or set drop_last=False."
            )
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}.")
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self._epoch = 0
        self._index = 0
        self._order: np.ndarray | None = None  # the current epoch's item order, built lazily

    @property
    def epoch(self) -> int:
        """The current epoch (= the number of completed passes over the dataset)."""
        return self._epoch

    @property
    def batches_per_epoch(self) -> int:
        n, b = len(self.dataset), self.batch_size
        return n // b if self.drop_last else -(-n // b)

    def next_batch(self) -> list[T]:
        """The next batch; moves to the next (reshuffled) epoch when this one is used up."""
        self._roll_epoch_if_done()
        if self._order is None:
            self._order = self._epoch_order(self._epoch)
        positions = self._order[self._index : self._index + self.batch_size]
        self._index += len(positions)
        self._roll_epoch_if_done()
        return [self.dataset[int(i)] for i in positions]

    def state_dict(self) -> dict[str, int]:
        """The position, as plain ints (JSON-serialisable)."""
        return {
            "epoch": self._epoch,
            "index": self._index,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "dataset_size": len(self.dataset),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position saved by `state_dict`: the following batches are the same as the
        saved loader's would have been (given the same dataset and batch size)."""
        missing = [key for key in STATE_KEYS if key not in state]
        if missing:
            raise ValueError(f"loader state is missing {missing}; got keys {sorted(state)}.")
        n = len(self.dataset)
        epoch, index, seed = int(state["epoch"]), int(state["index"]), int(state["seed"])
        if epoch < 0 or not 0 <= index <= n:
            raise ValueError(
                f"loader state position (epoch {epoch}, index {index}) is out of range for a "
                f"dataset of {n} items (saved with {state['dataset_size']}); this checkpoint "
                "was made with different data. Point data.train_path at that data, or set trainer.resume=off to start fresh."
            )
        if state["dataset_size"] != n:
            logger.warning(
                "Restoring the data position of a dataset of %d items into one of %d: the order "
                "of items differs from the saved run, so the resume is not exact.",
                state["dataset_size"], n,
            )
        if state["batch_size"] != self.batch_size:
            logger.warning(
                "Restoring a data position saved with batch_size %d into a loader with "
                "batch_size %d: resuming at the same item, with the new batch size.",
                state["batch_size"], self.batch_size,
            )
        if seed != self.seed:
            logger.warning("Data seed %d replaced by the saved seed %d.", self.seed, seed)
        self.seed, self._epoch, self._index, self._order = seed, epoch, index, None
        self._roll_epoch_if_done()
        logger.info("Restored data position: epoch %d, item %d of %d.", epoch, index, n)

    def _roll_epoch_if_done(self) -> None:
        n = len(self.dataset)
        usable = n - n % self.batch_size if self.drop_last else n
        if self._index >= usable:
            self._epoch += 1
            self._index = 0
            self._order = None

    def _epoch_order(self, epoch: int) -> np.ndarray:
        n = len(self.dataset)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)
