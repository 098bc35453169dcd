"""No import cycles among schedc's modules (tests/import_graph.py builds the graph from the source)."""

from __future__ import annotations

from import_graph import cycle_edges, cycles, import_graph, modules


def test_no_import_cycles():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles (run `python tests/import_graph.py`):\n" + "\n".join(
        ", ".join(c) + ": " + "; ".join(f"{a} -> {b}" for a, b in cycle_edges(graph, c)) for c in found)


def test_the_graph_sees_every_kind_of_import(tmp_path):
    """Module level, inside a function, under TYPE_CHECKING, relative, and the mapped folders."""
    (tmp_path / "schedc" / "sub").mkdir(parents=True)
    (tmp_path / "solvers").mkdir()
    (tmp_path / "grammar").mkdir()
    (tmp_path / "codegen").mkdir()
    files = {
        "schedc/__init__.py": "",
        "schedc/a.py": "from schedc.sub import b\n",
        "schedc/sub/__init__.py": "",
        "schedc/sub/b.py": "def f():\n    from ..c import x\n",
        "schedc/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import schedc.solvers.d\n",
        "solvers/__init__.py": "",
        "solvers/d.py": "from schedc import a\n",
        "grammar/__init__.py": "",
        "codegen/__init__.py": "from schedc.solvers import d\n",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    assert set(modules(tmp_path)) == {"schedc", "schedc.a", "schedc.sub", "schedc.sub.b", "schedc.c",
                                      "schedc.solvers", "schedc.solvers.d", "schedc.grammar", "schedc.codegen"}
    graph = import_graph(tmp_path)
    assert graph["schedc.sub.b"] == {"schedc.c"}
    assert graph["schedc.c"] == {"schedc.solvers.d"}
    assert graph["schedc.codegen"] == {"schedc.solvers.d"}
    assert cycles(graph) == [["schedc.a", "schedc.c", "schedc.solvers.d", "schedc.sub.b"]]
