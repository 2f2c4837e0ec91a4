"""The mla layout loaded by SGLang itself: SGLang 0.5.14 builds ``Eagle3DeepseekV2ForCausalLM`` from the export and
its ``load_weights`` sets every parameter from the export's tensors (the fused a-projection and gate/up from their
halves, the vocab map as ``hot_token_id``); only the embedding, shared from the target, is not the export's.
Skipped without a GPU (marker ``gpu``) or without SGLang installed."""

import pytest
import torch
from safetensors.torch import load_file

sglang = pytest.importorskip("sglang")

from models.backends.sglang.preflight import choose_attention_backend  # noqa: E402
from models.backends.sglang.target import SGLangTarget, _model_runner  # noqa: E402
from models.draft import Eagle3Draft, draft_shape_for  # noqa: E402
from models.vocab_map import build_vocab_map, count_tokens  # noqa: E402
from serving.export import export_draft  # noqa: E402
from serving.formats import ExportSpec  # noqa: E402
from tests.fixtures.sglang_tiny import tiny_deepseek_v3_config  # noqa: E402
from trainer.dist import free_port  # noqa: E402

pytestmark = pytest.mark.gpu


def test_sglang_sets_every_parameter_of_its_mla_draft_from_the_export(tmp_path):
    torch.manual_seed(0)
    shape = draft_shape_for(tiny_deepseek_v3_config(), 3, 256, layout="mla", fc_norm=True)
    draft = Eagle3Draft(shape)
    for p in draft.parameters():
        torch.nn.init.normal_(p, std=0.02)
    ids = torch.randint(0, shape.vocab_size, (2000,))
    vocab = build_vocab_map(count_tokens([(ids, torch.ones_like(ids, dtype=torch.bool))], shape.vocab_size), shape.draft_vocab_size)
    export = export_draft(tmp_path / "draft", "sglang", draft, vocab, ExportSpec.of([1, 3, 4], norm_output=False, target_num_layers=8))
    device = torch.device("cuda", 0)
    factory = SGLangTarget(path=str(export), mem_fraction_static=0.3, dist_port=free_port(), max_total_tokens=4096)
    backend = choose_attention_backend(None, torch.cuda.get_device_capability(device))
    runner = _model_runner(factory, backend.backend, device)
    model = runner.model
    assert type(model).__name__ == "Eagle3DeepseekV2ForCausalLM"
    params = {k: v.detach().float().cpu() for k, v in model.named_parameters()}
    ours = {k: v.float() for k, v in load_file(str(export / "model.safetensors")).items()}
    halves = {  # SGLang's fused parameter -> the export's tensors it is concatenated from
        "model.midlayer.self_attn.fused_qkv_a_proj_with_mqa.weight": ("q_a_proj", "kv_a_proj_with_mqa"),
        "model.midlayer.mlp.gate_up_proj.weight": ("gate_proj", "up_proj"),
    }
    sub = {"q_a_proj": "self_attn", "kv_a_proj_with_mqa": "self_attn", "gate_proj": "mlp", "up_proj": "mlp"}
    expected = {fused: torch.cat([ours.pop(f"midlayer.{sub[h]}.{h}.weight") for h in pair]) for fused, pair in halves.items()}
    d2t, ours = ours.pop("d2t"), {k: v for k, v in ours.items() if k != "t2d"}
    expected |= {(k if k.startswith("lm_head.") else f"model.{k}"): v for k, v in ours.items()}
    assert sorted(set(params) - set(expected)) == ["model.embed_tokens.weight"]  # shared from the target when served
    for name, tensor in expected.items():
        assert torch.equal(params[name], tensor.to(torch.bfloat16).float()), name
    assert torch.equal(model.hot_token_id.cpu(), d2t.long() + torch.arange(shape.draft_vocab_size))
