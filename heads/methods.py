"""The registry of drafting methods: each `DraftMethod` (heads/draft_method.py) registered once, found by the
`method` its heads config records.

    method_of("eagle3").trainer            # "headstart.train.eagle"
    method_of(heads.config).dynamic_tree   # an EAGLE draft grows its own tree

A new method declares its DraftMethod and calls `register` once (docs/design.md "Add a drafting method").
"""

from __future__ import annotations

from typing import Any

from headstart.heads.dflash import DFLASH
from headstart.heads.draft_method import DraftMethod
from headstart.heads.dspark import DSPARK
from headstart.heads.eagle import EAGLE, EAGLE3
from headstart.heads.medusa import MEDUSA

_BY_NAME: dict[str, DraftMethod] = {}


class UnknownMethodError(ValueError):
    """A config or name that no registered drafting method covers."""


def register(method: DraftMethod) -> DraftMethod:
    """Make `method` known under each of its names; a name another method holds is refused."""
    for name in method.names:
        held = _BY_NAME.get(name)
        if held is not None and held is not method:
            raise ValueError(f"drafting method {name!r} is already registered ({held.title})")
    for name in method.names:
        _BY_NAME[name] = method
    return method


def method_names() -> list[str]:
    """Every registered config.method value, in registration order."""
    return list(_BY_NAME)


def method_of(config_or_name: Any) -> DraftMethod:
    """The DraftMethod of a heads config (its `method`) or of a method name; UnknownMethodError names the known ones."""
    name = config_or_name if isinstance(config_or_name, str) else config_or_name.method
    method = _BY_NAME.get(name)
    if method is None:
        raise UnknownMethodError(f"unknown drafting method {name!r}; headstart knows {', '.join(_BY_NAME)}")
    return method


for _builtin in (MEDUSA, EAGLE, EAGLE3, DFLASH, DSPARK):
    register(_builtin)
