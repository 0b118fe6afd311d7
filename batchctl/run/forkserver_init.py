"""Imported by the fork server before its other preloads, and by nothing else (`processes.PRELOAD`)."""

from batchctl.run.processes import become_forkserver

become_forkserver()
