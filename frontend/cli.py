"""`h2c`: the h2 compiler's command line.

    h2c ir PATH         trace a model file (or parse an .h2ir file) and print its IR / costs
    h2c plan MODEL      plan a model on a cluster (HeteroAuto, uniform, or a .h2plan file)
    h2c compile MODEL   emit a build directory of per-stage programs, weights and streams
    h2c profile         measure what the local backends achieve (calibration)
    h2c check-ops       op-level accuracy of a backend against a float64 reference

Errors in the user's input print as `file:line:col: error: ...` and exit with code 2.
"""
from __future__ import annotations

import argparse
import json
import sys

from h2ir.errors import run_subcommand

# subcommand -> "module:function" taking argv and returning an exit code
SUBCOMMANDS = {
    "ir": "frontend.cli:ir_main",
    "plan": "frontend.plancli:main",
    "compile": "frontend.compiler:main",
    "profile": "frontend.profile:profile_main",
    "check-ops": "backends.check_ops:main",
}


def ir_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="h2c ir", description="Print a model's h2ir (typed graph "
                                 "grouped into layers, with costs).")
    ap.add_argument("path", help="a model file (.py) to trace, or an .h2ir file to parse")
    ap.add_argument("--arg", action="append", default=[], metavar="KEY=VALUE",
                    help="keyword argument for build_model (repeatable)")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--summary", action="store_true", help="one row per layer with its costs")
    ap.add_argument("--json", action="store_true", help="machine-readable layer costs")
    ap.add_argument("-o", "--output", help="write to FILE instead of stdout")
    a = ap.parse_args(argv)

    if a.path.endswith(".h2ir"):
        from h2ir.text import load_graph
        g = load_graph(a.path)
    else:
        from frontend.capture import capture, parse_model_args
        g = capture(a.path, parse_model_args(a.arg), a.micro_batch, a.seq_len)
        if g.attrs.get("model_output") and (a.json or a.summary):     # the IR header says it
            print(f"note: the model's output is not a tensor; h2 trains on "
                  f"{g.attrs['model_output']} as its logits", file=sys.stderr)
    if a.json:
        text = json.dumps(g.layer_costs().to_json(), indent=1) + "\n"
    elif a.summary:
        text = summary_table(g.layer_costs())
    else:
        from h2ir.text import print_graph
        text = print_graph(g)
    if a.output:
        with open(a.output, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


def summary_table(costs) -> str:
    from h2ir.text import human
    head = f"{'layer':<12} {'kind':<18} {'params':>10} {'fwd FLOP':>12} {'bwd FLOP':>12} " \
           f"{'act saved':>11} {'out':>10}"
    rows = [f"# {costs.model}: micro_batch={costs.micro_batch} seq_len={costs.seq_len}", head,
            "-" * len(head)]
    for l in costs.layers:
        rows.append(f"{l.name:<12} {l.kind:<18} {human(l.params, ''):>10} "
                    f"{human(l.fwd_flops, 'F'):>12} {human(l.bwd_flops, 'F'):>12} "
                    f"{human(l.act_saved_bytes, 'B'):>11} {human(l.out_bytes, 'B'):>10}")
    tot = costs.layers
    rows.append("-" * len(head))
    rows.append(f"{'total':<12} {f'{len(tot)} layers':<18} {human(costs.total_params, ''):>10} "
                f"{human(sum(l.fwd_flops for l in tot), 'F'):>12} "
                f"{human(sum(l.bwd_flops for l in tot), 'F'):>12} "
                f"{human(sum(l.act_saved_bytes for l in tot), 'B'):>11}")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    return run_subcommand(SUBCOMMANDS, "h2c", sys.argv[1:] if argv is None else argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
