"""Kernel cache: keys separate every input that changes the binary, entries survive processes, a
corrupt/truncated/garbage entry is detected, deleted and recompiled, and several processes
compiling the same variant into one empty directory produce one valid entry and no temp files."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import attncc
import attncc.runtime
from attncc.runtime.jit import cache as cache_mod
from attncc.runtime.jit.cache import (CorruptEntry, KernelCache, cached_compile, code_text,
                                      decode_entry, decode_result, default_cache_dir, encode_entry,
                                      encode_result)
from attncc.runtime.jit.nvrtc import NvrtcResult, available

needs_nvrtc = pytest.mark.skipif(not available(), reason="NVRTC cannot be loaded")

SRC = 'extern "C" __global__ void add1(int* x) { x[threadIdx.x] += 1; }\n'
KEY = "0123456789abcdef" * 4


def _leftovers(d: Path) -> list[str]:
    return [p.name for p in d.iterdir() if p.name.endswith(".tmp")]


# ---- pure: directory, keys, entry format ---------------------------------------------------

def test_cache_dir_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("ATTNCC_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "attncc"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "attncc"
    monkeypatch.setenv("ATTNCC_CACHE_DIR", str(tmp_path / "explicit"))
    assert default_cache_dir() == tmp_path / "explicit"
    assert KernelCache().dir == tmp_path / "explicit"
    assert KernelCache.default().dir == tmp_path / "explicit"


def test_key_changes_with_every_input() -> None:
    base = dict(arch="sm_90a", options=("-std=c++17",), name="a.cu", nvrtc=(12, 9))
    k = KernelCache.key_for(SRC, **base)
    assert k == KernelCache.key_for(SRC, **base)
    variants = [dict(base, arch="sm_80"), dict(base, options=("-std=c++17", "-lineinfo")),
                dict(base, options=()), dict(base, name="b.cu"), dict(base, nvrtc=(13, 0))]
    keys = {KernelCache.key_for(SRC, **v) for v in variants}
    keys.add(KernelCache.key_for(SRC + " ", **base))
    assert k not in keys and len(keys) == len(variants) + 1


def test_key_ignores_comments_but_not_code_or_strings() -> None:
    key = lambda src: KernelCache.key_for(src, arch="sm_90a", nvrtc=(12, 9))  # noqa: E731
    a = '// score_mod: user.py:10 (softcap)\nint f() { return 1; } /* x */\n'
    assert key(a) == key(a.replace("user.py:10", "user.py:42").replace("/* x */", "/* y */"))
    assert key(a) != key(a.replace("return 1", "return 2"))
    s = 'const char* p = "http://a"; // note\n'
    assert code_text(s) == 'const char* p = "http://a"; \n'
    assert key(s) != key(s.replace("http://a", "http://b"))
    # a block comment keeps its newlines, so __LINE__ after it is unchanged
    assert code_text("/* a\nb */__LINE__") == "\n__LINE__"
    # constructs a regex could mis-lex are keyed verbatim
    for unsafe in ('// c \\\nint x;', 'auto s = R"(//)";', "int n = 1'000; // c"):
        assert code_text(unsafe) == unsafe


def test_key_includes_format_version(monkeypatch: pytest.MonkeyPatch) -> None:
    k = KernelCache.key_for(SRC, arch="sm_80", nvrtc=(12, 9))
    monkeypatch.setattr(cache_mod, "CACHE_FORMAT_VERSION", cache_mod.CACHE_FORMAT_VERSION + 1)
    assert KernelCache.key_for(SRC, arch="sm_80", nvrtc=(12, 9)) != k


def test_entry_roundtrip_and_every_corruption_is_detected() -> None:
    blob = encode_entry(b"payload bytes")
    assert decode_entry(blob) == b"payload bytes"
    flipped = bytearray(blob)
    flipped[-3] ^= 0x40
    bad_magic = b"X" + blob[1:]
    cases = {"checksum": bytes(flipped), "truncated": blob[:-1], "truncated ": blob[:10],
             "bad magic": bad_magic, "format version": blob[:8] + b"\x63" + blob[9:]}
    for reason, data in cases.items():
        with pytest.raises(CorruptEntry, match=reason.strip()):
            decode_entry(data)


def test_result_payload_roundtrip() -> None:
    r = NvrtcResult(b"\x7fELF\x00\x01", ".version 8.0", "ptxas info: Used 12 registers",
                    ("--gpu-architecture=sm_90a", "-std=c++17"))
    assert decode_result(encode_result(r)) == r
    with pytest.raises(CorruptEntry):
        decode_result(b"\xff\xff\x00\x00{")


def test_get_put_memory_then_disk(tmp_path: Path) -> None:
    c = KernelCache(tmp_path)
    assert c.get(KEY) is None and c.stats["misses"] == 1
    c.put(KEY, b"abc")
    assert c.get(KEY) == b"abc" and c.stats["memory_hits"] == 1
    fresh = KernelCache(tmp_path)  # a new process, in effect
    assert fresh.get(KEY) == b"abc" and fresh.stats["disk_hits"] == 1
    assert fresh.get(KEY) == b"abc" and fresh.stats["memory_hits"] == 1
    assert [p.name for p in c.entries()] == [f"{KEY}.bin"]
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage", "empty"])
def test_damaged_entry_is_deleted_and_reported_missing(tmp_path: Path, damage: str) -> None:
    KernelCache(tmp_path).put(KEY, b"x" * 100)
    path = tmp_path / f"{KEY}.bin"
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-50] ^= 1
    elif damage == "truncate":
        data = data[:-10]
    elif damage == "garbage":
        data = bytearray(os.urandom(200))
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    c = KernelCache(tmp_path)
    with pytest.warns(RuntimeWarning, match="invalid"):
        assert c.get(KEY) is None
    assert not path.exists() and c.stats["corrupt"] == 1


def test_failed_write_leaves_no_temp_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    c = KernelCache(tmp_path)

    def boom(src: str, dst: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(cache_mod.os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        c.put(KEY, b"abc")
    assert _leftovers(tmp_path) == [] and c.entries() == []


def test_lock_is_exclusive_and_times_out(tmp_path: Path) -> None:
    pytest.importorskip("fcntl")
    a, b = KernelCache(tmp_path), KernelCache(tmp_path)
    with a.compile_lock(KEY) as got_a:
        assert got_a
        with b.compile_lock(KEY, timeout=0.05) as got_b:  # flock is per open file: b must wait
            assert not got_b
    with b.compile_lock(KEY, timeout=0.05) as got_b:
        assert got_b


# ---- with NVRTC ----------------------------------------------------------------------------

@pytest.mark.nvrtc
@needs_nvrtc
def test_cached_compile_miss_then_hits(tmp_path: Path) -> None:
    c = KernelCache(tmp_path)
    r1, hit1 = cached_compile(SRC, arch="sm_90a", cache=c)
    r2, hit2 = cached_compile(SRC, arch="sm_90a", cache=c)
    assert (hit1, hit2) == (False, True) and r1 == r2
    r3, hit3 = cached_compile(SRC, arch="sm_90a", cache=KernelCache(tmp_path))  # from disk
    assert hit3 and r3 == r1
    # each of these must miss: the binary could differ
    assert not cached_compile(SRC, arch="sm_80", cache=c)[1]
    assert not cached_compile(SRC, arch="sm_90a", options=["-lineinfo"], cache=c)[1]
    assert not cached_compile(SRC + "\n", arch="sm_90a", cache=c)[1]
    assert not cached_compile(SRC, arch="sm_90a", emit="ptx", cache=c)[1]
    assert len(c.entries()) == 5 and _leftovers(tmp_path) == []


@pytest.mark.nvrtc
@needs_nvrtc
def test_default_cache_follows_env_and_cache_false_writes_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNCC_CACHE_DIR", str(tmp_path / "env"))
    _, hit = cached_compile(SRC, arch="sm_80")
    assert not hit and len(KernelCache(tmp_path / "env").entries()) == 1
    assert cached_compile(SRC, arch="sm_80")[1]
    monkeypatch.setenv("ATTNCC_CACHE_DIR", str(tmp_path / "off"))
    assert not cached_compile(SRC, arch="sm_80", cache=False)[1]
    assert not (tmp_path / "off").exists()


@pytest.mark.nvrtc
@needs_nvrtc
@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage"])
def test_corrupt_entry_is_recompiled(tmp_path: Path, damage: str) -> None:
    good, _ = cached_compile(SRC, arch="sm_90a", cache=KernelCache(tmp_path))
    (path,) = KernelCache(tmp_path).entries()
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x10
    elif damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data = bytearray(b"not an attncc cache entry at all" * 4)
    path.write_bytes(bytes(data))
    c = KernelCache(tmp_path)  # empty memory layer: must read the damaged file
    with pytest.warns(RuntimeWarning, match="invalid"):
        again, hit = cached_compile(SRC, arch="sm_90a", cache=c)
    assert not hit and again == good and c.stats["corrupt"] == 1
    assert decode_result(decode_entry(path.read_bytes())) == good  # rewritten, valid
    assert cached_compile(SRC, arch="sm_90a", cache=KernelCache(tmp_path))[1]


@pytest.mark.nvrtc
@needs_nvrtc
def test_unwritable_cache_warns_but_compiles(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    def no_space(*a: object, **k: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cache_mod.tempfile, "mkstemp", no_space)
    with pytest.warns(RuntimeWarning, match="ATTNCC_CACHE_DIR"):
        r, hit = cached_compile(SRC, arch="sm_80", cache=KernelCache(tmp_path))
    assert not hit and r.cubin[:4] == b"\x7fELF"


# A child process: make `attncc.runtime` importable the way the parent found it (an installed
# package, or the repo's runtime/ directory). The `attncc` package object is a bare stand-in so
# the child skips attncc/__init__ (and its torch import): the cache needs neither, and each
# child then starts in well under a second.
_CHILD = textwrap.dedent("""
    import hashlib, importlib.util, json, sys, types
    pkg = types.ModuleType("attncc")
    pkg.__path__ = [{attncc_dir!r}]
    sys.modules["attncc"] = pkg
    try:
        import attncc.runtime
    except ImportError:
        spec = importlib.util.spec_from_file_location(
            "attncc.runtime", {runtime_init!r}, submodule_search_locations=[{runtime_dir!r}])
        mod = importlib.util.module_from_spec(spec)
        sys.modules["attncc.runtime"] = mod
        spec.loader.exec_module(mod)
    from attncc.runtime.jit.cache import cached_compile
    assert "torch" not in sys.modules
    r, hit = cached_compile(sys.argv[1], arch="sm_90a")
    print(json.dumps({{"sha": hashlib.sha256(r.cubin).hexdigest(), "hit": hit}}))
""")


@pytest.mark.nvrtc
@needs_nvrtc
def test_concurrent_processes_compile_once(tmp_path: Path) -> None:
    cache_dir = tmp_path / "shared-cache"  # does not exist yet: every process races to create it
    runtime_dir = Path(attncc.runtime.__file__).parent
    code = _CHILD.format(attncc_dir=str(Path(attncc.__file__).parent),
                         runtime_init=str(runtime_dir / "__init__.py"),
                         runtime_dir=str(runtime_dir))
    # A kernel big enough that compiles overlap in time.
    body = "\n".join(f"  acc = acc * {i}.5f + sinf(acc + x[{i}]);" for i in range(20))
    src = (f'extern "C" __global__ void busy(float* x) {{\n  float acc = x[0];\n{body}\n'
           f'  x[0] = acc;\n}}\n')
    env = {**os.environ, "ATTNCC_CACHE_DIR": str(cache_dir)}
    procs = [subprocess.Popen([sys.executable, "-c", code, src], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert len({o["sha"] for o in outs}) == 1
    assert sorted(o["hit"] for o in outs) == [False, True, True]  # the lock made it single-flight
    entries = sorted(cache_dir.glob("*.bin"))
    assert len(entries) == 1
    payload = decode_entry(entries[0].read_bytes())
    assert hashlib.sha256(decode_result(payload).cubin).hexdigest() == outs[0]["sha"]
    assert _leftovers(cache_dir) == []
