"""Test session setup shared by every module."""

import os
import tempfile

# One Inductor cache for the whole session, inherited by every spawned rank: kernels compiled for
# one stage or world size are reused by the others instead of going through the C++ compiler again.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="zc-inductor-cache-"))
