"""`schedc check SPEC`: parse and validate a spec; print what it means.

Exit 0 when valid (summary on stdout), 1 when not (diagnostics on stderr,
rendered by the dispatcher). `SPEC` may be `-` for standard input. With
`--json`, the resolved spec (or the diagnostics) is printed as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys

from schedc.load import load_argument
from schedc.summary import spec_to_dict, summarize


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", metavar="SPEC", help="spec file, or - to read standard input")
    parser.add_argument("--json", action="store_true", help="print the resolved spec (or the errors) as JSON")


def run(args: argparse.Namespace) -> int:
    spec, _ = load_argument(args.spec)
    if args.json:
        print(json.dumps({"ok": True, "spec": spec_to_dict(spec)}, indent=2))
    else:
        sys.stdout.write(summarize(spec))
    return 0
