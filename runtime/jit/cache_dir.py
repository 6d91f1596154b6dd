"""Where attncc keeps what it compiles: the one place both the kernel cache (cache.py) and the
NVRTC wrapper's version memo (nvrtc.py) read it from."""
from __future__ import annotations

import os
from pathlib import Path

__all__ = ["default_cache_dir"]


def default_cache_dir() -> Path:
    """Where compiled kernels live: $ATTNCC_CACHE_DIR, $XDG_CACHE_HOME/attncc or ~/.cache/attncc.

    Example:
        >>> import os
        >>> os.environ["ATTNCC_CACHE_DIR"] = "/tmp/attncc-doc"; str(default_cache_dir())
        '/tmp/attncc-doc'
        >>> del os.environ["ATTNCC_CACHE_DIR"]
    """
    env = os.environ.get("ATTNCC_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "attncc"
