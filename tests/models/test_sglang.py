"""engine=sglang without a GPU: the aux-id translation, the preflight (against small SGLang-like
source trees written here, and against the real SGLang source when it is present), the config
mapping to the target factory, and the engine's batch layout. Nothing here imports sglang."""

import ast
import copy
import importlib.util
import json
import pickle
import textwrap
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig

from models.aux_ids import AuxLayerIds
from models.aux_support import dotted_name
from models.backends.hf.target import PathTarget
from models.backends.registry import BACKENDS, Backend, Features, able
from models.backends.sglang.preflight import (
    SOURCE_ENV,
    SGLangSource,
    attention_backends,
    check_target,
    choose_attention_backend,
    find_sglang_source,
    preflight,
    read_target_shape,
    tp_size_problem,
)
from models.backends.sglang.preflight import main as preflight_main
from models.backends.sglang.target import SGLangTarget, check_aux_width, documents, import_sglang, prefill_buffer_tokens, rank_span, to_rows
from models.batch import TokenBatch
from models.draft import DraftShape
from models.embedded import embedded_target_dir, plain_config
from models.target import TargetInfo
from serving.formats import EXPORT_FORMATS, ExportSpec
from tests.fixtures.sglang_tiny import is_layer, layer_errors, tiny_deepseek_v3_config
from tests.fixtures.tiny import tiny_config
from trainer.dist import Parallel, free_port, group_port
from trainer.stream.engine_process import EngineError, failure_cause, failure_message
from trainer.stream.feature_stream import MODES, TargetSource
from trainer.target_setup import MAKERS, sglang_rank_factory, target_factory

KIMI = "KimiK25ForConditionalGeneration"
KIMI_IDS = [1, 29, 57]  # list(AuxLayerIds.default(61).ids), conf/target/kimi_k25.yaml

# --------------------------------------------------------------------------- small SGLang-like source trees

MODELS = {
    # Llama style: every explicit id + 1; the body reads layers_to_capture; the head hands aux to the logits processor.
    "llama.py": """
        from torch import nn

        class LlamaModel(nn.Module):
            def forward(self, x):
                aux_hidden_states = [x for i in range(3) if i in self.layers_to_capture]
                return x, aux_hidden_states

        class LlamaForCausalLM(nn.Module):
            def __init__(self, config):
                self.model = self._init_model(config)

            def _init_model(self, config):
                return LlamaModel(config)

            def forward(self, input_ids, positions, forward_batch):
                hidden_states, aux_hidden_states = self.model(input_ids)
                return self.logits_processor(input_ids, hidden_states, self.lm_head, forward_batch, aux_hidden_states)

            def set_eagle3_layers_to_capture(self, layer_ids=None):
                if not self.pp_group.is_last_rank:
                    return
                self.capture_aux_hidden_states = True
                self.model.layers_to_capture = [val + 1 for val in layer_ids]

        class NoCaptureForCausalLM(nn.Module):
            def forward(self, input_ids):
                return self.logits_processor(input_ids, input_ids, self.lm_head, None)

        class SilentForCausalLM(LlamaForCausalLM):
            def forward(self, input_ids, positions, forward_batch):
                hidden_states, _ = self.model(input_ids)
                return self.logits_processor(input_ids, hidden_states, self.lm_head, forward_batch)

        EntryClass = [LlamaForCausalLM, NoCaptureForCausalLM, SilentForCausalLM]
    """,
    # DeepSeek style: + 1 only when the first id is 1; a multimodal wrapper delegates to it (Kimi-K2.5's shape).
    "deepseek.py": """
        from torch import nn

        class DeepseekModel(nn.Module):
            def forward(self, x):
                return [layer(x, captured=(i in self.layers_to_capture)) for i, layer in enumerate(self.layers)]

        class DeepseekForCausalLM(nn.Module):
            def __init__(self, config):
                self.model = DeepseekModel(config)

            def forward(self, input_ids, forward_batch):
                hidden_states, aux_hidden_states = self.model(input_ids)
                return self.logits_processor(input_ids, hidden_states, self.lm_head, forward_batch, aux_hidden_states)

            def set_eagle3_layers_to_capture(self, layer_ids=None):
                self.capture_aux_hidden_states = True
                if layer_ids and layer_ids[0] == 1:
                    self.model.layers_to_capture = [val + 1 for val in layer_ids]
                else:
                    self.model.layers_to_capture = list(layer_ids)

        class WrapperForConditionalGeneration(nn.Module):
            def __init__(self, config):
                self.language_model = None
                if config.text:
                    self.language_model = DeepseekForCausalLM(config.text_config)

            def forward(self, input_ids, forward_batch):
                return embed_routine(input_ids, forward_batch, language_model=self.language_model)

            def set_eagle3_layers_to_capture(self, layer_ids=None):
                if not hasattr(self.language_model, "set_eagle3_layers_to_capture"):
                    raise AttributeError("language_model does not support EAGLE3")
                self.language_model.set_eagle3_layers_to_capture(layer_ids)

        EntryClass = [DeepseekForCausalLM, WrapperForConditionalGeneration]
    """,
}


def write_sglang_tree(root: Path, version: str = "9.9.9") -> Path:
    """An ``sglang/`` package dir shaped like the wheel's: _version.py, srt/server_args.py, srt/models/,
    beside a triton package (a site dir as pip --target writes it)."""
    package = root / "sglang"
    (package / "srt" / "models").mkdir(parents=True)
    (package / "_version.py").write_text(f"__version__ = version = '{version}'\n")
    choices = ["triton", "fa3", "flashinfer", "flashmla", "torch_native"]
    (package / "srt" / "server_args.py").write_text(f"ATTENTION_BACKEND_CHOICES = {choices!r}\n")
    for name, text in MODELS.items():
        (package / "srt" / "models" / name).write_text(textwrap.dedent(text))
    (root / "triton").mkdir()
    (root / "triton" / "__init__.py").write_text("")
    return package


def fake_install(root: Path, fa3: bool, flashinfer: str | None) -> Path:
    """A site dir that mimics an SGLang install: sglang, triton, sgl_kernel (its sm90 ops; the FA3 library
    only with ``fa3``) and flashinfer as ``flashinfer`` says: None (absent), "bare" (no kernels nor
    sources, like a stripped wheel), "jit" (data/csrc + data/include) or "cache" (flashinfer_jit_cache)."""
    package = write_sglang_tree(root)
    kernel = root / "sgl_kernel"
    (kernel / "sm90").mkdir(parents=True)
    (kernel / "sm90" / "common_ops.abi3.so").write_bytes(b"")
    if fa3:
        (kernel / "flash_ops.abi3.so").write_bytes(b"")
    if flashinfer is not None:
        (root / "flashinfer" / "jit").mkdir(parents=True)
    if flashinfer == "jit":
        for sub in ("csrc", "include"):
            (root / "flashinfer" / "data" / sub).mkdir(parents=True)
    if flashinfer == "cache":
        (root / "flashinfer_jit_cache").mkdir()
    return package


@pytest.fixture(scope="module")
def fake(tmp_path_factory) -> SGLangSource:
    return SGLangSource.read(write_sglang_tree(tmp_path_factory.mktemp("fake")))


@pytest.fixture(scope="module")
def real() -> SGLangSource:
    """The real SGLang source: $STREAMDRAFT_SGLANG_SRC, the installed package, or /tmp/sgl/sglang."""
    found = find_sglang_source()
    if found is None and (Path("/tmp/sgl/sglang") / "srt" / "models").is_dir():
        found = Path("/tmp/sgl/sglang")
    if found is None:
        pytest.skip(f"no SGLang source: set {SOURCE_ENV} to an unpacked sglang wheel's sglang/ (docs/SGLANG.md)")
    return SGLangSource.read(found)


def target_dir(
    root: Path, architecture: str, num_layers: int, hidden: int = 64, multimodal: bool = False, heads: int = 8, kv_heads: int = 8
) -> Path:
    sizes = {"num_hidden_layers": num_layers, "hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": kv_heads}
    config = {"architectures": [architecture], **({"text_config": sizes} if multimodal else sizes)}
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    return root


# --------------------------------------------------------------------------- the id translation


def test_our_ids_go_to_sglang_unchanged_and_it_captures_the_next_layers_input():
    ids = AuxLayerIds.of([1, 14, 26])
    assert ids.sglang_argument == [1, 14, 26]  # output of layer k, as SGLang reads explicit ids
    assert ids.sglang_layer_inputs == [2, 15, 27]  # SGLang captures the input of layer k + 1: the same tensor


def test_the_export_writes_the_argument_the_engine_passes():
    shape = DraftShape(
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        target_hidden_size=64,
        num_aux=3,
        vocab_size=300,
        draft_vocab_size=100,
        rms_norm_eps=1e-5,
        rope_theta=1e4,
        max_position_embeddings=512,
    )
    config = EXPORT_FORMATS["sglang"].write_config(shape, ExportSpec.of([1, 14, 26], norm_output=False, target_num_layers=30))
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == AuxLayerIds.of([1, 14, 26]).sglang_argument


# --------------------------------------------------------------------------- preflight on small source trees


def test_a_llama_style_class_passes_at_any_ids(fake):
    for ids in ([1, 3, 4], [2, 3, 5], [0, 3, 6]):
        checked = preflight(fake, "LlamaForCausalLM", 8, ids)
        assert checked.ids.sglang_layer_inputs == [k + 1 for k in ids]
        assert "llama.LlamaModel" in checked.captured_by and "llama.LlamaForCausalLM" in checked.logits_forward


def test_a_class_without_capture_is_the_field_failure(fake):
    with pytest.raises(ValueError) as err:
        preflight(fake, "NoCaptureForCausalLM", 61, KIMI_IDS, hidden_size=7168)
    text = str(err.value)
    for part in ("NoCaptureForCausalLM", "SGLang 9.9.9", "set_eagle3_layers_to_capture", "7168 values a token instead of 21504", "~1.0"):
        assert part in text


def test_a_wrapper_delegates_to_its_language_model(fake):
    checked = preflight(fake, "WrapperForConditionalGeneration", 61, KIMI_IDS)
    assert checked.ids.sglang_layer_inputs == [2, 30, 58]
    assert "deepseek.DeepseekModel" in checked.captured_by and "deepseek.DeepseekForCausalLM" in checked.logits_forward


@pytest.mark.parametrize("architecture", ["DeepseekForCausalLM", "WrapperForConditionalGeneration"])
def test_deepseek_rule_ids_not_starting_at_1_would_be_captured_a_layer_early(fake, architecture):
    with pytest.raises(ValueError) as err:
        preflight(fake, architecture, 61, [2, 30, 57])
    text = str(err.value)
    assert "captures the inputs of layers [2, 30, 57]" in text and "needs the inputs of layers [3, 31, 58]" in text
    assert "start with 1" in text and architecture in text and "9.9.9" in text


def test_a_forward_that_drops_the_aux_states_fails(fake):
    with pytest.raises(ValueError, match="never hands aux_hidden_states to a logits processor"):
        preflight(fake, "SilentForCausalLM", 8, [1, 3, 4])


def test_an_unknown_architecture_names_itself_and_the_version(fake):
    with pytest.raises(ValueError, match="GrokForCausalLM with SGLang 9.9.9: SGLang registers no model class"):
        preflight(fake, "GrokForCausalLM", 8, [1, 3, 4])


def test_check_target_reads_the_dir(tmp_path, fake):
    model = target_dir(tmp_path / "model", "WrapperForConditionalGeneration", 61, hidden=7168, multimodal=True)
    assert read_target_shape(model).num_layers == 61 and read_target_shape(model).hidden_size == 7168
    assert check_target(model, KIMI_IDS, source_dir=fake.package_dir).architecture == "WrapperForConditionalGeneration"
    with pytest.raises(ValueError, match="has no config.json"):
        read_target_shape(tmp_path)


HOPPER, AMPERE = (9, 0), (8, 0)


@pytest.mark.parametrize(
    "fa3, capability, backend, reason",
    [
        (True, HOPPER, "fa3", "SGLang's default on Hopper; sgl_kernel carries it"),
        (False, HOPPER, "triton", "fa3 unavailable: sgl_kernel/flash_ops*.so missing"),
        (True, AMPERE, "triton", "fa3 unavailable: SGLang picks it on Hopper only; this GPU is sm80"),
        (True, None, "fa3", "SGLang's default on Hopper; sgl_kernel carries it"),
    ],
)
def test_the_backend_is_chosen_from_what_the_install_carries(tmp_path, fa3, capability, backend, reason):
    package = fake_install(tmp_path, fa3=fa3, flashinfer="bare")
    choice = choose_attention_backend(None, capability, source_dir=package)
    assert (choice.backend, choice.reason) == (backend, reason)
    assert choice.describe() == f"attention backend: {backend} ({reason})"


def test_an_explicit_backend_is_checked_against_the_install(tmp_path):
    stripped = fake_install(tmp_path / "stripped", fa3=False, flashinfer="bare")
    for requested, why in [
        ("fa3", r"sgl_kernel/flash_ops\*\.so missing"),
        ("flashmla", r"sgl_kernel/flashmla_ops\*\.so missing"),
        ("flashinfer", "neither prebuilt kernels .* nor its JIT sources"),
    ]:
        with pytest.raises(
            ValueError, match=f"config engine.sglang.attention_backend: {requested} cannot run .*{why}.*attention_backend=triton"
        ):
            choose_attention_backend(requested, HOPPER, source_dir=stripped)
    assert choose_attention_backend("triton", HOPPER, source_dir=stripped).backend == "triton"
    with pytest.raises(ValueError, match="config engine.sglang.attention_backend: SGLang 9.9.9 knows no 'flashattn'"):
        choose_attention_backend("flashattn", HOPPER, source_dir=stripped)
    for flashinfer in ("jit", "cache"):
        full = fake_install(tmp_path / flashinfer, fa3=True, flashinfer=flashinfer)
        assert choose_attention_backend("flashinfer", HOPPER, source_dir=full).reason == "engine.sglang.attention_backend"
        assert choose_attention_backend("fa3", HOPPER, source_dir=full).backend == "fa3"
    with pytest.raises(ValueError, match="flashinfer is not installed"):
        choose_attention_backend("flashinfer", HOPPER, source_dir=fake_install(tmp_path / "none", fa3=True, flashinfer=None))


def test_the_preflight_command(tmp_path, fake, capsys):
    model = target_dir(tmp_path / "model", "LlamaForCausalLM", 8)
    assert preflight_main([str(model), "--sglang-src", str(fake.package_dir)]) == 0  # default ids [1, 3, 4]
    out = capsys.readouterr().out
    assert "with [1, 3, 4] captures the inputs of layers [2, 4, 5]" in out
    assert "attention backend: triton (fa3 unavailable: sgl_kernel is not installed)" in out


def test_the_source_is_found_by_env_var_or_not_at_all(tmp_path, fake, monkeypatch):
    monkeypatch.setenv(SOURCE_ENV, str(fake.package_dir))
    assert find_sglang_source() == fake.package_dir
    monkeypatch.setenv(SOURCE_ENV, str(tmp_path))
    with pytest.raises(ValueError, match="not an sglang package dir"):
        find_sglang_source()
    monkeypatch.delenv(SOURCE_ENV)
    if find_sglang_source() is None:  # sglang not installed here: the preflight says how to get it
        with pytest.raises(ValueError, match=r"pip install 'streamdraft\[sglang\]'"):
            check_target(target_dir(tmp_path / "m", "LlamaForCausalLM", 8), [1, 3, 4])


# --------------------------------------------------------------------------- preflight on the real SGLang source


def test_real_kimi_k25_captures_at_the_default_ids(real):
    checked = preflight(real, KIMI, 61, list(AuxLayerIds.default(61).ids), hidden_size=7168)
    assert checked.ids.sglang_argument == KIMI_IDS and checked.ids.sglang_layer_inputs == [2, 30, 58]
    assert checked.model_class == "kimi_k25.KimiK25ForConditionalGeneration"
    assert "deepseek_v2.DeepseekV2Model" in checked.captured_by  # Kimi-K2.5's language model is DeepSeek-V3
    assert "deepseek_v2.DeepseekV2ForCausalLM" in checked.logits_forward


def test_real_kimi_k25_rejects_ids_its_deepseek_rule_would_shift(real):
    with pytest.raises(ValueError, match=r"captures the inputs of layers \[2, 30, 57\]"):
        preflight(real, KIMI, 61, [2, 30, 57])


@pytest.mark.parametrize(
    "architecture", ["LlamaForCausalLM", "Qwen3ForCausalLM", "DeepseekV3ForCausalLM", "Qwen3VLForConditionalGeneration"]
)
def test_real_targets_that_capture_pass(real, architecture):
    assert preflight(real, architecture, 32, [1, 15, 28]).ids.sglang_layer_inputs == [2, 16, 29]


@pytest.mark.parametrize("architecture", ["TorchNativeLlamaForCausalLM", "KimiVLForConditionalGeneration", "Gemma2ForCausalLM"])
def test_real_targets_without_capture_fail_clearly(real, architecture):
    with pytest.raises(ValueError, match=f"{architecture} with SGLang {real.version}: .* neither defines nor inherits"):
        preflight(real, architecture, 32, [1, 15, 28])


def test_the_neighbour_check_catches_an_off_by_one():
    """The GPU test's check on transformers' own layer outputs of the tiny DeepSeek-V3 (bf16): each layer
    passes as itself with bf16-sized noise added, and fails in place of its neighbours k - 1 and k + 1."""
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(tiny_deepseek_v3_config()).to(torch.bfloat16)
    ids = torch.randint(1, 512, (2, 32))
    with torch.no_grad():  # hidden_states[j + 1]: the output of layer j; the last entry is after the final norm
        states = model.model(input_ids=ids, output_hidden_states=True).hidden_states
    outputs = [h.float().flatten(0, 1) for h in states[1:-1]]  # layers 0 .. N-2
    for k in (1, 3, 4):
        noisy = outputs[k] * (1 + 0.02 * torch.randn_like(outputs[k]))
        assert is_layer(layer_errors(noisy, outputs), k)
        assert not is_layer(layer_errors(outputs[k + 1], outputs), k) and not is_layer(layer_errors(outputs[k - 1], outputs), k)


# read only where guarded: hasattr(config, "num_nextn_predict_layers"); rope_theta / rope_scaling when the config
# has no rope_parameters; quantization_config for fp8 shared experts
GUARDED_DEEPSEEK_FIELDS = {"num_nextn_predict_layers", "rope_theta", "rope_scaling", "quantization_config"}


def test_the_tiny_deepseek_v3_config_has_every_field_sglang_reads(real, tmp_path):
    """Every ``config.X`` / ``self.config.X`` that SGLang's DeepSeek-V2/V3 model code reads, on the tiny
    config as saved (config.json) and read back: a field it lacks kills the engine at build."""
    files = [
        real.package_dir / "srt" / "models" / "deepseek_v2.py",
        *(real.package_dir / "srt" / "models" / "deepseek_common").glob("*.py"),
    ]
    read = set()
    for file in files:
        for n in ast.walk(ast.parse(file.read_text())):
            if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load) and dotted_name(n.value) in ("config", "self.config"):
                read.add(n.attr)
    assert {"moe_layer_freq", "topk_method", "scoring_func", "n_routed_experts"} <= read  # the reads are found
    tiny_deepseek_v3_config().save_pretrained(tmp_path)
    saved = DeepseekV3Config.from_pretrained(tmp_path)
    missing = sorted(f for f in read - GUARDED_DEEPSEEK_FIELDS if not hasattr(saved, f))
    assert not missing, f"SGLang {real.version} deepseek_v2.py reads {missing}, which the tiny config lacks"


def test_real_attention_backends(real):
    assert {"fa3", "flashinfer", "triton", "flashmla"} <= set(attention_backends(real))


# --------------------------------------------------------------------------- config -> target factory


def test_engine_sglang_maps_to_one_target_factory_per_local_rank():
    cfg = tiny_config(
        "engine=sglang",
        "engine.sglang.tp_size=4",
        "engine.sglang.mem_fraction_static=0.6",
        "engine.sglang.attention_backend=fa3",
        "engine.sglang.load_format=dummy",
        "engine.sglang.max_total_tokens=65536",
        "target=local",
        "target.path=/models/kimi",
        "engine.sglang.dist_port=29650",
    )
    assert cfg.engine.mode == "colocated" and cfg.engine.slot_tokens == cfg.data.max_tokens
    factories = [sglang_rank_factory(cfg.target, cfg.engine, KIMI_IDS, torch.bfloat16, r) for r in range(8)]
    assert [(r.tp_rank, r.dist_port) for r in factories] == [(i % 4, 29650 + i // 4) for i in range(8)]
    # with no dist_port set, the group meets on the port its first rank found free
    free = tiny_config("engine=sglang", "engine.sglang.tp_size=4", "target=local", "target.path=/models/kimi")
    assert sglang_rank_factory(free.target, free.engine, KIMI_IDS, torch.bfloat16, 5, port=41234).dist_port == 41234
    with pytest.raises(ValueError, match="engine.sglang.dist_port is null"):
        sglang_rank_factory(free.target, free.engine, KIMI_IDS, torch.bfloat16, 5)
    first = factories[0]
    assert (first.path, first.aux_layer_ids, first.dtype, first.tp_size) == ("/models/kimi", tuple(KIMI_IDS), torch.bfloat16, 4)
    assert (first.mem_fraction_static, first.attention_backend, first.load_format, first.max_total_tokens) == (0.6, "fa3", "dummy", 65536)
    # SGLang sizes its prefill input buffers by chunked_prefill_size (8192 on an H200 by default): one
    # prefill holds the batches of the 4 ranks of a group, so the buffers must hold 4 x max_tokens
    assert first.prefill_tokens == 4 * cfg.data.max_tokens
    assert [prefill_buffer_tokens(n) for n in (None, 1, 256, 16384, 14509)] == [None, 256, 256, 16384, 14592]
    assert pickle.loads(pickle.dumps(first)) == first  # the engine process receives it pickled


def test_a_kv_pool_or_a_ring_slot_smaller_than_a_batch_is_refused_before_an_engine_starts():
    """Both would stop the run at a batch (SGLang's "does not fit the KV pool", the slot's "does not fit"), after the
    weights loaded or hours in; the config says so first, naming the key and a value that fits."""
    sglang = ["engine=sglang", "engine.sglang.tp_size=2", "engine.sglang.dist_port=29650"]
    small = tiny_config(*sglang, "engine.sglang.max_total_tokens=1000")
    with pytest.raises(
        ValueError,
        match=r"config engine.sglang.max_total_tokens: a KV pool of 1000 tokens cannot hold one prefill of 1024 tokens "
        r"\(tp_size 2 x engine.slot_tokens 512\); set engine.sglang.max_total_tokens=1024 or more",
    ):
        sglang_rank_factory(small.target, small.engine, KIMI_IDS, torch.bfloat16, 0)
    enough = tiny_config(*sglang, "engine.sglang.max_total_tokens=1024")
    assert sglang_rank_factory(enough.target, enough.engine, KIMI_IDS, torch.bfloat16, 0).max_total_tokens == 1024
    cpu = Parallel(0, 1, 0, torch.device("cpu"))
    with pytest.raises(
        ValueError,
        match=r"config engine.slot_tokens: a ring slot of 256 tokens is smaller than a batch, up to data.max_tokens=512; "
        r"set engine.slot_tokens=512",
    ):
        target_factory(tiny_config("engine.mode=colocated", "engine.slot_tokens=256"), [1, 14, 26], torch.float32, cpu)
    assert isinstance(target_factory(tiny_config("engine.slot_tokens=256"), [1, 14, 26], torch.float32, cpu), PathTarget)  # inprocess


def _group_port_rank(rank: int, world: int, init: str, out: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        port = group_port(Parallel(rank, world, rank, torch.device("cpu")), group_size=2)
        Path(out, f"{rank}.json").write_text(json.dumps(port))
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_each_tp_group_meets_on_the_port_its_first_rank_found_free(tmp_path):
    """Two runs on one machine must not meet on one fixed port: each group of 2 of 4 ranks shares
    the port its first rank found free."""
    init = f"tcp://127.0.0.1:{free_port()}"
    torch.multiprocessing.spawn(_group_port_rank, args=(4, init, str(tmp_path)), nprocs=4)
    ports = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(4)]
    assert ports[0] == ports[1] and ports[2] == ports[3] and ports[0] != ports[2]
    assert all(1024 <= p <= 65535 for p in ports)


def test_the_kimi_preset_composes_with_engine_sglang():
    cfg = tiny_config("target=kimi_k25", "target.path=/models/kimi", "engine=sglang", "engine.sglang.tp_size=8")
    assert cfg.target.aux_layer_ids == KIMI_IDS == list(AuxLayerIds.default(61).ids)  # what the real-source test checks
    assert cfg.target.dtype == "bfloat16" and cfg.engine.sglang.tp_size == 8


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["engine=sglang", "engine.sglang.tp_size=0"], "engine.sglang.tp_size"),
        (["engine=sglang", "engine.sglang.mem_fraction_static=1.2"], "engine.sglang.mem_fraction_static"),
        (["engine=sglang", "engine.sglang.load_format=pt"], "engine.sglang.load_format"),
        (["engine=sglang", "engine.sglang.max_total_tokens=0"], "engine.sglang.max_total_tokens"),
        (["engine=sglang", "engine.sglang.dist_port=80"], "engine.sglang.dist_port"),
        (["engine=sglang", "engine.mode=inprocess"], "engine.mode"),
        (["engine.name=sglang"], "engine.sglang"),
        (["engine.name=vllm"], "engine.name"),
        (["engine=sglang", "target.dtype=float32"], "target.dtype"),
    ],
)
def test_bad_engine_values_name_the_key(overrides, key):
    with pytest.raises(ValueError, match=f"config {key}:"):
        tiny_config(*overrides)


def test_every_feature_engine_has_a_factory_maker_and_runs_in_known_modes():
    assert all(kind.factory in MAKERS and kind.modes and set(kind.modes) <= set(MODES) for kind in able("features").values())


def test_the_config_reads_engine_names_and_modes_from_the_registry(monkeypatch):
    with pytest.raises(ValueError, match=r"config engine.name: unknown engine 'other' \(known: hf, sglang\)"):
        tiny_config("engine.name=other")
    monkeypatch.setitem(BACKENDS, "other", Backend(features=Features(PathTarget, ("colocated",))))
    with pytest.raises(ValueError, match="config engine.mode: engine other runs in mode colocated, not inprocess"):
        tiny_config("engine.name=other")
    assert tiny_config("engine.name=other", "engine.mode=colocated").engine.name == "other"


def test_target_factory_per_engine(tmp_path, fake, monkeypatch):
    model = target_dir(tmp_path / "model", "WrapperForConditionalGeneration", 61, multimodal=True)
    gpu = Parallel(rank=0, world=2, local_rank=1, device=torch.device("cuda", 1))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: HOPPER)  # the only CUDA call made
    assert isinstance(target_factory(tiny_config(), [1, 14, 26], torch.float32, gpu), PathTarget)
    cfg = tiny_config("engine=sglang", "engine.sglang.tp_size=2", "target=local", f"target.path={model}", "engine.sglang.dist_port=29650")
    monkeypatch.setenv(SOURCE_ENV, str(fake.package_dir))
    monkeypatch.setenv("LOCAL_SIZE", "2")
    factory = target_factory(cfg, KIMI_IDS, torch.bfloat16, gpu)  # preflight passes
    assert isinstance(factory, SGLangTarget) and (factory.tp_rank, factory.dist_port) == (1, 29650)
    assert factory.attention_backend == "triton"  # the fake install carries no sgl_kernel
    with pytest.raises(ValueError, match="captures the inputs of layers"):
        target_factory(cfg, [2, 30, 57], torch.bfloat16, gpu)
    with pytest.raises(ValueError, match="config engine.name: sglang runs the target on CUDA GPUs"):
        target_factory(cfg, KIMI_IDS, torch.bfloat16, Parallel(0, 1, 0, torch.device("cpu")))
    monkeypatch.setenv("LOCAL_SIZE", "3")
    with pytest.raises(ValueError, match="config engine.sglang.tp_size: 2 does not divide the 3 trainer ranks"):
        target_factory(cfg, KIMI_IDS, torch.bfloat16, gpu)
    # SmolLM2's 9 heads cannot be split over 2 GPUs: refused before an engine starts, naming the key
    monkeypatch.setenv("LOCAL_SIZE", "2")
    odd = target_dir(tmp_path / "odd", "WrapperForConditionalGeneration", 61, multimodal=True, heads=9, kv_heads=3)
    cfg = tiny_config("engine=sglang", "engine.sglang.tp_size=2", "target=local", f"target.path={odd}", "engine.sglang.dist_port=29650")
    with pytest.raises(ValueError, match=r"config engine.sglang.tp_size: tp_size 2 does not divide the target's 9 attention heads"):
        target_factory(cfg, KIMI_IDS, torch.bfloat16, gpu)


@pytest.mark.parametrize(
    "heads, kv, tp, problem",
    [
        (32, 8, 8, None),
        (32, 8, 16, None),  # KV heads replicated: 16 is a multiple of 8
        (64, 64, 8, None),
        (9, 3, 2, "does not divide the target's 9 attention heads"),
        (12, 8, 4, None),
        (12, 8, 3, "neither divides nor is a multiple of the target's 8 KV heads"),
        (48, 6, 4, "neither divides nor is a multiple of the target's 6 KV heads"),
    ],
)
def test_tp_size_must_split_the_heads_as_sglang_does(tmp_path, heads, kv, tp, problem):
    path = target_dir(tmp_path, "LlamaForCausalLM", 4, heads=heads, kv_heads=kv)
    found = tp_size_problem(path, tp)
    assert found is None if problem is None else problem in found


def test_engine_sglang_on_the_embedded_default_uses_its_dequantised_dir(real, monkeypatch):
    cfg = tiny_config("engine=sglang")
    assert cfg.target.path is None
    factory = sglang_rank_factory(cfg.target, cfg.engine, [1, 14, 26], torch.bfloat16, 0, port=free_port())
    assert factory.path == str(embedded_target_dir())
    checked = check_target(factory.path, [1, 14, 26], source_dir=real.package_dir)  # a LlamaForCausalLM dir SGLang reads
    assert checked.architecture == "LlamaForCausalLM" and checked.ids.sglang_layer_inputs == [2, 15, 27]


def test_the_embedded_config_is_plain_with_or_without_a_quantization_config():
    """transformers 5.24 records a quantization_config on a GGUF-loaded config, 5.8.1 (SGLang's pin) none."""
    without = LlamaConfig(num_hidden_layers=30, hidden_size=576, vocab_size=49152, architectures=["LlamaModel"])
    assert not hasattr(without, "quantization_config")
    with_it = copy.deepcopy(without)
    with_it.quantization_config = {"quant_method": "gguf"}
    for loaded in (without, with_it):
        config = plain_config(loaded, Path("x.gguf"))
        assert not hasattr(config, "quantization_config") and config.architectures == ["LlamaForCausalLM"]
    assert hasattr(with_it, "quantization_config")  # the loaded config is left as it was
    with pytest.raises(ValueError, match="x.gguf: hidden_size is 64, expected 576"):
        plain_config(LlamaConfig(num_hidden_layers=30, hidden_size=64, vocab_size=49152), Path("x.gguf"))


# --------------------------------------------------------------------------- the engine's batch layout


def test_documents_of_padded_and_packed_batches():
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]])
    padded = TokenBatch(ids, ids > 0, torch.tensor([3, 2]))
    assert documents(padded) == [[5, 6, 7], [8, 9]]
    packed = TokenBatch(ids, ids > 0, torch.tensor([3, 2]), doc_ids=torch.tensor([[0, 0, 1, -1], [0, 0, -1, -1]]))
    assert documents(packed) == [[5, 6], [7], [8, 9]]  # each document is its own prefill (positions from 0)


def test_each_rank_keeps_its_rows_of_the_group_prefill():
    per_rank = [[[1, 2, 3], [4]], [[5, 6]], [[7], [8, 9]]]  # the documents of 3 TP ranks
    flat = torch.tensor([t for docs in per_rank for d in docs for t in d], dtype=torch.float32)[:, None]  # [N, 1]
    counts = [sum(map(len, docs)) for docs in per_rank]
    assert [flat[rank_span(counts, r)].flatten().tolist() for r in range(3)] == [[1, 2, 3, 4], [5, 6], [7, 8, 9]]
    rows = to_rows(flat[rank_span(counts, 2)], [1, 2], width=3)  # rank 2: rows of 1 and 2 valid tokens
    assert rows.shape == (2, 3, 1) and rows[..., 0].tolist() == [[7, 0, 0], [8, 9, 0]]


def test_an_engine_that_hands_over_the_last_hidden_state_is_refused():
    info = TargetInfo(KIMI, "kimi_k25", 61, 7168, 163840, tuple(KIMI_IDS), "/models/kimi")
    check_aux_width(torch.zeros(5, 3 * 7168), info, "0.5.14")
    with pytest.raises(ValueError, match="handed 7168 values a token instead of 21504"):
        check_aux_width(torch.zeros(5, 7168), info, "0.5.14")


def test_engine_and_trainer_must_agree_on_the_target():
    mine = TargetInfo("LlamaForCausalLM", "llama", 8, 64, 128, (1, 3, 4), "x")
    source = TargetSource(PathTarget())
    source._check_same_target(mine, mine)
    with pytest.raises(ValueError, match=r"aux_layer_ids: trainer \(1, 3, 4\), engine \(2, 3, 4\)"):
        source._check_same_target(mine, TargetInfo("LlamaForCausalLM", "llama", 8, 64, 128, (2, 3, 4), "x"))


def test_without_sglang_the_engine_says_how_to_install_it():
    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("sglang is installed here")
    with pytest.raises(ImportError, match=r"pip install 'streamdraft\[sglang\]'"):
        import_sglang()
    with pytest.raises(ImportError, match="SGLang 0.5.14"):
        SGLangTarget(path="/models/x").build(torch.device("cpu"))


# --------------------------------------------------------------------------- faults: the cause and the setting to change


@dataclass(frozen=True)
class OutOfMemoryTarget:
    """A target factory whose build runs out of GPU memory, as SGLang's weight load or KV pool can."""

    def build(self, device: torch.device):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.81 GiB")


@pytest.mark.parametrize(
    "traceback_tail, setting",
    [
        ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", "engine.sglang.mem_fraction_static"),
        (
            "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static. Current value: mem_fraction_static=0.3",
            "raise engine.sglang.mem_fraction_static",
        ),
        (  # SGLang 0.5.14 on the H200 while a second engine loaded on the same GPU
            "ValueError: Loaded weights leave no GPU memory for the KV cache under --mem-fraction-static=0.15. Raise "
            "--mem-fraction-static above 0.153 (minimum viable = 1 - available/pre = 0.1528).",
            "start two runs on one GPU one after the other",
        ),
        ("ImportError: Can not import FA3 in sgl_kernel. Please check your installation.", "engine.sglang.attention_backend=triton"),
        ("RuntimeError: Ninja build failed. Ninja output:\nnvcc fatal : Unsupported gpu architecture 'compute_90a'", "~/.cache/tvm-ffi"),
        ("RuntimeError: ninja exited with status 1\nstderr:\n/bin/sh: 1: nvcc: not found", "CUDA_HOME"),
    ],
)
def test_an_engine_failure_names_its_cause_and_the_setting(traceback_tail, setting):
    traceback = f'Traceback (most recent call last):\n  File "models/backends/sglang/target.py", line 118, in start\n{traceback_tail}\n'
    message = failure_message(traceback)
    assert setting in failure_cause(traceback)
    assert message.startswith(f"the engine process failed: {failure_cause(traceback)}") and traceback in message
    assert message.endswith(f"cause: {failure_cause(traceback)}")  # also last: what a terminal shows


def test_an_unknown_engine_failure_keeps_its_traceback():
    traceback = "Traceback (most recent call last):\nValueError: poisoned batch\n"
    assert failure_cause(traceback) is None and failure_message(traceback) == f"the engine process failed; its traceback:\n{traceback}"


def test_an_engine_out_of_gpu_memory_stops_the_trainer_with_the_setting():
    with pytest.raises(EngineError) as err:
        TargetSource(OutOfMemoryTarget()).colocated(
            SimpleNamespace(slots=2, slot_tokens=64, start_timeout_s=120.0, wait_timeout_s=120.0), torch.device("cpu")
        )
    text = str(err.value)
    assert text.startswith("the engine process failed: the engine ran out of GPU memory: lower data.max_tokens")
    assert "torch.OutOfMemoryError: CUDA out of memory" in text and "engine.sglang.mem_fraction_static" in text
