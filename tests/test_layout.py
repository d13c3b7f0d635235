"""The package's layout shows its architecture (issue 24): pcdist/ in three parts a newcomer reads from
the names, the engine independent of the service, and the engine's central classes short."""

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "pcdist"


def test_pcdist_is_the_engine_the_distributed_layer_and_the_service():
    """Three folders and, beside them, only the package's entry points and the errors all three share."""
    parts = sorted(p.name for p in PKG.iterdir() if (p / "__init__.py").is_file())
    assert parts == ["distributed", "engine", "service"]
    assert sorted(p.name for p in PKG.glob("*.py")) == ["__init__.py", "__main__.py", "errors.py"]


def imported_modules(path: Path) -> set[str]:
    """The absolute names of the modules ``path`` (a file of pcdist) imports, relative imports resolved."""
    package = path.relative_to(PKG.parent).with_suffix("").parts[:-1]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else ()
            names.add(".".join([*base, *([node.module] if node.module else [])]))
    return names


@pytest.mark.parametrize("part, above", [("engine", ["distributed", "service"]), ("distributed", ["service"])])
def test_each_part_imports_nothing_of_the_parts_built_on_it(part, above):
    """The service (config, runs, data, checkpoints) builds on the other two and the distributed layer on the
    engine, never the other way round: the PC maths stays plain and parallelism is applied from outside
    (the engine declares the exchange it needs, pcdist/engine/exchange.py; distributed/ implements it)."""
    found = {f"{f.relative_to(PKG)}: {m}" for f in (PKG / part).rglob("*.py") for m in imported_modules(f)
             for a in above if m == f"pcdist.{a}" or m.startswith(f"pcdist.{a}.")}
    assert not found
    assert {"pcdist.engine.exchange", "pcdist.engine.network"} <= imported_modules(PKG / "engine/trainer.py"), \
        "relative imports are resolved"
    assert "pcdist.engine.exchange" in imported_modules(PKG / "distributed/exchange.py")


@pytest.mark.parametrize("path, name", [("engine/stage.py", "Stage"), ("engine/network.py", "PCNetwork"),
                                        ("engine/trainer.py", "PCTrainer")])
def test_the_engines_central_classes_stay_short(path, name):
    """At most 200 lines each: what is not the class's own job (conversions, checks, traces) is a function."""
    (cls,) = [n for n in ast.parse((PKG / path).read_text()).body if isinstance(n, ast.ClassDef) and n.name == name]
    assert cls.end_lineno - cls.lineno + 1 <= 200, f"{name} has {cls.end_lineno - cls.lineno + 1} lines"
