"""`python -m benchmarks.capacity`, from the repository root."""

import sys

from benchmarks import harness

sys.exit(harness.main("benchmarks.capacity"))
