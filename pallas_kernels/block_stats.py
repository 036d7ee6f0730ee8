"""How many attention tiles one lookahead step computes and skips, from the kernel's own block map.

    python -m pallas_kernels.block_stats --W=15 --N=5 --G=15 --cache_len=512
    python -m pallas_kernels.block_stats --W=15 --N=5 --G=15 --cache_len=512 --cache_size=2048 \
        --block_q=16 --block_k=16 --group=4 --json

Counts are per (batch row, K/V head) and step, for the kernel's tiling (`BlockMap`): query
tiles of block_q rows (a row = token x query head of the K/V group) against key tiles of
block_k keys over [cache (cache_size slots, cache_len committed) | the step's T tokens].
A tile is skipped when it holds no visible key: cache tiles at or past cache_len, and step
tiles the layout's mask leaves empty. Block sizes default to the kernel's for --backend.
"""

from __future__ import annotations

import json
from typing import Sequence

from absl import app, flags

from lookahead_jax.lookahead.layout import StepLayout
from pallas_kernels.block_map import BlockMap
from pallas_kernels.lookahead_attention import BACKENDS, default_blocks


def block_stats(W: int, N: int, G: int, cache_len: int, *, cache_size: int | None = None,
                group: int = 1, block_q: int | None = None, block_k: int | None = None,
                backend: str = "triton") -> dict:
    """The counts of `BlockMap.counts` for a step of (W, N, G), with the kernel's tiling."""
    layout = StepLayout(W, N, G)
    dq, dk = default_blocks(backend, layout.size * group)
    bmap = BlockMap.of(layout, group, block_q or dq, block_k or dk)
    return {"W": W, "N": N, "G": G, "backend": backend, **bmap.counts(cache_len, cache_size)}


def format_stats(st: dict) -> str:
    lines = [
        f"lookahead step W={st['W']} N={st['N']} G={st['G']}: T={st['T']} tokens x group "
        f"{st['group']} = {st['T'] * st['group']} query rows; cache {st['cache_len']} of "
        f"{st['cache_size']} slots; block_q={st['block_q']} block_k={st['block_k']} "
        f"({st['backend']}); {st['q_blocks']} query blocks",
        "tiles per (batch row, K/V head) and step:",
        f"  {'':6} {'computed':>9} {'skipped':>8} {'total':>6} {'skipped':>8}",
    ]
    for name, part in (("cache", st["cache_blocks"]), ("step", st["step_blocks"]),
                       ("all", {k: st[k] for k in ("computed", "skipped", "total")})):
        frac = part["skipped"] / part["total"] if part["total"] else 0.0
        lines.append(f"  {name:6} {part['computed']:>9} {part['skipped']:>8} {part['total']:>6} "
                     f"{frac:>8.1%}")
    return "\n".join(lines)


def define_flags() -> None:
    if "block_k" in flags.FLAGS:
        return
    flags.DEFINE_integer("W", 15, "Lookahead window width.")
    flags.DEFINE_integer("N", 5, "N-gram size.")
    flags.DEFINE_integer("G", 15, "Verification candidates.")
    flags.DEFINE_integer("cache_len", 512, "Committed tokens in the cache.")
    flags.DEFINE_integer("cache_size", None, "Cache slots (default: cache_len).")
    flags.DEFINE_integer("group", 1, "Query heads per K/V head (1 = MHA).")
    flags.DEFINE_integer("block_q", None, "Query rows per tile (default: the backend's).")
    flags.DEFINE_integer("block_k", None, "Keys per tile (default: the backend's).")
    flags.DEFINE_enum("backend", "triton", list(BACKENDS), "Whose default block sizes.")
    flags.DEFINE_bool("json", False, "Print JSON instead of a table.")


def main(argv: Sequence[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {' '.join(argv[1:])!r}")
    f = flags.FLAGS
    st = block_stats(f.W, f.N, f.G, f.cache_len, cache_size=f.cache_size, group=f.group,
                     block_q=f.block_q, block_k=f.block_k, backend=f.backend)
    print(json.dumps(st, indent=1) if f.json else format_stats(st))
    return 0


if __name__ == "__main__":
    define_flags()
    app.run(main)
