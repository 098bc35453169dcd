"""schedc's version (`schedc.__version__`), in a module that imports nothing.

Modules that the package's `__init__` reaches (codegen stamps generated
programs with it) read it from here, not from `schedc`, so that no module
imports the package that imports it. pyproject.toml's `version` is the same.
"""

__version__ = "0.1.0"
