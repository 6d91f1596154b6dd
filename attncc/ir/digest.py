"""One rule for "did the code that produced a stored result change": a digest over the name,
size and modification time of every file under some source trees (stat only, so a warm start
reads no source; an edited or reinstalled file gives a new digest). The simplified-IR store
(`attncc.ir.simplified`) and the kernel cache's form memo (`runtime/jit/forms.py`) key their
entries with it.

Example:
    >>> from pathlib import Path
    >>> d = tree_digest((Path(__file__).parent,))
    >>> len(d), d == tree_digest((Path(__file__).parent,))
    (64, True)
"""
from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path
from typing import Sequence

__all__ = ["tree_digest"]

_digests: dict[tuple[str, ...], str] = {}  # computed once per process and set of roots
_lock = threading.Lock()


def tree_digest(roots: Sequence[Path]) -> str:
    """sha256 over (path relative to its root, size, mtime in ns) of every file under `roots`
    (`__pycache__` left out), in sorted order; remembered for the process."""
    key = tuple(str(r) for r in roots)
    hit = _digests.get(key)
    if hit is not None:
        return hit
    h = hashlib.sha256()
    for i, root in enumerate(roots):
        h.update(f"root {i}\0".encode())  # a file cannot pass for one under another root
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for name in sorted(filenames):
                path = os.path.join(dirpath, name)
                st = os.stat(path)
                h.update(f"{os.path.relpath(path, root)}\0{st.st_size}\0{st.st_mtime_ns}\0"
                         .encode())
    with _lock:
        return _digests.setdefault(key, h.hexdigest())
