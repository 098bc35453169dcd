"""The installed package must contain every module of the tree (grammar/, solvers/, codegen/ are mapped)."""

from __future__ import annotations

import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAPPED = {"grammar": "schedc.grammar", "solvers": "schedc.solvers", "codegen": "schedc.codegen"}


def _packages_in_tree() -> set[str]:
    found = set()
    for init in ROOT.glob("schedc/**/__init__.py"):
        found.add(".".join(init.parent.relative_to(ROOT).parts))
    for folder, name in MAPPED.items():
        for init in (ROOT / folder).glob("**/__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((name, *rel)))
    return found


def test_every_package_is_listed_in_pyproject():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    missing = _packages_in_tree() - listed
    assert not missing, f"add these to [tool.setuptools] packages in pyproject.toml: {sorted(missing)}"
    for folder, name in MAPPED.items():
        assert config["package-dir"][name] == folder


def test_import_schedc_stays_light():
    # `schedc check` must start fast: importing the package may not pull in torch or OR-Tools.
    import subprocess
    import sys

    code = "import sys, schedc; print(any(m in sys.modules for m in ('torch', 'ortools')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_every_cli_command_imports_and_declares_its_options():
    # The dispatcher imports only the chosen command, so a broken one would go unnoticed elsewhere.
    import argparse
    import importlib

    from schedc.cli import COMMANDS

    for name, (module, _help) in COMMANDS.items():
        mod = importlib.import_module(module)
        parser = argparse.ArgumentParser(prog=f"schedc {name}")
        mod.add_arguments(parser)
        assert callable(mod.run), name
