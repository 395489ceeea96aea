"""`h2x`: the h2 executor's command line.

    h2x run BUILD/      train: one process per worker interprets its instruction stream
    h2x bench-comm      DiComm latency and bandwidth per transport, memcpy beside them

Errors in the user's input print as `file:line:col: error: ...` and exit with code 2.
"""
from __future__ import annotations

import argparse
import sys

from h2ir.errors import float_flag, int_flag, run_subcommand

MAX_STEPS = 10 ** 12            # steps are counted in float64 status slots: exact below 2**53
MAX_TIMEOUT_S = 7 * 24 * 3600  # a week: a longer communication timeout is a typo
MAX_DATA_BYTES = 1 << 40        # of text; one file is memory-mapped, a directory's are read

SUBCOMMANDS = {
    "run": "executor.cli:run_main",
    "bench-comm": "executor.dicomm.bench:bench_main",
}


def run_main(argv: list[str]) -> int:
    from executor.data import FORMATS, MAX_BYTES
    from executor.launcher import run
    ap = argparse.ArgumentParser(prog="h2x run", description="Train from a build directory.")
    ap.add_argument("build", help="build directory written by `h2c compile`")
    ap.add_argument("--steps", type=int_flag(1, MAX_STEPS), default=20,
                    help="train until this step (default 20)")
    ap.add_argument("--data", default=None, metavar="PATH", help="a text file or directory, or a "
                    "token file (default: the Python standard library's source files)")
    ap.add_argument("--data-format", default="auto", choices=FORMATS,
                    help="auto (default): .bin/.u16 -> tokens-u16, .u32 -> tokens-u32, else text "
                    "with --tokenizer, else bytes; tokens-u16/-u32: a flat little-endian id array "
                    "(memory-mapped); text: tokenized with --tokenizer; bytes: byte values")
    ap.add_argument("--tokenizer", default=None, metavar="TOKENIZER_JSON",
                    help="the model's tokenizer.json (the `tokenizers` library) for text data")
    ap.add_argument("--data-max-bytes", type=int_flag(2, MAX_DATA_BYTES), default=MAX_BYTES,
                    metavar="N",
                    help=f"read at most the first N bytes of text (default {MAX_BYTES}); token "
                    "files are memory-mapped whole")
    ap.add_argument("--json-log", default=None, help="write one JSON object per step to FILE")
    ap.add_argument("--trace", default=None, help="write the measured Chrome/Perfetto trace to FILE")
    ap.add_argument("--checkpoint-every", type=int_flag(0, MAX_STEPS), default=0, metavar="K",
                    help="save a checkpoint every K steps (default 0: never)")
    ap.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    ap.add_argument("--transport", default="shm", choices=["tcp", "shm", "rdma"])
    ap.add_argument("--strict-transport", action="store_true",
                    help="refuse to run if the asked transport is unavailable (default: fall back)")
    ap.add_argument("--timeout", type=float_flag(0, MAX_TIMEOUT_S, lo_open=True), default=10.0,
                    help="communication timeout, seconds (default 10)")
    ap.add_argument("--device", default=None, help="torch device for torch-backend stages "
                    "(default: the one compiled in, e.g. cpu)")
    a = ap.parse_args(argv)
    run(a.build, steps=a.steps, data=a.data, data_format=a.data_format, tokenizer=a.tokenizer,
        data_max_bytes=a.data_max_bytes, json_log=a.json_log, trace=a.trace,
        checkpoint_every=a.checkpoint_every, resume=a.resume, transport=a.transport,
        strict_transport=a.strict_transport, timeout=a.timeout, device=a.device)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_subcommand(SUBCOMMANDS, "h2x", sys.argv[1:] if argv is None else argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
