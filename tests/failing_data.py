"""Datasets, collate functions, samplers and a data class that raise while loading (importable by
the replicas' process and by configurations: ``_target_: failing_data.FailingData``)."""

from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.dataloader import default_collate

from conftest import make_data


class DataError(Exception):
    """What the objects below raise: a type of the user's own, to see that it arrives as such."""


class FailingDataset(Dataset):
    """``make_data``'s samples; reading sample ``fail_at`` raises once ``from_read`` samples were
    read (``from_read=len(self)`` fails in the second epoch)."""

    def __init__(self, n: int = 64, seed: int = 0, fail_at: int = 20, from_read: int = 0) -> None:
        self.data, self.fail_at, self.from_read, self.reads = make_data(n, seed), fail_at, from_read, 0

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int):
        self.reads += 1
        if index == self.fail_at and self.reads > self.from_read:
            raise DataError(f"sample {index} cannot be read")
        return self.data[index]


class FailingCollate:
    """``default_collate``, except for call number ``fail_on`` (counting from 0)."""

    def __init__(self, fail_on: int) -> None:
        self.fail_on, self.calls = fail_on, 0

    def __call__(self, samples):
        call, self.calls = self.calls, self.calls + 1
        if call == self.fail_on:
            raise DataError(f"batch {call} cannot be collated")
        return default_collate(samples)


class FailingSampler(Sampler):
    """Sequential indices up to ``fail_at``, then an error; ``fail_at=None`` fails in ``iter()``
    itself, before any index is drawn."""

    def __init__(self, n: int, fail_at: int | None) -> None:
        self.n, self.fail_at = n, fail_at

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        if self.fail_at is None:
            raise DataError("the sampler cannot start")
        return self._indices()

    def _indices(self):
        for index in range(self.n):
            if index == self.fail_at:
                raise DataError(f"the sampler fails at index {index}")
            yield index


class FailingData:
    """``conftest.RegressionData`` whose ``stage`` (``"train"`` or ``"val"``) dataset raises."""

    def __init__(self, stage: str = "train", fail_at: int = 20, from_read: int = 0, batch_size: int = 8) -> None:
        self.stage, self.fail_at, self.from_read, self.batch_size = stage, fail_at, from_read, batch_size

    def _loader(self, stage: str, n: int, seed: int) -> DataLoader:
        if stage == self.stage:
            return DataLoader(FailingDataset(n, seed, self.fail_at, self.from_read), batch_size=self.batch_size)
        return DataLoader(make_data(n, seed), batch_size=self.batch_size)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", 64, 0)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", 16, 1)

