"""A PEFT LoRA adapter on a base built on the meta device: no rank ever holds the whole base.

`zerocompile.from_pretrained(path, stage, lora=LoraConfig(...))` builds the base on meta, reads
which files hold which base tensor (by the base's own names, before PEFT renames them), attaches
the adapter with `peft.get_peft_model` still on meta, and `shard()` then fills each rank's shards:
the base's bytes straight from the files, the adapter through `adapter_init`.

The adapter's values equal what PEFT gives on the whole base with the same seed. PEFT draws them
while it attaches the adapter: for each LoRA layer in the model's order, `nn.Linear`'s own init of
`lora_A` then of `lora_B`, then `reset_lora_parameters` (A again; B zeroed). Attached on meta, none
of that draws (the tensors have no values), and `adapter_init`, which `shard()` runs module by
module in that same order from group rank 0's generator state, draws it again: same numbers, and
the generator ends where PEFT's would. The tests compare it with PEFT on the whole base.

Supported: LoRA on `nn.Linear` layers initialised by `init_lora_weights` True, False or
"gaussian". Anything else PEFT would add (DoRA and other variants, inits that read the base
weights such as PiSSA or LoftQ, `modules_to_save` copies, embedding or convolution adapters) is
refused before anything is built, naming the setting.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

_INITS = (True, False, "gaussian")


def _peft() -> Any:
    try:
        import peft
    except ImportError as error:
        raise ImportError('zerocompile.from_pretrained(..., lora=) attaches PEFT adapters and needs peft: pip install "zerocompile[hf]"') from error
    return peft


def attach_on_meta(base: nn.Module, config: Any) -> nn.Module:
    """`peft.get_peft_model(base, config)` for a `base` on the meta device: the PeftModel, its
    adapter on meta too (no values, no random numbers drawn). Refuses what `adapter_init` cannot
    initialise as PEFT would."""
    peft = _peft()
    if not isinstance(config, peft.LoraConfig):
        raise TypeError(f"lora= takes a peft.LoraConfig; got {type(config).__name__}")
    refused = {
        "use_dora": "DoRA reads the base weights to initialise its magnitudes",
        "modules_to_save": "its trainable copies of base modules would need the base's values",
        "trainable_token_indices": "its trainable rows of the embedding would need the base's values",
    }
    for setting, why in refused.items():
        if getattr(config, setting, None):
            raise ValueError(
                f"zerocompile.from_pretrained(..., lora=) does not take LoraConfig({setting}=...): {why}, which no rank "
                "holds whole on a base built on the meta device. Attach the adapter to a whole base instead "
                "(transformers' from_pretrained, get_peft_model, then ZeroTrainer or zerocompile.shard)"
            )
    if config.init_lora_weights not in _INITS:
        raise ValueError(
            f"zerocompile.from_pretrained(..., lora=) initialises adapters with init_lora_weights in {_INITS}; "
            f"{config.init_lora_weights!r} reads the base weights or the data. Attach it to a whole base instead "
            "(transformers' from_pretrained, get_peft_model, then ZeroTrainer or zerocompile.shard)"
        )
    with torch.device("meta"):
        model = peft.get_peft_model(base, config)
    for name, module in model.named_modules():
        if isinstance(module, peft.tuners.lora.LoraLayer) and type(module) is not peft.tuners.lora.Linear:
            raise ValueError(
                f"LoRA target '{name}' is a {type(module.get_base_layer()).__name__}: zerocompile.from_pretrained(..., lora=) "
                "builds adapters of nn.Linear layers only. Choose Linear target_modules, or attach the adapter to a "
                "whole base (transformers' from_pretrained, get_peft_model, then ZeroTrainer or zerocompile.shard)"
            )
    return model


def adapter_init(model: nn.Module, base_init: Callable[[nn.Module], Any]) -> Callable[[nn.Module], None]:
    """`shard(init=...)` for a PeftModel that `attach_on_meta` built: each LoRA layer's adapter
    drawn as PEFT draws it (module docstring), `base_init` for the base's modules (only those
    the files lack reach it), nothing for the adapter's own modules (their layer draws them)."""
    peft = _peft()
    layers = [module for module in model.modules() if isinstance(module, peft.tuners.lora.Linear)]
    inside_adapters = {
        inner
        for layer in layers
        for attribute in layer.adapter_layer_names
        for inner in getattr(layer, attribute).modules()
    }
    configs = model.peft_config

    def init(module: nn.Module) -> None:
        if module in inside_adapters:
            return
        if isinstance(module, peft.tuners.lora.Linear):
            for adapter in module.lora_A:
                module.lora_A[adapter].reset_parameters()
                module.lora_B[adapter].reset_parameters()
                module.reset_lora_parameters(adapter, configs[adapter].init_lora_weights)
            return
        base_init(module)

    return init
