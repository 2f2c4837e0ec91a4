"""engine=sglang on GPUs: SGLang's features equal the transformers engine's on the same input,
within bf16 tolerance, and each aux block is the output of the layer we asked for (not a
neighbour). Skipped without a GPU (marker ``gpu``) or without SGLang 0.5.14 installed."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sglang = pytest.importorskip("sglang")

from transformers import DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: E402

from models.backends.sglang.target import SGLangTarget  # noqa: E402
from models.batch import TokenBatch  # noqa: E402
from models.target import HFTargetEngine  # noqa: E402
from tests.fixtures.sglang_tiny import is_layer, layer_errors, tiny_deepseek_v3_config  # noqa: E402
from trainer.dist import free_port  # noqa: E402
from trainer.stream.feature_stream import TargetSource, open_feature_stream  # noqa: E402

pytestmark = pytest.mark.gpu

VOCAB = 512  # tiny_deepseek_v3_config's too
IDS = (1, 3, 4)  # AuxLayerIds.default(8); starts at 1, as SGLang's DeepSeek class needs
SETTINGS = SimpleNamespace(mode="colocated", slots=2, slot_tokens=256, start_timeout_s=900.0, wait_timeout_s=600.0)


def save_target(root: Path, kind: str) -> Path:
    """A small random bf16 target dir: Llama, or DeepSeek-V3 (``tiny_deepseek_v3_config``)."""
    torch.manual_seed(0)
    if kind == "llama":
        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=8,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1024,
        )
        model = LlamaForCausalLM(config)
    else:
        model = DeepseekV3ForCausalLM(tiny_deepseek_v3_config())  # with the routing fields SGLang reads
        fix_routing(model)
    path = root / kind
    model.to(torch.bfloat16).save_pretrained(path)
    return path


def fix_routing(model: DeepseekV3ForCausalLM) -> None:
    """Every MoE layer picks the same experts for every token. A random gate scores the experts
    nearly alike, and transformers (fp32 router logits) and SGLang (bf16) then pick different experts
    for some tokens: features that differ by a whole expert, not by rounding. The correction bias
    decides the choice alone when its steps (1.0) exceed the spread of the sigmoid scores (< 1); the
    chosen experts' weights still come from each token's scores."""
    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:
            gate.e_score_correction_bias.copy_(torch.arange(gate.e_score_correction_bias.numel(), dtype=torch.float32))


def batches(seed: int) -> list[TokenBatch]:
    """A right-padded batch (rows of 64, 40, 17 tokens) and a packed one (documents 30 + 20 | 50)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (3, 64), generator=g)
    lengths = torch.tensor([64, 40, 17])
    valid = torch.arange(64)[None, :] < lengths[:, None]
    padded = TokenBatch(ids.masked_fill(~valid, 0), valid, lengths)
    packed_ids = torch.randint(1, VOCAB, (2, 64), generator=g)
    doc_ids = torch.full((2, 64), -1)
    doc_ids[0, :30], doc_ids[0, 30:50], doc_ids[1, :50] = 0, 1, 0
    packed = TokenBatch(packed_ids.masked_fill(doc_ids < 0, 0), doc_ids >= 0, torch.tensor([50, 50]), doc_ids)
    return [padded, packed]


def sglang_target(path: Path, **kw) -> SGLangTarget:
    # triton attention: one backend for MHA and MLA at any head size
    return SGLangTarget(
        path=str(path),
        aux_layer_ids=IDS,
        dtype=torch.bfloat16,
        mem_fraction_static=0.3,
        attention_backend="triton",
        dist_port=free_port(),
        **kw,
    )


def assert_bf16_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    got, want = got.float(), want.float()
    rel = ((got - want).norm() / want.norm()).item()
    cos = torch.nn.functional.cosine_similarity(got, want, dim=-1).min().item()
    assert rel < 2e-2 and cos > 0.995, f"{what}: relative error {rel:.3g}, min cosine {cos:.4f}"


def compare(tokens: TokenBatch, got_aux: torch.Tensor, got_final: torch.Tensor, hf: HFTargetEngine) -> None:
    """SGLang's features of ``tokens`` against transformers', on valid tokens only."""
    want = hf.features(tokens)
    valid = torch.arange(tokens.input_ids.shape[1])[None, :] < tokens.lengths[:, None]  # [B, T]
    H = hf.info.hidden_size
    for slot, k in enumerate(IDS):
        block = slice(slot * H, (slot + 1) * H)
        assert_bf16_close(got_aux[..., block][valid], want.aux[..., block].cpu()[valid], f"aux layer {k}")
    assert_bf16_close(got_final[valid], want.final.cpu()[valid], "final hidden")


@pytest.mark.parametrize("kind", ["llama", "deepseek_v3"])
def test_sglang_features_equal_transformers_features(tmp_path, kind):
    path = save_target(tmp_path, kind)
    hf = HFTargetEngine.from_path(path, list(IDS), device="cuda", dtype=torch.bfloat16)
    data = batches(0)
    with TargetSource(sglang_target(path), engine=hf) as source:  # the engine must report the same ids, layers, width
        with open_feature_stream(SETTINGS, source, data, "cuda") as stream:
            got = [(fb.aux.cpu().clone(), fb.final.cpu().clone()) for fb in stream]
    assert len(got) == len(data)
    for tokens, (aux, final) in zip(data, got):
        compare(tokens, aux, final, hf)


def test_each_aux_block_is_the_requested_layer_not_a_neighbour(tmp_path):
    """Each aux slot is closest to the output of its own layer k, by a clear margin over every other
    layer, k - 1 and k + 1 included: SGLang's DeepSeek class shifts explicit ids by one only when the
    first id is 1, so an id mix-up shows as a slot sitting on a neighbour. With the tiny config's
    default init, consecutive layer outputs differ by 40-75 % (relative), bf16 noise is ~1 %."""
    path = save_target(tmp_path, "deepseek_v3")
    hf = HFTargetEngine.from_path(path, list(IDS), device="cuda", dtype=torch.bfloat16)
    tokens = batches(1)[0]
    with TargetSource(sglang_target(path)) as source, open_feature_stream(SETTINGS, source, [tokens], "cuda") as stream:
        aux = next(stream).aux.float().cpu()
    t = tokens.to("cuda")
    mask = (torch.arange(t.input_ids.shape[1], device="cuda")[None, :] < t.lengths[:, None]).long()
    with torch.no_grad():  # hidden_states[j + 1]: the output of layer j; the last entry is after the final norm
        states = hf.model.model(input_ids=t.input_ids, attention_mask=mask, output_hidden_states=True).hidden_states
    valid = mask.bool().cpu()
    outputs = [h.float().cpu()[valid] for h in states[1:-1]]  # layers 0 .. N-2, before any norm
    H = hf.info.hidden_size
    for slot, k in enumerate(IDS):
        errors = layer_errors(aux[..., slot * H : (slot + 1) * H][valid], outputs)
        assert is_layer(errors, k), f"aux slot {slot} (layer {k}): relative error per layer {[round(e, 3) for e in errors]}"


def test_dummy_weights_give_features_of_the_right_shape(tmp_path):
    path = save_target(tmp_path, "llama")
    tokens = batches(2)[0]
    with (
        TargetSource(sglang_target(path, load_format="dummy")) as source,
        open_feature_stream(SETTINGS, source, [tokens], "cuda") as stream,
    ):
        fb = next(stream)
        assert fb.aux.shape == (3, 64, 3 * 256) and fb.final.shape == (3, 64, 256) and fb.aux.dtype == torch.bfloat16
        assert torch.isfinite(fb.aux).all()


def _tp_rank(rank: int, path: str, port: int, out: str) -> None:
    """One 'trainer rank' of a TP=2 group: its own engine process on cuda:rank, its own batches."""
    torch.cuda.set_device(rank)
    tp = SGLangTarget(
        path=path,
        aux_layer_ids=IDS,
        dtype=torch.bfloat16,
        tp_size=2,
        tp_rank=rank,
        dist_port=port,
        mem_fraction_static=0.3,
        attention_backend="triton",
    )
    with TargetSource(tp) as source, open_feature_stream(SETTINGS, source, batches(10 + rank), f"cuda:{rank}") as stream:
        torch.save([(fb.aux.cpu().clone(), fb.final.cpu().clone()) for fb in stream], Path(out) / f"rank{rank}.pt")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("kind", ["llama", "deepseek_v3"])
def test_tensor_parallel_ranks_each_get_their_own_rows(tmp_path, kind):
    path = save_target(tmp_path, kind)
    torch.multiprocessing.spawn(_tp_rank, args=(str(path), free_port(), str(tmp_path)), nprocs=2)
    hf = HFTargetEngine.from_path(path, list(IDS), device="cuda", dtype=torch.bfloat16)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for tokens, (aux, final) in zip(batches(10 + rank), got, strict=True):
            compare(tokens, aux, final, hf)
