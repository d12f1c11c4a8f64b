"""The model of --model: its MODULE:FACTORY imported and called on the meta device."""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from typing import Any, Callable

import torch
from torch import nn

from .records import PlanError


def load_factory(spec: str) -> Callable[[], Any]:
    """The callable named by MODULE:FACTORY (FACTORY may be dotted, e.g. Class.create)."""
    module_name, sep, attribute_path = spec.partition(":")
    if not sep or not module_name or not attribute_path or ":" in attribute_path:
        raise PlanError(f"--model takes MODULE:FACTORY, e.g. zerocompile.tools.gpt:GPT; got {spec!r}")
    # As `python -m` would: a user's mymodels.py in the working directory is importable.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name == module_name or module_name.startswith(f"{error.name}."):
            raise PlanError(
                f"cannot import module {module_name!r} of --model {spec}: no module named {error.name!r}. "
                f"Run from the directory holding it, add that directory to PYTHONPATH, or install its package"
            ) from None
        raise PlanError(
            f"importing module {module_name!r} of --model {spec} failed: it imports {error.name!r}, which is "
            "not installed; install it"
        ) from None
    target: Any = module
    for name in attribute_path.split("."):
        if not hasattr(target, name):
            callables = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
            raise PlanError(
                f"module {module_name!r} has no {attribute_path!r} (from --model {spec}); its callables: "
                f"{', '.join(callables) or 'none'}"
            )
        target = getattr(target, name)
    if not callable(target):
        raise PlanError(f"--model {spec} names a {type(target).__name__}, not a callable returning an nn.Module")
    _check_takes_no_arguments(target, spec)
    return target


def _check_takes_no_arguments(factory: Callable[..., Any], spec: str) -> None:
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # some builtins have no signature: calling will tell
        return
    required = [
        name
        for name, parameter in signature.parameters.items()
        if parameter.default is inspect.Parameter.empty
        and parameter.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]
    if required:
        raise PlanError(
            f"--model {spec} needs arguments ({', '.join(required)}), but plan calls it with none: "
            f"wrap it in a function, e.g. def make_model(): return {spec.partition(':')[2]}(...)"
        )


def build_on_meta(factory: Callable[[], Any], spec: str) -> nn.Module:
    """Call the factory with the meta device as default: shapes and dtypes, no storage."""
    with torch.device("meta"):
        model = factory()
    if not isinstance(model, nn.Module):
        raise PlanError(f"--model {spec} returned a {type(model).__name__}, not a torch.nn.Module")
    allocated = [name for name, tensor in [*model.named_parameters(), *model.named_buffers()] if not tensor.is_meta]
    if allocated:
        print(
            f"zerocompile plan: note: {spec} put {allocated[:3]} on a real device despite the meta default "
            "(an explicit device= argument); they were allocated, the counts are unaffected",
            file=sys.stderr,
        )
    return model
