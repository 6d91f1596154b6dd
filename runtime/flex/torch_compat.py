"""What `attncc.flex_attention` takes from torch's FlexAttention signature beyond the basics:
torch's `kernel_options` keys and `return_aux=AuxRequest(...)` (docs/flex-api.md).

torch's kernel_options tune its Triton kernels. The keys with a meaning here are honoured: the
tile keys (`BLOCK_M`, `BLOCK_N`, `num_stages`, `num_warps`), their `fwd_`-prefixed forms (which
win over the plain key, as in torch), the two promises, and `BACKEND="AUTO"`. The others
(`PRESCALE_QK`, `USE_TMA`, `WRITE_DQ`, backward tiles, `bwd_` keys, ROCm knobs, another
`BACKEND`) are dropped with one warning per key per process. A key neither torch nor attncc
knows stays an error (`api._validate_kernel_options`).

Example:
    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as seen:
    ...     warnings.simplefilter("always")
    ...     opts = {"fwd_BLOCK_M": 64, "BLOCK_M": 32, "PRESCALE_QK": True}
    ...     forward_kernel_options(opts, known={"BLOCK_M"})
    {'BLOCK_M': 64}
    >>> [str(w.message).split(":")[0] for w in seen]
    ["attncc.flex_attention ignores torch's kernel_options ['PRESCALE_QK']"]
"""
from __future__ import annotations

import warnings
from typing import Any, Collection, Mapping, NamedTuple

import torch

from attncc.errors import InvalidArgument

try:  # torch >= 2.13 has them; attncc's results are then torch's own types
    from torch.nn.attention.flex_attention import AuxOutput, AuxRequest
except ImportError:  # torch 2.11 / 2.12: the same fields, as attncc's types
    class AuxRequest(NamedTuple):  # type: ignore[no-redef]
        """Which auxiliary outputs flex_attention returns (torch 2.13's AuxRequest)."""
        lse: bool = False
        max_scores: bool = False

    class AuxOutput(NamedTuple):  # type: ignore[no-redef]
        """Auxiliary outputs of flex_attention; None where not requested."""
        lse: torch.Tensor | None = None
        max_scores: torch.Tensor | None = None

# torch's keys that mean nothing to attncc's kernels, with the type torch gives them
_TORCH_ONLY: dict[str, type] = {
    "PRESCALE_QK": bool, "USE_TMA": bool, "FORCE_USE_FLEX_ATTENTION": bool, "WRITE_DQ": bool,
    "BACKEND": str, "BLOCK_M1": int, "BLOCK_N1": int, "BLOCK_M2": int, "BLOCK_N2": int,
    "kpack": int, "matrix_instr_nonkdim": int, "waves_per_eu": int,
}
_BACKENDS = ("AUTO", "TRITON", "FLASH", "TRITON_DECODE")
_INTERNAL = ("OUTPUT_LOGSUMEXP", "OUTPUT_MAX")
_warned: set[str] = set()


def _check_torch_value(key: str, val: Any) -> None:
    want = _TORCH_ONLY[key]
    if want is bool and not isinstance(val, bool):
        raise InvalidArgument(f"kernel_options[{key!r}] must be True or False, got {val!r}")
    if want is int and (isinstance(val, bool) or not isinstance(val, int)):
        raise InvalidArgument(f"kernel_options[{key!r}] must be an int, got {val!r}")
    if key == "BACKEND" and val not in _BACKENDS:
        raise InvalidArgument(f"kernel_options['BACKEND']={val!r}; torch's backends are "
                              f"{', '.join(_BACKENDS)} (attncc always runs its own kernels)")


def forward_kernel_options(kernel_options: Any, known: Collection[str]) -> Any:
    """`kernel_options` with torch's keys resolved: `fwd_X` as `X`, keys attncc has no use for
    dropped (warned once), everything else (attncc's keys, unknown keys) kept as given.
    `known`: attncc's own keys (`api.SUPPORTED_KERNEL_OPTIONS`). Not a mapping: returned
    unchanged, for the caller's type check."""
    if not isinstance(kernel_options, Mapping):
        return kernel_options
    out: dict[str, Any] = {}
    prefixed: dict[str, Any] = {}
    dropped: list[str] = []
    if "BACKEND" in kernel_options and kernel_options.get("FORCE_USE_FLEX_ATTENTION"):
        raise InvalidArgument("kernel_options: BACKEND cannot be combined with "
                              "FORCE_USE_FLEX_ATTENTION (torch's rule); keep only BACKEND")
    for key, val in kernel_options.items():
        if key in _INTERNAL:
            raise InvalidArgument(f"kernel_options[{key!r}] is internal to torch; ask for the "
                                  f"outputs with return_lse= or return_aux=AuxRequest(...)")
        base = key[4:] if key.startswith(("fwd_", "bwd_")) else key
        if key.startswith("bwd_") and (base in known or base in _TORCH_ONLY):
            dropped.append(key)  # a backward tile: the forward has no use for it
        elif base in _TORCH_ONLY:
            _check_torch_value(base, val)
            if not (base == "BACKEND" and val == "AUTO"):  # AUTO: attncc picks, as asked
                dropped.append(key)
        elif key.startswith("fwd_") and base in known:
            prefixed[base] = val
        else:
            out[key] = val
    out.update(prefixed)  # fwd_X wins over X, as in torch
    new = [k for k in dropped if k not in _warned]
    if new:
        _warned.update(new)
        warnings.warn(f"attncc.flex_attention ignores torch's kernel_options {new}: they tune "
                      f"torch's Triton kernels and have no meaning for attncc's (see "
                      f"docs/options.md); this warning is shown once per key", UserWarning,
                      stacklevel=3)
    return out


def aux_request(return_aux: Any, return_lse: bool) -> tuple[bool, bool]:
    """(lse wanted, max_scores wanted) from `return_lse` and torch's `return_aux`."""
    if return_aux is None:
        return return_lse, False
    if return_lse:
        raise InvalidArgument("pass return_lse=True or return_aux=AuxRequest(...), not both "
                              "(return_aux=AuxRequest(lse=True) returns the LSE)")
    lse, mx = getattr(return_aux, "lse", None), getattr(return_aux, "max_scores", None)
    if not isinstance(lse, bool) or not isinstance(mx, bool):
        raise InvalidArgument(f"return_aux must be an AuxRequest(lse=bool, max_scores=bool) "
                              f"(attncc.AuxRequest, or torch's), got {return_aux!r}")
    return lse, mx


def finish(out: torch.Tensor, lse: torch.Tensor | None, max_scores: torch.Tensor | None,
           return_lse: bool, return_aux: Any) -> Any:
    """flex_attention's result: out; (out, lse); or (out, AuxOutput) when return_aux is given."""
    if return_aux is not None:
        return out, AuxOutput(lse=lse if return_aux.lse else None,
                              max_scores=max_scores if return_aux.max_scores else None)
    return (out, lse) if return_lse else out


__all__ = ["AuxOutput", "AuxRequest", "aux_request", "finish", "forward_kernel_options"]
