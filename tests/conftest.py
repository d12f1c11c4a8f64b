"""Test session setup shared by every module."""

import atexit
import os
import shutil
import tempfile

# One Inductor cache for the in-process tests of the session: kernels compiled for one stage or
# world size are reused by the others instead of going through the C++ compiler again. Ranks spawned
# by ranks.py each use a directory of their rank inside it. Made once, by the process that starts
# the session (xdist's workers inherit it), and removed when that process ends: a full run leaves
# some 100 MB of kernels there, and CI machines share their disk between runs.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    _inductor_cache = tempfile.mkdtemp(prefix="zc-inductor-cache-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _inductor_cache
    atexit.register(shutil.rmtree, _inductor_cache, ignore_errors=True)

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import zerocompile as zc
from fx_helpers import WORLD

# New examples every run, yet any run repeatable: property tests that spawn ranks pass this seed to
# every rank (hypothesis' own --hypothesis-seed does not reach spawned processes). Put in the
# environment, so pytest-xdist's workers, started after this module is imported, draw with the seed
# the header names rather than one of their own.
os.environ.setdefault("ZC_HYPOTHESIS_SEED", str(int.from_bytes(os.urandom(4), "big")))
HYPOTHESIS_SEED = int(os.environ["ZC_HYPOTHESIS_SEED"])


def pytest_report_header(config: pytest.Config) -> str:
    return f"hypothesis seed {HYPOTHESIS_SEED}: rerun with ZC_HYPOTHESIS_SEED={HYPOTHESIS_SEED} to draw the same examples"


@pytest.fixture(scope="session")
def hypothesis_seed() -> int:
    return HYPOTHESIS_SEED


@pytest.fixture(scope="module")
def group_name():
    """A fake world of 4 ranks for one module (`pytestmark = pytest.mark.usefixtures("group_name")`),
    torn down even if a test fails."""
    created = False
    if dist.is_initialized():
        # Left over by another module (or a session fixture): usable only if it is the same kind.
        if dist.get_backend() != "fake" or dist.get_world_size() != WORLD:
            pytest.skip(
                f"a {dist.get_backend()} process group of {dist.get_world_size()} ranks is already "
                f"initialised in this process; these tests need a fake group of {WORLD}"
            )
    else:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
        created = True
    try:
        yield dist.group.WORLD.group_name
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()


def _fake_group(world_size: int):
    """Rank 0 of a fake process group of `world_size` in this process (shapes only, nothing sent),
    destroyed after the test. A group left by an earlier test is that test's bug: asserted, not skipped."""
    assert not dist.is_initialized(), f"a {dist.get_backend()} process group was left initialised by an earlier test"
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    torch._dynamo.reset()
    try:
        yield
    finally:
        torch._dynamo.reset()
        dist.destroy_process_group()


@pytest.fixture
def fake_two_ranks():
    yield from _fake_group(2)


@pytest.fixture
def fake_eight_ranks():
    """As a GPU job's rank 0 of 8 sees its group (the layout every backend but gloo takes)."""
    yield from _fake_group(8)


@pytest.fixture
def single_rank():
    """A one-rank gloo group in this process, as `init_distributed()` starts it without a launcher."""
    assert not dist.is_initialized()
    zc.init_distributed()
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    dist.destroy_process_group()
