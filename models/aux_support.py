"""Which target architectures capture EAGLE-3 aux hidden states in SGLang and in vLLM.

A target class that does not capture aux states hands the draft its
final hidden state instead of the fused aux features, and acceptance collapses to 1.0.
Whether a class captures is a fact of the engine's source, so this module reads that
source (statically, with ``ast``: nothing is imported) and writes the answer as a table,
``models/aux_capture_table.py``, which ``serving.verify`` consults.

* SGLang: ``ModelRunner.init_aux_hidden_state_capture`` calls
  ``model.set_eagle3_layers_to_capture(ids)``; an architecture (a class named in a
  module's ``EntryClass``) supports EAGLE-3 iff that method is defined on it or on a base.
* vLLM: ``GPUModelRunner._setup_eagle3_aux_hidden_state_outputs`` requires
  ``supports_eagle3(model)``, i.e. the ``SupportsEagle3`` interface in the class's bases;
  architectures are the keys of ``_TEXT_GENERATION_MODELS`` / ``_MULTIMODAL_MODELS`` in
  ``vllm/model_executor/models/registry.py``.

Refresh the table (sources are the unpacked wheels; nothing is installed)::

    pip download --no-deps sglang==0.5.14 -d /tmp/sgl && (cd /tmp/sgl && unzip -qo sglang-*.whl 'sglang/*')
    pip download --no-deps vllm==0.33.0 -d /tmp/vllm && (cd /tmp/vllm && unzip -qo vllm-*.whl 'vllm/*')
    python -m models.aux_support --sglang-src /tmp/sgl/sglang --vllm-src /tmp/vllm/vllm
"""

from __future__ import annotations

import argparse
import ast
import re
from dataclasses import dataclass
from pathlib import Path

TABLE_PATH = Path(__file__).with_name("aux_capture_table.py")
SGLANG_METHOD = "set_eagle3_layers_to_capture"
SGLANG_PACKAGE = "sglang.srt.models"
VLLM_INTERFACE = "SupportsEagle3"
VLLM_REGISTRIES = ("_TEXT_GENERATION_MODELS", "_MULTIMODAL_MODELS")
VLLM_DRAFTS = ("_SPECULATIVE_DECODING_MODELS",)  # the draft classes (SGLang registers drafts like any model)

ClassKey = tuple[str, str]  # (module path relative to the models package, without .py; class name)


@dataclass(frozen=True)
class ClassInfo:
    key: ClassKey
    bases: tuple[ClassKey | str, ...]  # resolved (module, name) or an unresolved dotted name
    methods: frozenset[str]


@dataclass(frozen=True)
class Support:
    """Whether ``architecture`` captures aux hidden states in ``engine`` (per the table)."""

    engine: str
    version: str
    architecture: str
    known: bool  # the engine registers this architecture at all
    supported: bool
    via: str | None  # "module.Class" that provides the capture


# --------------------------------------------------------------------------- parsing


def _module_name(path: Path, root: Path) -> str:
    return ".".join(path.relative_to(root).with_suffix("").parts)


def _resolve_relative(module: str, level: int, target: str | None) -> str:
    parts = module.split(".")[: len(module.split(".")) - level]
    return ".".join(parts + ([target] if target else []))


def _imports(tree: ast.Module, module: str, package: str) -> dict[str, ClassKey | str]:
    """Local name -> (module relative to the models package, name), or a dotted module name."""
    names: dict[str, ClassKey | str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = _resolve_relative(module, node.level, node.module) if node.level else (node.module or "")
            rel = source.removeprefix(package + ".") if source.startswith(package + ".") else None
            for alias in node.names:
                local = alias.asname or alias.name
                names[local] = (rel, alias.name) if rel is not None else f"{source}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                names[alias.asname or alias.name.split(".")[0]] = alias.name
    return names


def dotted_name(node: ast.expr) -> str | None:
    """``a.b.c`` for a name or attribute chain (a subscript is dropped: ``List[int]`` -> ``List``); else None."""
    if isinstance(node, ast.Subscript):
        return dotted_name(node.value)
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = dotted_name(node.value)
        return f"{head}.{node.attr}" if head else None
    return None


def resolve_name(name: str, module: str, local: set[str], imports: dict, package: str) -> ClassKey | str:
    """A (dotted) name used in ``module`` as (module, class), or the dotted name when it leaves the package."""
    head, _, rest = name.partition(".")
    if not rest:
        if head in local:
            return (module, head)
        found = imports.get(head)
        return found if isinstance(found, tuple) else (found or head)
    found = imports.get(head)
    if isinstance(found, str) and found.startswith(package + "."):
        return (found.removeprefix(package + "."), rest)
    if isinstance(found, tuple):  # `from . import llama` then `llama.LlamaForCausalLM`
        return (f"{found[0]}.{found[1]}".strip("."), rest)
    return name


def parse_package(root: Path, package: str) -> tuple[dict[ClassKey, ClassInfo], dict[str, dict]]:
    """Every class under ``root`` (the models package dir) and each module's imports."""
    classes: dict[ClassKey, ClassInfo] = {}
    module_imports: dict[str, dict] = {}
    for path in sorted(root.rglob("*.py")):
        module = _module_name(path, root)
        tree = ast.parse(path.read_text(encoding="utf-8-sig"), filename=str(path))
        imports = _imports(tree, f"{package}.{module}", package)
        module_imports[module] = imports
        local = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
        for node in tree.body:
            if not isinstance(node, ast.ClassDef):
                continue
            bases = tuple(resolve_name(d, module, local, imports, package) for d in map(dotted_name, node.bases) if d is not None)
            methods = frozenset(n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
            classes[(module, node.name)] = ClassInfo((module, node.name), bases, methods)
    return classes, module_imports


def ancestors(key: ClassKey, classes: dict[ClassKey, ClassInfo]) -> list[ClassKey | str]:
    """``key`` and every base reachable from it (depth first, each once)."""
    seen: list[ClassKey | str] = []
    stack: list[ClassKey | str] = [key]
    while stack:
        item = stack.pop()
        if item in seen:
            continue
        seen.append(item)
        info = classes.get(item) if isinstance(item, tuple) else None
        if info is not None:
            stack.extend(reversed(info.bases))
    return seen


# --------------------------------------------------------------------------- engines


def _entry_names(tree: ast.Module) -> list[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "EntryClass" for t in node.targets):
            values = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value]
            return [d for d in map(dotted_name, values) if d is not None]
    return []


def sglang_registry(models_dir: Path, classes: dict[ClassKey, ClassInfo], imports: dict[str, dict]) -> dict[str, ClassKey]:
    """Architecture -> its class: every class a module names in ``EntryClass`` (SGLang registers it by name)."""
    registry: dict[str, ClassKey] = {}
    for path in sorted(models_dir.rglob("*.py")):
        module = _module_name(path, models_dir)
        local = {k[1] for k in classes if k[0] == module}
        for name in _entry_names(ast.parse(path.read_text(encoding="utf-8-sig"))):
            key = resolve_name(name, module, local, imports[module], SGLANG_PACKAGE)
            if isinstance(key, tuple):
                registry[key[1]] = key
    return registry


def scan_sglang(models_dir: Path) -> dict[str, str | None]:
    """Architecture -> "module.Class" defining ``set_eagle3_layers_to_capture`` (None: absent)."""
    classes, imports = parse_package(models_dir, SGLANG_PACKAGE)
    table: dict[str, str | None] = {}
    for arch, key in sglang_registry(models_dir, classes, imports).items():
        via = next(
            (a for a in ancestors(key, classes) if isinstance(a, tuple) and a in classes and SGLANG_METHOD in classes[a].methods),
            None,
        )
        table[arch] = f"{via[0]}.{via[1]}" if via else None
    return dict(sorted(table.items()))


def _registry(models_dir: Path, registries: tuple[str, ...] = VLLM_REGISTRIES) -> dict[str, ClassKey]:
    tree = ast.parse((models_dir / "registry.py").read_text(encoding="utf-8-sig"))
    entries: dict[str, ClassKey] = {}
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else (node.targets[0] if isinstance(node, ast.Assign) else None)
        if not (isinstance(target, ast.Name) and target.id in registries and isinstance(node.value, ast.Dict)):
            continue
        for k, v in zip(node.value.keys, node.value.values):
            if isinstance(k, ast.Constant) and isinstance(v, ast.Tuple) and len(v.elts) == 2:
                module, cls = (e.value if isinstance(e, ast.Constant) else None for e in v.elts)
                if isinstance(module, str) and isinstance(cls, str):
                    entries[k.value] = (module, cls)
    return entries


def scan_vllm(models_dir: Path) -> dict[str, str | None]:
    """Architecture -> "module.Class" whose bases include ``SupportsEagle3`` (None: absent)."""
    classes, _ = parse_package(models_dir, "vllm.model_executor.models")
    table: dict[str, str | None] = {}
    for arch, key in _registry(models_dir).items():
        via = None
        for a in ancestors(key, classes):
            info = classes.get(a) if isinstance(a, tuple) else None
            if info is not None and any(b == ("interfaces", VLLM_INTERFACE) or b == VLLM_INTERFACE for b in info.bases):
                via = f"{a[0]}.{a[1]}"
                break
        table[arch] = via
    return dict(sorted(table.items()))


def scan_vllm_drafts(models_dir: Path) -> list[str]:
    """The draft architectures vLLM registers (what a draft's ``architectures`` may name)."""
    return sorted(_registry(models_dir, VLLM_DRAFTS))


def source_version(package_dir: Path) -> str:
    """``__version__`` from ``<package>/_version.py`` (as written by the wheel build)."""
    path = package_dir / "_version.py"
    match = re.search(r"__version__\s*=\s*(?:version\s*=\s*)?['\"]([^'\"]+)['\"]", path.read_text()) if path.is_file() else None
    if match is None:
        raise ValueError(f"{path}: cannot read the package version; is {package_dir} an unpacked wheel?")
    return match.group(1)


# --------------------------------------------------------------------------- table


def write_table(tables: dict[str, dict], path: Path = TABLE_PATH) -> Path:
    lines = [
        '"""Generated by `python -m models.aux_support`: do not edit. Architecture -> the class that',
        'provides EAGLE-3 aux hidden-state capture in that engine, or None (no capture)."""',
        "",
        "TABLE = {",
    ]
    for engine, entry in tables.items():
        lines.append(f"    {engine!r}: {{")
        lines.append(f"        'version': {entry['version']!r},")
        lines.append(f"        'rule': {entry['rule']!r},")
        lines.append("        'architectures': {")
        lines += [f"            {arch!r}: {via!r}," for arch, via in entry["architectures"].items()]
        lines.append("        },")
        if "drafts" in entry:
            lines += ["        'drafts': [", *(f"            {arch!r}," for arch in entry["drafts"]), "        ],"]
        lines.append("    },")
    lines.append("}")
    path.write_text("\n".join(lines) + "\n")
    return path


def aux_capture_support(engine: str, architecture: str) -> Support:
    """Look ``architecture`` up in the committed table for ``engine`` ("sglang" or "vllm")."""
    from models.aux_capture_table import TABLE

    if engine not in TABLE:
        raise ValueError(f"unknown engine {engine!r}; the aux-capture table knows {sorted(TABLE)}")
    entry = TABLE[engine]
    archs = entry["architectures"]
    via = archs.get(architecture)
    return Support(engine, entry["version"], architecture, architecture in archs, via is not None, via)


def draft_class_known(engine: str, architecture: str) -> tuple[bool, str]:
    """(whether ``engine``'s committed table has a draft class ``architecture``, the engine's version)."""
    from models.aux_capture_table import TABLE

    entry = TABLE[engine]
    return architecture in entry.get("drafts", entry["architectures"]), entry["version"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sglang-src", type=Path, required=True, help="unpacked sglang package dir (contains srt/)")
    parser.add_argument("--vllm-src", type=Path, required=True, help="unpacked vllm package dir (contains model_executor/)")
    parser.add_argument("--out", type=Path, default=TABLE_PATH)
    args = parser.parse_args(argv)
    sglang = scan_sglang(args.sglang_src / "srt" / "models")
    vllm = scan_vllm(args.vllm_src / "model_executor" / "models")
    tables = {
        "sglang": {"version": source_version(args.sglang_src), "rule": f"defines or inherits {SGLANG_METHOD}", "architectures": sglang},
        "vllm": {
            "version": source_version(args.vllm_src),
            "rule": f"inherits {VLLM_INTERFACE}",
            "architectures": vllm,
            "drafts": scan_vllm_drafts(args.vllm_src / "model_executor" / "models"),
        },
    }
    out = write_table(tables, args.out)
    for engine, entry in tables.items():
        archs = entry["architectures"]
        print(f"{engine} {entry['version']}: {sum(v is not None for v in archs.values())} of {len(archs)} architectures capture aux states")
        if "drafts" in entry:
            print(f"{engine} {entry['version']}: {len(entry['drafts'])} draft architectures")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
