"""attncc.kernels: the CUDA templates attncc ships (package data, read by codegen).

The `.cuh` files here are self-contained (no toolkit `#include`), so NVRTC can compile them on a
machine with no CUDA toolkit. Codegen inlines them into one translation unit.

Example:
    >>> from attncc.kernels import read_template, template_path
    >>> template_path("attncc_types.cuh").name
    'attncc_types.cuh'
    >>> "namespace attncc" in read_template("attention_params.cuh")
    True
"""
from __future__ import annotations

import pathlib
from importlib import resources

__all__ = ["read_template", "template_path"]


def _check_name(name: str) -> None:
    # Only plain file names: templates live flat in this package, and a path would escape it.
    if not name or "/" in name or "\\" in name or name.startswith("."):
        raise ValueError(f"template name {name!r} must be a plain file name such as "
                         f"'simple_attention.cuh'")


def template_path(name: str) -> pathlib.Path:
    """Filesystem path of the shipped template `name` (e.g. 'simple_attention.cuh').

    Example:
        >>> template_path("simple_attention.cuh").exists()
        True
    """
    _check_name(name)
    path = pathlib.Path(str(resources.files(__name__).joinpath(name)))
    if not path.is_file():
        shipped = sorted(p.name for p in path.parent.iterdir()
                         if p.suffix in (".cuh", ".cu", ".j2"))
        raise FileNotFoundError(f"attncc ships no kernel template {name!r}; shipped: "
                                f"{', '.join(shipped)}")
    return path


def read_template(name: str) -> str:
    """Text of the shipped template `name`, exactly as stored (UTF-8).

    Example:
        >>> read_template("attncc_types.cuh").startswith("//")
        True
    """
    return template_path(name).read_text(encoding="utf-8")
