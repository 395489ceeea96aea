"""`h2c`: the h2 compiler's command line.

    h2c ir PATH         trace a model file (or parse an .h2ir file) and print its IR / costs
    h2c plan MODEL      plan a model on a cluster (HeteroAuto, uniform, or a .h2plan file)
    h2c compile MODEL   emit a build directory of per-stage programs, weights and streams
    h2c profile         measure what the local backends achieve (calibration)
    h2c check-ops       op-level accuracy of a backend against a float64 reference
    h2c ops             the h2ir op set as a table: signature, backends, check-ops alignment
    h2c config          the job configuration's fields (defaults, meanings), or a file resolved

Errors in the user's input print as `file:line:col: error: ...` and exit with code 2.
"""
from __future__ import annotations

import argparse
import json
import sys

from h2ir.errors import MAX_MICRO_BATCH, MAX_SEQ_LEN, int_flag, run_subcommand

# subcommand -> "module:function" taking argv and returning an exit code
SUBCOMMANDS = {
    "ir": "frontend.cli:ir_main",
    "plan": "frontend.plancli:main",
    "compile": "frontend.compiler:main",
    "profile": "frontend.profile:profile_main",
    "check-ops": "backends.check_ops:main",
    "ops": "frontend.cli:ops_main",
    "config": "frontend.cli:config_main",
}


def config_main(argv: list[str]) -> int:
    """h2c config: every field of the job configuration with its default and meaning; with
    --config FILE (and --section.field overrides) the resolved configuration as TOML."""
    from h2ir import config as jobconfig
    argv, overrides = jobconfig.split_overrides(argv)
    ap = argparse.ArgumentParser(prog="h2c config", description="The job configuration that "
                                 "h2c and h2x read: every field, its default and meaning; with "
                                 "--config FILE (and --section.field VALUE) the resolved "
                                 "configuration as TOML, checked.")
    ap.add_argument("--config", metavar="FILE.toml")
    a = ap.parse_args(argv)
    if a.config or overrides:
        cfg = jobconfig.build_config(config_file=a.config, overrides=overrides)
        sys.stdout.write(cfg.to_toml())
    else:
        sys.stdout.write(jobconfig.describe())
    return 0


def ir_main(argv: list[str]) -> int:
    from h2ir import config as jobconfig
    argv, overrides = jobconfig.split_overrides(argv)
    ap = argparse.ArgumentParser(prog="h2c ir", description="Print a model's h2ir (typed graph "
                                 "grouped into layers, with costs).")
    ap.add_argument("path", nargs="?", help="a model file (.py) to trace, or an .h2ir file to "
                    "parse (default: the config's model.file)")
    ap.add_argument("--config", metavar="FILE.toml", help="the job configuration: model.file, "
                    "model.args, batch.seq and batch.micro are the defaults of the flags")
    ap.add_argument("--arg", action="append", default=[], metavar="KEY=VALUE",
                    help="keyword argument for build_model (repeatable)")
    ap.add_argument("--seq-len", type=int_flag(1, MAX_SEQ_LEN), help="batch.seq (default 128)")
    ap.add_argument("--micro-batch", type=int_flag(1, MAX_MICRO_BATCH),
                    help="batch.micro (default 1)")
    ap.add_argument("--summary", action="store_true", help="one row per layer with its costs")
    ap.add_argument("--json", action="store_true", help="machine-readable layer costs")
    ap.add_argument("-o", "--output", help="write to FILE instead of stdout")
    a = ap.parse_args(argv)
    cfg = jobconfig.build_config(config_file=a.config, overrides=overrides)
    a.path = a.path or cfg.model.file
    if not a.path:
        ap.error("the model file is required (a positional argument, or model.file in --config)")
    a.seq_len = a.seq_len or cfg.batch.seq
    a.micro_batch = a.micro_batch or cfg.batch.micro or 1
    config_args = cfg.model.args

    if a.path.endswith(".h2ir"):
        from h2ir.text import load_graph
        g = load_graph(a.path)
    else:
        from frontend.capture import capture, parse_model_args
        g = capture(a.path, {**config_args, **parse_model_args(a.arg)}, a.micro_batch, a.seq_len)
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


# ---- h2c ops -------------------------------------------------------------------------------------

CHECK_DTYPE = "f32"


def ops_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="h2c ops", description="The h2ir op set, one row per op: "
                                 "group, inputs and attributes, which backends implement it and "
                                 "whether each one's kernel is aligned (check-ops at f32).")
    ap.add_argument("--check", action="store_true", help=f"run check-ops on every backend at "
                    f"{CHECK_DTYPE} for the alignment columns (otherwise: 'not run'); exit 1 "
                    "if an op fails")
    ap.add_argument("--json", action="store_true", help="machine-readable table")
    a = ap.parse_args(argv)
    table = op_table(check=a.check)
    sys.stdout.write(json.dumps(table, indent=1) + "\n" if a.json else format_op_table(table))
    failed = any(b["aligned"] == "fail" for o in table["ops"] for b in o["backends"].values())
    return 1 if failed else 0


def op_table(check: bool = False) -> dict:
    """The op set as data: {"backends", "check", "ops": [{"op", "group", "inputs", "attrs",
    "backends": {name: {"implemented", "aligned"}}}], "counts"}. `aligned` is "pass" or "fail"
    (check-ops at f32 against the backend's independent reference), "not run" without `check`,
    "not implemented", or "runtime" for COMM/MOE ops, which the runtime executes, not kernels."""
    from backends.check_ops import EXCLUDED_GROUPS, check_backend
    from backends.registry import BACKENDS, get_backend
    from h2ir import opset

    impls = {b: get_backend(b) for b in BACKENDS}
    checked: dict[str, dict] = {b: {} for b in BACKENDS}
    if check:
        for b, be in impls.items():
            checked[b] = {r.op: r for r in check_backend(be, CHECK_DTYPE).results}
    rows = []
    for name, d in opset.OPS.items():
        per = {}
        for b, be in impls.items():
            r = checked[b].get(name)
            if d.group in EXCLUDED_GROUPS:
                status = "runtime"
            elif name not in be.ops:
                status = "not implemented"
            elif r is None:
                status = "not run"
            else:
                status = "pass" if r.passed else "fail"
            entry = {"implemented": name in be.ops, "aligned": status}
            if r is not None:
                entry.update(max_abs=r.max_abs, max_rel=r.max_rel, reference=r.reference)
                if r.error:
                    entry["error"] = r.error
            per[b] = entry
        rows.append({"op": name, "group": d.group.value, "inputs": list(d.inputs),
                     "attrs": [_attr_json(k, v) for k, v in d.attrs.items()], "backends": per})
    return {"backends": list(BACKENDS), "check": {"run": check, "dtype": CHECK_DTYPE},
            "ops": rows, "counts": _op_counts(rows, list(BACKENDS), check)}


def _attr_json(name: str, default) -> dict:
    from h2ir import opset
    if default is opset.REQUIRED:
        return {"name": name, "required": True}
    try:
        json.dumps(default)
    except TypeError:
        default = repr(default)
    return {"name": name, "required": False, "default": default}


def _op_counts(rows: list, backends: list, check: bool) -> dict:
    every = lambda pred: sum(all(pred(o["backends"][b]) for b in backends) for o in rows)  # noqa: E731
    kernel_rows = [o for o in rows if all(x["aligned"] != "runtime" for x in o["backends"].values())]
    return {
        "ops": len(rows), "kernel_ops": len(kernel_rows),
        "implemented_by_all": every(lambda x: x["implemented"]),
        "aligned_on_all": every(lambda x: x["aligned"] == "pass") if check else None,
        "per_backend": {b: {"implemented": sum(o["backends"][b]["implemented"] for o in rows),
                            "aligned": sum(o["backends"][b]["aligned"] == "pass" for o in rows)
                            if check else None} for b in backends},
    }


def op_signature(o: dict) -> str:
    """'x, indices*; dims, accumulate=false': inputs, then attributes (a default after '=')."""
    from h2ir.text import fmt_literal
    attrs = [a["name"] if a["required"] else f"{a['name']}={fmt_literal(a['default'])}"
             for a in o["attrs"]]
    ins = ", ".join(o["inputs"]) or "(no inputs)"
    return ins + ("; " + ", ".join(attrs) if attrs else "")


OP_STATUS = {"pass": "pass", "fail": "FAIL", "not run": "yes", "not implemented": "-",
             "runtime": "runtime"}


def format_op_table(t: dict) -> str:
    bs = t["backends"]
    rows = [[o["op"], o["group"], op_signature(o)] + [OP_STATUS[o["backends"][b]["aligned"]]
                                                      for b in bs] for o in t["ops"]]
    head = ["op", "group", "inputs; attributes"] + bs
    width = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    line = lambda r: "  ".join(str(x).ljust(w) for x, w in zip(r, width)).rstrip()  # noqa: E731
    out = [line(head), line(["-" * w for w in width])] + [line(r) for r in rows]
    c = t["counts"]
    out.append("")
    out.append(f"{c['ops']} ops ({c['kernel_ops']} run as kernels; the rest by the runtime); "
               f"implemented by all of {', '.join(bs)}: {c['implemented_by_all']}; "
               + (f"aligned on all (check-ops, {t['check']['dtype']}): {c['aligned_on_all']}"
                  if t["check"]["run"] else "alignment not run (--check runs check-ops)"))
    out.append("cells: pass/FAIL = implemented, check-ops result; yes = implemented, not checked; "
               "- = no kernel; runtime = executed by the runtime/DiComm")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    return run_subcommand(SUBCOMMANDS, "h2c", sys.argv[1:] if argv is None else argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
