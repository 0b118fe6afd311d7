"""Running a build: the processes (pool, collator, fork server), their signals, the work folder,
the lock, the Dask engine."""
