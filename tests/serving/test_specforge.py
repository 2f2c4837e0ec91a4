"""SpecForge 0.2.0 reads our SGLang export as our draft computes: its ``LlamaForCausalLMEagle3``
logits, read from its source (nothing imported), equal the draft's. Skipped without the source:
``pip download --no-deps specforge==0.2.0``, unzip, and point $STREAMDRAFT_SPECFORGE_SRC at the
unpacked ``specforge/`` dir."""

import ast
import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

from serving.export import export_draft, load_export
from serving.formats import ExportSpec
from tests.serving.test_export import AUX_IDS, CARRIED, _draft, _vocab

SOURCE_ENV = "STREAMDRAFT_SPECFORGE_SRC"
DRAFT_FILE = Path("modeling") / "draft" / "llama3_eagle.py"


def _specforge_dir() -> Path:
    given = os.environ.get(SOURCE_ENV)
    if given:
        return Path(given).expanduser()
    spec = importlib.util.find_spec("specforge")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"no SpecForge source: set {SOURCE_ENV} to an unpacked specforge 0.2.0 wheel's specforge/")
    return Path(list(spec.submodule_search_locations)[0])


@pytest.fixture(scope="module")
def eagle3_class() -> ast.ClassDef:
    path = _specforge_dir() / DRAFT_FILE
    assert path.is_file(), f"{path} missing: {SOURCE_ENV} must name a specforge package dir"
    tree = ast.parse(path.read_text())
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "LlamaForCausalLMEagle3")


def _norm_output_default(cls: ast.ClassDef) -> bool:
    """``self.norm_output = getattr(config, "norm_output", DEFAULT)`` in ``__init__``."""
    for node in ast.walk(cls):
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "self.norm_output":
            call = node.value
            assert isinstance(call, ast.Call) and ast.unparse(call.func) == "getattr", ast.unparse(node)
            return ast.literal_eval(call.args[2])
    raise AssertionError("LlamaForCausalLMEagle3 sets no self.norm_output")


def _compute_logits(cls: ast.ClassDef):
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "compute_logits")
    namespace = {"torch": torch}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "specforge_compute_logits", "exec"), namespace)
    return namespace["compute_logits"]


class _SpecForgeHead(torch.nn.Module):
    """The attributes ``compute_logits`` reads, from our export as SpecForge would load it."""

    def __init__(self, draft, config: dict, default: bool):
        super().__init__()
        self.norm, self.lm_head = draft.norm, draft.lm_head
        self.norm_output = config.get("norm_output", default)  # getattr(config, "norm_output", default)


@pytest.mark.parametrize("norm_output", [False, True])
def test_specforge_computes_our_logits_from_the_export(tmp_path, eagle3_class, norm_output):
    draft, vocab = _draft(CARRIED), _vocab(CARRIED)
    out = export_draft(tmp_path / "x", "sglang", draft, vocab, ExportSpec.of(AUX_IDS, norm_output=norm_output, dtype=torch.float32))
    back, _, config = load_export(out)
    hidden = torch.randn(2, 5, CARRIED.hidden_size, generator=torch.Generator().manual_seed(0))  # pre-norm [B, T, H]
    ours = draft.lm_head(draft.norm(hidden))  # Eagle3Draft.step's logits
    default, compute_logits = _norm_output_default(eagle3_class), _compute_logits(eagle3_class)
    theirs = compute_logits(_SpecForgeHead(back, config, default), hidden)
    assert torch.allclose(theirs, ours, atol=1e-6)
    explicit_false = compute_logits(_SpecForgeHead(back, {**config, "norm_output": False}, default), hidden)
    assert not torch.allclose(explicit_false, ours, atol=1e-3)  # what an explicit false costs a SpecForge user
    assert json.loads((out / "config.json").read_text()).get("norm_output", False) is norm_output
