"""`h2x`: the h2 executor's command line.

    h2x run BUILD/      train: one process per worker interprets its instruction stream
    h2x bench-comm      DiComm latency and bandwidth per transport, memcpy beside them
    h2x export BUILD/   a checkpoint's weights as one model (a transformers directory)
    h2x reshard A/ B/   a checkpoint of build A laid out for build B (another plan); then
                        `h2x run B --resume` continues

Errors in the user's input print as `file:line:col: error: ...` and exit with code 2.
"""
from __future__ import annotations

import argparse
import sys

from h2ir.errors import H2Error, float_flag, int_flag, run_subcommand

MAX_STEPS = 10 ** 12            # steps are counted in float64 status slots: exact below 2**53
MAX_TIMEOUT_S = 7 * 24 * 3600  # a week: a longer communication timeout is a typo
MAX_DATA_BYTES = 1 << 40        # of text; one file is memory-mapped, a directory's are read

SUBCOMMANDS = {
    "run": "executor.cli:run_main",
    "bench-comm": "executor.dicomm.bench:bench_main",
    "export": "executor.export:main",
    "reshard": "executor.reshard:main",
}


# short flags of h2x run -> the job configuration's fields (h2ir/config.py)
RUN_ALIASES = {"steps": ("training", "steps"), "data": ("data", "path"),
               "data_format": ("data", "format"), "tokenizer": ("data", "tokenizer"),
               "data_max_bytes": ("data", "max_bytes"), "json_log": ("logging", "json_log"),
               "trace": ("logging", "trace"), "checkpoint_every": ("checkpoint", "every"),
               "checkpoint_dir": ("checkpoint", "dir"), "resume": ("checkpoint", "resume"),
               "transport": ("run", "transport"), "strict_transport": ("run", "strict_transport"),
               "timeout": ("run", "timeout"), "device": ("run", "device"),
               "device_map": ("run", "device_map")}


def run_parser(prog: str = "h2x run") -> argparse.ArgumentParser:
    """h2x run's flags; `python -m executor.run` (the per-worker process under torchrun) reads
    the same ones. Each short flag sets a field of the job configuration (RUN_ALIASES); its
    default is the build's train.toml, then --config."""
    from executor.data import FORMATS
    ap = argparse.ArgumentParser(prog=prog, description="Train from a build directory. Every "
                                 "setting is a field of the job configuration (`h2c config` "
                                 "lists them), starting from the build's train.toml: --config "
                                 "FILE.toml sets fields, --section.field VALUE overrides one; "
                                 "the flags below are short names of fields.")
    ap.add_argument("build", help="build directory written by `h2c compile`")
    ap.add_argument("--config", metavar="FILE.toml", help="the job configuration")
    ap.add_argument("--steps", type=int_flag(1, MAX_STEPS), help="training.steps: train until "
                    "this step (default 20)")
    ap.add_argument("--data", metavar="PATH", help="data.path: a text file or directory, or a "
                    "token file (default: the Python standard library's source files)")
    ap.add_argument("--data-format", choices=FORMATS,
                    help="data.format; auto (default): .bin/.u16 -> tokens-u16, .u32 -> "
                    "tokens-u32, else text with --tokenizer, else bytes; tokens-u16/-u32: a flat "
                    "little-endian id array (memory-mapped); text: tokenized with --tokenizer; "
                    "bytes: byte values")
    ap.add_argument("--tokenizer", metavar="TOKENIZER_JSON",
                    help="data.tokenizer: the model's tokenizer.json for text data")
    ap.add_argument("--data-max-bytes", type=int_flag(2, MAX_DATA_BYTES), metavar="N",
                    help="data.max_bytes: read at most the first N bytes of text; token files "
                    "are memory-mapped whole")
    ap.add_argument("--json-log", help="logging.json_log: one JSON object per step to FILE")
    ap.add_argument("--trace", help="logging.trace: the measured Chrome/Perfetto trace to FILE")
    ap.add_argument("--checkpoint-every", type=int_flag(0, MAX_STEPS), metavar="K",
                    help="checkpoint.every: save a checkpoint every K steps (default 0: never)")
    ap.add_argument("--checkpoint-dir", metavar="DIR",
                    help="checkpoint.dir (default BUILD/ckpt); multi-host: a directory every host "
                    "sees (each host writes its own workers' files)")
    ap.add_argument("--resume", nargs="?", const="yes", choices=["yes", "auto"],
                    help="checkpoint.resume: continue from the newest complete checkpoint; "
                    "`--resume auto`: if there is one (a torchrun restart resumes automatically)")
    ap.add_argument("--transport", choices=["tcp", "shm", "rdma"],
                    help="run.transport: between the workers of one host (default shm); between "
                    "hosts tcp (rdma where a device is), chosen per link")
    ap.add_argument("--strict-transport", action="store_true", default=None,
                    help="run.strict_transport: refuse to run if the asked transport is "
                    "unavailable (default: fall back)")
    ap.add_argument("--timeout", type=float_flag(0, MAX_TIMEOUT_S, lo_open=True),
                    help="run.timeout: communication timeout, seconds (default 10)")
    ap.add_argument("--device", help="run.device: torch device for torch-backend stages "
                    "(default: the one compiled in, e.g. cpu); a type (cuda) gives each worker "
                    "its own index, an indexed one (cuda:0) puts them all there")
    ap.add_argument("--device-map", metavar="MAP", help="run.device_map: per-worker devices, "
                    "e.g. w0=cuda:1,w1=cuda:0; w0+w1=cuda:0 shares one on purpose")
    mh = ap.add_argument_group("multi-host (torchrun; docs/executor.md)")
    mh.add_argument("--nnodes", type=int_flag(1, 1 << 16), default=None, metavar="N",
                    help="hosts in the run: start this host's torchrun agent")
    mh.add_argument("--node-rank", type=int_flag(0, 1 << 16), default=None, metavar="I",
                    help="this host's index in the build (0: hosts the rendezvous)")
    mh.add_argument("--master", default=None, metavar="HOST:PORT",
                    help="node rank 0's address and the rendezvous port")
    mh.add_argument("--max-restarts", type=int_flag(0, 1000), default=0, metavar="R",
                    help="torchrun restarts of the whole job after a failure (default 0)")
    mh.add_argument("--rdzv-id", default=None, metavar="ID",
                    help="the job's rendezvous id (default: from the build's fingerprint)")
    mh.add_argument("--iface", default=None, metavar="NAME",
                    help="network interface workers listen on (default: the cluster file's "
                    "node iface, else the one that routes to the rendezvous host)")
    mh.add_argument("--secret-file", default=None, metavar="PATH",
                    help="the run secret every host shares (else env H2_SECRET)")
    return ap


def parse_run_args(argv: list[str], prog: str = "h2x run"):
    """(args, config): the flags, and the job configuration they resolve to — the build's
    train.toml < --config < short flags and --section.field. The resolved values are written
    back into the short flags' attributes, which the launchers read. A change to a field the
    programs depend on is refused."""
    from h2ir import config as jobconfig
    rest, overrides = jobconfig.split_overrides(argv)
    a = run_parser(prog).parse_args(rest)
    from executor.build import BuildDir
    build = BuildDir(a.build)
    built = build.config()
    given = {field: getattr(a, dest) for dest, field in RUN_ALIASES.items()
             if getattr(a, dest) is not None}
    cfg = jobconfig.build_config(base=build.config(), config_file=a.config, overrides=overrides,
                                 aliases=given)
    changed = jobconfig.program_differences(built, cfg)
    if changed:
        raise H2Error(f"the build's programs depend on {changed[0].split(':')[0]}, which "
                      f"differs from the build ({'; '.join(changed)})",
                      a.config or str(build.path / "train.toml"),
                      hint="recompile with `h2c compile` for other values")
    for dest, (section, key) in RUN_ALIASES.items():
        f = "global_" if key == "global" else key
        setattr(a, dest, getattr(getattr(cfg, section), f))
    a.resume = None if a.resume == "no" else a.resume
    a.job = cfg
    check_devices(a.device, getattr(a, "device_map", None), len(build.workers))
    return a, cfg


def check_devices(device: str | None, device_map: str | None, num_workers: int) -> None:
    """run.device and every device of run.device_map: a type a torch stage trains on, with a
    numeric index if any, refused before any worker starts (whether this host has the CUDA
    device is the worker's check: it is the process that takes it)."""
    from h2ir.schedule.devices import DEVICE_TYPES, parse_device_map
    named = [("--device", device)] if device else []
    named += [("--device-map", d) for d in parse_device_map(device_map, num_workers)[0].values()]
    for flag, dev in named:
        kind, colon, index = str(dev).partition(":")
        if kind not in DEVICE_TYPES or (colon and not index.isdigit()):
            why = "meta tensors have shapes but no data" if kind == "meta" else \
                "not a device a torch stage trains on"
            raise H2Error(f"{flag} {dev!r}: {why}; expected cpu, cuda or cuda:N",
                          hint="leave it out to run where the build was compiled for")


def run_main(argv: list[str]) -> int:
    a, cfg = parse_run_args(argv)
    if a.nnodes is not None:
        from executor.run import launch
        return launch(a, argv)
    if a.iface or a.secret_file or a.node_rank is not None or a.master:
        raise H2Error("--iface, --secret-file, --node-rank and --master go with --nnodes "
                      "(a multi-host run)")
    from executor.launcher import run
    if a.resume == "auto":
        from executor.checkpoint import complete_steps
        from pathlib import Path
        root = Path(a.checkpoint_dir) if a.checkpoint_dir else Path(a.build) / "ckpt"
        a.resume = "yes" if complete_steps(root) else None
    run(a.build, steps=a.steps, data=a.data, data_format=a.data_format, tokenizer=a.tokenizer,
        data_max_bytes=a.data_max_bytes, json_log=a.json_log, trace=a.trace,
        checkpoint_every=a.checkpoint_every, resume=bool(a.resume), transport=a.transport,
        strict_transport=a.strict_transport, timeout=a.timeout, device=a.device,
        device_map=a.device_map,
        checkpoint_dir=a.checkpoint_dir, config=cfg)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_subcommand(SUBCOMMANDS, "h2x", sys.argv[1:] if argv is None else argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
