"""`schedc profile SPEC`: time a model's stages and measure their memory, as the runtime runs them.

Prints a table per stage, the ratio to the cost model where the spec's
`model` block allows one, and a `stages { ... }` block to paste into the
spec; `--write` puts that block into SPEC itself (replacing its `stages`
block, atomically), so `schedc compile SPEC` plans with measured costs.
A spec that names no `model.source` is refused (E584); figures still noisy
after re-measuring are printed but not offered, and the command fails (E585).
torch is imported only here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from schedc.diagnostics import RunError, SchedcError, error
from schedc.load import load_argument, load_text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", metavar="SPEC", help="spec file (model.source, model.data, partition), or - for stdin")
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    parser.add_argument("--repeats", type=int, default=10, metavar="N", help="timed rounds per stage (default 10)")
    parser.add_argument("--warmup", type=int, default=3, metavar="N", help="untimed rounds first (default 3)")
    parser.add_argument("--write", action="store_true",
                        help="replace the spec's `stages` block with the measured one (or add it)")
    parser.add_argument("--json", action="store_true", help="print the measurements as JSON")


def run(args: argparse.Namespace) -> int:
    from schedc.profile import profile, render, write_stages_block

    if args.spec == "-" and args.write:
        raise RunError([error("E583", "--write needs a spec file, not standard input",
                              hint="save the spec to a file, or paste the printed block yourself")])
    spec, text = load_argument(args.spec)
    name = spec.source_name
    if args.write:
        from schedc.plan import check_output_file

        check_output_file(args.spec, "--write: the spec")
    try:
        result = profile(spec, device=args.device, repeats=args.repeats, warmup=args.warmup)
    except SchedcError as exc:
        exc.sources.setdefault(name, text)  # so a span into the spec shows its line
        raise
    noise = result.noise_error()
    if noise is not None:  # the figures are shown, never offered, never written
        if args.json:
            print(json.dumps({"ok": False, **result.to_json(), "stages_block": None, "written": None,
                              "diagnostics": [d.to_json() for d in noise.diagnostics]}, indent=2))
            return 1
        sys.stdout.write(render(result))
        sys.stdout.flush()
        raise noise
    written = None
    if args.write:
        new_text = write_stages_block(args.spec, text, result.stages_block())
        load_text(new_text, name=name)  # what is written must load (E2xx otherwise, nothing written)
        target = Path(args.spec)
        tmp = target.with_name(f".{target.name}.schedc-tmp")
        tmp.write_text(new_text)
        os.replace(tmp, target)
        written = str(target)
    if args.json:
        out = {"ok": True, **result.to_json(), "stages_block": result.stages_block(), "written": written}
        print(json.dumps(out, indent=2))
    else:
        sys.stdout.write(render(result))
        if written:
            print(f"wrote the measured stages block into {written}")
    return 0
