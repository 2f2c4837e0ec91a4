"""The Kimi-K2.5-shaped target dir (lab/kimi_reduced.py), the memory arithmetic of
docs/SGLANG.md as code (models/memory_plan.py), and the reduced run's dry mode
(lab/kimi_reduced_run.sh --dry): all on the CPU."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors import safe_open

from lab.kimi_reduced import ARCHITECTURE, KIMI_K25_TEXT, SGLANG_GUARDED, SGLANG_READS, WRAPPER, text_config, write_target
from lab.kimi_reduced_report import (
    moe_forward_flops,
    own_write_bytes,
    process_tree,
    read_proc,
    watch,
    while_training,
)
from models.memory_plan import GB, TargetShape, param_counts, plan
from models.memory_plan import main as plan_main
from trainer.config import register_schema, to_config

ROOT = Path(__file__).resolve().parents[2]
# Kimi-K2.5's structure at tiny widths: what a CPU can load through transformers
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
)


@pytest.fixture(scope="module")
def reduced(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("kimi5")
    write_target(out, full=False, layers=5, experts=16, with_head=False)
    return out


@pytest.fixture(scope="module")
def full(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("kimi-full")
    return write_target(out, full=True, layers=0, experts=0, with_head=False)


def test_config_has_every_field_sglang_reads_with_kimi_widths(reduced):
    from transformers import AutoConfig, AutoTokenizer

    top = AutoConfig.from_pretrained(reduced, local_files_only=True)  # what SGLang's get_config builds
    assert top.architectures == [WRAPPER] and top.model_type == "kimi_k25" and top.vision_config is not None
    config = top.get_text_config()  # the language model SGLang's wrapper builds from text_config
    missing = [f for f in SGLANG_READS if getattr(config, f, None) is None]
    assert not missing, f"config.json lacks fields SGLang 0.5.14 reads: {missing}"
    assert config.architectures == [ARCHITECTURE] and config.moe_layer_freq == 1
    assert config.rope_parameters["rope_theta"] == 50000.0 and config.rope_parameters["factor"] == 64.0
    assert (config.num_hidden_layers, config.n_routed_experts) == (5, 16)
    for key in (
        "hidden_size",
        "q_lora_rank",
        "kv_lora_rank",
        "qk_rope_head_dim",
        "qk_nope_head_dim",
        "v_head_dim",
        "num_attention_heads",
        "vocab_size",
        "intermediate_size",
        "moe_intermediate_size",
        "n_shared_experts",
        "num_experts_per_tok",
        "first_k_dense_replace",
    ):
        assert getattr(config, key) == KIMI_K25_TEXT[key], key
    tokenizer = AutoTokenizer.from_pretrained(reduced, local_files_only=True)
    assert max(tokenizer.get_vocab().values()) < config.vocab_size
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    provenance = json.loads((reduced / "provenance.json").read_text())
    assert "SmolLM2" in provenance["tokenizer"] and WRAPPER in provenance["architecture"]
    assert not (reduced / "model.safetensors").exists()


def sglang_source() -> Path | None:
    env = os.environ.get("STREAMDRAFT_SGLANG_SRC")
    for candidate in ([Path(env)] if env else []) + [Path("/tmp/sgl/sglang")]:
        if (candidate / "srt" / "models" / "deepseek_v2.py").is_file():
            return candidate
    return None


def test_sglang_reads_list_is_what_deepseek_v2_reads():
    src = sglang_source()
    if src is None:
        pytest.skip("no SGLang 0.5.14 source: set STREAMDRAFT_SGLANG_SRC to an unpacked wheel's sglang/")
    text = (src / "srt" / "models" / "deepseek_v2.py").read_text()
    read = set(re.findall(r"(?<![\w])config\.([a-zA-Z_]\w*)", text))
    assert read - set(SGLANG_READS) - set(SGLANG_GUARDED) == set()


def test_full_config_is_kimi_k25_in_int4(full):
    assert full["architectures"] == [WRAPPER]
    assert (text_config(full)["num_hidden_layers"], text_config(full)["n_routed_experts"]) == (61, 384)
    s = TargetShape.from_config(full)
    assert (s.expert_bits, s.group_size, s.dense_layers, s.moe_layers) == (4, 32, 1, 60)
    p = param_counts(s)
    assert round(p["routed_experts"] / 1e9, 1) == 1014.7 and round(sum(p.values()) / 1e9) == 1027  # with the vision tower
    assert 32.0e9 < moe_forward_flops(s, 0.0) / 2 + p["embedding_lm_head"] < 33.5e9  # "32B active a token"


def test_memory_plan_reproduces_the_docs_figures(full):
    p = plan(full, tp=8, tokens=8192)
    f, items = p.facts, {i.name: i.bytes / GB for i in p.items}
    # the language model's 594 GB (76.2 a GPU) and the vision tower's 0.94 GB, replicated
    assert round(f["weights"]["total"] / GB) == 595 and round(f["weights"]["per_gpu"] / GB, 1) == 77.1
    assert f["kv_bytes_per_token"] == 70_272 and f["handoff_bytes_per_token"] == 57_344 and f["aux_width"] == 21_504
    assert round(f["draft_trainable"] / 1e9, 3) == 0.985
    assert round(items["KV pool (65536 tokens)"], 1) == 4.6 and round(items["prefill: hidden + residual"], 1) == 1.9
    assert round(items["captured aux + final of the prefill (65536 tokens)"], 1) == 3.8
    assert round(items["FULL-mode concatenation of the aux states"], 1) == 2.8
    assert (
        round(items["draft trainable bf16 weights + grads"], 1) == 3.9
        and round(items["fp32 master + Adam m, v (ZeRO over 8 ranks)"], 1) == 1.5
    )
    assert round(items["draft's frozen embedding, bf16"] + items["target lm_head for the labels, bf16"], 1) == 4.7
    assert (
        round(items["feature ring (3 slots x 8192 tokens)"], 1) == 1.4 and round(f["static_bytes"] / GB, 1) == 81.7
    )  # 80.8 + the replicated vision tower
    # what docs/SGLANG.md leaves out: SGLang's req_to_token table and the fused-MoE buffer
    # [tokens, top-k, hidden] of a 65,536-token prefill
    assert round(items["req_to_token table"], 2) == 2.15
    assert items["prefill: fused-MoE buffers, or attention if larger"] > 7.5
    assert 135 < p.total() / GB < 150.8  # fits an H200 (150.8 GB), but above the doc's ~130


def test_plan_of_the_reduced_run_and_its_cli(reduced, capsys):
    result = plan_main(["--config", str(reduced), "--tp", "2", "--tokens", "8192", "--max-total-tokens", "24576", "--hf-target-in-trainer"])
    out = capsys.readouterr().out
    assert "5 layers (1 dense)" in out and "16 routed experts" in out and "aux width 21504" in out
    assert result.facts["kv_bytes_per_token"] == 576 * 5 * 2 and result.facts["prefill_tokens"] == 16384
    assert result.total() / GB < 100  # two copies of this beside each other would not; one per GPU does
    with pytest.raises(ValueError, match="one prefill"):
        plan(json.loads((reduced / "config.json").read_text()), tp=2, tokens=8192, max_total_tokens=8192)


def test_head_is_read_by_name_and_a_dir_without_it_cannot_load(tmp_path):
    from models.target import HFTargetEngine

    bare = tmp_path / "bare"
    write_target(bare, full=False, layers=5, experts=16, with_head=False, wrapper=False, overrides=TINY)
    with pytest.raises(ValueError, match="transformers cannot load its model"):  # a dummy dir has no decoder weights
        HFTargetEngine.from_path(bare, [1, 2, 3])
    head = tmp_path / "head"
    write_target(head, full=False, layers=5, experts=16, with_head=True, wrapper=False, overrides=TINY)
    with safe_open(str(head / "model.safetensors"), framework="pt") as f:
        assert sorted(f.keys()) == ["lm_head.weight", "model.embed_tokens.weight"]
        embed = f.get_tensor("model.embed_tokens.weight")
    assert embed.shape == (163840, 64) and embed.dtype == torch.bfloat16
    engine = HFTargetEngine.from_path(head, [1, 2, 3])
    assert torch.equal(engine.embed_weight, embed.float()) and engine.info.vocab_size == 163840
    scaled = tmp_path / "scaled"
    write_target(scaled, full=False, layers=5, experts=16, with_head=True, wrapper=False, overrides=TINY, lm_head_scale=2.0**17)
    with safe_open(str(scaled / "model.safetensors"), framework="pt") as f:  # the same draw, the lm_head scaled exactly
        assert torch.equal(f.get_tensor("model.embed_tokens.weight"), embed)
        assert torch.equal(f.get_tensor("lm_head.weight").float(), embed.float() * 2.0**17)
    assert json.loads((scaled / "provenance.json").read_text())["lm_head_scale"] == 2.0**17
    assert (engine.info.architecture, engine.info.num_layers) == (ARCHITECTURE, 5)


@pytest.mark.slow
def test_dry_run_prints_commands_whose_overrides_the_schema_accepts(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    out = subprocess.run(
        ["bash", str(ROOT / "lab" / "kimi_reduced_run.sh"), str(tmp_path / "out"), "--dry"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    plan_full = json.loads((tmp_path / "out" / "plan_full.json").read_text())
    assert plan_full["facts"]["kv_bytes_per_token"] == 70_272 and (tmp_path / "out" / "plan.json").is_file()
    train = next(line for line in out.stdout.splitlines() if "train_measured.py" in line)
    overrides = [a for a in train.split("train_measured.py", 1)[1].split() if not a.startswith("hydra.")]
    register_schema()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = to_config(compose(config_name="config", overrides=overrides))
    assert cfg.engine.name == "sglang" and cfg.engine.sglang.tp_size == 2 and cfg.engine.sglang.load_format == "dummy"
    assert cfg.target.aux_layer_ids == [1, 2, 3] and cfg.data.max_tokens == 8192 and cfg.engine.slot_tokens == 8192
    assert Path(cfg.target.path) == tmp_path / "out" / "target" and "chatterbot" in cfg.data.sources
    assert "serving.verify" in out.stdout and "--engine sglang" in out.stdout


def test_watch_sees_a_child_and_its_io_counters():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert process_tree(os.getpid())[child.pid] == os.getpid()
        seen = read_proc(child.pid)
        assert seen is not None and "write_bytes" in seen["io"] and "sleep" in seen["cmd"]
    finally:
        child.kill()
        child.wait()
    assert read_proc(child.pid) is None


def test_watch_follows_a_process_until_it_exits_and_keeps_its_counters(tmp_path):
    script = "import time; open(%r, 'wb').write(bytes(1 << 20)); time.sleep(1.0)" % str(tmp_path / "blob")
    child = subprocess.Popen([sys.executable, "-c", script])
    try:
        before = time.time()
        result = watch(child.pid, tmp_path / "watch.json", interval=0.1)  # returns once the child is a zombie
        after = time.time()
    finally:
        child.wait()
    seen = result["processes"][child.pid]
    assert seen["io_last"]["wchar"] >= 1 << 20 and "blob" in seen["cmd"]
    assert seen["writes"][0] == [pytest.approx(seen["first_s"], abs=0.01), seen["io_first"]["write_bytes"]]
    assert seen["writes"][-1][1] == seen["io_last"]["write_bytes"]
    saved = json.loads((tmp_path / "watch.json").read_text())
    assert saved["root_pid"] == child.pid and before <= saved["started_epoch"] <= after


def test_while_training_counts_only_the_steps_window():
    """The rank started 2 s into the watch, spent 3 s starting and 5 s in its first eval, then 30 s in its steps: the
    window is [10, 40] s. The checkpoint at 50 s is after it; the engine's kernel builds at 6 s before it."""
    handoff, tokens = 57344, 100_000
    rank = {"rank": 0, "created_epoch": 1002.0}
    summary = {"phase_s": {"start-up": 3.0, "start-of-run held-out eval": 5.0}, "train_time_s": 30.0}

    def watched(engine_during: int) -> dict:
        trainer = [[2.0, 0], [12.0, 4096], [50.0, 4096 + 17 * int(GB)]]  # a log line's page, then the checkpoint
        engine = [[4.0, 0], [6.0, int(GB) // 4], [20.0, int(GB) // 4 + engine_during]]
        procs = {"12": {"writes": trainer}, "13": {"writes": engine}}
        return {"started_epoch": 1000.0, "processes": procs}

    clean = while_training([rank], summary, watched(0), tokens, handoff)
    assert clean["window_s"] == [10.0, 40.0] and clean["bytes"] == 4096
    assert clean["bytes_per_token"] == pytest.approx(4096 / tokens) and clean["bytes_per_token"] < 0.01 * handoff
    leak = while_training([rank], summary, watched(tokens * handoff // 10), tokens, handoff)  # a tenth of the states
    assert leak["bytes"] == 4096 + tokens * handoff // 10 and leak["bytes_per_token"] > 0.01 * handoff
    assert while_training([{"rank": 0}], summary, watched(0), tokens, handoff) is None  # an older rank record


def test_each_process_writes_are_counted_once():
    """The chain of the co-located run: a runner that reaped its launcher, which reaped the trainer rank; the rank's
    engine was still running at the rank's last look. Linux adds a reaped child's counters into its parent's."""

    def proc(ppid, first, last, last_s):
        return {"cmd": "", "ppid": ppid, "io_first": {"write_bytes": first}, "io_last": {"write_bytes": last}, "last_s": last_s}

    procs = {
        "10": proc(1, 0, 18 * int(GB) + 7, 100.0),  # runner: the launcher's (and so the rank's) counters, + 7 of its own
        "11": proc(10, 0, 18 * int(GB), 99.0),  # launcher: the rank's counters
        "12": proc(11, 0, 18 * int(GB), 98.0),  # the rank: 17.7 GB of checkpoints and exports, its engine's 0.3 GB
        "13": proc(12, 0, int(GB) // 4, 98.0),  # the engine: seen last with its parent, so not yet reaped into it
    }
    own = own_write_bytes(procs)
    gb = int(GB)
    assert own == {"10": 7, "11": 0, "12": 18 * gb, "13": gb // 4}


def test_each_rank_records_when_its_process_started(tmp_path, monkeypatch):
    """The report places the rank's phases on the watcher's clock from ``created_epoch``."""
    import psutil

    from lab.train_measured import io_counters, record

    monkeypatch.setenv("RANK", "0")
    record(tmp_path, io_counters())
    row = json.loads((tmp_path / "rank0.json").read_text())
    assert row["created_epoch"] == psutil.Process().create_time() and row["pid"] == os.getpid()
