"""Rows of a dataset's arrays by number (an incremental build's carried rows), read as a training
read reads them: chunk by chunk from a local dataset's shard files (`chunkread.ChunkReader`,
`ValuesReader`: several times zarr-python's speed) or by ranged reads from a URL
(`remote.RemoteChunkReader`, `RemoteValuesReader`), every checksum checked and a missing shard or
chunk an error; through zarr only for a layout batchctl does not write."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from batchctl.store import ragged, storage
from batchctl.store.chunkread import BatchValues, ChunkReader, DatasetRoot, ValuesReader, batch_values
from batchctl.store.metadata import offsets_array, values_array
from batchctl.store.remote import RemoteChunkReader, RemoteStore, RemoteValuesReader
from batchctl.store.zarrmeta import ArrayMeta


class RowReader:
    """Rows `start:stop` of the arrays of the dataset at `location` (`arrays`: the arrays
    zarr-python opened there, for their documents and for a layout batchctl does not write)."""

    def __init__(
        self, location: str, arrays: Mapping[str, Any], storage_options: Mapping[str, Any] | None = None
    ) -> None:
        self.arrays = arrays
        metas = {name: ArrayMeta.of_zarr(arr) for name, arr in arrays.items()}
        self.root: DatasetRoot | None = None
        self.store: RemoteStore | None = None
        self.readers: dict[str, ChunkReader | RemoteChunkReader | None]
        self.values: dict[str, BatchValues | None]
        if storage.is_url(location):
            store = self.store = RemoteStore(location, storage_options or {}, cache=None)
            self.readers = {name: RemoteChunkReader.for_array(store, meta) for name, meta in metas.items()}
            self.values = {name: RemoteValuesReader.for_array(store, meta) for name, meta in metas.items()}
        else:
            root = self.root = DatasetRoot(Path(location))
            self.readers = {name: ChunkReader.for_array(root, meta) for name, meta in metas.items()}
            self.values = {name: ValuesReader.for_array(root, meta) for name, meta in metas.items()}

    def ragged_rows(self, field: str, start: int, stop: int) -> np.ndarray:
        """Rows `start:stop` of the ragged field `field` (an object array of arrays), read batch
        by batch: each batch's offsets, then its values."""
        offsets_name, values_name = offsets_array(field), values_array(field)
        batch_size, total = int(self.arrays[offsets_name].chunks[0]), int(self.arrays[offsets_name].shape[0])
        out = np.empty(stop - start, dtype=object)
        for batch in range(start // batch_size, (stop - 1) // batch_size + 1):
            first, last = batch * batch_size, min((batch + 1) * batch_size, total)
            offsets = self.rows(offsets_name, first, last)
            where = f"{values_name} batch {batch}"
            values = batch_values(self.values[values_name], self.arrays[values_name], batch, offsets, where)
            rows = ragged.rows_of(offsets, values, where)
            lo, hi = max(start, first), min(stop, last)
            out[lo - start : hi - start] = rows[lo - first : hi - first]
        return out

    def rows(self, name: str, start: int, stop: int) -> np.ndarray:
        reader, arr = self.readers[name], self.arrays[name]
        if reader is None:
            return np.asarray(arr[start:stop])
        size = reader.chunk_shape[0]
        chunks = [self._chunk(reader, chunk) for chunk in range(start // size, (stop - 1) // size + 1)]
        first = (start // size) * size
        return np.concatenate(chunks)[start - first : stop - first]

    def _chunk(self, reader: ChunkReader | RemoteChunkReader, chunk: int) -> np.ndarray:
        if isinstance(reader, ChunkReader):
            return reader.read(chunk)
        assert self.store is not None
        out = np.empty(reader.chunk_shape, reader.dtype)
        self.store.read_chunks(chunk, [(reader, [out])])
        return out

    def close(self) -> None:
        if self.root is not None:
            self.root.close()
