"""Bench only (`benchmarks/order.py`, on PYTHONPATH for its "arrival order" runs): the collator
places each chunk's rows as the chunk arrives, as batchctl did before the reorder window, so the
bench can compare both without a switch in batchctl itself. Python runs this at start-up in every
process of the build; the collator module is patched once it is imported (nothing is imported
early: the runs compared pay the same imports)."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any

TARGET = "batchctl.run.collate"


def _take_in_arrival_order(self: Any, message: Any) -> None:
    self._add(self._outputs(message.body))
    self._release(message.body)
    self.held.value = 0


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: ModuleType | None = None) -> Any:
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        load = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            load(module)
            module.Placement.take = _take_in_arrival_order  # type: ignore[attr-defined]

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _PatchAfterImport())
