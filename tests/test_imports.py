"""Imports flow one way: models <- serving <- trainer <- launch <- lab, no two modules import each other,
and no two folders do either (a folder: a package or sub-package, its modules one node; the
trainer's top-level modules are one node, ``trainer/data`` another).

Every import statement of every module is read with ``ast`` (also those inside functions: a
lazy import is still an arrow). The product's tests (``tests/models``, ``tests/serving``,
``tests/trainer``, ``tests/fixtures``, ``tests/test_*.py``) import neither ``launch`` nor the experiment
tooling in ``lab``: an oracle they need lives in the test or in ``tests/fixtures``. ``python
tests/test_imports.py [ROOT]`` prints the offences of another checkout.
"""

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("models", "serving", "trainer", "launch", "lab")  # a package may import only those before it
PRODUCT = ("models", "serving", "trainer")  # the installed packages
TOOLING = ("launch", "lab")  # scripts run from a checkout
PRODUCT_TESTS = ("tests/models", "tests/serving", "tests/trainer", "tests/fixtures")  # and tests/test_*.py


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under the layered packages."""
    modules = {}
    for package in LAYERS:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def imported_names(path: Path, module: str) -> set[str]:
    """Dotted names one module imports: ``from a.b import c`` gives ``a.b.c`` (``a.b`` when c is no module)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the project modules it imports (a name resolves to its longest module prefix)."""
    modules = module_files(root)
    graph = {}
    for module, path in modules.items():
        targets = set()
        for name in imported_names(path, module):
            parts = name.split(".")
            while parts and ".".join(parts) not in modules:
                parts.pop()
            if parts and ".".join(parts) != module:
                targets.add(".".join(parts))
        graph[module] = targets
    return graph


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    rank = {package: i for i, package in enumerate(LAYERS)}
    return sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        for target in targets
        if rank[target.split(".")[0]] > rank[module.split(".")[0]]
    )


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def folder_of(module: str, path: Path) -> str:
    """The package a module belongs to (a package's ``__init__`` is the package itself)."""
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def folder_imports(root: Path) -> dict[tuple[str, str], list[str]]:
    """(folder, folder it imports) -> the module imports that make that arrow."""
    modules = module_files(root)
    folder = {module: folder_of(module, path) for module, path in modules.items()}
    arrows: dict[tuple[str, str], list[str]] = {}
    for module, targets in import_graph(root).items():
        for target in sorted(targets):
            if folder[target] != folder[module]:
                arrows.setdefault((folder[module], folder[target]), []).append(f"{module} -> {target}")
    return arrows


def folder_graph(root: Path) -> dict[str, set[str]]:
    """Folder -> the folders its modules import."""
    graph: dict[str, set[str]] = {folder_of(m, p): set() for m, p in module_files(root).items()}
    for source, target in folder_imports(root):
        graph[source].add(target)
    return graph


def folder_cycle_imports(root: Path, cycle: list[str]) -> list[str]:
    """The module imports between the folders of ``cycle``, the ones to move to break it."""
    inside = set(cycle)
    return [line for (a, b), lines in sorted(folder_imports(root).items()) if a in inside and b in inside for line in lines]


def product_test_files(root: Path) -> list[Path]:
    """The tests of models/, serving/ and trainer/, their fixtures and the checks of the whole tree."""
    files = [p for folder in PRODUCT_TESTS for p in sorted((root / folder).rglob("*.py"))]
    return files + sorted((root / "tests").glob("test_*.py"))


def tooling_imports(root: Path) -> list[str]:
    """``file -> name`` for each import of ``launch`` or ``lab`` by the product or its tests."""
    files = [p for package in PRODUCT for p in sorted((root / package).rglob("*.py"))] + product_test_files(root)
    found = []
    for path in files:
        module = ".".join(path.relative_to(root).with_suffix("").parts)
        for name in sorted(imported_names(path, module)):
            if name.split(".")[0] in TOOLING:
                found.append(f"{path.relative_to(root)} -> {name}")
    return found


def test_graph_reads_the_tree():
    graph = import_graph(ROOT)
    assert "trainer.build" in graph and "models.draft" in graph["trainer.build"]


def test_no_lower_package_imports_a_higher_one():
    assert upward_imports(import_graph(ROOT)) == []


def test_no_import_cycles():
    assert cycles(import_graph(ROOT)) == []


def test_no_import_cycles_between_folders():
    found = cycles(folder_graph(ROOT))
    assert found == [], "\n".join(line for cycle in found for line in folder_cycle_imports(ROOT, cycle))


def test_the_product_and_its_tests_import_no_tooling():
    assert tooling_imports(ROOT) == []


def test_tests_import_launch_as_a_package():
    """Tests import ``launch.*`` and ``lab.*`` like every other package (their ``__init__.py``), never by editing the import path."""
    edits = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "tests").rglob("*.py")) if "sys." + "path" in p.read_text()]
    assert edits == []


def test_checks_catch_an_upward_import_and_a_cycle(tmp_path):
    for package, text in {
        "models": {"a.py": "from serving import b\n"},
        "serving": {"b.py": "import serving.c\n", "c.py": "from . import b\n"},
        "trainer": {},
        "launch": {},
        "lab": {},
    }.items():
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
        for name, source in text.items():
            (tmp_path / package / name).write_text(source)
    graph = import_graph(tmp_path)
    assert upward_imports(graph) == ["models.a -> serving.b"]
    assert cycles(graph) == [["serving.b", "serving.c"]]


def test_the_tooling_check_catches_a_product_module_or_test_importing_the_lab(tmp_path):
    for path, source in {
        "models/a.py": "",
        "serving/b.py": "def f():\n    from lab.bench import rows\n",
        "trainer/c.py": "",
        "tests/trainer/test_c.py": "import launch.recipe\n",
        "tests/fixtures/oracle.py": "from lab import variants\n",
        "tests/test_whole.py": "import models.a\n",
        "tests/lab/test_bench.py": "from lab.bench import rows\n",  # the tooling's own tests may
    }.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(source)
    assert tooling_imports(tmp_path) == [
        "serving/b.py -> lab.bench.rows",
        "tests/trainer/test_c.py -> launch.recipe",
        "tests/fixtures/oracle.py -> lab.variants",
    ]


def test_the_folder_check_catches_a_loop_the_module_check_cannot_see(tmp_path):
    """Two loops of folders through modules that form no module cycle: trainer/data -> trainer/datagen ->
    trainer/data, and the trainer's top level -> trainer/report -> the top level."""
    for path, source in {
        "models/__init__.py": "",
        "serving/__init__.py": "",
        "launch/__init__.py": "",
        "lab/__init__.py": "",
        "trainer/__init__.py": "",
        "trainer/config.py": "",
        "trainer/loop.py": "from trainer.report import card\n",
        "trainer/data/__init__.py": "",
        "trainer/data/dedup.py": "",
        "trainer/data/select.py": "from trainer.datagen.filters import english\n",
        "trainer/datagen/__init__.py": "",
        "trainer/datagen/filters.py": "from trainer.data.dedup import words\n",
        "trainer/report/__init__.py": "",
        "trainer/report/card.py": "from trainer.config import Config\n",
    }.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(source)
    assert cycles(import_graph(tmp_path)) == []
    found = cycles(folder_graph(tmp_path))
    assert found == [["trainer", "trainer.report"], ["trainer.data", "trainer.datagen"]]
    assert folder_cycle_imports(tmp_path, found[1]) == [
        "trainer.data.select -> trainer.datagen.filters",
        "trainer.datagen.filters -> trainer.data.dedup",
    ]


if __name__ == "__main__":
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT
    graph, folder_loops = import_graph(root), cycles(folder_graph(root))
    print("\n".join(["upward:", *upward_imports(graph), "cycles:", *map(" <-> ".join, cycles(graph))]))
    print("\n".join(["tooling imported by the product or its tests:", *tooling_imports(root)]))
    print("\n".join(["folder cycles:", *(f"{' <-> '.join(c)}: {'; '.join(folder_cycle_imports(root, c))}" for c in folder_loops)]))
