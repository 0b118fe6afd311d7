"""On disk: the dataset's metadata, arrays, shard codec and chunk reader, and where files live (local or a URL)."""
