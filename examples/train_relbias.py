"""Train a tiny transformer whose attention learns a relative-position bias, with attncc and with
torch's FlexAttention, from the same seed; print both loss curves side by side and their time.

The attention variant is plain Python: `score + bias[h, q_idx - kv_idx + S - 1]` under a causal
mask, where `bias` is an `nn.Parameter` the score_mod captures, so its gradient comes out of the
attention's backward. The model (2 layers, d_model 256, 4 heads of 64, no position embedding: the
bias is its only notion of position) learns a copy task generated here: every sequence is 128
random tokens repeated, and the loss counts the predictable second half. The exact solution is an
attention head looking back 127 positions, so the learned table's peak shows up there. The loss
sits near chance (ln 64 = 4.16) until a table focuses a head, then falls within ~20 steps (the
eager model on the CPU, batch 8: 4.18 at step 50, 0.13 at 70, 0.002 at 100).

    python examples/train_relbias.py                          # CUDA: 300 steps, bf16 attention
    python examples/train_relbias.py --device cpu --steps 5   # CPU: attncc's fp64 reference
    python examples/train_relbias.py --out bench/results/train-relbias-h200.json   # + PNG

On CUDA the comparison is torch.compile'd FlexAttention; where its default Triton tiles do not
fit the GPU's shared memory (torch 2.11 on an H200), it trains again with FLEX_SMALL_TILES. On
the H200 both curves agree to 6e-3 at every step (bench/results/train-relbias-h200.json: attncc
9.4 ms a step, Flex 8.8, both host-bound at this size). torch's FlexAttention has no CPU
backward, so on the CPU the comparison is the same attention written out in eager PyTorch
(`eager`), and attncc runs its exact (float64, differentiable) reference.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

import attncc

VOCAB, PERIOD = 64, 128
LAYERS, D_MODEL, HEADS, SEQ = 2, 256, 4, 256


def copy_batch(gen: torch.Generator, batch: int, seq: int = SEQ) -> tuple[torch.Tensor, ...]:
    """(inputs, targets) [batch, seq] of the copy task: token i equals token i - PERIOD."""
    first = torch.randint(VOCAB, (batch, PERIOD), generator=gen)
    tokens = first.repeat(1, math.ceil((seq + 1) / PERIOD))[:, :seq + 1]
    return tokens[:, :-1], tokens[:, 1:]


def relbias_mod(bias: torch.Tensor, seq: int) -> Callable[..., Any]:
    """The learnable relative-bias score_mod: one entry per head and offset q_idx - kv_idx."""
    def relbias(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return score + bias[h, q_idx - kv_idx + seq - 1]
    return relbias


def causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return q_idx >= kv_idx


# FlexAttention's Triton tiles when its defaults do not fit the GPU's shared memory (torch 2.11's
# inductor on an H200 asks 245,760 bytes for this variant's forward, over the 232,448 an SM has)
FLEX_SMALL_TILES = {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 1, "num_warps": 4,
                    "bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64,
                    "bwd_BLOCK_N2": 32}


class Backend:
    """One attention implementation: `attend(q, k, v, score_mod)` with a causal mask;
    `flex_options`: FlexAttention's kernel_options (None: its autotuned defaults)."""

    def __init__(self, name: str, device: str, seq: int,
                 flex_options: dict[str, Any] | None = None) -> None:
        self.name, self.device = name, device
        self.flex_options = flex_options
        self.dtype = torch.bfloat16 if device == "cuda" else torch.float32
        if name == "attncc":
            self.block_mask = attncc.create_block_mask(causal, None, None, seq, seq, device=device)
        elif name == "flex":
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            self.block_mask = create_block_mask(causal, None, None, seq, seq, device=device)
            self.flex = torch.compile(flex_attention, dynamic=False)
        elif name != "eager":
            raise ValueError(f"backend {name!r}: expected attncc, flex or eager")

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               bias: torch.Tensor, score_mod: Callable[..., Any]) -> torch.Tensor:
        if self.name == "attncc":
            return attncc.flex_attention(q, k, v, score_mod=score_mod, block_mask=self.block_mask)
        if self.name == "flex":
            return self.flex(q, k, v, score_mod=score_mod, block_mask=self.block_mask,
                             kernel_options=self.flex_options)
        S = q.shape[-2]  # eager: the same attention written out (scores materialized)
        i = torch.arange(S, device=q.device)
        scores = (q @ k.transpose(-1, -2)).float() / q.shape[-1] ** 0.5
        scores = scores + bias[:, i[:, None] - i[None, :] + S - 1]
        scores = scores.masked_fill(i[:, None] < i[None, :], float("-inf"))
        return (scores.softmax(-1).to(v.dtype) @ v)


class Attention(nn.Module):
    def __init__(self, backend: Backend, seq: int) -> None:
        super().__init__()
        self.backend = backend
        self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL, bias=False)
        self.proj = nn.Linear(D_MODEL, D_MODEL, bias=False)
        self.bias = nn.Parameter(torch.zeros(HEADS, 2 * seq - 1))
        self.score_mod = relbias_mod(self.bias, seq)  # one function per layer: traced once

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        dtype = self.backend.dtype
        q, k, v = (t.contiguous() for t in  # [B, H, S, 64] each, one layout for every backend
                   self.qkv(x).to(dtype).view(B, S, 3, HEADS, -1).permute(2, 0, 3, 1, 4))
        out = self.backend.attend(q, k, v, self.bias, self.score_mod)
        if torch.is_grad_enabled() and out.grad_fn is None:
            # without a backward the layers below attention would silently stop training
            raise RuntimeError(f"{self.backend.name} attention returned an output without a "
                               f"grad_fn on {x.device}: it has no backward here")
        return self.proj(out.transpose(1, 2).reshape(B, S, D_MODEL).to(x.dtype))


class TinyTransformer(nn.Module):
    def __init__(self, backend: Backend, seq: int = SEQ) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"ln1": nn.LayerNorm(D_MODEL), "attn": Attention(backend, seq),
                           "ln2": nn.LayerNorm(D_MODEL),
                           "mlp": nn.Sequential(nn.Linear(D_MODEL, 4 * D_MODEL), nn.GELU(),
                                                nn.Linear(4 * D_MODEL, D_MODEL))})
            for _ in range(LAYERS))
        self.ln = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Cross-entropy over the predictable positions (targets from the second period on)."""
        x = self.embed(tokens)
        for blk in self.blocks:
            x = x + blk["attn"](blk["ln1"](x))
            x = x + blk["mlp"](blk["ln2"](x))
        logits = self.head(self.ln(x))[:, PERIOD - 1:]
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets[:, PERIOD - 1:].reshape(-1))


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def train(backend_name: str, args: argparse.Namespace,
          flex_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Train one model from `args.seed`; its losses, wall-clock and the learned bias peaks."""
    torch.manual_seed(args.seed)  # the same initial weights for every backend
    model = TinyTransformer(Backend(backend_name, args.device, args.seq, flex_options),
                            args.seq)
    model.to(args.device)
    # the bias tables get a larger step: a table entry must move by ~log(S) to focus a head
    tables = [p for n, p in model.named_parameters() if n.endswith("attn.bias")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("attn.bias")]
    opt = torch.optim.AdamW([{"params": rest}, {"params": tables, "lr": args.bias_lr}],
                            lr=args.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.seed)  # the same batches for every backend
    losses, first_step_s = [], 0.0
    _sync(args.device)
    t0 = time.perf_counter()
    for step in range(args.steps):
        tokens, targets = (t.to(args.device) for t in copy_batch(gen, args.batch, args.seq))
        loss = model(tokens, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())  # synchronizes: every step's time is in the wall-clock
        if step == 0:
            first_step_s = time.perf_counter() - t0
        if step % args.print_every == 0:
            print(f"  {backend_name} step {step:4d} loss {losses[-1]:.4f} "
                  f"({time.perf_counter() - t0:.1f} s)", flush=True)
    wall_s = time.perf_counter() - t0
    # the offset q_idx - kv_idx each head of the first layer learned to favour
    table = model.blocks[0]["attn"].bias.detach()[:, args.seq - 1:]
    return {"loss": losses, "wall_s": wall_s, "first_step_s": first_step_s,
            "peak_offsets": table.argmax(-1).tolist(),
            "bias_abs_mean": float(sum(p.detach().abs().mean() for n, p in
                                       model.named_parameters() if n.endswith("attn.bias")))}


def print_curves(names: list[str], runs: dict[str, dict[str, Any]], every: int) -> None:
    steps = len(runs[names[0]]["loss"])
    print(f"{'step':>6} " + " ".join(f"{n:>10}" for n in names) + f" {'|diff|':>9}")
    for i in sorted({*range(0, steps, every), steps - 1}):
        vals = [runs[n]["loss"][i] for n in names]
        print(f"{i:6d} " + " ".join(f"{v:10.4f}" for v in vals)
              + f" {max(vals) - min(vals):9.2e}")
    for n in names:
        r = runs[n]
        steady = (r["wall_s"] - r["first_step_s"]) / max(1, steps - 1)
        print(f"{n:>8}: {r['wall_s']:7.2f} s for {steps} steps (first step {r['first_step_s']:.2f}"
              f" s with compilation; then {1e3 * steady:.1f} ms/step); layer 0's bias peaks at "
              f"q_idx - kv_idx = {r['peak_offsets']} (the copy task's answer: {PERIOD - 1})")


def write_out(path: Path, names: list[str], runs: dict[str, dict[str, Any]],
              args: argparse.Namespace) -> None:
    """The curves and times as JSON at `path`, and a PNG beside it when matplotlib is there."""
    meta = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "torch": torch.__version__, "attncc": attncc.__version__,
            **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "model": {"layers": LAYERS, "d_model": D_MODEL, "heads": HEADS, "vocab": VOCAB}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))
    print(f"wrote {path}")
    try:
        import matplotlib
    except ImportError:
        print("no PNG: matplotlib is not installed")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for n in names:
        ax.plot(runs[n]["loss"], label=f"{n} ({runs[n]['wall_s']:.1f} s)")
    ax.set_xlabel("step")
    ax.set_ylabel("copy-task loss")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(f"learnable relative bias, {meta['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if cuda else "cpu")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=None, help="default 32 on CUDA, 2 on the CPU")
    ap.add_argument("--seq", type=int, default=SEQ, help="sequence length (> 128)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--bias-lr", type=float, default=5e-2, help="the bias tables' learning rate")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backends", nargs="+", default=None, choices=("attncc", "flex", "eager"),
                    help="default: attncc and flex on CUDA, attncc and eager on the CPU")
    ap.add_argument("--print-every", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None, help="write the curves as JSON (+ PNG)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not cuda:
        ap.error("--device cuda: torch sees no CUDA device; use --device cpu")
    if args.steps < 1 or args.seq <= PERIOD:
        ap.error(f"need --steps >= 1 and --seq > {PERIOD}")
    args.batch = args.batch or (32 if args.device == "cuda" else 2)
    args.print_every = args.print_every or max(1, args.steps // 15)
    return args


def train_or_retry(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """`train(name)`; when FlexAttention's default Triton tiles run out of shared memory, once
    more with FLEX_SMALL_TILES (recorded in the run as `flex_kernel_options`)."""
    try:
        return train(name, args)
    except Exception as e:  # noqa: BLE001 - only Flex's shared-memory failure is retried
        if name != "flex" or "out of resource" not in str(e):
            raise
        why = str(e).split("OutOfMemoryError: ")[-1].split("\n")[0][:160]
        print(f"  flex: its default tiles do not compile here ({why}); again with "
              f"kernel_options={FLEX_SMALL_TILES}", flush=True)
        torch._dynamo.reset()
        run = train(name, args, FLEX_SMALL_TILES)
        run["flex_kernel_options"] = FLEX_SMALL_TILES
        return run


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    args = parse_args(argv)
    names = args.backends or ["attncc", "flex" if args.device == "cuda" else "eager"]
    print(f"copy task, {LAYERS} layers, d_model {D_MODEL}, {HEADS} heads, seq {args.seq}, batch "
          f"{args.batch}, {args.steps} steps on {args.device}: " + " vs ".join(names))
    runs = {n: train_or_retry(n, args) for n in names}
    print_curves(names, runs, args.print_every)
    if args.out is not None:
        write_out(args.out, names, runs, args)
    return runs


if __name__ == "__main__":
    main()
