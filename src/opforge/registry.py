"""The registry of specs, and the one place that wires a spec to the runtime.

A spec (``opforge.opspec``) only describes an operator. Registering it here
gives the operator, in this process, its fake kernel, its autograd kernel (or
the spec's formula over an owner's operator), its public function
(``spec.function``) and its DTensor sharding strategies. ``opforge.load()``
registers the library's specs; ``opforge.register(opforge.spec(...))`` a user's.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterable

import torch

from opforge import autograd, sharding_strategies
from opforge.arguments import name_missing_tensors
from opforge.opspec import OpSpec
from opforge.public import public_function

_REGISTRY: dict[str, OpSpec] = {}


def wire(spec: OpSpec) -> None:
    """Python-side registrations of ``spec``, without adding it to the registry:
    fake kernel, autograd, public function (``spec.function``), sharding strategies.
    An owner-registered operator gets only what the spec adds, through
    torch.library's own functions (which refuse a second fake kernel or
    autograd formula): opforge's autograd kernel would replace the owner's."""
    sharding_strategies.validate(spec)
    name = spec.qualname if spec.overload_name == "default" else f"{spec.qualname}.{spec.overload_name}"
    if spec.fake is not None:
        torch.library.register_fake(name)(spec.fake)
    if not spec.owner_registered:
        autograd.register(spec)
        name_missing_tensors(spec)
    elif spec.backward is not None:
        torch.library.register_autograd(name, spec.backward, setup_context=spec.setup_context)
    spec.function = public_function(spec)
    sharding_strategies.register(spec)


def register(spec: OpSpec) -> OpSpec:
    """Adds a spec whose operator is already in torch.ops, and registers its
    fake kernel, autograd formula, public function and sharding strategies. Library
    ops and users' ops both go here; ``opforge.register(opforge.spec(...))`` in a
    user's own script. The same spec again is a no-op (a spec file that registers
    its specs itself, then loaded by ``opforge check``)."""
    if not isinstance(spec, OpSpec):
        raise TypeError(f"opforge.register: expected an OpSpec (as opforge.spec(...) makes), got {type(spec).__name__}: {spec!r:.80}")
    if _REGISTRY.get(spec.qualname) is spec:
        return spec
    if spec.qualname in _REGISTRY:
        raise ValueError(f"{spec.qualname}: a spec for this operator is already registered")
    spec.overload  # noqa: B018 - fails clearly if the C++ side lacks it
    wire(spec)
    _REGISTRY[spec.qualname] = spec
    return spec


def replace_registered(spec: OpSpec) -> OpSpec:
    """A spec file's spec over one of opforge's own operators, in place of the
    library's spec in this process (its checks and timings use the file's
    reference, samples and tolerances). It may add nothing to the operator: a
    fake kernel or autograd formula would be a second registration."""
    if spec.qualname not in _REGISTRY:
        return register(spec)
    if not spec.owner_registered or spec.fake is not None or spec.backward is not None:
        raise ValueError(
            "a spec for this operator is already registered (opforge's own): a spec over it may give its reference, samples "
            "and tolerances, not fake=, backward= or owner_registered=False"
        )
    spec.function = _REGISTRY[spec.qualname].function
    _REGISTRY[spec.qualname] = spec
    return spec


def register_module(module_name: str) -> list[OpSpec]:
    """Registers the ``SPECS`` of every public module in a package (``opforge.ops``)."""
    package = importlib.import_module(module_name)
    found: list[OpSpec] = []
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{module_name}.{info.name}")
        for spec in getattr(module, "SPECS", ()):
            found.append(register(spec))
    return found


def all_specs() -> list[OpSpec]:
    return list(_REGISTRY.values())


def get_specs(names: Iterable[str] | None = None) -> list[OpSpec]:
    """Specs by name (``add`` or ``opforge::add``); all of them when ``names`` is empty."""
    names = list(names or [])
    if not names:
        return all_specs()
    by_short = {s.name: s for s in _REGISTRY.values()}
    out = []
    for n in names:
        spec = _REGISTRY.get(n) or by_short.get(n)
        if spec is None:
            known = ", ".join(sorted(by_short))
            raise KeyError(f"no operator named {n!r}; known: {known}")
        out.append(spec)
    return out


__all__ = ["all_specs", "get_specs", "register", "register_module", "replace_registered", "wire"]
