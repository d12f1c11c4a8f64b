"""`zc.from_pretrained(path, stage)`: a Hugging Face model from a `save_pretrained` directory, built
on the meta device and filled straight into this rank's shards.

The one-line form of: `AutoConfig.from_pretrained(path)`, `from_config` under `torch.device("meta")`
(no rank holds the model), then `shard(model, stage, init=model._init_weights, weights=path)`, which
reads each rank's bytes of every tensor the files hold and runs the model's own init only for what
they lack (a new task head). Then what `from_pretrained` does after loading: the generation config
of the directory, and eval mode. transformers is imported here only, when called.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zerocompile.lora import adapter_init, attach_on_meta
from zerocompile.sharding import shard
from zerocompile.weights import file_readers, weights_record

_GENERATION_CONFIG = "generation_config.json"


def from_pretrained(
    path: str | os.PathLike,
    stage: int = 3,
    *,
    model_class: Any = None,
    config: Any = None,
    lora: Any = None,
    **shard_settings: Any,
) -> nn.Module:
    """A sharded Hugging Face model holding the weights `save_pretrained` wrote to `path`.

    Every rank of the group calls it. `model_class` is a transformers Auto class or model class
    (default `AutoModelForCausalLM`); `config` replaces `AutoConfig.from_pretrained(path)` (e.g.
    `AutoConfig.from_pretrained(path, num_labels=3)` for a classification head). `shard_settings`
    go to `zerocompile.shard` (`group=`, `param_dtype=`, ...). As `from_pretrained`, names in the
    files the model lacks (another task's head) are ignored (`weights_strict=True` refuses them),
    tensors the files lack get the model's `_init_weights`, and the model is returned in eval mode.
    `path` is a local directory: download a Hub model first (`huggingface_hub.snapshot_download`).

    `lora`: a `peft.LoraConfig`. The model returned is then PEFT's model (`get_peft_model`) of the
    sharded base, built as the base is: no rank holds the base whole, its frozen parameters get
    no gradient and no optimizer state, and the adapter holds the values PEFT would give it on the
    whole base with the same seed (`zerocompile.lora` says what is supported).
    """
    transformers = _transformers()
    directory = Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(
            f"zerocompile.from_pretrained reads a local directory that save_pretrained() wrote; {directory} is not "
            "one. For a model on the Hugging Face Hub, download it first: "
            "huggingface_hub.snapshot_download(repo_id) returns such a directory"
        )
    config = config if config is not None else transformers.AutoConfig.from_pretrained(directory)
    model_class = model_class if model_class is not None else transformers.AutoModelForCausalLM
    # Auto classes build through from_config; model classes through the _from_config it calls.
    build = getattr(model_class, "from_config", None) or model_class._from_config
    with torch.device("meta"):
        base = build(config)
    weights, init, model = directory, base._init_weights, base
    if lora is not None:
        # The files name the base's tensors as the base names them, before PEFT's wrappers do.
        weights = file_readers(base, directory, strict=shard_settings.get("weights_strict", False))
        model = attach_on_meta(base, lora)
        init = adapter_init(model, base._init_weights)
    shard(model, stage, init=init, weights=weights, **{"weights_strict": False, **shard_settings})
    model._zero_base = weights_record(directory)  # what checkpoints of its trainable part were trained on
    _as_from_pretrained_leaves_it(base, model, directory, transformers)
    return model


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as error:
        raise ImportError(
            'zerocompile.from_pretrained builds Hugging Face models and needs transformers: pip install "zerocompile[hf]"'
        ) from error
    return transformers


def _as_from_pretrained_leaves_it(base: nn.Module, model: nn.Module, directory: Path, transformers: Any) -> None:
    """What `from_pretrained` does after loading besides the weights: the directory's generation
    settings on the transformers model `base` (from_config derives them from the model config
    alone), and eval mode for `model` (`base`, or the PEFT model around it)."""
    if base.can_generate() and (directory / _GENERATION_CONFIG).is_file():
        base.generation_config = transformers.GenerationConfig.from_pretrained(directory)
    model.eval()
