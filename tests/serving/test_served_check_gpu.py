"""``python -m serving.served_check`` in SGLang itself, on a tiny DeepSeek-V3 target (Kimi-K2.5's language model)
with dummy weights: the right draft passes, and the field failure (a target class whose aux capture is never
switched on) and a draft trained at another width are each refused by name, exit code 1. Each check runs as the
user runs it, in its own process. Skipped without a GPU (marker ``gpu``) or without SGLang installed."""

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytest.importorskip("sglang")

from models.draft import Eagle3Draft, draft_shape_for  # noqa: E402
from models.vocab_map import build_vocab_map, count_tokens  # noqa: E402
from serving.export import export_draft  # noqa: E402
from serving.formats import ExportSpec  # noqa: E402
from tests.fixtures.sglang_tiny import tiny_deepseek_v3_config  # noqa: E402

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]

CAPTURE_OFF = """
import sys
import sglang.srt.layers.flashinfer_comm_fusion  # SGLang's guarded flashinfer.comm import, first as in its own start
from sglang.srt.models.deepseek_v2 import DeepseekV2ForCausalLM
from serving.served_check import main
DeepseekV2ForCausalLM.set_eagle3_layers_to_capture = lambda self, layer_ids=None: None  # a class without aux capture
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """A config-only target dir, an export trained at its width, and one trained on a target half as wide."""
    root = tmp_path_factory.mktemp("served")
    config = tiny_deepseek_v3_config()
    config.architectures = ["DeepseekV3ForCausalLM"]
    config.save_pretrained(root / "target")
    exports = {}
    for name, shape in [("right", draft_shape_for(config, 3, 256)), ("narrow", None)]:
        shape = shape or replace(exports["right_shape"], target_hidden_size=config.hidden_size // 2)
        exports[f"{name}_shape"] = shape
        torch.manual_seed(0)
        ids = torch.randint(0, shape.vocab_size, (2000,))
        vocab = build_vocab_map(count_tokens([(ids, torch.ones_like(ids, dtype=torch.bool))], shape.vocab_size), shape.draft_vocab_size)
        spec = ExportSpec.of([1, 3, 4], norm_output=False, target_num_layers=config.num_hidden_layers)
        exports[name] = export_draft(root / name, "sglang", Eagle3Draft(shape), vocab, spec)
    return root / "target", exports


def check(export, target, *launcher):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    args = [str(export), "--target", str(target), "--load-format", "dummy", "--mem-fraction-static", "0.3"]
    cmd = [sys.executable, *(launcher or ("-m", "serving.served_check")), *args]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    return p.returncode, p.stdout + p.stderr


def test_the_draft_trained_on_this_target_passes(dirs):
    target, exports = dirs
    rc, out = check(exports["right"], target)
    assert rc == 0, out[-3000:]
    assert "DeepseekV3ForCausalLM hands the draft 1536 values a token" in out


def test_a_target_class_without_aux_capture_is_refused_by_name(dirs):
    target, exports = dirs
    rc, out = check(exports["right"], target, "-c", CAPTURE_OFF)
    assert rc == 1, out[-3000:]
    assert "last hidden state (512 values a token)" in out and "aux capture is not switched on" in out


def test_a_draft_trained_at_another_width_is_refused_by_name(dirs):
    target, exports = dirs
    rc, out = check(exports["narrow"], target)
    assert rc == 1, out[-3000:]
    assert "trained on a 256-wide target (fc takes 768 values a token); this target is 512 wide" in out
