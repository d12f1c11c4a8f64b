"""The modules of a sharded model: one `ModuleState` each, and the generated classes whose
properties make every use of a parameter a `zerocompile::unshard` marker.

Each module holding parameters gets a generated subclass whose `weight`/`bias`/... properties
return `zerocompile::unshard(shard)`: a class property wins over `nn.Module.__getattr__`, so model
code is untouched and every use of a parameter becomes a marker in the traced graph. What those
properties, the registration guard, `no_sync` and the state-dict hooks need of a module is its
`ModuleState` (`module._zero_state`), set once by `shard()` through `install_state`. The two parts
a property reads at every use, `access` and `sync`, are bound on the module too (`_zero_access`,
`_zero_sync`): under torch.compile each attribute on the way is traced and guarded, and reading
them through the state was one more guard per module and 3% more of Dynamo's Python calls.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from zerocompile.passes.markers import UNSHARD
from zerocompile.sharded_parameters import ShardInfo, shard_info, sharded_shape

if TYPE_CHECKING:
    from zerocompile.accumulation import AccumulationSlot, GradientSync

FIX_BEFORE_SHARD = (
    "zerocompile.shard() slices each parameter once, so change the model before it (build the model "
    "again, change it, then shard it), or change values in place under "
    "`with zerocompile.gathered(model): module.weight.copy_(new)`"
)


@dataclasses.dataclass(eq=False)
class ModuleState:
    """What `shard()` recorded on one module of a sharded model (`module._zero_state`); every
    module of the model has one, those without parameters with empty dicts."""

    prefix: str  # its name in the model: what the registration guard names; its mark of a sharded model
    sync: GradientSync  # one per model: what no_sync(model) enters and exits
    shards: dict[str, nn.Parameter]  # its own parameters as shard() left them: what the properties expect
    # The property's one lookup: the sharded shape and the marker's arguments after the shard (see
    # zerocompile.passes.markers.unshard). The FQN is left out: Dynamo would guard on it, and every
    # block of a model compiled block by block (or split by graph breaks) would then compile a graph
    # of its own. The backend fills it in.
    access: dict[str, tuple[tuple[int, ...], tuple, dict[str, Any]]]
    slots: dict[str, AccumulationSlot]  # each parameter's no_sync slot, shared by every module holding it


def module_state(module: nn.Module) -> ModuleState | None:
    """`module`'s state if it belongs to a sharded model, else None (read without nn.Module's
    attribute lookup: the registration guard asks this of every module anything registers on)."""
    return module.__dict__.get("_zero_state")


def install_state(module: nn.Module, prefix: str, sync: GradientSync) -> ModuleState:
    """Record `module`'s state (its parameters already carry their shard info) and, if it holds
    parameters, give it the sharded class whose properties read that state."""
    shards = {name: param for name, param in module._parameters.items() if param is not None}
    access, slots = {}, {}
    for name, shard in shards.items():
        info = shard_info(shard)
        markers, keywords = info.marker_args(shard.dtype).call()
        access[name] = (sharded_shape(info), markers, keywords)
        slots[name] = sync.slots[info.fqn]
    state = ModuleState(prefix=prefix, sync=sync, shards=shards, access=access, slots=slots)
    module._zero_state = state
    if shards:
        module._zero_access, module._zero_sync = state.access, state.sync  # what the properties read (see above)
        module.__class__ = _sharded_class(type(module), tuple(shards))
    return state


def plain_class(module: nn.Module) -> type:
    """The class a module of the sharded class had before `shard()` (what `gathered()` swaps back
    to for its block)."""
    return type(module)._zero_plain_class


@functools.cache
def _sharded_class(cls: type, names: tuple[str, ...]) -> type:
    def make_property(name: str) -> property:
        def full_parameter(self: nn.Module) -> torch.Tensor:
            param = self._parameters.get(name)
            # What shard() recorded, in one lookup: under torch.compile every attribute this reads
            # is traced and guarded at every use of every parameter. Walking param._zero's
            # ShardInfo, config and stage policy instead was a fifth of Dynamo's work on a GPT
            # (Python calls while tracing a 12-layer one: 5.7M, 4.6M with this lookup).
            sharded, markers, keywords = self._zero_access[name]
            # Traced, testing identity with the recorded shard would make Dynamo guard that two
            # sources are one object, in a guard function of Python run at every call; `hasattr`
            # is guarded in C++, and a Parameter put in the shard's place has no shard info.
            if torch.compiler.is_compiling():
                replaced = not hasattr(param, "_zero")
            else:
                replaced = param is not self._zero_state.shards[name]
            # The shape comparison is decided while tracing (a changed shape fails a guard).
            if replaced or tuple(param.shape) != sharded:  # a removed parameter (None) is replaced too
                _raise_changed_after_shard(self._zero_state, name, param)
            if self._zero_sync.quiet:  # no no_sync copy or pending gradient: the plain marker
                return UNSHARD(param, *markers, **keywords)
            return self._zero_state.slots[name].marker(param, markers, keywords)

        return property(full_parameter, doc=f"the full `{name}`, gathered from its shards")

    attributes: dict[str, Any] = {name: make_property(name) for name in names}
    attributes["_zero_plain_class"] = cls
    return type(cls.__name__, (cls,), attributes)


def _raise_changed_after_shard(state: ModuleState, name: str, param: torch.Tensor | None) -> None:
    """The error for a parameter whose Parameter object or data changed since shard()."""
    info = shard_info(state.shards[name])
    if param is None:
        raise RuntimeError(f"parameter '{info.fqn}' was removed after zerocompile.shard(): {FIX_BEFORE_SHARD}")
    if param is not state.shards[name]:
        raise RuntimeError(
            f"parameter '{info.fqn}' was replaced after zerocompile.shard() by a new Parameter of shape "
            f"{tuple(param.shape)}, which is not sharded: {FIX_BEFORE_SHARD}"
        )
    raise RuntimeError(data_replaced_message(info, param))


def data_replaced_message(info: ShardInfo, param: torch.Tensor) -> str:
    """The error for a parameter whose data was replaced after shard() (a shape its shard never has)."""
    return (
        f"parameter '{info.fqn}' holds a tensor of shape {tuple(param.shape)}, but at stage {info.stage} "
        f"it is sharded to {sharded_shape(info)} (full shape {info.shape}): its .data was replaced after "
        f"zerocompile.shard(). {FIX_BEFORE_SHARD}"
    )
