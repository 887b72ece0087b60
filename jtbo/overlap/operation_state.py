"""The per-micro-batch state that a list of operations shares.

Operations are SGLang's: ``op(state, **inputs)`` reads, sets and pops entries of its
micro-batch's state in place, and an entry lives from the operation that sets it to the one
that pops it. A subclass declares its entries as class annotations (a type and a comment
each), and the state then refuses any other name: a misspelt entry raises where it is set,
read or popped. The plain ``OperationState`` declares none and takes any name (small
operation lists, tests).

Why a mutable object with declared entries and not a frozen pytree dataclass: the executor
owns the state across operations and swaps its live values at every barrier (round, issue
and ``pin_issued`` barriers run between any two operations, over exactly the entries set at
that moment), a joint operation sets entries of both micro-batches' states at once, and the
entries set change from one operation to the next. An immutable state would have to be
returned by every operation and would carry every entry of the layer, set or not, into each
barrier. The live entries (``live_values``) are a plain dict, which is a pytree.

Context entries (attention metadata, the micro-batch's EP dispatcher, DP context, ...) are
given at construction, as a mapping or as an object whose attributes they are (a frozen
dataclass), are read-only, and survive ``clear``.
"""

import dataclasses
import inspect
import typing
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar


def _declared_entries(cls: type) -> frozenset[str] | None:
    """The entries a state class declares (annotations of it and its bases), None if none."""
    names = set()
    for klass in cls.__mro__:
        if klass is OperationState or not issubclass(klass, OperationState):
            continue
        for name, hint in inspect.get_annotations(klass).items():
            if typing.get_origin(hint) is not ClassVar and hint is not ClassVar:
                names.add(name)
    return frozenset(names) or None


def _context_entries(context: Any) -> dict[str, Any]:
    """A context given as a mapping or as a dataclass, as a dict of its entries."""
    if context is None:
        return {}
    if isinstance(context, Mapping):
        return dict(context)
    return {field.name: getattr(context, field.name) for field in dataclasses.fields(context)}


class OperationState:
    """Per-micro-batch scratch space that refuses to overwrite an entry (module docstring).

    Entries set by operations are cleared by ``clear(expect_keys)`` at the end of a layer,
    which checks that exactly the expected keys are left (something left over means an
    operation holds memory longer than it should).
    """

    ENTRIES: ClassVar[frozenset[str] | None] = None  # declared entries; None: any name

    def __init_subclass__(cls, **kwargs):
        """Collects the subclass's declared entries into ``ENTRIES``."""
        super().__init_subclass__(**kwargs)
        cls.ENTRIES = _declared_entries(cls)

    def __init__(self, context: Any = None):
        """Creates an empty state over the read-only ``context`` entries.

        Args:
          context: a mapping of the entries, an object (a dataclass) whose fields they are,
            or None.

        Raises:
          KeyError: a context entry has the name of a declared entry.
        """
        entries = _context_entries(context)
        clash = sorted(set(entries) & (self.ENTRIES or set()))
        if clash:
            raise KeyError(f"context entries {clash} are declared entries of {type(self).__name__}")
        object.__setattr__(self, "_context", entries)
        object.__setattr__(self, "_data", {})

    def _check_declared(self, key: str) -> None:
        if self.ENTRIES is not None and key not in self.ENTRIES and key not in self._context:
            raise AttributeError(
                f"`{key}` is no entry of {type(self).__name__} (entries: {sorted(self.ENTRIES)}; "
                f"context: {sorted(self._context)})"
            )

    def __setattr__(self, key: str, value: Any) -> None:
        if key in self._context:
            raise KeyError(f"state key `{key}` is a read-only context entry")
        self._check_declared(key)
        if key in self._data:
            raise KeyError(f"state key `{key}` already exists; pop it before setting it again")
        self._data[key] = value

    def __getattr__(self, key: str) -> Any:
        data, context = self.__dict__["_data"], self.__dict__["_context"]
        if key in data:
            return data[key]
        if key in context:
            return context[key]
        self._check_declared(key)
        raise AttributeError(f"state has no key `{key}` (keys: {sorted(data) + sorted(context)})")

    def __delattr__(self, key: str) -> None:
        self.pop(key)

    def __contains__(self, key: str) -> bool:
        return key in self._data or key in self._context

    def get(self, key: str, default: Any = None) -> Any:
        """Returns the entry or context entry ``key``, or ``default``.

        Raises:
          AttributeError: ``key`` is neither declared nor a context entry.
        """
        self._check_declared(key)
        return self._data.get(key, self._context.get(key, default))

    def pop(self, key: str) -> Any:
        """Removes and returns the entry ``key`` (context entries cannot be popped).

        Raises:
          AttributeError: ``key`` is not declared.
          KeyError: ``key`` is not set, or a context entry.
        """
        self._check_declared(key)
        if key not in self._data:
            raise KeyError(f"state has no (non-context) key `{key}`")
        return self._data.pop(key)

    def update(self, values: Mapping[str, Any]) -> None:
        """Sets every entry of ``values`` (each must be new)."""
        for key, value in values.items():
            setattr(self, key, value)

    def keys(self) -> list[str]:
        """The keys set by operations (not the context)."""
        return list(self._data)

    def clear(self, expect_keys: Sequence[str]) -> None:
        """Drops every entry set by operations after checking they are exactly ``expect_keys``.

        Raises:
          KeyError: the entries differ from ``expect_keys``.
        """
        if set(self._data) != set(expect_keys):
            raise KeyError(
                f"unexpected state keys when clearing: have {sorted(self._data)}, "
                f"expected {sorted(expect_keys)}; an operation left something behind or "
                "released it too early"
            )
        self._data.clear()

    def live_values(self) -> dict[str, Any]:
        """The entries set by operations (for round barriers)."""
        return self._data

    def replace_live_values(self, values: Mapping[str, Any]) -> None:
        """Swaps the entries for ``values`` with the same keys (for round barriers).

        Raises:
          KeyError: ``values`` has other keys than the entries set.
        """
        if set(values) != set(self._data):
            raise KeyError(f"keys changed: {sorted(values)} vs {sorted(self._data)}")
        self._data.update(values)
