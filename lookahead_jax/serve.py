"""The OpenAI-compatible server: `python -m lookahead_jax.serve --config=smollm2_135m --port=8000`.

Loads a preset (the embedded SmolLM2 by default) and serves /v1/completions and
/v1/chat/completions (streaming or not), /v1/models, /health and /metrics, with continuous
batching over --slots slots (`lookahead_jax.serving`), on one device or tensor-parallel over
a mesh's model axis (--mesh=model:4). Each request picks its
method and settings in the `lookahead` field, up to the server's maximum (--W/--N/--G, default
the preset's; --pl_tokens/--pl_ngram); see `lookahead_jax.serving.api` for every field.

--warmup compiles the default method's programs (greedy and sampling, every row count) before
listening, so the first requests do not wait for XLA. SIGTERM or Ctrl-C drains: new requests
get 503, running ones get up to --drain_s seconds to finish, then the process exits. Bad flags
print one `error: ...` line and exit with status 2.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time
from typing import Sequence

from lookahead_jax.engine import Engine
from lookahead_jax.sampling import Sampling
from lookahead_jax.serving.server import Server
from lookahead_jax.serving.slots import Limits, SlotEngine, SlotRequest
from models.config import ConfigError

EXIT_ERROR = 2


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m lookahead_jax.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="smollm2_135m", help="preset name (configs/)")
    p.add_argument("--ckpt", default=None, help="checkpoint overriding the preset's")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16"))
    p.add_argument("--mesh", default=None,
                   help="tensor parallelism, e.g. model:4: parameters and every slot's KV cache "
                        "split over 4 devices (default: the preset's mesh, else one device)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: any free port (printed)")
    p.add_argument("--slots", type=int, default=8, help="requests decoded at once")
    p.add_argument("--queue_size", type=int, default=64,
                   help="requests waiting for a slot before 429s")
    p.add_argument("--max_len", type=int, default=1024, help="context: prompt + new tokens")
    p.add_argument("--max_tokens", type=int, default=256, help="new tokens per request, at most")
    p.add_argument("--method", default=None, choices=("ar", "lookahead", "prompt_lookup"),
                   help="the default method (default: lookahead where the preset has settings)")
    for name, text in (("W", "window width"), ("N", "n-gram size"), ("G", "candidates")):
        p.add_argument(f"--{name}", type=int, default=None,
                       help=f"largest lookahead {text} a request may ask for (default: the "
                            f"preset's)")
    p.add_argument("--pl_tokens", type=int, default=16, help="largest prompt-lookup draft")
    p.add_argument("--pl_ngram", type=int, default=5, help="largest prompt-lookup n-gram")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="compile the default method's programs before listening")
    p.add_argument("--drain_s", type=float, default=30.0,
                   help="on SIGTERM, seconds running requests get to finish")
    return p.parse_args(argv)


def build_server(args: argparse.Namespace) -> Server:
    kw = {"dtype": args.dtype} if args.dtype else {}
    if args.mesh:
        kw["mesh"] = args.mesh
    engine = Engine.from_preset(args.config, ckpt=args.ckpt, devices=1, **kw)
    la = engine.lookahead
    limits = Limits(max_len=args.max_len, max_tokens=args.max_tokens,
                    W=args.W or (la.W if la else 15), N=args.N or (la.N if la else 5),
                    G=args.G if args.G is not None else (la.G if la else 15),
                    pl_tokens=args.pl_tokens, pl_ngram=args.pl_ngram)
    slots = SlotEngine(engine, slots=args.slots, limits=limits)
    server = Server(slots, model_name=args.config, default_method=args.method,
                    queue_size=args.queue_size)
    if args.warmup:
        ids = engine.encode("Warm up.") if engine.tokenizer is not None else [1, 2, 3]
        t0 = time.perf_counter()
        slots.warmup([SlotRequest(ids, method=server.default_method, max_tokens=2,
                                  sampling=s) for s in (Sampling(), Sampling(1.0))])
        print(f"warmup: compiled {server.default_method} (greedy and sampling, up to "
              f"{args.slots} rows) in {time.perf_counter() - t0:.1f} s", file=sys.stderr,
              flush=True)
    return server


async def serve(server: Server, host: str, port: int, drain_s: float) -> bool:
    port = await server.start(host, port)
    print(f"serving {server.model_name} on http://{host}:{port} ({server.slots.slots} slots, "
          f"default method {server.default_method}); SIGTERM drains", file=sys.stderr,
          flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    print(f"draining: up to {drain_s:g} s for {server.scheduler.pending} request(s)",
          file=sys.stderr, flush=True)
    finished = await server.shutdown(drain_s)
    print("stopped" + ("" if finished else " (requests still running were cancelled)"),
          file=sys.stderr, flush=True)
    return finished


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        server = build_server(args)
    except (ConfigError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR
    asyncio.run(serve(server, args.host, args.port, args.drain_s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
