"""Preflight for ``engine=sglang``: does SGLang's class for this target capture the aux hidden
states we train on, at the layers we train on? Answered from SGLang's source (parsed, never
imported), before a weight is loaded or a training step runs.

For the architecture a target's ``config.json`` names (``architectures[0]``):

1. SGLang registers a class of that name (some module's ``EntryClass``).
2. The class defines or inherits ``set_eagle3_layers_to_capture``, which ``ModelRunner`` calls
   to switch EAGLE-3 capture on (model_runner.py:1002-1011). A class without it is the field
   failure: the draft is handed the H-wide last hidden state instead of num_aux x H aux
   features, ``fc`` is skipped by a shape check and acceptance collapses to ~1.0.
3. Replaying that method's source on a stand-in model (``_StandIn``) with our ids sets
   ``layers_to_capture`` to the layers k + 1 whose *input* (= the output of layer k, our
   semantics) SGLang captures. The classes differ: Llama-style classes add 1 to every explicit
   id (llama.py:812-824); the DeepSeek-V2/V3 family, Kimi-K2.5 included, adds 1 only when the
   first id is 1 and otherwise takes the ids as layer inputs (deepseek_v2.py:2799-2814), so
   there ids [2, 30, 57] would be captured one layer early.
4. The model whose ``layers_to_capture`` were set reads them in its ``forward``, and the class's
   ``forward`` (or that of the language model it wraps) hands ``aux_hidden_states`` to its logits
   processor, which returns them under ``CaptureHiddenMode.FULL``.

Beside it, ``choose_attention_backend`` picks (or checks) the attention backend from the files the
install carries: SGLang's own Hopper default, fa3, dies at the first prefill where FlashAttention-3
was left out.

The ids we pass are ours unchanged (``AuxLayerIds.sglang_argument``) and the SGLang export writes the same
list as ``eagle_aux_hidden_state_layer_ids`` (serving/formats.py), which SGLang's serving hands to
the same method: one replay covers training and serving. With SGLang importable the engine checks
the same things again on the live model (``models.backends.sglang.target``).

The source is the installed ``sglang`` package (found with ``importlib.util.find_spec``, not
imported) or the dir ``$STREAMDRAFT_SGLANG_SRC`` names (an unpacked wheel's ``sglang/``)::

    pip download --no-deps sglang==0.5.14 -d /tmp/sgl && (cd /tmp/sgl && unzip -qo sglang-*.whl 'sglang/*')
    STREAMDRAFT_SGLANG_SRC=/tmp/sgl/sglang python -m models.backends.sglang.preflight /models/Kimi-K2.5
"""

from __future__ import annotations

import argparse
import ast
import builtins
import copy
import functools
import importlib.util
import logging
import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Sequence

from models.aux_ids import AuxLayerIds
from models.aux_support import (
    SGLANG_METHOD,
    SGLANG_PACKAGE,
    ClassInfo,
    ClassKey,
    ancestors,
    dotted_name,
    parse_package,
    resolve_name,
    sglang_registry,
    source_version,
)
from models.target_config import read_json_object, read_text_config

SOURCE_ENV = "STREAMDRAFT_SGLANG_SRC"
INSTALL_HINT = "pip install 'streamdraft[sglang]'"
CAPTURE_MARKERS = ("layers_to_capture", "_is_layer_to_capture")  # what a decoder body's forward tests per layer
_LAST_RANK = SimpleNamespace(is_last_rank=True, is_first_rank=True)


# --------------------------------------------------------------------------- the source


def find_sglang_source(explicit: str | Path | None = None) -> Path | None:
    """The ``sglang`` package dir: ``explicit``, else $STREAMDRAFT_SGLANG_SRC, else the installed
    package (located, not imported); None when there is none."""
    given = explicit if explicit is not None else os.environ.get(SOURCE_ENV)
    if given:
        path = Path(given).expanduser()
        if not (path / "srt" / "models").is_dir():
            raise ValueError(f"{path} is not an sglang package dir (no srt/models): point {SOURCE_ENV} at an unpacked wheel's sglang/")
        return path
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


@dataclass
class SGLangSource:
    """SGLang's model classes as source: parsed once, method bodies read on demand."""

    package_dir: Path
    version: str
    classes: dict[ClassKey, ClassInfo]
    imports: dict[str, dict]
    registry: dict[str, ClassKey]  # architecture -> class
    trees: dict[str, ast.Module] = field(default_factory=dict)  # module -> parsed file, filled on demand

    @classmethod
    def read(cls, package_dir: Path) -> "SGLangSource":
        models = package_dir / "srt" / "models"
        classes, imports = parse_package(models, SGLANG_PACKAGE)
        return cls(package_dir, source_version(package_dir), classes, imports, sglang_registry(models, classes, imports))

    def file(self, module: str) -> Path:
        return self.package_dir / "srt" / "models" / Path(*module.split(".")).with_suffix(".py")

    def where(self, owner: ClassKey, node: ast.AST) -> str:
        """``module.Class`` (models/<file>.py:<line>) for messages."""
        return f"{owner[0]}.{owner[1]} (srt/models/{owner[0].replace('.', '/')}.py:{node.lineno})"

    def _class_node(self, key: ClassKey) -> ast.ClassDef:
        if key[0] not in self.trees:
            self.trees[key[0]] = ast.parse(self.file(key[0]).read_text(encoding="utf-8-sig"))
        return next(n for n in self.trees[key[0]].body if isinstance(n, ast.ClassDef) and n.name == key[1])

    def _owners(self, key: ClassKey, name: str) -> list[tuple[ClassKey, ast.FunctionDef]]:
        """(class, def) of every definition of method ``name`` in ``key`` and its bases, nearest first."""
        return [
            (owner, next(n for n in self._class_node(owner).body if isinstance(n, ast.FunctionDef) and n.name == name))
            for owner in ancestors(key, self.classes)
            if isinstance(owner, tuple) and owner in self.classes and name in self.classes[owner].methods
        ]

    def method(self, key: ClassKey, name: str) -> tuple[ClassKey, ast.FunctionDef] | None:
        """(owner, def) of method ``name`` as ``key`` resolves it: its own, else the first base's that has it."""
        owners = self._owners(key, name)
        return owners[0] if owners else None

    def attribute_class(self, key: ClassKey, attr: str) -> ClassKey | None:
        """The class an ``__init__`` of ``key`` (its own or a base's) assigns to ``self.<attr>``:
        ``self.model = LlamaModel(...)``, through a ``self._init_model(...)`` helper that returns
        one, or through a constructor parameter's default; None when the source does not say."""
        for owner, init in self._owners(key, "__init__"):
            for node in ast.walk(init):
                assigned = isinstance(node, ast.Assign) and any(dotted_name(t) == f"self.{attr}" for t in node.targets)
                if assigned and isinstance(node.value, ast.Call):
                    found = self._called_class(key, owner[0], init, node.value, helper=True)
                    if found is not None:
                        return found
        return None

    def _called_class(self, key: ClassKey, module: str, fn: ast.FunctionDef, call: ast.Call, helper: bool) -> ClassKey | None:
        """The class ``call`` (made in ``fn``, in ``module``) constructs, if the source says."""
        name = dotted_name(call.func)
        if name is not None and name.startswith("self."):  # a helper method: the class it returns
            found = self.method(key, name.removeprefix("self.")) if helper else None
            if found is None:
                return None
            returns = (n.value for n in ast.walk(found[1]) if isinstance(n, ast.Return) and isinstance(n.value, ast.Call))
            return next((c for c in (self._called_class(key, found[0][0], found[1], r, helper=False) for r in returns) if c), None)
        name = dotted_name(_parameter_defaults(fn).get(name, call.func))  # `language_model_cls=Qwen3LLMModel`
        if name is None:
            return None
        local = {k[1] for k in self.classes if k[0] == module}
        resolved = resolve_name(name, module, local, self.imports[module], SGLANG_PACKAGE)
        return resolved if isinstance(resolved, tuple) and resolved in self.classes else None


def _parameter_defaults(fn: ast.FunctionDef) -> dict[str, ast.expr]:
    positional = fn.args.posonlyargs + fn.args.args
    pairs = zip(positional[len(positional) - len(fn.args.defaults) :], fn.args.defaults)
    keyword = ((a, d) for a, d in zip(fn.args.kwonlyargs, fn.args.kw_defaults) if d is not None)
    return {a.arg: d for a, d in [*pairs, *keyword]}


# --------------------------------------------------------------------------- replaying a capture method


def _compiled(source: SGLangSource, owner: ClassKey, fn: ast.FunctionDef) -> Callable:
    """The method's source as a plain function (decorators and annotations dropped)."""
    fn = copy.deepcopy(fn)
    fn.decorator_list, fn.returns = [], None
    for arg in [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs, fn.args.vararg, fn.args.kwarg]:
        if arg is not None:
            arg.annotation = None
    module = ast.fix_missing_locations(ast.Module(body=[fn], type_ignores=[]))
    namespace = {"__builtins__": builtins, "get_pp_group": lambda: _LAST_RANK, "logger": logging.getLogger(__name__)}
    exec(compile(module, str(source.file(owner[0])), "exec"), namespace)  # noqa: S102 - SGLang's own method, on a stand-in
    return namespace[fn.name]


class _StandIn:
    """``self`` of an SGLang model class as its capture method sees it on the last pipeline rank.

    Attributes it sets are kept; a sub-model it reaches (``self.model``, ``self.language_model``)
    is a stand-in of the class ``__init__`` assigns there; a method it calls is replayed from
    source. A stand-in of an unknown class has no methods (``hasattr`` is false).
    """

    def __init__(self, source: SGLangSource, key: ClassKey | None, num_layers: int):
        self._source, self._key, self._num_layers = source, key, num_layers
        self.config = SimpleNamespace(num_hidden_layers=num_layers)
        self.config.text_config = self.config
        self.pp_group = _LAST_RANK
        self.layers = defaultdict(SimpleNamespace)

    def __getattr__(self, name: str):  # only for attributes not set yet
        if name.startswith("_") or self._key is None:
            raise AttributeError(name)
        found = self._source.method(self._key, name)
        if found is not None:
            return functools.partial(_compiled(self._source, *found), self)
        child = _StandIn(self._source, self._source.attribute_class(self._key, name), self._num_layers)
        setattr(self, name, child)
        return child

    def captured(self) -> list[tuple[ClassKey | None, list[int]]]:
        """(class, layers_to_capture) of every stand-in in this tree that had them set."""
        mine = vars(self).get("layers_to_capture")
        found = [(self._key, list(mine))] if mine else []
        for child in vars(self).values():
            if isinstance(child, _StandIn):
                found += child.captured()
        return found


def replay_capture(source: SGLangSource, key: ClassKey, num_layers: int, argument: list[int]) -> list[tuple[ClassKey | None, list[int]]]:
    """Run ``key``'s ``set_eagle3_layers_to_capture(argument)`` from source on a stand-in; what it set."""
    found = source.method(key, SGLANG_METHOD)
    assert found is not None, f"{key} has no {SGLANG_METHOD}"
    model = _StandIn(source, key, num_layers)
    try:
        _compiled(source, *found)(model, list(argument))
    except Exception as err:  # foreign code on a stand-in: any failure is a preflight failure, cause attached
        raise ValueError(f"replaying {source.where(*found)} on a stand-in failed: {type(err).__name__}: {err}") from err
    return model.captured()


# --------------------------------------------------------------------------- the checks


def _mentions(fn: ast.FunctionDef, names: Sequence[str]) -> bool:
    return any(
        (isinstance(n, ast.Attribute) and n.attr in names) or (isinstance(n, ast.Constant) and n.value in names) for n in ast.walk(fn)
    )


def _hands_aux_to_logits(fn: ast.FunctionDef) -> bool:
    """``self.logits_processor(..., aux_hidden_states, ...)`` somewhere in ``fn``."""
    for n in ast.walk(fn):
        if isinstance(n, ast.Call) and dotted_name(n.func) == "self.logits_processor":
            values = [*n.args, *(k.value for k in n.keywords)]
            if any(isinstance(v, ast.Name) and v.id == "aux_hidden_states" for v in values):
                return True
    return False


def forwards(source: SGLangSource, key: ClassKey) -> list[tuple[ClassKey, ast.FunctionDef]]:
    """``key``'s forward, then the forwards of the bases it reaches through ``super()``."""
    found = source.method(key, "forward")
    if found is None:
        return []
    owner, fn = found
    if not any(isinstance(n, ast.Call) and dotted_name(n.func) == "super" for n in ast.walk(fn)):
        return [found]
    bases = [b for b in source.classes[owner].bases if isinstance(b, tuple) and b in source.classes]
    return [found, *(f for b in bases for f in forwards(source, b))]


def logits_forward(source: SGLangSource, key: ClassKey, seen: frozenset = frozenset()) -> tuple[ClassKey, ast.FunctionDef] | None:
    """The forward that hands aux states to the logits processor: ``key``'s (``forwards``) or that
    of a model it wraps (a ``self.<attr>`` its forward uses, e.g. Kimi-K2.5's ``language_model``)."""
    chain = forwards(source, key) if key not in seen else []
    hit = next((f for f in chain if _hands_aux_to_logits(f[1])), None)
    if hit is not None or not chain:
        return hit
    attrs = sorted({n.attr for _, fn in chain for n in ast.walk(fn) if isinstance(n, ast.Attribute) and dotted_name(n.value) == "self"})
    wrapped = [c for c in (source.attribute_class(key, a) for a in attrs) if c is not None]
    return next((hit for c in wrapped if (hit := logits_forward(source, c, seen | {key})) is not None), None)


@dataclass(frozen=True)
class Preflight:
    """What the SGLang source says about capturing aux states of one target, all checks passed."""

    architecture: str
    version: str
    model_class: str  # where the architecture's class is
    capture_method: str  # the set_eagle3_layers_to_capture it runs
    captured_by: str  # the decoder-body forward that reads the layers_to_capture it sets
    logits_forward: str  # the forward that hands the aux states to the logits processor
    ids: AuxLayerIds

    def describe(self) -> str:
        return (
            f"SGLang {self.version}: {self.architecture} = {self.model_class}; {self.capture_method} with "
            f"{self.ids.sglang_argument} captures the inputs of layers {self.ids.sglang_layer_inputs} in {self.captured_by}; "
            f"{self.logits_forward} returns them"
        )


def preflight(
    source: SGLangSource, architecture: str, num_layers: int, aux_layer_ids: Sequence[int], hidden_size: int | None = None
) -> Preflight:
    """Every check of the module docstring, for our aux ids (output of layer k); ValueError naming
    the architecture and the SGLang version on the first that fails."""

    def fail(what: str) -> ValueError:
        return ValueError(f"engine=sglang cannot train a draft for {architecture} with SGLang {source.version}: {what}")

    key = source.registry.get(architecture)
    if key is None:
        raise fail(f"SGLang registers no model class named {architecture} (no EntryClass in sglang/srt/models)")
    found = source.method(key, SGLANG_METHOD)
    if found is None:
        widths = "the last hidden state instead of the aux features"
        if hidden_size is not None:
            widths = f"{hidden_size} values a token instead of {len(aux_layer_ids) * hidden_size}"
        raise fail(
            f"its class {key[0]}.{key[1]} neither defines nor inherits {SGLANG_METHOD}, so SGLang cannot capture aux "
            f"hidden states for it: the draft would be handed {widths}, fc would be skipped and acceptance would "
            "collapse to ~1.0"
        )
    ids = AuxLayerIds.of(aux_layer_ids, num_layers)
    captured = replay_capture(source, key, num_layers, ids.sglang_argument)
    if len(captured) != 1:
        raise fail(f"{source.where(*found)} set layers_to_capture on {len(captured)} models ({captured}), expected 1")
    body, got = captured[0]
    if got != ids.sglang_layer_inputs:
        raise fail(_mismatch(source.where(*found), ids, got))
    body_forward = next((f for f in forwards(source, body) if _mentions(f[1], CAPTURE_MARKERS)), None) if body else None
    if body_forward is None:
        raise fail(f"{source.where(*found)} sets layers_to_capture on a model whose forward never reads them")
    hit = logits_forward(source, key)
    if hit is None:
        raise fail(f"{key[0]}.{key[1]}.forward never hands aux_hidden_states to a logits processor (nor does a model it wraps)")
    return Preflight(
        architecture, source.version, f"{key[0]}.{key[1]}", source.where(*found), source.where(*body_forward), source.where(*hit), ids
    )


def _mismatch(method: str, ids: AuxLayerIds, got: list[int]) -> str:
    why = ""
    if got == ids.sglang_deepseek_layer_inputs:
        why = (
            " It took the ids as layer inputs: this class adds 1 to explicit ids only when the first id is 1; "
            "use aux ids that start with 1 (the default [1, N//2-1, N-4] does)."
        )
    return (
        f"with our aux ids {ids.sglang_argument} (outputs of layers k) {method} captures the inputs of layers {got}, but "
        f"training needs the inputs of layers {ids.sglang_layer_inputs}. The SGLang export hands the same ids to the same "
        f"method when serving, so the draft would be served other layers than it was trained on.{why}"
    )


# --------------------------------------------------------------------------- a target dir


@dataclass(frozen=True)
class TargetShape:
    architecture: str
    num_layers: int
    hidden_size: int


def read_target_shape(path: str | Path) -> TargetShape:
    """``architectures[0]``, layers and hidden size from a model dir's ``config.json`` (a multimodal
    config's sizes are in its ``text_config``, as SGLang reads them)."""
    architecture, text = read_text_config(path)
    return TargetShape(architecture, int(text["num_hidden_layers"]), int(text["hidden_size"]))


def tp_size_problem(path: str | Path, tp_size: int) -> str | None:
    """Why SGLang cannot split the target at ``path`` over ``tp_size`` GPUs (None: it can). Its
    attention layers assert that ``tp_size`` divides the query heads, and that it divides the KV
    heads or is a multiple of them (KV heads are then replicated)."""
    _, text = read_text_config(path)
    heads = int(text["num_attention_heads"])
    kv = int(text.get("num_key_value_heads") or heads)
    if heads % tp_size:
        return f"tp_size {tp_size} does not divide the target's {heads} attention heads"
    if kv % tp_size and tp_size % kv:
        return f"tp_size {tp_size} neither divides nor is a multiple of the target's {kv} KV heads"
    return None


def attention_backends(source: SGLangSource) -> list[str]:
    """``ATTENTION_BACKEND_CHOICES`` of the source's server_args.py."""
    tree = ast.parse((source.package_dir / "srt" / "server_args.py").read_text(encoding="utf-8-sig"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(dotted_name(t) == "ATTENTION_BACKEND_CHOICES" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise ValueError(f"{source.package_dir}/srt/server_args.py defines no ATTENTION_BACKEND_CHOICES")


def _source(source_dir: str | Path | None) -> SGLangSource:
    found = find_sglang_source(source_dir)
    if found is None:
        raise ValueError(f"engine=sglang needs SGLang: {INSTALL_HINT} (or point {SOURCE_ENV} at an unpacked sglang wheel)")
    return SGLangSource.read(found)


def check_target(path: str | Path, aux_layer_ids: Sequence[int], source_dir: str | Path | None = None) -> Preflight:
    """The preflight of a local target dir against the SGLang source (``find_sglang_source``): its quantization
    format one SGLang builds, then its class's aux capture."""
    shape, source = read_target_shape(path), _source(source_dir)
    problem = quantization_problem(path, source)
    if problem is not None:
        raise ValueError(problem)
    return preflight(source, shape.architecture, shape.num_layers, aux_layer_ids, shape.hidden_size)


def quantization_methods(source: SGLangSource) -> set[str]:
    """The ``quant_method`` names SGLang registers (``BASE_QUANTIZATION_METHODS`` of ``srt/layers/quantization``,
    its platform updates included)."""
    tree = ast.parse((source.package_dir / "srt" / "layers" / "quantization" / "__init__.py").read_text(encoding="utf-8-sig"))
    tables = [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, (ast.Assign, ast.AnnAssign))
        and any(dotted_name(t) == "BASE_QUANTIZATION_METHODS" for t in (node.targets if isinstance(node, ast.Assign) else [node.target]))
    ]
    tables += [
        node.args[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and dotted_name(node.func) == "BASE_QUANTIZATION_METHODS.update" and node.args
    ]
    return {k.value for table in tables if isinstance(table, ast.Dict) for k in table.keys if isinstance(k, ast.Constant)}


def quantization_problem(path: str | Path, source: SGLangSource) -> str | None:
    """Why SGLang cannot build the target's weights in the format its ``quantization_config`` names (None: it can,
    or the target is not quantized)."""
    file = Path(path) / "config.json"
    config = read_json_object(file, f"{file}: missing")
    quant = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if not quant:
        return None
    method = quant.get("quant_method")
    known = quantization_methods(source)
    if method not in known:
        return (
            f"{file}: quantization_config.quant_method {method!r} is not a format SGLang {source.version} builds "
            f"(srt/layers/quantization: {', '.join(sorted(known))})"
        )
    return None


# --------------------------------------------------------------------------- the attention backend

HOPPER = 9  # compute capability major where SGLang's default attention backend is fa3 (server_args.py:4407-4459)


def _package(site: Path, name: str) -> Path | None:
    """The dir of installed package ``name``: in ``site`` (where sglang is), else wherever Python finds it (not imported)."""
    if (site / name).is_dir():
        return site / name
    spec = importlib.util.find_spec(name)
    return Path(list(spec.submodule_search_locations)[0]) if spec is not None and spec.submodule_search_locations else None


def backend_unavailable(backend: str, site: Path) -> str | None:
    """Why this install cannot run attention ``backend`` (None: it can, as far as its files tell).

    fa3 and flashmla are libraries of sgl_kernel that load on first use (an offline wheel set may
    strip them: sgl_kernel/flash_attn.py raises "Can not import FA3 in sgl_kernel"); flashinfer needs
    prebuilt kernels or its JIT sources (and nvcc); triton is the triton package. Other backends
    are not judged here."""
    if backend in ("fa3", "flashmla"):
        library = {"fa3": "flash_ops", "flashmla": "flashmla_ops"}[backend]
        kernel = _package(site, "sgl_kernel")
        if kernel is None:
            return "sgl_kernel is not installed"
        return None if any(kernel.glob(f"{library}*.so")) else f"sgl_kernel/{library}*.so missing"
    if backend == "flashinfer":
        package = _package(site, "flashinfer")
        if package is None:
            return "flashinfer is not installed"
        prebuilt = _package(site, "flashinfer_jit_cache") is not None or (package / "data" / "aot").is_dir()
        sources = (package / "data" / "csrc").is_dir() and (package / "data" / "include").is_dir()
        return (
            None
            if prebuilt or sources
            else "flashinfer has neither prebuilt kernels (flashinfer_jit_cache) nor its JIT sources (flashinfer/data/csrc)"
        )
    if backend == "triton":
        return None if _package(site, "triton") is not None else "triton is not installed"
    return None


@dataclass(frozen=True)
class BackendChoice:
    backend: str
    reason: str

    def describe(self) -> str:
        return f"attention backend: {self.backend} ({self.reason})"


def choose_attention_backend(
    requested: str | None, capability: tuple[int, int] | None = None, source_dir: str | Path | None = None
) -> BackendChoice:
    """The attention backend the engine runs: ``requested`` (``engine.sglang.attention_backend``) if
    SGLang knows it and this install can run it, else ValueError naming the setting; with none
    requested, fa3 on a Hopper GPU (``capability``) when sgl_kernel carries it, otherwise triton."""
    source = _source(source_dir)
    site = source.package_dir.parent
    if requested is not None:
        if requested not in (known := attention_backends(source)):
            raise ValueError(
                f"config engine.sglang.attention_backend: SGLang {source.version} knows no {requested!r} (known: {', '.join(known)})"
            )
        why = backend_unavailable(requested, site)
        if why is not None:
            raise ValueError(
                f"config engine.sglang.attention_backend: {requested} cannot run with the SGLang install in {site} ({why}); "
                "set engine.sglang.attention_backend=triton, or null to let StreamDraft choose"
            )
        return BackendChoice(requested, "engine.sglang.attention_backend")
    why = backend_unavailable("fa3", site)
    if why is None and capability is not None and capability[0] != HOPPER:
        why = f"SGLang picks it on Hopper only; this GPU is sm{capability[0]}{capability[1]}"
    if why is None:
        return BackendChoice("fa3", "SGLang's default on Hopper; sgl_kernel carries it")
    triton = backend_unavailable("triton", site)
    if triton is not None:
        raise ValueError(f"engine=sglang: no attention backend can run (fa3: {why}; triton: {triton}); set engine.sglang.attention_backend")
    return BackendChoice("triton", f"fa3 unavailable: {why}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Check that SGLang captures a target's EAGLE-3 aux states at our ids.")
    parser.add_argument("target", help="local model dir (config.json)")
    parser.add_argument("--aux-layer-ids", type=int, nargs="+", help="outputs of layers k; default [1, N//2-1, N-4]")
    parser.add_argument("--attention-backend", help="engine.sglang.attention_backend to check (default: choose one)")
    parser.add_argument("--sglang-src", help=f"sglang package dir (default: ${SOURCE_ENV}, else the installed package)")
    args = parser.parse_args(argv)
    ids = AuxLayerIds.resolve(args.aux_layer_ids, read_target_shape(args.target).num_layers)
    print(check_target(args.target, ids.ids, source_dir=args.sglang_src).describe())
    print(choose_attention_backend(args.attention_backend, source_dir=args.sglang_src).describe())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
