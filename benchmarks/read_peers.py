"""One training-read pass, in a process of its own, for benchmarks/read.py: batchctl's loader
through a torch DataLoader, LitData's StreamingDataset + StreamingDataLoader on its `optimize()`
output of the same arrays, or torchvision's ImageFolder + Resize/CenterCrop over the photos.

    python read_peers.py batchctl DATASET WORKERS BATCH
    python read_peers.py batchctl-augment DATASET WORKERS BATCH
    python read_peers.py batchctl-side-by-side DATASET WORKERS BATCH ROUNDS [augment]
    python read_peers.py litdata-optimize DATASET OUT WORKERS
    python read_peers.py litdata OUT WORKERS BATCH
    python read_peers.py litdata-remote URL CACHE BATCH
    python read_peers.py torchvision PHOTOS WORKERS BATCH
    python read_peers.py torchvision-rrc PHOTOS WORKERS BATCH
    python read_peers.py batchctl-rrc DATASET WORKERS BATCH
    python read_peers.py loader-rrc DATASET THREADS BATCH

Prints `RATE images/s` for the second of two epochs (the first warms the page cache and starts
the workers; torchvision's one epoch, whose decoding dwarfs both). `batchctl-side-by-side` runs
two DataLoaders in one process, without workers and with WORKERS (kept), an epoch of each in
turn for ROUNDS rounds after a first one, and prints `SIDE rate0 rateN ratio`: the medians of
each one's epochs and of the rounds' ratios (this machine is shared: one epoch of 2,400 photos
takes ~0.1 s, and two epochs of one loader in a row were seen to differ 2x).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any


def timed_epochs(loader: Iterable[Any], epochs: int = 2) -> float:
    rate = 0.0
    for _ in range(epochs):
        images, start = 0, time.perf_counter()
        for batch in loader:
            images += len(batch["image"])
        rate = images / (time.perf_counter() - start)
    return rate


def run_batchctl(path: str, workers: int, batch: int) -> float:
    from torch.utils.data import DataLoader

    from batchctl.torch import IterableBatches

    stream = IterableBatches(path, batch_size=batch, shuffle=True, mix=16)
    kept = workers > 0
    return timed_epochs(DataLoader(stream, batch_size=None, num_workers=workers, persistent_workers=kept))


def run_batchctl_augment(path: str, workers: int, batch: int) -> float:
    """As `run_batchctl`, each batch given a CPU augmentation in the workers (`transform=`): a
    random 192x192 crop and a random horizontal flip per image, in NumPy."""
    from torch.utils.data import DataLoader

    from batchctl.torch import IterableBatches

    stream = IterableBatches(path, batch_size=batch, shuffle=True, mix=16, transform=_crop_and_flip)
    kept = workers > 0
    return timed_epochs(DataLoader(stream, batch_size=None, num_workers=workers, persistent_workers=kept))


def run_side_by_side(path: str, workers: int, batch: int, rounds: int, augment: bool) -> tuple[float, float, float]:
    """Medians of `IterableBatches` epochs without DataLoader workers and with `workers`, taken
    in turn, and of each round's ratio (with / without)."""
    from statistics import median

    from torch.utils.data import DataLoader

    from batchctl.torch import IterableBatches

    transform = _crop_and_flip if augment else None
    loaders = [
        DataLoader(
            IterableBatches(path, batch_size=batch, shuffle=True, mix=16, transform=transform),
            batch_size=None,
            num_workers=n,
            persistent_workers=n > 0,
        )
        for n in (0, workers)
    ]
    for loader in loaders:  # the page cache warmed, the workers started
        timed_epochs(loader, epochs=1)
    rates: list[list[float]] = [[], []]
    for _ in range(rounds):
        for rate, loader in zip(rates, loaders, strict=True):
            rate.append(timed_epochs(loader, epochs=1))
    ratios = [mine / bare for bare, mine in zip(*rates, strict=True)]
    return median(rates[0]), median(rates[1]), median(ratios)


def _crop_and_flip(got: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    import torch

    rng = np.random.default_rng()
    images = got["image"].numpy()
    out = np.empty((len(images), 192, 192, images.shape[3]), images.dtype)
    for k, image in enumerate(images):
        top, left = rng.integers(0, image.shape[0] - 191), rng.integers(0, image.shape[1] - 191)
        crop = image[top : top + 192, left : left + 192]
        out[k] = crop[:, ::-1] if rng.random() < 0.5 else crop
    return {**got, "image": torch.from_numpy(out)}


def litdata_optimize(path: str, out: str, workers: int) -> None:
    from litdata import optimize

    import batchctl

    batches = [(path, i) for i in range(len(batchctl.open(path)))]
    optimize(fn=_litdata_samples, inputs=batches, output_dir=out, num_workers=workers, chunk_bytes="64MB")


_opened: dict[str, Any] = {}


def _litdata_samples(item: tuple[str, int]) -> Iterator[dict[str, Any]]:
    """The same preprocessed arrays: the image and label of each row of batchctl's batch i."""
    import batchctl

    path, index = item
    ds = _opened.get(path) or _opened.setdefault(path, batchctl.open(path))
    batch = ds[index]
    for image, label in zip(batch["image"], batch["label"], strict=True):
        yield {"image": image, "label": int(label)}


def run_litdata(out: str, workers: int, batch: int) -> float:
    from litdata import StreamingDataLoader, StreamingDataset

    dataset = StreamingDataset(out, shuffle=True, drop_last=True)
    return timed_epochs(StreamingDataLoader(dataset, batch_size=batch, num_workers=workers))


def run_litdata_remote(url: str, cache: str, batch: int) -> float:
    """One epoch of LitData's StreamingDataset from a bucket into an empty cache (all fetched),
    in the main process (as batchctl's remote figure), the endpoint from AWS_ENDPOINT_URL."""
    import litdata.streaming.downloader as downloader
    from litdata import StreamingDataLoader, StreamingDataset

    # LitData's obstore client refuses a plain-http endpoint (the loopback server; a bucket is https)
    downloader._OBSTORE_CLIENT_OPTIONS = {**downloader._OBSTORE_CLIENT_OPTIONS, "allow_http": "true"}
    dataset = StreamingDataset(url, cache_dir=cache, shuffle=True, drop_last=True)
    return timed_epochs(StreamingDataLoader(dataset, batch_size=batch, num_workers=0), epochs=1)


def run_torchvision(photos: str, workers: int, batch: int) -> float:
    """ImageFolder + Resize(256) + CenterCrop(224) in a shuffled DataLoader. Where torchvision
    does not import (PyPI's wheel is the CUDA build, which a CPU torch cannot load), the same
    work on PIL: batchctl's image preprocessing is torchvision's Resize + CenterCrop, tested
    against it (tests/reference.py)."""
    try:
        from torchvision import datasets, transforms

        pipeline = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224), transforms.PILToTensor()])
        folder: Any = datasets.ImageFolder(photos, transform=pipeline)
    except (ImportError, RuntimeError):
        folder = _PhotoFolder(photos)
        print("STANDIN torchvision does not import here: the same decode, Resize and CenterCrop on PIL")
    return _folder_epoch(folder, workers, batch)


def run_torchvision_rrc(photos: str, workers: int, batch: int) -> float:
    """ImageFolder + RandomResizedCrop(224) + RandomHorizontalFlip over the original photos in a
    shuffled DataLoader (the peer): one epoch. Where torchvision does not import, the same
    on PIL: decode, convert to RGB, torchvision's crop rules (`augment.random_resized_box`), one
    bilinear resize of the region (PIL's, as torchvision's PIL path), a flip half the time."""
    try:
        from torchvision import datasets, transforms

        steps = [transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(), transforms.PILToTensor()]
        folder: Any = datasets.ImageFolder(photos, transform=transforms.Compose(steps))
    except (ImportError, RuntimeError):
        folder = _PhotoFolder(photos, crop=224)
        print("STANDIN torchvision does not import here: the same decode, RandomResizedCrop and flip on PIL")
    return _folder_epoch(folder, workers, batch)


def _folder_epoch(folder: Any, workers: int, batch: int) -> float:
    """One shuffled epoch of an ImageFolder-like dataset in a DataLoader: images/s."""
    import torch
    from torch.utils.data import DataLoader

    loader = DataLoader(folder, batch_size=batch, shuffle=True, num_workers=workers, drop_last=True)
    images, start = 0, time.perf_counter()
    for image, _label in loader:
        assert isinstance(image, torch.Tensor)
        images += len(image)
    return images / (time.perf_counter() - start)


def run_batchctl_rrc(path: str, workers: int, batch: int) -> float:
    """`IterableBatches` decoding the stored JPEGs with RandomResizedCrop(224) + flip in the
    DataLoader's workers (each decodes in its loader's threads): the second of two epochs."""
    from torch.utils.data import DataLoader

    from batchctl.torch import IterableBatches

    stream = IterableBatches(path, batch_size=batch, mix=16, random_resized_crop=224, flip=True)
    kept = workers > 0
    return timed_epochs(DataLoader(stream, batch_size=None, num_workers=workers, persistent_workers=kept))


def run_loader_rrc(path: str, threads: int, batch: int) -> float:
    """batchctl's own loader decoding with RandomResizedCrop(224) + flip in its read threads
    (`prefetch` stored batches in flight; one thread per core): the second of two epochs."""
    import batchctl

    del threads  # the loader takes one thread per core
    return timed_epochs(batchctl.open(path).loader(batch_size=batch, mix=16, random_resized_crop=224, flip=True))


class _PhotoFolder:
    """ImageFolder's listing (class folders, sorted) and one photo decoded per item."""

    def __init__(self, root: str, crop: int = 0) -> None:
        from pathlib import Path

        classes = sorted(p.name for p in Path(root).iterdir() if p.is_dir())
        self.items = [(f, c) for c, name in enumerate(classes) for f in sorted((Path(root) / name).iterdir())]
        self.crop = crop  # RandomResizedCrop(crop) + flip; 0: Resize(256) + CenterCrop(224)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        import torch

        from batchctl.preprocess.image import preprocess_image

        path, label = self.items[index]
        if self.crop:
            return torch.from_numpy(_random_resized_crop(path, self.crop)).permute(2, 0, 1), label
        return torch.from_numpy(preprocess_image(path)["image"]).permute(2, 0, 1), label


def _random_resized_crop(path: Any, size: int) -> Any:
    import numpy as np
    from PIL import Image

    from batchctl.read.augment import random_resized_box

    rng = np.random.default_rng()
    with Image.open(path) as img:
        rgb = img.convert("RGB")
    left, top, w, h = random_resized_box(rgb.width, rgb.height, (0.08, 1.0), (3 / 4, 4 / 3), rng)
    out = rgb.resize((size, size), Image.Resampling.BILINEAR, box=(left, top, left + w, top + h))
    if rng.random() < 0.5:
        out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return np.asarray(out)


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    if mode == "litdata-optimize":
        litdata_optimize(args[0], args[1], int(args[2]))
        sys.exit(0)
    if mode == "batchctl-side-by-side":
        print("SIDE", *run_side_by_side(args[0], int(args[1]), int(args[2]), int(args[3]), args[4:] == ["augment"]))
        sys.exit(0)
    if mode == "litdata-remote":
        print("RATE", run_litdata_remote(args[0], args[1], int(args[2])), flush=True)
        sys.exit(0)
    run = {
        "batchctl": run_batchctl,
        "batchctl-augment": run_batchctl_augment,
        "litdata": run_litdata,
        "torchvision": run_torchvision,
        "torchvision-rrc": run_torchvision_rrc,
        "batchctl-rrc": run_batchctl_rrc,
        "loader-rrc": run_loader_rrc,
    }[mode]
    print("RATE", run(args[0], int(args[1]), int(args[2])), flush=True)
