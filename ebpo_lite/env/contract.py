"""The user's side of tool use: TRL 1.16's contract, so an environment written for TRL runs here.

- `env.factory: module:Class` (or the class itself through the Python API): built with no
  arguments, one instance per episode. `reset(**columns)` gets the example's columns and returns
  `str | None`, appended to the prompt (the last user message of a chat prompt); every other
  public method is a tool; an optional `get_reward()` makes the environment a reward source.
  A dict `{name: module:Class}` picks the class by each example's `environment` column.
- `env.tools: [module:function, ...]`: plain tools without state, offered in every episode.
- A tool's JSON schema is transformers' `get_json_schema` of the bound method or function (type
  hints and a Google-style docstring), exactly what TRL renders; a tool it cannot describe is one
  line before the model loads.

Modules are found on the Python path and in the recipe's folder. Everything here runs in the
trainer at set-up; the tools themselves run contained (`host.py`).
"""

from __future__ import annotations

import importlib
import inspect
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ebpo_lite.errors import ConfigError

ENV_COLUMN = "environment"  # the column that names an example's environment (TRL's)


@dataclass
class ToolSetup:
    """A run's environments and tools, resolved. `factories` maps an environment name (None: the
    single unnamed one) to its class; `schemas` each name to the JSON schemas of its tools (its
    methods, then the plain tools); `first_params` each tool name to its first parameter."""

    factories: dict[str | None, type] = field(default_factory=dict)
    tools: list[Any] = field(default_factory=list)
    schemas: dict[str | None, list[dict]] = field(default_factory=dict)
    first_params: dict[str, str | None] = field(default_factory=dict)
    rewarded: dict[str | None, bool] = field(default_factory=dict)  # has get_reward

    @property
    def names(self) -> list[str | None]:
        return list(self.schemas)

    def tool_names(self, env: str | None) -> list[str]:
        return [s["function"]["name"] for s in self.schemas[env]]


def load(
    factory: Any = None,
    tools: list[Any] | tuple = (),
    recipe_dir: str | Path | None = None,
) -> ToolSetup | None:
    """Resolve `env.factory` / `env.tools` (targets or objects); None when neither is set.
    Every mistake is a one-line ConfigError naming the key."""
    if not factory and not tools:
        return None
    if recipe_dir is not None and str(recipe_dir) not in sys.path:
        sys.path.append(str(recipe_dir))  # after the Python path: an installed module wins
    named = factory if isinstance(factory, dict) else ({None: factory} if factory else {})
    setup = ToolSetup()
    setup.tools = [resolve(t, f"env.tools[{i}]", want="function") for i, t in enumerate(tools)]
    plain = [schema_of(fn, f"env.tools[{i}]") for i, fn in enumerate(setup.tools)]
    for name, target in named.items():
        key = "env.factory" if name is None else f"env.factory.{name}"
        cls = resolve(target, key, want="class")
        methods = public_methods(cls, key)
        instance_methods = [schema_of(getattr(cls, m), f"{key} ({m})", bound=True) for m in methods]
        setup.factories[name] = cls
        setup.schemas[name] = instance_methods + plain
        setup.rewarded[name] = callable(getattr(cls, "get_reward", None))
    if not named:
        setup.schemas[None] = plain
        setup.rewarded[None] = False
    for name, schemas in setup.schemas.items():
        seen: set[str] = set()
        for s in schemas:
            tool = s["function"]["name"]
            if tool in seen:
                where = "env.tools" if name is None else f"env.factory.{name}"
                raise ConfigError(f"{where}: two tools are named {tool!r}; rename one")
            seen.add(tool)
            params = list(s["function"].get("parameters", {}).get("properties", {}))
            setup.first_params[tool] = params[0] if params else None
    return setup


def resolve(target: Any, key: str, want: str) -> Any:
    """A `module:attribute` target's object (or the object itself), checked to be a `want`."""
    if isinstance(target, str):
        module_name, colon, attr = target.partition(":")
        if not colon or not module_name or not attr:
            raise ConfigError(
                f"{key}: {target!r} is not module:{want} (e.g. my_env:{want.title()})"
            )
        try:
            module = importlib.import_module(module_name)
        except (ImportError, SyntaxError) as e:
            raise ConfigError(
                f"{key}: cannot import {module_name!r} ({type(e).__name__}: {e}); put it on the "
                "Python path or in the recipe's folder"
            ) from None
        obj = getattr(module, attr, None)
        if obj is None:
            raise ConfigError(f"{key}: {module_name} has no {attr!r}")
    else:
        obj = target
    if want == "class" and not inspect.isclass(obj):
        raise ConfigError(f"{key}: {target!r} is not a class (TRL's environment_factory is one)")
    if want == "function" and (inspect.isclass(obj) or not callable(obj)):
        raise ConfigError(f"{key}: {target!r} is not a function")
    return obj


def public_methods(cls: type, key: str) -> list[str]:
    """The tools of an environment class: its public functions besides `reset` and
    `get_reward` (read on the class, as TRL does: properties are not evaluated)."""
    names = [n for n, _ in inspect.getmembers(cls, predicate=inspect.isfunction)]
    if "reset" not in names:
        raise ConfigError(
            f"{key}: {cls.__name__} has no reset method; an environment class defines "
            "reset(self, **columns) -> str | None"
        )
    return [n for n in names if not n.startswith("_") and n not in ("reset", "get_reward")]


def schema_of(fn: Any, key: str, bound: bool = False) -> dict:
    """transformers' `get_json_schema` of a tool (a method is described without `self`)."""
    from transformers.utils import get_json_schema

    if bound:  # an unbound method: describe it as the instance's bound method would be
        fn = _without_self(fn)
    try:
        return get_json_schema(fn)
    except Exception as e:  # transformers' DocstringParsingException / TypeHintParsingException
        name = getattr(fn, "__name__", repr(fn))
        raise ConfigError(
            f"{key}: tool {name!r} cannot be described to the model ({type(e).__name__}: "
            f"{str(e).splitlines()[0]}); give every argument a type hint and a Google-style "
            "docstring (a summary line, then Args: with each argument)"
        ) from None


def _without_self(fn: Any) -> Any:
    """`fn` (a function defined in a class) as a bound method of a dummy instance: same name,
    docstring and hints, `self` gone, and nothing of the class is constructed."""
    import types

    return types.MethodType(fn, object())


def environment_of(setup: ToolSetup, columns: dict[str, Any], where: str) -> str | None:
    """The environment an example uses: None with one factory, else its `environment` column,
    which must name one of the dict's keys."""
    if list(setup.schemas) == [None]:
        return None
    name = columns.get(ENV_COLUMN)
    if name not in setup.schemas:
        raise ConfigError(
            f"env.factory: {where} has {ENV_COLUMN}={name!r}, not one of "
            f"{', '.join(str(n) for n in setup.schemas)}; every example names its environment "
            f"in an {ENV_COLUMN!r} column"
        )
    return name
