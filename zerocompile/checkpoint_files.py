"""The on-disk layout of a zerocompile checkpoint directory, and the only code that touches it.

    CKPT/zerocompile.json                  what was saved (JSON): parameter names with their tied
                                           aliases, full shapes, dtypes, stage, world size, the
                                           optimizer's groups and state kinds, the EMA decay
    CKPT/state/shard-*.safetensors         one file per rank: DCP's Hugging Face storage format
                                           (safetensors; chunk offsets as JSON in its header)
    CKPT/extra/rank{R}.safetensors         rank R's `extra`: tensors, other values as JSON

Nothing here unpickles: JSON and safetensors only, and any other file in the directory makes it
unreadable (a planted pickle is refused, never opened). The JSON lists every data file with its
size and SHA-256, checked before anything is loaded: a truncated, corrupted or missing file is
an error naming it, never a crash inside the reader and never garbage loaded silently. Saves are written into `.CKPT.partial`
beside the target and renamed into place when complete (`publish`), so a crash leaves the
previous checkpoint intact; `resolve` finds it even if the crash fell between the two renames.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import struct
from pathlib import Path
from typing import Any

import torch

from zerocompile.user_warnings import warn_at_caller

FORMAT = "zerocompile-checkpoint"
VERSION = 2  # 2 added "files": each data file's size and SHA-256; version 1 is still read
_READABLE_VERSIONS = (1, 2)
_DIGEST_BLOCK = 8 * 2**20
METADATA = "zerocompile.json"
STATE_DIR = "state"
EXTRA_DIR = "extra"
_EXTRA_JSON_KEY = "zerocompile.extra"
_STATE_FILE = re.compile(r"shard-\d+-model-\d+-of-\d+\.safetensors")
_EXTRA_FILE = re.compile(r"rank\d+\.safetensors")
# torch dtype -> the safetensors format's name for it: the one table of them, read by every writer of
# safetensors headers and checker of their dtypes (`weights`, `zerocompile convert`).
SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be read (missing, foreign, incomplete or tampered)."""


def staging_dir(final: Path) -> Path:
    return final.parent / f".{final.name}.partial"


def previous_dir(final: Path) -> Path:
    return final.parent / f".{final.name}.previous"


def prepare_staging(final: Path) -> Path:
    """An empty staging directory for a save to `final`; a crashed save's leftovers are removed."""
    staging = staging_dir(final)
    if staging.exists():
        shutil.rmtree(staging)
    (staging / EXTRA_DIR).mkdir(parents=True)
    return staging


def publish(staging: Path, final: Path) -> None:
    """Move a complete staging directory to `final`, replacing an older checkpoint there.

    POSIX cannot rename a directory over a non-empty one, so the old one is first renamed aside;
    a crash between the two renames leaves both complete, and `resolve` then loads the old one.
    At every moment `final` or the renamed-aside copy is a complete checkpoint.
    """
    previous = previous_dir(final)
    if final.exists():
        if previous.exists():  # left by a crash after a publication: `final` supersedes it
            shutil.rmtree(previous)
        os.rename(final, previous)
    os.rename(staging, final)
    fsync_directory(final.parent)
    if previous.exists():
        shutil.rmtree(previous)


def fsync_directory(directory: Path) -> None:
    """Make the entries just renamed or created in `directory` durable, as the files' own fsync does not."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def resolve(path: str | os.PathLike) -> Path:
    """The directory to load for `path`: itself, or the previous checkpoint a crashed save left."""
    final = Path(path).absolute()
    if (final / METADATA).is_file():
        return final
    previous = previous_dir(final)
    if (previous / METADATA).is_file():
        warn_at_caller(
            f"{final} is missing: a save to it was interrupted while replacing the previous "
            f"checkpoint; loading that previous checkpoint from {previous}"
        )
        return previous
    if final.exists():
        raise CheckpointError(
            f"{final} has no {METADATA}: it is not a zerocompile checkpoint (write one with "
            "zerocompile.save()), or the checkpoint is damaged"
        )
    raise FileNotFoundError(f"no checkpoint at {final}")


def write_json(path: Path, value: Any) -> None:
    with open(path, "w") as f:
        json.dump(value, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def read_metadata(directory: Path) -> dict[str, Any]:
    """The checkpoint's JSON metadata, after checking that the directory holds only our files."""
    check_contents(directory)
    try:
        metadata = json.loads((directory / METADATA).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{directory / METADATA} is not valid JSON ({error}): the checkpoint is damaged") from None
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
        raise CheckpointError(f"{directory / METADATA} is not zerocompile checkpoint metadata")
    if metadata.get("version") not in _READABLE_VERSIONS:
        raise CheckpointError(
            f"{directory} has checkpoint format version {metadata.get('version')}; this zerocompile "
            f"reads versions {list(_READABLE_VERSIONS)}"
        )
    _check_schema(directory / METADATA, metadata)
    return metadata


# The metadata's fields and their JSON types; "files" from version 2 on.
_SCHEMA = {
    "stage": (int, type(None)),
    "world_size": int,
    "params": list,
    "buffers": list,
    "state_dict_keys": list,
    "optimizer": (dict, list, type(None)),  # a list: several optimizers, saved in order
    "ema": (dict, type(None)),
}
_ENTRY_SCHEMA = {"params": {"names": list, "shape": list, "dtype": str}, "buffers": {"name": str, "shape": list, "dtype": str}}


def _check_schema(path: Path, metadata: dict[str, Any]) -> None:
    """Valid JSON with a field missing or of the wrong kind is damage too: say so here, not with a
    KeyError from deep inside loading."""
    schema = {**_SCHEMA, **({"files": dict} if metadata["version"] >= 2 else {})}
    problems = [key for key, kind in schema.items() if not isinstance(metadata.get(key), kind)]
    for key, fields in _ENTRY_SCHEMA.items():
        entries = metadata.get(key) if isinstance(metadata.get(key), list) else []
        if not all(isinstance(e, dict) and all(isinstance(e.get(f), k) for f, k in fields.items()) for e in entries):
            problems.append(f"{key} entries")
    if problems:
        raise CheckpointError(f"{path} lacks or garbles {problems}: the checkpoint is damaged")


def data_files(directory: Path) -> list[str]:
    """Every data file of a checkpoint (shards and extras), relative to it, in one order on every rank."""
    return [str(p.relative_to(directory)) for p in [*state_files(directory), *sorted((directory / EXTRA_DIR).glob("*.safetensors"))]]


def file_digest(path: Path) -> dict[str, Any]:
    """Size and SHA-256 of a file, read in blocks (a shard can be larger than memory allows twice)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_DIGEST_BLOCK):
            digest.update(block)
    return {"bytes": path.stat().st_size, "sha256": digest.hexdigest()}


def check_files(directory: Path, metadata: dict[str, Any], share: slice) -> None:
    """The data files are exactly those the metadata lists, each of its recorded size; the files in
    `share` of the listing (one rank's part of the work) also hash as recorded.

    Version-1 checkpoints record no files: nothing to check.
    """
    listed = metadata.get("files")
    if listed is None:
        return
    present = set(data_files(directory))
    missing = sorted(set(listed) - present)
    if missing:
        raise CheckpointError(f"{directory}: {missing} missing (the save wrote them): the checkpoint is damaged")
    unlisted = sorted(present - set(listed))
    if unlisted:
        raise CheckpointError(f"{directory}: {unlisted} were not written by its save: the checkpoint is damaged")
    for name, recorded in listed.items():
        size = (directory / name).stat().st_size
        if size != recorded.get("bytes"):
            raise CheckpointError(
                f"{directory / name} has {size} bytes, its save wrote {recorded.get('bytes')} (truncated or "
                "overwritten): the checkpoint is damaged"
            )
    for name in sorted(listed)[share]:
        if file_digest(directory / name)["sha256"] != listed[name].get("sha256"):
            raise CheckpointError(
                f"{directory / name} does not hash to the SHA-256 its save recorded (its bytes changed): "
                "the checkpoint is damaged"
            )


def check_contents(directory: Path) -> None:
    """Refuse a directory holding any file we did not write: nothing else is ever opened."""
    unexpected = []
    for entry in sorted(directory.rglob("*")):
        relative = entry.relative_to(directory)
        parts = relative.parts
        if entry.is_dir() and len(parts) == 1 and parts[0] in (STATE_DIR, EXTRA_DIR):
            continue
        expected = (
            (parts == (METADATA,))
            or (len(parts) == 2 and parts[0] == STATE_DIR and _STATE_FILE.fullmatch(parts[1]))
            or (len(parts) == 2 and parts[0] == EXTRA_DIR and _EXTRA_FILE.fullmatch(parts[1]))
        )
        if not (expected and entry.is_file() and not entry.is_symlink()):
            unexpected.append(str(relative))
    if unexpected:
        raise CheckpointError(
            f"refusing to load {directory}: it holds files zerocompile does not write ({unexpected}). "
            f"A checkpoint holds only {METADATA}, {STATE_DIR}/shard-*.safetensors and "
            f"{EXTRA_DIR}/rank*.safetensors; remove the others if you trust them"
        )
    for path in [*state_files(directory), *sorted((directory / EXTRA_DIR).glob("*.safetensors"))]:
        read_safetensors_header(path)  # a file of another format (a pickle, say) fails here


def state_files(directory: Path) -> list[Path]:
    return sorted((directory / STATE_DIR).glob("shard-*.safetensors"))


_DAMAGED = ": the checkpoint is damaged, or the file was not written by zerocompile"


def read_safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    """A safetensors file's JSON header and the file offset its data starts at.

    The format: an 8-byte little-endian header length, the JSON header, then the data; each
    tensor's `data_offsets` count from the end of the header.
    """
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"{path} is not a safetensors file (too short){_DAMAGED}")
        (length,) = struct.unpack("<Q", prefix)
        if length > min(os.path.getsize(path) - 8, 100 * 2**20):
            raise CheckpointError(f"{path} is not a safetensors file (header length {length}){_DAMAGED}")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise CheckpointError(f"{path} is not a safetensors file (header is not JSON){_DAMAGED}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} is not a safetensors file (header is not a JSON object){_DAMAGED}")
    return header, 8 + length


def encode_extra(extra: dict[str, Any]) -> tuple[dict[str, torch.Tensor], str]:
    """Split `extra` into tensors and the JSON of everything else; a clear error otherwise."""
    tensors = {k: v.detach().cpu().contiguous().clone() for k, v in extra.items() if isinstance(v, torch.Tensor)}
    values = {k: v for k, v in extra.items() if not isinstance(v, torch.Tensor)}
    for key, value in values.items():
        try:
            json.dumps(value, allow_nan=True)
        except (TypeError, ValueError) as error:
            raise TypeError(
                f"extra value {key!r} of type {type(value).__name__} cannot be saved ({error}): extra "
                "values must be tensors (e.g. torch.get_rng_state()) or JSON values (numbers, strings, "
                "bools, None, lists and dicts of them)"
            ) from None
    return tensors, json.dumps(values)


def write_extra(directory: Path, rank: int, tensors: dict[str, torch.Tensor], values_json: str) -> None:
    from safetensors.torch import save_file

    path = directory / EXTRA_DIR / f"rank{rank}.safetensors"
    save_file(tensors, str(path), metadata={_EXTRA_JSON_KEY: values_json})
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def read_extra(directory: Path, rank: int) -> dict[str, Any]:
    """What rank `rank` saved as `extra`; ranks the saving run did not have get rank 0's."""
    from safetensors import safe_open

    path = directory / EXTRA_DIR / f"rank{rank}.safetensors"
    if not path.is_file():
        path = directory / EXTRA_DIR / "rank0.safetensors"
    try:
        with safe_open(str(path), framework="pt") as f:
            extra = json.loads((f.metadata() or {})[_EXTRA_JSON_KEY])
            extra.update({key: f.get_tensor(key) for key in f.keys()})
    except Exception as error:  # safetensors raises its own error types for damaged files
        raise CheckpointError(f"{path} is not a readable extra file ({error}): the checkpoint is damaged") from None
    return extra


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in checkpoint metadata")
    return dtype
