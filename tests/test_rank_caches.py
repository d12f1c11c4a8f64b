"""Each rank spawned by tests/ranks.py compiles into an Inductor cache of its own.

With a shared cache a rank may load the graph its peer just compiled and skip zerocompile's passes,
so what a test counts on one rank would depend on what its peer compiled first. Ranks of the same
index in later tests reuse the directory (the C++ kernels are what makes the suite fast).
"""

from __future__ import annotations

from pathlib import Path

from ranks import run_on_ranks


def compile_and_list_cache(rank: int, world_size: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch._inductor.runtime.cache_dir_utils import cache_dir, triton_cache_dir

    # Different code per rank, so each rank's cache has entries the other's must not.
    body = torch.sin if rank == 0 else torch.cos
    compiled = torch.compile(lambda x: body(x) * (rank + 2))
    compiled(torch.randn(8))
    dist.barrier()  # both ranks have written their entries before either looks
    root = Path(cache_dir())
    return {
        "cache_dir": str(root),
        "triton_cache_dir": triton_cache_dir(0),
        "files": sorted(str(path.relative_to(root)) for path in root.rglob("*") if path.is_file()),
    }


def test_spawned_ranks_compile_into_caches_of_their_own(tmp_path: Path, monkeypatch) -> None:
    # A cache the parent asks for (the conftest's, or CI's) must not be what ranks share.
    shared = tmp_path / "parent-cache"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(shared))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(shared / "triton"))

    first, second = run_on_ranks(2, compile_and_list_cache, timeout=300)

    dirs = [Path(first["cache_dir"]), Path(second["cache_dir"])]
    assert dirs[0] != dirs[1], f"both ranks compiled into {dirs[0]}"
    for rank, (directory, report) in enumerate(zip(dirs, (first, second))):
        # A directory of this rank's own inside the parent's cache, so the next test's rank of the
        # same index reuses its kernels.
        assert directory == shared / f"rank{rank}", (rank, directory)
        assert Path(report["triton_cache_dir"]).is_relative_to(directory), (rank, report["triton_cache_dir"])
        assert report["files"], f"rank {rank} compiled nothing into {directory}"
    only_first = set(first["files"]) - set(second["files"])
    only_second = set(second["files"]) - set(first["files"])
    assert only_first and only_second, "a rank's cache holds the other rank's entries"
