"""Full model weights in Hugging Face's safetensors layout, streamed to and from sharded models.

`load_weights(model, path)` fills a sharded model from what `save_pretrained` (or `save_weights`)
wrote. A shard is a flat range of its row-major parameter, and a flat range is a run of contiguous
bytes in the file: each rank reads only that run, through the `safetensors` library's lazy slices
(the tail of a row, whole rows, the head of a row; recursively in the trailing dimensions), so no
rank ever holds a full tensor it does not own. Every file header and shape is checked before the
first value is read, so a bad file or a model of other sizes fails with the model unchanged; the
checks read the same files on every rank and decide the same, and loading needs no collective.
`file_readers` makes the same checks for `shard(model, weights=path)` on a meta-built model, and
gives the walk of `meta_init` the same reads, each into a new tensor of this rank's part.

`save_weights(model, path)` writes the same layout back. Group rank 0 writes; it streams one
tensor at a time, receiving a sharded parameter shard by shard (point to point, unpadded) and
writing each as it arrives, so its memory rises by at most one shard. The safetensors format is
written by hand here because the library's writer wants every tensor in memory at once. Files
appear under their final names only when complete (written beside, then renamed), the index last.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import os
import re
import struct
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, NamedTuple

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from torch import nn
from torch.distributed import distributed_c10d as c10d

from zerocompile.checkpoint import parameter_names, unwrap_model
from zerocompile.checkpoint_files import SAFETENSORS_DTYPES, fsync_directory, write_json
from zerocompile.meta_init import PartReader
from zerocompile.offload import full_precision, master_written
from zerocompile.sharded_parameters import ShardInfo, is_sharded, shard_info
from zerocompile.state_dicts import persistent_buffers

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
# Hugging Face's convention for max_shard_size: decimal units, binary ones with an "i".
_SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_SIZE_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})
_LISTED = 20  # names shown in an error before "... and N more"


class LoadResult(NamedTuple):
    """What `load_weights(..., strict=False)` could not match, as torch's `load_state_dict` reports it."""

    missing_keys: list[str]
    unexpected_keys: list[str]


@dataclasses.dataclass(frozen=True)
class _ModelTensor:
    """A distinct parameter (under every name it has) or a persistent buffer, as this rank holds it."""

    names: tuple[str, ...]
    tensor: torch.Tensor  # this rank's shard (its master weights where offload keeps them), or the whole tensor
    info: ShardInfo | None

    @property
    def name(self) -> str:
        return self.names[0]  # a tied parameter's first name: the one `shard()` records as its FQN

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.info.shape) if self.info is not None else tuple(self.tensor.shape)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.tensor.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class _Stored:
    """A tensor in a safetensors file, not yet read."""

    name: str
    file: Path
    shape: tuple[int, ...]


def _model_tensors(model: nn.Module) -> list[_ModelTensor]:
    params = parameter_names(model)
    tensors = [_ModelTensor(names, full_precision(param), shard_info(param)) for param, names in params.items()]
    tensors += [_ModelTensor((name,), buffer, None) for name, buffer in persistent_buffers(model, params).items()]
    return tensors


def _listed(names: list[str]) -> str:
    shown = ", ".join(f"'{name}'" for name in names[:_LISTED])
    return shown + (f" ... and {len(names) - _LISTED} more" if len(names) > _LISTED else "")


# ---------------------------------------------------------------------------------------------
# Loading


def load_weights(model: nn.Module, path: str | os.PathLike, strict: bool = True) -> LoadResult | None:
    """Load full weights in Hugging Face's safetensors layout into `model`, sharded or not.

    `path` is a `.safetensors` file, or a directory holding `model.safetensors` or
    `model.safetensors.index.json` with its numbered files (what `save_pretrained` writes). Each
    rank reads only the bytes of its own shards; values are cast to the parameters' dtype and
    device. Names are checked as `load_state_dict` checks them (a tied parameter is loaded from
    any one of its names): with `strict`, missing or unexpected names raise; without, they are
    returned as a `LoadResult`. A damaged file or a wrong shape raises before anything changes.
    Needs no collective: each rank may call it on its own.
    """
    model = unwrap_model(model)
    targets = _model_tensors(model)
    with contextlib.ExitStack() as opened:
        stored = _stored_tensors(Path(path), opened)
        pairs, missing, unexpected = _match(targets, stored)
        _check_shapes(pairs)
        if strict and (missing or unexpected):
            raise RuntimeError(_names_mismatch(Path(path), type(model).__name__, missing, unexpected, len(pairs)))
        with torch.no_grad():
            for target, source in pairs:
                _read_into(target, source)
    for param in parameter_names(model):
        master_written(param)
    return None if strict else LoadResult(missing, unexpected)


def file_readers(model: nn.Module, path: str | os.PathLike, *, strict: bool = True) -> dict[torch.Tensor, PartReader]:
    """For `shard(model, weights=path)` on a meta-built model: each tensor of `model` the files at
    `path` hold (a parameter under any of its names, a persistent buffer), with a function reading
    this rank's part of it. Checked as `load_weights` checks, from headers, nothing read: a damaged
    file or a wrong shape raises; names the model lacks raise with `strict`; tensors the files lack
    are left to `init`. Files that hold none of the model's tensors raise: another model's weights.
    """
    targets = _model_tensors(model)
    with contextlib.ExitStack() as opened:
        stored = _stored_tensors(Path(path), opened)
    pairs, missing, unexpected = _match(targets, stored)
    _check_shapes(pairs)
    if not pairs:
        raise RuntimeError(_names_mismatch(Path(path), type(model).__name__, missing, unexpected, 0, _OTHER_MODEL_ADVICE))
    if strict and unexpected:
        raise RuntimeError(_names_mismatch(Path(path), type(model).__name__, [], unexpected, len(pairs), _SHARD_ADVICE))
    return {target.tensor: functools.partial(_read_part, source, target.shape, target.tensor.dtype) for target, source in pairs}


def _read_part(
    source: _Stored, shape: tuple[int, ...], dtype: torch.dtype, shard_numel: int | None, rank: int, device: torch.device
) -> torch.Tensor:
    """`source` read into a new tensor of `dtype` on `device`: whole (`shard_numel` None), or the
    padded flat shard of `shard_numel` elements that group rank `rank` holds."""
    if shard_numel is None:
        whole = torch.empty(shape, dtype=dtype, device=device)
        _read_whole(whole, source)
        return whole
    flat = torch.empty(shard_numel, dtype=dtype, device=device)
    _read_flat_range(flat, source, shape, rank * shard_numel)
    return flat


def _stored_tensors(path: Path, opened: contextlib.ExitStack) -> dict[str, _Stored]:
    """Every tensor `path` holds, by name, from headers only; a file that cannot be read raises."""
    if path.is_dir() and (path / SINGLE_FILE).is_file():
        path = path / SINGLE_FILE  # preferred over an index, as `from_pretrained` prefers it
    if path.is_file():
        handle = _open(path, opened)
        return {name: _Stored(name, path, _shape(handle, name)) for name in handle.keys()}
    if (path / INDEX_FILE).is_file():
        return _indexed_tensors(path / INDEX_FILE, opened)
    if path.is_dir():
        raise FileNotFoundError(
            f"{path} holds neither {SINGLE_FILE} nor {INDEX_FILE}: pass the directory save_pretrained() or "
            "zerocompile.save_weights() wrote, or a .safetensors file"
        )
    raise FileNotFoundError(f"no weights at {path}: no such file or directory")


def weights_record(path: str | os.PathLike) -> dict[str, str]:
    """Which weights `path` holds, for checkpoints of what was trained on them: the path and the
    SHA-256 of the index (or of a single file's header): their names, shapes, dtypes and files.
    It tells another model or another save layout apart, not other values of the same layout."""
    path = Path(path).absolute()
    if path.is_dir() and (path / SINGLE_FILE).is_file():
        path = path / SINGLE_FILE
    if path.is_file():
        with open(path, "rb") as file:
            (length,) = struct.unpack("<Q", file.read(8))
            described = file.read(length)
    else:
        described = (path / INDEX_FILE).read_bytes()
    return {"path": str(path), "digest": hashlib.sha256(described).hexdigest()}


def _open(file: Path, opened: contextlib.ExitStack) -> Any:
    try:
        return opened.enter_context(safe_open(str(file), framework="pt"))
    except SafetensorError as error:
        raise ValueError(
            f"{file} is not a readable safetensors file ({error}): it is truncated, damaged or of another "
            "format (a torch.save pickle is not read). Save the weights again with save_pretrained() or "
            "zerocompile.save_weights()"
        ) from None


def _shape(handle: Any, name: str) -> tuple[int, ...]:
    return tuple(handle.get_slice(name).get_shape())  # from the header; nothing is read


def _indexed_tensors(index: Path, opened: contextlib.ExitStack) -> dict[str, _Stored]:
    weight_map = _weight_map(index)
    by_file: dict[Path, list[str]] = {}
    for name, file in weight_map.items():
        by_file.setdefault(index.parent / file, []).append(name)
    for file, names in sorted(by_file.items()):
        if not file.is_file():
            raise FileNotFoundError(
                f"{index} places {_listed(names)} in {file.name}, which does not exist in {index.parent}: the "
                "save was interrupted or the file was not copied. Copy it there, or save the weights again"
            )
    stored = {}
    for file, names in sorted(by_file.items()):
        handle = _open(file, opened)
        held = set(handle.keys())
        absent = [name for name in names if name not in held]
        if absent:
            raise ValueError(
                f"{index} places {_listed(absent)} in {file}, which does not hold them: the index and its "
                "files come from different saves. Save the weights again"
            )
        stored.update({name: _Stored(name, file, _shape(handle, name)) for name in names})
    return stored


def _weight_map(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        weight_map = None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise ValueError(
            f"{index} is not a Hugging Face weight index (JSON whose \"weight_map\" maps tensor names to "
            "files): save the weights again"
        )
    return weight_map


def _match(
    targets: list[_ModelTensor], stored: dict[str, _Stored]
) -> tuple[list[tuple[_ModelTensor, _Stored]], list[str], list[str]]:
    """Each model tensor with the stored tensor it loads from; missing and unexpected names."""
    pairs, missing = [], []
    for target in targets:
        source = next((stored[name] for name in target.names if name in stored), None)
        if source is None:
            missing.extend(target.names)
        else:
            pairs.append((target, source))
    known = {name for target in targets for name in target.names}
    return pairs, missing, [name for name in stored if name not in known]


def _check_shapes(pairs: list[tuple[_ModelTensor, _Stored]]) -> None:
    wrong = [
        f"'{source.name}' is {list(source.shape)} in {source.file} but {list(target.shape)} in the model"
        for target, source in pairs
        if source.shape != target.shape
    ]
    if wrong:
        raise RuntimeError(
            f"size mismatch: {'; '.join(wrong)}. These are the weights of a model of other sizes: load "
            "weights saved from this architecture and configuration"
        )


_LOAD_ADVICE = (
    "Load weights saved from this model, or pass strict=False to load the tensors whose names match "
    "and get the missing and unexpected keys back"
)
_OTHER_MODEL_ADVICE = "Pass the weights of this model"
_SHARD_ADVICE = (
    "Load weights saved from this model (tensors they lack are left to init), or pass weights_strict=False "
    "to shard() to ignore the names the model lacks (as from_pretrained ignores the head of another task)"
)


def _names_mismatch(
    path: Path, model: str, missing: list[str], unexpected: list[str], matched: int, advice: str = _LOAD_ADVICE
) -> str:
    found = []
    if missing:
        found.append(f"missing keys {_listed(missing)}")
    if unexpected:
        found.append(f"unexpected keys {_listed(unexpected)}")
    if not matched:
        advice = (
            "None of the model's tensors is in it: it holds the weights of another model (or its names "
            f"carry another prefix). {advice}"
        )
    return f"cannot load {path} into {model}: {'; '.join(found)}. {advice}"


def _read_into(target: _ModelTensor, source: _Stored) -> None:
    """Copy `source`'s part that this rank holds into `target` (cast to its dtype and device).

    The file is mapped afresh for each tensor: the pages a read touches count as this rank's
    resident memory for as long as their mapping lives, so one mapping for the whole load held
    every byte this rank read on top of the shards it read them into (200m GPT, 2 ranks: +465 MB
    of file pages at the peak, measured 2026-11-25).
    """
    info = target.info
    if is_sharded(info):
        _read_flat_range(target.tensor.view(-1), source, info.shape, info.shard_offset)
    else:
        _read_whole(target.tensor, source)


def _read_whole(tensor: torch.Tensor, source: _Stored) -> None:
    with safe_open(str(source.file), framework="pt") as handle:
        tensor.copy_(handle.get_tensor(source.name))


def _read_flat_range(flat: torch.Tensor, source: _Stored, shape: tuple[int, ...], start: int) -> None:
    """`flat` filled from the elements of `source` (of `shape`, row-major) from `start` on; where
    `flat` reaches past the tensor's last element it is padding, zeroed as shard() leaves it."""
    valid = max(0, min(flat.numel(), math.prod(shape) - start))
    position = 0
    with safe_open(str(source.file), framework="pt") as handle:
        for piece in _flat_range(handle.get_slice(source.name), shape, start, start + valid):
            flat[position : position + piece.numel()].copy_(piece)
            position += piece.numel()
    flat[position:].zero_()


def _flat_range(
    stored: Any, shape: tuple[int, ...], begin: int, end: int, index: tuple[int, ...] = ()
) -> Iterator[torch.Tensor]:
    """Elements [begin, end) of the row-major tensor `stored[index]` of `shape`, as 1-D pieces.

    A flat range is the tail of one row, whole rows, and the head of another row; a partial row is
    a flat range of the next dimension down. Each piece is one read of exactly its bytes, and there
    are at most two per dimension.
    """
    if begin >= end:
        return
    row = math.prod(shape[1:])
    first, head = divmod(begin, row)
    last, tail = divmod(end, row)
    if first == last:  # inside one row
        yield from _flat_range(stored, shape[1:], head, tail, (*index, first))
        return
    if head:
        yield from _flat_range(stored, shape[1:], head, row, (*index, first))
        first += 1
    if first < last:
        yield stored[(*index, slice(first, last))].reshape(-1)
    if tail:
        yield from _flat_range(stored, shape[1:], 0, tail, (*index, last))


# ---------------------------------------------------------------------------------------------
# Saving


@dataclasses.dataclass(frozen=True)
class _File:
    name: str
    tensors: tuple[_ModelTensor, ...]


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where a save's tensors go: the files (in a directory) and, when there are several, an index."""

    directory: Path
    files: tuple[_File, ...]
    in_directory: bool  # model.safetensors or numbered files, rather than a file the caller named
    sharded: bool  # numbered files and an index


def save_weights(model: nn.Module, path: str | os.PathLike, max_shard_size: int | str = "5GB") -> None:
    """Write `model`'s full weights as Hugging Face does; every rank of its group calls it.

    `path` ending in `.safetensors` is one file; otherwise a directory gets `model.safetensors`,
    or, past `max_shard_size` bytes of tensors (an int, or "500MB", "2GiB": GB = 10^9, GiB = 2^30),
    numbered files and `model.safetensors.index.json`. Each parameter is written once, under its
    first name (tied ones as `save_pretrained` does); persistent buffers too. Group rank 0 writes,
    one tensor at a time; files appear only when complete, and a previous save's files there
    are replaced. With hybrid sharding only the first replica's shard group takes part, and the
    other replicas wait for its outcome. On return the files exist for every rank (on a shared
    file system).
    """
    model = unwrap_model(model)
    limit = _parse_size(max_shard_size)
    tensors = _model_tensors(model)
    _check_dtypes(tensors)
    group = _group(tensors)
    replicas = _replica_group(tensors)
    layout = _layout(Path(path), tensors, limit)
    error = None
    if replicas is None or dist.get_rank(replicas) == 0:
        try:
            _write(layout, tensors, group, Path(path))
        except Exception as caught:  # re-raised below, once the other replicas have heard of it
            if replicas is None:
                raise
            error = caught
    if replicas is not None:
        _agree(error, replicas, Path(path))


def _write(layout: _Layout, tensors: list[_ModelTensor], group: dist.ProcessGroup | None, path: Path) -> None:
    writer = _Writer(layout, writing=group is None or dist.get_rank(group) == 0)
    for file in layout.files:
        writer.attempt(writer.begin, file)
        for tensor in file.tensors:
            for piece in _pieces(tensor, group):
                writer.attempt(writer.write, piece)
        writer.attempt(writer.end)
    writer.attempt(writer.publish)
    if writer.error is not None:
        writer.discard()
    _agree(writer.error, group, path)


def _parse_size(size: int | str) -> int:
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)\s*", size.upper()) if isinstance(size, str) else None
    if match is None or float(match[1]) <= 0:
        raise ValueError(
            f"max_shard_size must be a positive number of bytes, as an int or a string such as \"500MB\" or "
            f"\"2GiB\" (GB = 10^9 bytes, GiB = 2^30), got {size!r}"
        )
    return int(float(match[1]) * _SIZE_UNITS[match[2]])


def _check_dtypes(tensors: list[_ModelTensor]) -> None:
    unsupported = [f"'{t.name}' ({t.tensor.dtype})" for t in tensors if t.tensor.dtype not in SAFETENSORS_DTYPES]
    if unsupported:
        raise TypeError(
            f"save_weights cannot write {', '.join(unsupported)}: it writes the dtypes "
            f"{sorted(str(d) for d in SAFETENSORS_DTYPES)}. Cast them (model.to(dtype)) first"
        )


def _group(tensors: list[_ModelTensor]) -> dist.ProcessGroup | None:
    """The group whose rank 0 writes: the one the model is sharded over (the world for a replicated
    model in a distributed run); None without torch.distributed, when this process writes alone."""
    groups = {t.info.group_name: t.name for t in tensors if t.info is not None}
    if len(groups) > 1:
        named = ", ".join(f"'{name}' over {group}" for group, name in sorted(groups.items()))
        raise ValueError(
            f"the model is sharded over several process groups ({named}): save_weights writes a model "
            "sharded over one group. Save each part's modules with save_weights on its own group"
        )
    if groups:
        return c10d._resolve_process_group(next(iter(groups)))
    return dist.group.WORLD if dist.is_initialized() else None


def _replica_group(tensors: list[_ModelTensor]) -> dist.ProcessGroup | None:
    """Hybrid sharding's replica group (every shard group holds the whole model), else None."""
    names = {t.info.replica_group_name for t in tensors if t.info is not None and t.info.replicas > 1}
    return c10d._resolve_process_group(next(iter(names))) if names else None


def _layout(path: Path, tensors: list[_ModelTensor], limit: int) -> _Layout:
    if path.name.endswith(".safetensors"):
        return _Layout(path.parent, (_File(path.name, tuple(tensors)),), in_directory=False, sharded=False)
    groups = _split(tensors, limit)
    if len(groups) == 1:
        return _Layout(path, (_File(SINGLE_FILE, groups[0]),), in_directory=True, sharded=False)
    files = tuple(_File(f"model-{i:05d}-of-{len(groups):05d}.safetensors", g) for i, g in enumerate(groups, 1))
    return _Layout(path, files, in_directory=True, sharded=True)


def _split(tensors: list[_ModelTensor], limit: int) -> list[tuple[_ModelTensor, ...]]:
    """Split as Hugging Face does, keeping the tensors' order: a new file when the next tensor would
    take this one past `limit`; a tensor larger than `limit` is a file of its own."""
    groups: list[list[_ModelTensor]] = [[]]
    size = 0
    for tensor in tensors:
        if groups[-1] and size + tensor.nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(tensor)
        size += tensor.nbytes
    return [tuple(group) for group in groups]


def _pieces(tensor: _ModelTensor, group: dist.ProcessGroup | None) -> Iterator[torch.Tensor]:
    """On the writing rank, `tensor`'s values in row-major order as 1-D pieces; the others send
    their part and yield nothing.

    A sharded parameter arrives shard by shard, each received only after the previous one was
    written, without its padding: the writer holds one shard at a time, the senders nothing extra.
    (`dist.gather` would hold the whole tensor, twice on gloo, which gathers into a staging buffer
    and copies out.)
    """
    rank = 0 if group is None else dist.get_rank(group)
    local = tensor.tensor.detach()
    if not is_sharded(tensor.info):
        if rank == 0:
            yield local.reshape(-1)
        return
    for source in range(dist.get_world_size(group)):
        numel = dataclasses.replace(tensor.info, group_rank=source).valid_numel
        if not numel or rank not in (0, source):
            continue
        if rank == source == 0:
            yield local[:numel]
        elif rank == source:
            dist.send(local[:numel], group=group, group_dst=0)
        else:
            received = torch.empty(numel, dtype=local.dtype, device=local.device)
            dist.recv(received, group=group, group_src=source)
            yield received


class _Writer:
    """The files of one save, on the writing rank (on the others every step does nothing).

    A failure (a full disk, say) is kept, not raised, until the save's end: raised mid-stream, it
    would leave the other ranks blocked sending shards nobody receives.
    """

    def __init__(self, layout: _Layout, writing: bool) -> None:
        self.layout = layout
        self.writing = writing
        self.error: Exception | None = None
        self._out: BinaryIO | None = None
        self._partial: list[Path] = []

    def attempt(self, step: Callable[..., None], *args: Any) -> None:
        if self.writing and self.error is None:
            try:
                step(*args)
            except Exception as error:  # raised by save_weights once every rank has finished sending
                self.error = error

    def begin(self, file: _File) -> None:
        self.layout.directory.mkdir(parents=True, exist_ok=True)
        partial = _partial(self.layout.directory / file.name)
        self._partial.append(partial)
        self._out = open(partial, "wb")
        self._out.write(_header(file.tensors))

    def write(self, piece: torch.Tensor) -> None:
        # The tensor's own bytes, no copy on the CPU: a uint8 view's buffer.
        self._out.write(piece.cpu().view(torch.uint8).numpy().data)

    def end(self) -> None:
        self._out.flush()
        os.fsync(self._out.fileno())
        self._out.close()
        self._out = None

    def publish(self) -> None:
        """Rename the complete files into place. A previous save's files that a loader could pair with
        the new ones or prefer to them (its index, its single file, its other numbered files) go."""
        layout, directory = self.layout, self.layout.directory
        if layout.sharded:
            # Before any numbered file is replaced: the old index would pair new files with old ones,
            # and an old model.safetensors would be loaded instead of the new index.
            (directory / INDEX_FILE).unlink(missing_ok=True)
            (directory / SINGLE_FILE).unlink(missing_ok=True)
        for file in layout.files:
            os.replace(_partial(directory / file.name), directory / file.name)
        if layout.sharded:
            index = _partial(directory / INDEX_FILE)
            self._partial.append(index)
            write_json(index, _index(layout))
            os.replace(index, directory / INDEX_FILE)
        elif layout.in_directory:
            (directory / INDEX_FILE).unlink(missing_ok=True)
        if layout.in_directory:
            written = {file.name for file in layout.files}
            for stale in directory.iterdir():
                if _SHARD_FILE.fullmatch(stale.name) and stale.name not in written:
                    stale.unlink()
        fsync_directory(directory)

    def discard(self) -> None:
        """Remove what a failed save left under temporary names."""
        if self._out is not None:
            self._out.close()
        for partial in self._partial:
            partial.unlink(missing_ok=True)


def _partial(final: Path) -> Path:
    return final.with_name(f".{final.name}.partial")


def _header(tensors: tuple[_ModelTensor, ...]) -> bytes:
    """The safetensors header: its length (8 bytes, little-endian), then JSON naming each tensor's
    dtype, shape and byte range in the data, padded with spaces so the data is 8-byte aligned."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    position = 0
    for tensor in tensors:
        end = position + tensor.nbytes
        header[tensor.name] = {
            "dtype": SAFETENSORS_DTYPES[tensor.tensor.dtype], "shape": list(tensor.shape), "data_offsets": [position, end]
        }
        position = end
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded


def _index(layout: _Layout) -> dict[str, Any]:
    return {
        "metadata": {"total_size": sum(t.nbytes for file in layout.files for t in file.tensors)},
        "weight_map": {t.name: file.name for file in layout.files for t in file.tensors},
    }


def _agree(error: Exception | None, group: dist.ProcessGroup | None, path: Path) -> None:
    """Group rank 0 tells the others whether it wrote everything: its failure is raised on every
    rank, and this ends the save together (the files exist when any rank returns)."""
    if group is not None:
        outcome = [None if error is None else f"{type(error).__name__}: {error}"]
        dist.broadcast_object_list(outcome, group=group, group_src=0)
        if error is None and outcome[0] is not None:
            raise RuntimeError(f"group rank 0 failed to write the weights to {path}: {outcome[0]}")
    if error is not None:
        raise error
