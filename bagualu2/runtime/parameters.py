"""The storages of a model's parameters and buffers, found again only when the model may have changed.

Owns ``ParameterStorages`` (one model's, reused while it is current) and ``storages_of`` (the
storages under one tensor).

Design note
-----------
Parameters and buffers are not activations: a save of one is never counted, offloaded or
recomputed, and it is told apart by its storage. A provisioner asks for the model's storages at
every micro-batch, because a wrapper applied after ``enable`` (FSDP2's ``fully_shard``) replaces
them and a replaced parameter's address may hold an activation by the next forward. Walking the
module tree for that costs each micro-batch more than the rest of its bookkeeping, so the walk's
result is reused while both of these hold:

* no module, parameter or buffer was registered anywhere in the process since the walk. torch
  calls its global registration hooks for each (``setattr`` of a module, a ``Parameter`` or a
  buffer, ``register_module``, ``register_parameter``, ``register_buffer``, ``add_module``, a
  ``ModuleList`` item); one counter here counts them all, so the tables the walk read are the
  tables the model has.
* every storage the walk found is still alive (a weak reference to each). A storage replaced
  without a registration (``param.data = ...``, ``module._apply``, a table written directly)
  frees the old one once nothing else holds it, and only then can its address go to another
  storage.

Invariant: the set ``current`` vouches for holds no address of a storage that died since the
walk. That is what makes a stale set unsafe: an activation at such an address would be taken for
a parameter and go uncounted. A parameter added without a registration while every storage the
walk found lives is missed until the next walk; a save of it is counted as an activation, the
error on the budget's side.
"""
from __future__ import annotations

import itertools
from typing import Any, Iterator, List, Optional, Set

import torch

from bagualu2.runtime.recipes import is_plain

__all__ = ["ParameterStorages", "storages_of"]

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def storages_of(t: torch.Tensor) -> Iterator[torch.UntypedStorage]:
    """The storages of ``t``, or of the tensors a wrapper subclass holds (``__tensor_flatten__``)."""
    if is_plain(t) or not hasattr(t, "__tensor_flatten__"):
        yield t.untyped_storage()
        return
    names, _ = t.__tensor_flatten__()
    for name in names:
        inner = getattr(t, name)
        if isinstance(inner, torch.Tensor):
            yield from storages_of(inner)


class _Registrations:
    """How many modules, parameters and buffers the process has registered since the first
    ``ParameterStorages`` asked (torch's global registration hooks, installed then, once)."""

    def __init__(self) -> None:
        self._counter = itertools.count()
        self.count = next(self._counter)
        self._installed = False

    def install(self) -> None:
        if not self._installed:
            self._installed = True
            hooks = torch.nn.modules.module
            hooks.register_module_module_registration_hook(self._registered)
            hooks.register_module_parameter_registration_hook(self._registered)
            hooks.register_module_buffer_registration_hook(self._registered)

    def _registered(self, module: torch.nn.Module, name: str, value: Any) -> None:
        self.count = next(self._counter)  # returns None: the registered value is left as it is


_REGISTRATIONS = _Registrations()


class ParameterStorages:
    """One model's parameter and buffer storages (the module note says when they are reused)."""

    def __init__(self) -> None:
        self._model: Optional[torch.nn.Module] = None
        self._registrations = -1
        self._weak: List[int] = []  # a weak reference to each storage the last walk found

    def current(self, model: torch.nn.Module) -> bool:
        """Whether the storages the last ``walk`` found are still ``model``'s."""
        if model is not self._model or _REGISTRATIONS.count != self._registrations:
            return False
        expired = torch.UntypedStorage._expired
        for weak in self._weak:
            if expired(weak):
                return False
        return True

    def walk(self, model: torch.nn.Module) -> Set[int]:
        """The storages (``_cdata``) of every parameter and buffer of ``model`` and its submodules
        (those ``model.parameters()`` and ``model.buffers()`` yield), read from the modules' own
        tables: torch's nested generators cost several times more per tensor."""
        _REGISTRATIONS.install()
        self.forget()
        registrations = _REGISTRATIONS.count
        found: List[torch.UntypedStorage] = []
        seen: Set[int] = set()
        stack = [model]
        while stack:
            module = stack.pop()
            if id(module) in seen:
                continue
            seen.add(id(module))
            for table in (module._parameters, module._buffers):
                for t in table.values():
                    if t is None:
                        continue
                    if type(t) in _PLAIN:
                        found.append(t.untyped_storage())
                    else:
                        found.extend(storages_of(t))
            stack.extend(m for m in module._modules.values() if m is not None)
        params = {s._cdata for s in found}
        self._weak = [s._weak_ref() for s in {s._cdata: s for s in found}.values()]
        self._model, self._registrations = model, registrations
        return params

    def forget(self) -> None:
        """Drop the last walk (its weak references given back): the next ``current`` is False."""
        free = torch.UntypedStorage._free_weak_ref
        weak, self._weak, self._model = self._weak, [], None
        for w in weak:
            free(w)
