"""`simplify_variant` with a memory, so a warm start never imports sympy.

Simplification (`attncc.ir.simplify`, sympy inside) is a pure function of the traced IR and of
the IR package's code. Its result is remembered twice: per process (the traced IR's key), and,
once the runtime installs a store (`use_store`, done by `attncc.runtime.jit.cache`), in the
kernel cache's directory, keyed by the traced IR's pickled bytes and a digest of this package's
sources. A new process that calls a variant simplified before reads the result and never loads
sympy (about a second of import on a small machine; docs/jit.md, "Warm start").

Example:
    >>> from attncc.ir.nodes import var
    >>> from attncc.ir.program import Hook, VariantIR
    >>> ir = VariantIR(hooks={"score_mod": Hook("score_mod", var("score") * 1.0)})
    >>> simplify_variant(ir).hooks
    {}
"""
from __future__ import annotations

import hashlib
import pickle
import threading
from pathlib import Path
from typing import Callable

from .digest import tree_digest
from .program import VariantIR

# Bump when the stored payload's meaning changes (the sources digest covers code changes).
STORE_FORMAT = 1
_MEMO_SIZE = 256

_memo: dict[tuple, VariantIR] = {}
_lock = threading.Lock()
_store: tuple[Callable[[str], bytes | None], Callable[[str, bytes], None]] | None = None


def use_store(get: Callable[[str], bytes | None] | None,
              put: Callable[[str, bytes], None] | None = None) -> None:
    """Install (or, with None, remove) the byte store simplified IR persists in: `get(key)`
    returns the bytes stored under a 64-hex-digit key or None, `put(key, data)` stores them."""
    global _store
    _store = None if get is None or put is None else (get, put)


def simplify_variant(ir: VariantIR) -> VariantIR:
    """`attncc.ir.simplify.simplify_variant(ir)`, remembered in this process and in the store."""
    key = _memo_key(ir)
    hit = _memo.get(key)
    if hit is not None:
        return hit
    store, skey = _store, None
    if store is not None:
        skey = _store_key(ir)
        out = _load(store[0], skey) if skey is not None else None
        if out is not None:
            return _remember(key, out)
    from .simplify import simplify_variant as simplify_now

    out = simplify_now(ir)
    if store is not None and skey is not None:
        try:
            store[1](skey, pickle.dumps(out, protocol=4))
        except (OSError, RecursionError, pickle.PicklingError):
            pass  # only the next process's warm start is lost
    return _remember(key, out)


def clear_memo() -> None:
    """Forget this process's memory (the store keeps its entries)."""
    with _lock:
        _memo.clear()


def _memo_key(ir: VariantIR) -> tuple:
    # nodes are interned: the same expressions are the same objects, hashed by identity
    return (tuple((n, h.expr, h.source) for n, h in ir.hooks.items()), ir.normalize, ir.name,
            ir.scalars, ir.tensors)


def _remember(key: tuple, out: VariantIR) -> VariantIR:
    with _lock:
        while len(_memo) >= _MEMO_SIZE:
            del _memo[next(iter(_memo))]
        _memo[key] = out
    return out


def _store_key(ir: VariantIR) -> str | None:
    """sha256 over the format, this package's sources and the traced IR's pickle (which holds
    every hook's expression and source line, the captures and the normalization), or None when
    the IR is too deep to pickle."""
    try:
        blob = pickle.dumps(ir, protocol=4)
    except (RecursionError, pickle.PicklingError):
        return None
    h = hashlib.sha256(b"attncc-simplified-ir\0%d\0" % STORE_FORMAT)
    h.update(_sources_digest().encode())
    h.update(blob)
    return h.hexdigest()


def _load(get: Callable[[str], bytes | None], key: str) -> VariantIR | None:
    try:
        data = get(key)
        out = pickle.loads(data) if data is not None else None
    except Exception:  # an unreadable entry is a miss: simplify again and overwrite it
        return None
    return out if isinstance(out, VariantIR) else None


def _sources_digest() -> str:
    """A digest of the IR package's sources (`digest.tree_digest`): any change to the
    simplifier (or to the nodes it builds) gives new keys, so a store never answers with
    another version's result."""
    return tree_digest((Path(__file__).parent,))
