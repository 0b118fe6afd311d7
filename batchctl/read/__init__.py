"""Reading a dataset: the Python API, `info` and `verify`, previews."""
