"""The on-disk (plus in-memory) cache of NVRTC results, safe across processes.

Layout of the cache directory (`ATTNCC_CACHE_DIR`, else `$XDG_CACHE_HOME/attncc`, else
`~/.cache/attncc`):

    <key>.bin          one entry: 52-byte header (magic, format version, payload length,
                       sha256 of payload) followed by the payload
    locks/<key>.lock   empty files for fcntl.flock, so one process compiles a key at a time
                       (they stay: deleting a lock file others may hold is a race)

The key is a sha256 over the source (minus comments), the exact NVRTC options (which name the
arch), the program name, the NVRTC version and `CACHE_FORMAT_VERSION`, so a new NVRTC or a new
entry layout never reads an old entry. Writes go to a temp file in the same directory and are
published with `os.replace`, which is atomic: readers see either no entry or a whole one. Entries
are not fsynced; a torn write after a crash fails the checksum, is deleted and recompiled.

Example:
    >>> import tempfile
    >>> from attncc.runtime.jit.cache import KernelCache
    >>> c = KernelCache(tempfile.mkdtemp())
    >>> k = c.key_for("__global__ void k() {}", arch="sm_90a", nvrtc=(12, 9))
    >>> c.get(k) is None
    True
    >>> c.put(k, b"payload"); c.clear_memory()
    >>> c.get(k)
    b'payload'
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import struct
import tempfile
import threading
import time
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from attncc.ir import simplified

from .cache_dir import default_cache_dir
from .nvrtc import (NvrtcResult, build_options, compile_cuda, loaded_version, normalize_arch,
                    nvrtc_version)

# Bump whenever the key recipe, the header or the payload encoding changes.
CACHE_FORMAT_VERSION = 1
MAGIC = b"ATTNCCK\0"
_HEADER = struct.Struct("<8sIQ32s")  # magic, format version, payload length, sha256(payload)
_META_LEN = struct.Struct("<I")
_MEMORY_ENTRIES = 512  # LRU bound: cubins are 10 KB - 1 MB; a process compiles few variants
_LOCK_TIMEOUT_S = float(os.environ.get("ATTNCC_CACHE_LOCK_TIMEOUT", "300"))


# String/char literals (kept verbatim) or comments (dropped), leftmost first, as a C++ lexer would.
_LEXEMES = re.compile(r'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|//[^\n]*|/\*.*?\*/', re.S)
# Constructs where the regex above could mis-lex; such sources are keyed verbatim.
_UNSAFE_TO_STRIP = re.compile(r'\\\n|(?<![\w"])(?:u8|[uUL])?R"|\d\'\d')


def code_text(source: str) -> str:
    """The source with comments removed: what the cache key hashes.

    Generated sources carry comments such as the file:line a mod came from; those do not change
    the binary, so editing lines above a mod must not force a recompile. Newlines inside block
    comments are kept so `__LINE__` (which can reach the binary) is unchanged. Sources with line
    splices, raw strings or digit separators are returned unchanged rather than risk mis-lexing.

    Example:
        >>> code_text('int a; // from x.py:3\\nconst char* s = "//keep"; /* a\\nb */ int b;')
        'int a; \\nconst char* s = "//keep"; \\n int b;'
    """
    if _UNSAFE_TO_STRIP.search(source):
        return source

    def repl(m: "re.Match[str]") -> str:
        tok = m.group(0)
        if tok[0] in "\"'":
            return tok
        return "\n" * tok.count("\n")

    return _LEXEMES.sub(repl, source)


class CorruptEntry(Exception):
    """Internal: an entry failed validation (the reason is the message)."""


def encode_entry(payload: bytes) -> bytes:
    """Header + payload, as written to disk.

    Example:
        >>> decode_entry(encode_entry(b"abc"))
        b'abc'
    """
    return _HEADER.pack(MAGIC, CACHE_FORMAT_VERSION, len(payload),
                        hashlib.sha256(payload).digest()) + payload


def decode_entry(blob: bytes) -> bytes:
    """The payload of an on-disk entry; raises CorruptEntry naming what is wrong.

    Example:
        >>> try:
        ...     decode_entry(encode_entry(b"abc")[:-1])
        ... except CorruptEntry as e:
        ...     print(e)
        truncated: header says 3 payload bytes, file has 2
    """
    if len(blob) < _HEADER.size:
        raise CorruptEntry(f"truncated: {len(blob)} bytes is shorter than the header")
    magic, version, length, digest = _HEADER.unpack_from(blob)
    if magic != MAGIC:
        raise CorruptEntry(f"bad magic {magic!r}")
    if version != CACHE_FORMAT_VERSION:
        raise CorruptEntry(f"format version {version}, expected {CACHE_FORMAT_VERSION}")
    payload = blob[_HEADER.size:]
    if len(payload) != length:
        raise CorruptEntry(f"truncated: header says {length} payload bytes, "
                           f"file has {len(payload)}")
    if hashlib.sha256(payload).digest() != digest:
        raise CorruptEntry("checksum mismatch")
    return payload


def encode_result(r: NvrtcResult) -> bytes:
    """Serialize an NvrtcResult: u32 meta length, JSON meta (log, options, ptx), cubin bytes.

    Example:
        >>> r = NvrtcResult(b"\\x7fELF", None, "ok", ("-std=c++17",))
        >>> decode_result(encode_result(r)) == r
        True
    """
    meta = json.dumps({"log": r.log, "options": list(r.options), "ptx": r.ptx}).encode("utf-8")
    return _META_LEN.pack(len(meta)) + meta + r.cubin


def decode_result(payload: bytes) -> NvrtcResult:
    """Inverse of `encode_result`; raises CorruptEntry on a malformed payload."""
    try:
        (n,) = _META_LEN.unpack_from(payload)
        meta = json.loads(payload[_META_LEN.size:_META_LEN.size + n].decode("utf-8"))
        return NvrtcResult(payload[_META_LEN.size + n:], meta["ptx"], meta["log"],
                           tuple(meta["options"]))
    except (struct.error, ValueError, KeyError, TypeError) as e:
        raise CorruptEntry(f"malformed payload: {e}") from None


class KernelCache:
    """Compiled-kernel cache: an in-process LRU dict in front of a directory of entries.

    `get`/`put` move opaque bytes; `cached_compile` stores NVRTC results. Corrupt, truncated or
    foreign files are detected on read (RuntimeWarning), deleted, and reported as a miss.
    `stats` counts memory_hits, disk_hits, misses and corrupt entries.

    Example:
        >>> import tempfile
        >>> c = KernelCache(tempfile.mkdtemp())
        >>> c.put("ab" * 32, b"x"); c.get("ab" * 32), c.stats["memory_hits"]
        (b'x', 1)
    """

    _defaults: dict[Path, "KernelCache"] = {}
    _defaults_lock = threading.Lock()

    def __init__(self, dir: str | os.PathLike[str] | None = None) -> None:
        self.dir = Path(dir).expanduser() if dir is not None else default_cache_dir()
        self._memory: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()
        self.stats = {"memory_hits": 0, "disk_hits": 0, "misses": 0, "corrupt": 0}
        # Callers (attncc.compile) memoize their own derived objects here, so they share this
        # cache's lifetime and a new ATTNCC_CACHE_DIR starts from a clean slate.
        self.memo: dict[Any, Any] = {}

    def __repr__(self) -> str:
        return f"KernelCache({str(self.dir)!r})"

    @classmethod
    def default(cls) -> "KernelCache":
        """The process-wide cache for the current default directory (re-read from the env).

        Example:
            >>> KernelCache.default() is KernelCache.default()
            True
        """
        return cls.shared(default_cache_dir())

    @classmethod
    def shared(cls, d: Path) -> "KernelCache":
        """The process-wide cache of directory `d` (one object per directory).

        Example:
            >>> KernelCache.shared(Path("/tmp/x")) is KernelCache.shared(Path("/tmp/x"))
            True
        """
        with cls._defaults_lock:
            if d not in cls._defaults:
                cls._defaults[d] = cls(d)
            return cls._defaults[d]

    # ---- keys and paths -------------------------------------------------------------------
    @staticmethod
    def key_for(source: str, *, arch: str, options: Sequence[str] = (), name: str = "attncc.cu",
                nvrtc: tuple[int, int] | None = None) -> str:
        """sha256 hex key over (format version, NVRTC version, arch, options, name, source
        without comments: see `code_text`).

        Example:
            >>> a = KernelCache.key_for("s", arch="sm_80", nvrtc=(12, 9))
            >>> a == KernelCache.key_for("s", arch="sm_90a", nvrtc=(12, 9)), len(a)
            (False, 64)
        """
        ver = nvrtc if nvrtc is not None else nvrtc_version()
        # JSON of a list is unambiguous (no separator collisions between fields).
        blob = json.dumps([CACHE_FORMAT_VERSION, list(ver), arch, list(options), name,
                           code_text(source)],
                          ensure_ascii=False).encode("utf-8")
        return hashlib.sha256(blob).hexdigest()

    def path_for(self, key: str) -> Path:
        return self.dir / f"{key}.bin"

    def entries(self) -> list[Path]:
        """Every entry file currently on disk (valid or not)."""
        return sorted(self.dir.glob("*.bin")) if self.dir.is_dir() else []

    # ---- bytes in, bytes out --------------------------------------------------------------
    def get(self, key: str) -> bytes | None:
        """The payload stored under key, or None (missing, or corrupt: then it is deleted)."""
        with self._lock:
            hit = self._memory.get(key)
            if hit is not None:
                self._memory.move_to_end(key)
                self.stats["memory_hits"] += 1
                return hit
        payload = self._read_disk(key)
        if payload is None:
            self.stats["misses"] += 1
            return None
        self.stats["disk_hits"] += 1
        self._remember(key, payload)
        return payload

    def put(self, key: str, data: bytes) -> None:
        """Store data under key: in memory, and atomically on disk (temp file + os.replace)."""
        self._remember(key, bytes(data))
        self.dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{key[:16]}.", suffix=".tmp", dir=self.dir)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(encode_entry(bytes(data)))
            os.replace(tmp, self.path_for(key))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def clear_memory(self) -> None:
        """Forget the in-process layer (entries on disk stay)."""
        with self._lock:
            self._memory.clear()
            self.memo.clear()

    def _remember(self, key: str, payload: bytes) -> None:
        with self._lock:
            self._memory[key] = payload
            self._memory.move_to_end(key)
            while len(self._memory) > _MEMORY_ENTRIES:
                self._memory.popitem(last=False)

    def _read_disk(self, key: str) -> bytes | None:
        path = self.path_for(key)
        try:
            with open(path, "rb") as f:
                blob = f.read()
                ino = os.fstat(f.fileno()).st_ino
        except FileNotFoundError:
            return None
        except OSError as e:
            warnings.warn(f"attncc cache: cannot read {path} ({e}); compiling instead",
                          RuntimeWarning, stacklevel=3)
            return None
        try:
            return decode_entry(blob)
        except CorruptEntry as e:
            self._discard(path, ino, str(e))
            return None

    def _discard(self, path: Path, ino: int, reason: str) -> None:
        self.stats["corrupt"] += 1
        warnings.warn(f"attncc cache: {path.name} is invalid ({reason}); deleted, recompiling",
                      RuntimeWarning, stacklevel=4)
        # Only delete the file we read: another process may already have replaced it with a good
        # entry (os.replace gives the path a new inode).
        with contextlib.suppress(OSError):
            if os.stat(path).st_ino == ino:
                os.unlink(path)

    def discard(self, key: str, reason: str) -> None:
        """Drop an entry whose payload turned out unusable (from memory and disk)."""
        with self._lock:
            self._memory.pop(key, None)
        path = self.path_for(key)
        with contextlib.suppress(OSError):
            self._discard(path, os.stat(path).st_ino, reason)

    # ---- cross-process single-flight ------------------------------------------------------
    @contextlib.contextmanager
    def compile_lock(self, key: str, timeout: float = _LOCK_TIMEOUT_S) -> Iterator[bool]:
        """Hold an exclusive per-key lock (True) so only one process compiles that key; after
        `timeout` seconds of waiting, or where locking is impossible, yields False and the caller
        compiles anyway (the atomic write keeps that safe, just duplicated work)."""
        try:
            import fcntl
        except ImportError:  # not POSIX
            yield False
            return
        try:
            lock_dir = self.dir / "locks"
            lock_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock_dir / f"{key}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:  # read-only cache dir and the like: compile without coordination
            yield False
            return
        locked = False
        try:
            deadline = time.monotonic() + timeout
            delay = 0.005
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    locked = True
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        break
                    time.sleep(delay)
                    delay = min(delay * 2, 0.05)
            yield locked
        finally:
            if locked:
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def _resolve_cache(cache: "KernelCache | bool | None") -> KernelCache | None:
    if cache is False:
        return None
    if cache is None or cache is True:
        return KernelCache.default()
    return cache


def cached_compile(source: str, *, arch: str | None, options: Sequence[str] = (),
                   cache: KernelCache | bool | None = None, name: str = "attncc.cu",
                   include_dirs: Sequence[str] = (), emit: str = "cubin",
                   verbose: bool = False,
                   keep: Callable[[NvrtcResult], bool] | None = None
                   ) -> tuple[NvrtcResult, bool]:
    """`compile_cuda` through the cache; returns (result, hit).

    `keep(result)` False leaves a fresh compile out of the disk cache (the kernel cache keeps a
    cubin that spilled past its form's budget out of it: jit/kernels.py).

    `cache=None`/True uses `KernelCache.default()`, False compiles without any caching. Only
    successful compiles are stored. Concurrent processes compiling the same key wait on a
    per-key lock, so the work is done once. The key covers the source text, not the contents of
    `include_dirs`: attncc sources are self-contained.

    Example:
        >>> import tempfile
        >>> from attncc.runtime.jit.nvrtc import available
        >>> c = KernelCache(tempfile.mkdtemp())
        >>> src = 'extern "C" __global__ void k(int* x) { x[0] = 1; }'
        >>> if available():
        ...     (r1, hit1), (r2, hit2) = (cached_compile(src, arch="sm_80", cache=c) for _ in "ab")
        ...     assert (hit1, hit2) == (False, True) and r1 == r2
    """
    arch = normalize_arch(arch)
    kc = _resolve_cache(cache)
    if kc is None:
        return compile_cuda(source, arch=arch, name=name, options=options,
                            include_dirs=include_dirs, emit=emit, verbose=verbose), False
    def keyed() -> tuple[str, NvrtcResult | None]:  # the key by nvrtc_version(), and its hit
        opts = build_options(arch, emit=emit, options=options, include_dirs=include_dirs,
                             verbose=verbose)
        key = _key(source, arch, opts, name)
        return key, _lookup(kc, key)

    remembered = nvrtc_version()  # from the memo on a warm start: NVRTC not loaded
    key, hit = keyed()
    if hit is None and loaded_version() != remembered:  # the memo named another NVRTC
        key, hit = keyed()
    if hit is not None:
        return hit, True
    with kc.compile_lock(key):
        hit = _lookup(kc, key)  # another process may have finished it while we waited
        if hit is not None:
            return hit, True
        result = compile_cuda(source, arch=arch, name=name, options=options,
                              include_dirs=include_dirs, emit=emit, verbose=verbose)
        if keep is None or keep(result):
            _put(kc, key, result)
    return result, False


def store_compile(source: str, result: NvrtcResult, *, arch: str, name: str = "attncc.cu",
                  options: Sequence[str] = (), verbose: bool = False,
                  cache: KernelCache | bool | None = None, confirmed: bool = False) -> None:
    """Write `result` (compiled elsewhere: a retry) under the key `cached_compile` would use
    for the same arguments, replacing what is there.

    Example:
        >>> import tempfile
        >>> from attncc.runtime.jit.nvrtc import available
        >>> c = KernelCache(tempfile.mkdtemp())
        >>> if available():  # the key names the NVRTC version
        ...     store_compile("src", NvrtcResult(b"cubin", None, "log", ()), arch="sm_90a",
        ...                   cache=c)
        ...     assert len(c.entries()) == 1
    """
    kc = _resolve_cache(cache)
    if kc is None:
        return
    key = _cubin_key(source, arch, name, options, verbose)
    _put(kc, key, result)
    if confirmed:
        kc.put(_confirmed_key(key), CONFIRMED_MARK)


def is_confirmed(source: str, *, arch: str, name: str = "attncc.cu",
                 options: Sequence[str] = (), verbose: bool = False,
                 cache: KernelCache | bool | None = None) -> bool:
    """Whether the entry `cached_compile` would read for these arguments was written with
    `store_compile(..., confirmed=True)`: a result the kernel cache compiled three times
    (twice in this process, once in a fresh one) with the same outcome, so a later process may
    trust it without compiling again (jit/kernels.py, `compile_form`).

    Example:
        >>> import tempfile
        >>> from attncc.runtime.jit.nvrtc import available
        >>> c = KernelCache(tempfile.mkdtemp())
        >>> if available():
        ...     r = NvrtcResult(b"cubin", None, "log", ())
        ...     store_compile("a", r, arch="sm_90a", cache=c)
        ...     store_compile("b", r, arch="sm_90a", cache=c, confirmed=True)
        ...     assert not is_confirmed("a", arch="sm_90a", cache=c)
        ...     assert is_confirmed("b", arch="sm_90a", cache=c)
    """
    kc = _resolve_cache(cache)
    if kc is None:
        return False
    return kc.get(_confirmed_key(_cubin_key(source, arch, name, options, verbose))) is not None


def _cubin_key(source: str, arch: str, name: str, options: Sequence[str], verbose: bool) -> str:
    """The key `cached_compile` uses for a cubin compile of these arguments."""
    arch = normalize_arch(arch)
    return _key(source, arch, build_options(arch, options=options, verbose=verbose), name)


# The payload of a confirmed mark: an entry of its own beside the result it confirms.
CONFIRMED_MARK = b"attncc: confirmed by three compiles"


def _confirmed_key(key: str) -> str:
    return hashlib.sha256(f"confirmed:{key}".encode()).hexdigest()


def _put(kc: KernelCache, key: str, result: NvrtcResult) -> None:
    try:
        kc.put(key, encode_result(result))
    except OSError as e:  # a full or read-only disk must not fail the compile itself
        warnings.warn(f"attncc cache: could not write to {kc.dir} ({e}); the kernel works "
                      f"but will be recompiled next time. Set ATTNCC_CACHE_DIR to a "
                      f"writable directory", RuntimeWarning, stacklevel=3)


@functools.lru_cache(maxsize=256)
def _key(source: str, arch: str, options: tuple[str, ...], name: str) -> str:
    # Memoized: stripping comments from and hashing a ~100 KB source costs milliseconds, and a
    # warm repeat of the same compile should cost microseconds.
    return KernelCache.key_for(source, arch=arch, options=options, name=name)


def _lookup(kc: KernelCache, key: str) -> NvrtcResult | None:
    payload = kc.get(key)
    if payload is None:
        return None
    try:
        return decode_result(payload)
    except CorruptEntry as e:  # valid checksum but unreadable payload: written by a buggy build
        kc.discard(key, str(e))
        return None


def _ir_store() -> KernelCache:
    """The simplified-IR entries: `ir/` inside the current cache directory (apart from the
    cubins, which `entries()` lists)."""
    return KernelCache.shared(default_cache_dir() / "ir")


# simplified IR persists beside the cubins: a warm start never imports sympy
# (attncc/ir/simplified.py)
simplified.use_store(lambda key: _ir_store().get(key), lambda key, data: _ir_store().put(key, data))
