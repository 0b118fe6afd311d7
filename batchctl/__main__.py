from batchctl.cli import run

run()
