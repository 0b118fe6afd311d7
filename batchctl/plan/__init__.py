"""Planning a build: the input files, and what changed since the last build."""
