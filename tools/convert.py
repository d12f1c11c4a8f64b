"""Write a checkpoint's full weights to one file, offline: no process group, no ranks.

  zerocompile convert CKPT_DIR OUT [--format safetensors|torch] [--ema]

Reads a checkpoint written by zerocompile.save() at any stage and world size. A full parameter is
its flat chunks (one per saving rank, at the offsets DCP records in each file's header) laid end
to end, so it is copied from the shard files into OUT in blocks of 8 MiB: memory stays at one
block, whatever the size of the tensors or of the model. Names are the model's own, without
torch.compile's or DDP's wrapper prefixes; buffers come along. OUT is written beside and renamed
when complete.

  --format safetensors (default): tied parameters are stored once, under their first name; the
      header's metadata entry "zerocompile.tied" (JSON) maps each other name to it. Load with
      safetensors.torch.load_file and model.load_state_dict(sd, strict=False) (the missing tied
      names are loaded through their first name), or add the tied names first for strict=True.
  --format torch: a torch.save file whose tied names share one tensor (stored once): load with
      torch.load(OUT, weights_only=True) and model.load_state_dict(sd, strict=True).
  --ema: the checkpoint's EMA averages in place of the parameters.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import struct
from pathlib import Path
from typing import BinaryIO

import torch
from torch.distributed.checkpoint._hf_utils import CUSTOM_METADATA_KEY, SAVED_OFFSETS_KEY

from zerocompile import checkpoint_files as files
from zerocompile.checkpoint_files import SAFETENSORS_DTYPES

BLOCK_BYTES = 8 * 2**20
FORMATS = ("safetensors", "torch")


@dataclasses.dataclass(frozen=True)
class Chunk:
    """A contiguous run of a saved tensor's elements inside one shard file."""

    path: Path
    start: int  # file offset of its first byte
    offset: int  # index of its first element in the flat tensor
    numel: int
    nbytes: int
    dtype: str  # safetensors dtype name


@dataclasses.dataclass(frozen=True)
class Entry:
    """One tensor of the output: its names (tied ones share it), shape, dtype and chunks."""

    names: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: tuple[Chunk, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CKPT_DIR", help="directory written by zerocompile.save()")
    parser.add_argument("out", metavar="OUT", help="file to write")
    parser.add_argument("--format", choices=FORMATS, default="safetensors", help="output format (default safetensors)")
    parser.add_argument("--ema", action="store_true", help="write the EMA's averages instead of the parameters")


def run(args: argparse.Namespace) -> int:
    try:
        written = convert(args.checkpoint, args.out, args.format, ema=args.ema)
    except (files.CheckpointError, FileNotFoundError) as error:
        print(f"zerocompile convert: {error}")
        return 1
    print(f"wrote {written['tensors']} tensors, {written['bytes'] / 1e6:.1f} MB, to {args.out}")
    return 0


def convert(checkpoint: str | os.PathLike, out: str | os.PathLike, format: str = "safetensors", ema: bool = False) -> dict[str, int]:
    """Write the full weights of `checkpoint` to `out`; returns the tensor and byte counts."""
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    directory = files.resolve(checkpoint)
    metadata = files.read_metadata(directory)
    files.check_files(directory, metadata, slice(None))  # no ranks to share the hashing with
    entries = _entries(directory, metadata, ema)
    out = Path(out)
    partial = out.with_name(f".{out.name}.partial")
    try:
        if format == "safetensors":
            _write_safetensors(partial, entries)
        else:
            _write_torch(partial, entries, metadata["state_dict_keys"])
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, out)
    return {"tensors": len(entries), "bytes": sum(e.nbytes for e in entries)}


def _entries(directory: Path, metadata: dict, ema: bool) -> list[Entry]:
    """The output tensors in the model's order, each with its chunks checked to cover it exactly."""
    if ema and metadata.get("ema") is None:
        raise files.CheckpointError(f"{directory} holds no EMA: it was saved without ema=")
    chunks = _index_chunks(directory)
    prefix = "ema" if ema else "param"
    wanted = [(f"{prefix}.{p['names'][0]}", tuple(p["names"]), p) for p in metadata["params"]]
    wanted += [(f"buffer.{b['name']}", (b["name"],), b) for b in metadata["buffers"]]
    entries = []
    for key, names, spec in wanted:
        entry = Entry(names, tuple(spec["shape"]), files.dtype_from_name(spec["dtype"]), tuple(chunks.get(key, ())))
        _check_coverage(directory, key, entry)
        entries.append(entry)
    return entries


def _index_chunks(directory: Path) -> dict[str, list[Chunk]]:
    """Every saved tensor's chunks, from the shard files' headers (JSON; nothing is unpickled)."""
    chunks: dict[str, list[Chunk]] = {}
    for path in files.state_files(directory):
        header, data_start = files.read_safetensors_header(path)
        metadata = header.pop("__metadata__", None) or {}
        sharding = json.loads(metadata.get(CUSTOM_METADATA_KEY, "{}"))
        for key, tensor in header.items():
            offsets = sharding.get(key, {}).get(SAVED_OFFSETS_KEY) or [0]
            if len(tensor["shape"]) > 1 and any(offsets):
                raise files.CheckpointError(f"{path}: {key} is a chunk of a multi-dimensional tensor, which save() never writes")
            begin, end = tensor["data_offsets"]
            chunks.setdefault(key, []).append(
                Chunk(path, data_start + begin, offsets[0], math.prod(tensor["shape"]), end - begin, tensor["dtype"])
            )
    return chunks


def _check_coverage(directory: Path, key: str, entry: Entry) -> None:
    """The chunks must tile the flat tensor exactly, in its dtype, or the checkpoint is damaged."""
    numel, expected_dtype = math.prod(entry.shape), SAFETENSORS_DTYPES.get(entry.dtype)
    if expected_dtype is None:
        raise files.CheckpointError(f"{key} has dtype {entry.dtype}, which convert cannot write")
    position = 0
    for chunk in sorted(entry.chunks, key=lambda c: c.offset):
        if chunk.offset != position or chunk.dtype != expected_dtype or chunk.nbytes != chunk.numel * entry.dtype.itemsize:
            break
        position += chunk.numel
    if position != numel or sum(c.numel for c in entry.chunks) != numel:
        found = sorted((c.offset, c.numel, c.dtype) for c in entry.chunks)
        raise files.CheckpointError(
            f"{directory} is incomplete or damaged: {key} ({numel} elements of {entry.dtype}) has "
            f"chunks (offset, elements, dtype) {found}"
        )


def _copy_chunks(entry: Entry, out: BinaryIO, buffer: memoryview) -> None:
    for chunk in sorted(entry.chunks, key=lambda c: c.offset):
        with open(chunk.path, "rb") as source:
            source.seek(chunk.start)
            left = chunk.nbytes
            while left:
                read = source.readinto(buffer[: min(left, len(buffer))])
                if not read:
                    raise files.CheckpointError(f"{chunk.path} ends inside a tensor: the checkpoint is damaged")
                out.write(buffer[:read])
                left -= read


def _write_safetensors(path: Path, entries: list[Entry]) -> None:
    """The safetensors layout written directly (its writer needs every tensor in memory at once)."""
    header: dict = {}
    position = 0
    for entry in entries:
        header[entry.names[0]] = {
            "dtype": SAFETENSORS_DTYPES[entry.dtype],
            "shape": list(entry.shape),
            "data_offsets": [position, position + entry.nbytes],
        }
        position += entry.nbytes
    tied = {alias: entry.names[0] for entry in entries for alias in entry.names[1:]}
    header["__metadata__"] = {"format": "pt", "zerocompile.tied": json.dumps(tied)}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the format aligns the data to 8 bytes
    buffer = memoryview(bytearray(BLOCK_BYTES))
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(encoded)))
        out.write(encoded)
        for entry in entries:
            _copy_chunks(entry, out, buffer)
        out.flush()
        os.fsync(out.fileno())


def _write_torch(path: Path, entries: list[Entry], state_dict_keys: list[str]) -> None:
    """A torch.save file written in two passes: torch.save of fake tensors under `skip_data`
    lays out the archive with room for each storage, then each tensor is copied to its offset."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fakes = {entry.names[0]: torch.empty(entry.shape, dtype=entry.dtype) for entry in entries}
    primary = {name: entry.names[0] for entry in entries for name in entry.names}
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save({name: fakes[primary[name]] for name in state_dict_keys}, path)
    laid_out = torch.load(path, map_location="meta", weights_only=True)
    buffer = memoryview(bytearray(BLOCK_BYTES))
    with open(path, "r+b") as out:
        for entry in entries:
            if entry.nbytes:
                out.seek(laid_out[entry.names[0]].untyped_storage()._checkpoint_offset)
                _copy_chunks(entry, out, buffer)
        out.flush()
        os.fsync(out.fileno())
