"""Warnings that point at the user's line: the first frame outside zerocompile.

`warnings.warn(stacklevel=N)` counts frames, and zerocompile's calls pass through helpers such as
`distributed.agreed` on their way, so a fixed N names one of our own files; Python 3.12's
`skip_file_prefixes` does this, but 3.11 is supported.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

_PACKAGE = str(Path(__file__).resolve().parent)


def warn_at_caller(message: str, category: type[Warning] = UserWarning) -> None:
    """`warnings.warn(message, category)` attributed to the innermost frame not in zerocompile."""
    frame, level = sys._getframe(1), 1
    while frame is not None and str(Path(frame.f_code.co_filename).resolve()).startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level + 1)
