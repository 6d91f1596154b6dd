"""attncc.kernels: the CUDA templates attncc ships (package data, read by codegen).

The `.cuh` files here are self-contained (no toolkit `#include`), so NVRTC can compile them on a
machine with no CUDA toolkit. Codegen inlines them into one translation unit. They are grouped
by role (docs/kernel-interface.md#1-one-translation-unit-per-kernel): `common/` (types,
argument structs, the building blocks FA2 and FA3 share), `hopper/` (TMA and wgmma), `fa2/`,
`fa3/` and `small/` (merge, pre-pass, the simple reference kernel). A template is named by its
path under this package.

Example:
    >>> from attncc.kernels import read_template, template_path
    >>> template_path("common/attncc_types.cuh").name
    'attncc_types.cuh'
    >>> "namespace attncc" in read_template("common/attention_params.cuh")
    True
"""
from __future__ import annotations

import pathlib
from importlib import resources

__all__ = ["read_template", "template_path"]


def _check_name(name: str) -> None:
    # A path inside this package: plain '/'-separated parts, none that could climb out of it.
    parts = name.split("/") if name else [""]
    if "\\" in name or any(not p or p.startswith(".") for p in parts):
        raise ValueError(f"template name {name!r} must be a path under attncc.kernels such as "
                         f"'small/simple_attention.cuh'")


def _shipped(root: pathlib.Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                  if p.suffix in (".cuh", ".cu", ".j2"))


def template_path(name: str) -> pathlib.Path:
    """Filesystem path of the shipped template `name` (e.g. 'small/simple_attention.cuh').

    Example:
        >>> template_path("small/simple_attention.cuh").exists()
        True
        >>> template_path("simple_attention.cuh")
        Traceback (most recent call last):
        ...
        FileNotFoundError: attncc ships no kernel template 'simple_attention.cuh'; did you mean 'small/simple_attention.cuh'?
    """
    _check_name(name)
    root = pathlib.Path(str(resources.files(__name__)))
    path = root.joinpath(*name.split("/"))
    if not path.is_file():
        shipped = _shipped(root)
        near = [s for s in shipped if s.rsplit("/", 1)[-1] == name.rsplit("/", 1)[-1]]
        hint = f"did you mean {near[0]!r}?" if near else f"shipped: {', '.join(shipped)}"
        raise FileNotFoundError(f"attncc ships no kernel template {name!r}; {hint}")
    return path


def read_template(name: str) -> str:
    """Text of the shipped template `name`, exactly as stored (UTF-8).

    Example:
        >>> read_template("common/attncc_types.cuh").startswith("//")
        True
    """
    return template_path(name).read_text(encoding="utf-8")
