"""ModelTable: the loaded models of one engine, by name.

One table per :class:`~engine.core.engine_core.EngineCore` (``core.slots``): the
:class:`~engine.core.loading.ModelLoader` adds a model's :class:`~engine.core.slot.ModelSlot` when
it installs it and removes it at unload (or when a load is undone); the core, the
:class:`~engine.core.pool_keeper.PoolKeeper` and the :class:`~engine.core.step_policy.StepPolicy`
read it. Iteration is in load order.
"""

from __future__ import annotations

from collections.abc import ItemsView, Iterator, ValuesView

from engine.core.slot import ModelSlot
from engine.errors import EngineError


class ModelTable:
    def __init__(self) -> None:
        self._slots: dict[str, ModelSlot] = {}

    def add(self, slot: ModelSlot) -> None:
        """Install ``slot`` under its name; a name already in the table is refused."""
        if slot.name in self._slots:
            raise EngineError(f"model {slot.name!r} is already loaded")
        self._slots[slot.name] = slot

    def remove(self, name: str) -> ModelSlot | None:
        """Take ``name`` out of the table; its slot, or None when it was not there."""
        return self._slots.pop(name, None)

    def get(self, name: str) -> ModelSlot:
        """The loaded model ``name``; an EngineError saying it is not loaded otherwise."""
        slot = self._slots.get(name)
        if slot is None:
            raise EngineError(f"model {name!r} is not loaded")
        return slot

    def find(self, name: str) -> ModelSlot | None:
        """The loaded model ``name``, or None."""
        return self._slots.get(name)

    def names(self) -> list[str]:
        return list(self._slots)

    def items(self) -> ItemsView[str, ModelSlot]:
        return self._slots.items()

    def values(self) -> ValuesView[ModelSlot]:
        return self._slots.values()

    def __contains__(self, name: object) -> bool:
        return name in self._slots

    def __iter__(self) -> Iterator[str]:
        return iter(self._slots)

    def __len__(self) -> int:
        return len(self._slots)
