"""Replays of the engines' EAGLE-3 weight loaders over a checkpoint's names and shapes.

Each replay builds the parameter table the engine's draft module would have for a config
(names and shapes, computed the way the engine computes them, defaults included) and then
walks the checkpoint's tensor names through the engine's renaming, exactly as its
``load_weights`` does, recording where every tensor lands. The result says which tensors
were consumed, which were dropped (SGLang drops unknown names silently) or refused (vLLM
raises on them), which parameters were never set, and which shapes disagree.

* SGLang 0.5.14, ``sglang/srt/models/llama_eagle3.py`` ``LlamaForCausalLMEagle3.load_weights``:
  legacy names (``midlayer`` -> ``layers.0``, ``aux_norm_*`` -> ``fc_norm.*``); ``d2t`` ->
  ``hot_token_id``; ``t2d`` ignored; stacked ``q/k/v_proj`` -> ``qkv_proj`` and
  ``gate/up_proj`` -> ``gate_up_proj``; a name not in the parameter dict gets ``model.``
  prepended; a name still unknown is skipped without a word.
* vLLM 0.33.0, ``vllm/model_executor/models/llama_eagle3.py``
  ``Eagle3LlamaForCausalLM.load_weights``: ``t2d`` skipped; ``d2t`` ->
  ``draft_id_to_target_id`` (a parameter only when the draft vocab differs from the
  target's); every other name but ``lm_head`` gets ``model.``; ``LlamaModel``'s mapper
  renames ``midlayer.`` -> ``layers.0.`` and stacks the projections; an unknown name raises.
  Parameters left unset keep their initial values (``draft_id_to_target_id`` zeros: the
  identity map) except the embedding and ``lm_head``, which are shared from the target.
* The mla layout, ``Eagle3DeepseekV2ForCausalLM`` (SGLang 0.5.14 ``kimi_k25_eagle3.py``, vLLM 0.33.0
  ``deepseek_eagle3.py``): ``q_a_proj`` and ``kv_a_proj_with_mqa`` fill one fused parameter
  (SGLang holds the first until the second arrives: one alone sets nothing), the other MLA
  tensors land by name. SGLang renames a leading ``layers.0.`` to ``midlayer.`` and prepends
  ``model.`` to all but ``lm_head``, and skips unknown names with a warning; vLLM prepends
  ``model.`` likewise, renames ``midlayer.`` to ``layers.0.``, has ``draft_id_to_target_id``
  whatever the vocab sizes (left out of the load when the checkpoint has no ``d2t``) and
  refuses unknown names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

Shape = tuple[int, ...]
STACKED = [
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
    (".gate_up_proj", ".gate_proj", 0),
    (".gate_up_proj", ".up_proj", 1),
]
SGLANG_LEGACY = {"midlayer": "layers.0", "aux_norm_low": "fc_norm.0", "aux_norm_mid": "fc_norm.1", "aux_norm_high": "fc_norm.2"}


@dataclass(frozen=True)
class Param:
    shape: Shape
    shards: dict = field(default_factory=dict)  # shard id -> shape of that slice (stacked params)


@dataclass
class Replay:
    engine: str
    params: dict[str, Param]
    landed: dict[str, str] = field(default_factory=dict)  # checkpoint name -> parameter (or role)
    dropped: list[str] = field(default_factory=list)  # SGLang: skipped silently
    refused: list[str] = field(default_factory=list)  # vLLM: load_weights raises
    set_params: dict[str, set] = field(default_factory=dict)  # parameter -> shard ids (or {None}) written
    shape_errors: list[tuple[str, str, Shape, Shape]] = field(default_factory=list)  # (ckpt, param, got, want)
    shared_from_target: set[str] = field(default_factory=set)  # left unset on purpose: the engine shares them

    def unset(self) -> list[str]:
        """Parameters no checkpoint tensor (or shard of one) set, minus those shared from the target."""
        out = []
        for name, p in self.params.items():
            want = set(p.shards) if p.shards else {None}
            if name not in self.shared_from_target and not want <= self.set_params.get(name, set()):
                out.append(name)
        return out


def _cfg(config: dict, key: str, default=None):
    return config[key] if key in config else default


def _num_aux(config: dict, eagle: dict) -> int:
    explicit = config.get("num_aux_hidden_states")
    if explicit is not None:
        return explicit
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    return len(ids) if ids else 3


def _layer_params(prefix: str, i: int, h: int, inter: int, q: int, kv: int) -> dict[str, Param]:
    width = 2 * h if i == 0 else h
    p = f"{prefix}layers.{i}."
    return {
        p + "self_attn.qkv_proj.weight": Param((q + 2 * kv, width), {"q": (q, width), "k": (kv, width), "v": (kv, width)}),
        p + "self_attn.o_proj.weight": Param((h, q)),
        p + "mlp.gate_up_proj.weight": Param((2 * inter, h), {0: (inter, h), 1: (inter, h)}),
        p + "mlp.down_proj.weight": Param((h, inter)),
        p + "input_layernorm.weight": Param((h,)),
        p + "post_attention_layernorm.weight": Param((h,)),
        p + "hidden_norm.weight": Param((h,)),
    }


MLA_STACKED = [(".fused_qkv_a_proj", ".q_a_proj", 0), (".fused_qkv_a_proj", ".kv_a_proj_with_mqa", 1)]


def _mla_layer_params(p: str, layer: dict, fused: str) -> dict[str, Param]:
    """One MLA draft layer's parameters under prefix ``p``; ``fused``: the engine's name of the fused
    q_a / kv_a projection (shards 0 and 1)."""
    h, inter, n = layer["hidden_size"], layer["intermediate_size"], layer["num_attention_heads"]
    q_rank, kv_rank, rope = layer["q_lora_rank"], layer["kv_lora_rank"], layer["qk_rope_head_dim"]
    nope, v = layer["qk_nope_head_dim"], layer["v_head_dim"]
    return {
        p + f"self_attn.{fused}.weight": Param((q_rank + kv_rank + rope, 2 * h), {0: (q_rank, 2 * h), 1: (kv_rank + rope, 2 * h)}),
        p + "self_attn.q_a_layernorm.weight": Param((q_rank,)),
        p + "self_attn.q_b_proj.weight": Param((n * (nope + rope), q_rank)),
        p + "self_attn.kv_a_layernorm.weight": Param((kv_rank,)),
        p + "self_attn.kv_b_proj.weight": Param((n * (nope + v), kv_rank)),
        p + "self_attn.o_proj.weight": Param((h, n * v)),
        p + "mlp.gate_up_proj.weight": Param((2 * inter, h), {0: (inter, h), 1: (inter, h)}),
        p + "mlp.down_proj.weight": Param((h, inter)),
        p + "input_layernorm.weight": Param((h,)),
        p + "post_attention_layernorm.weight": Param((h,)),
        p + "hidden_norm.weight": Param((h,)),
    }


def _head_params(config: dict, num_aux: int, target_hidden: int) -> dict[str, Param]:
    """The embedding, ``fc`` (and its ``fc_norm`` list) and the final norm of a draft of either layout."""
    h = config["hidden_size"]
    params = {"model.embed_tokens.weight": Param((config["vocab_size"], h)), "model.fc.weight": Param((h, target_hidden * num_aux))}
    if config.get("fc_norm") or config.get("use_aux_norm"):
        params.update({f"model.fc_norm.{i}.weight": Param((target_hidden,)) for i in range(num_aux)})
    params["model.norm.weight"] = Param((h,))
    return params


def _body_params(layer: dict, num_aux: int, target_hidden: int) -> dict[str, Param]:
    h, inter = layer["hidden_size"], layer["intermediate_size"]
    heads, kv_heads = layer["num_attention_heads"], _cfg(layer, "num_key_value_heads", layer["num_attention_heads"])
    head_dim = _cfg(layer, "head_dim", None) or h // heads
    params = {"model.embed_tokens.weight": Param((layer["vocab_size"], h)), "model.fc.weight": Param((h, target_hidden * num_aux))}
    for i in range(layer["num_hidden_layers"]):
        params.update(_layer_params("model.", i, h, inter, heads * head_dim, kv_heads * head_dim))
    params["model.norm.weight"] = Param((h,))
    return params


def sglang_params(config: dict) -> tuple[dict[str, Param], set[str]]:
    """SGLang's parameters for ``config`` (``LlamaForCausalLMEagle3`` or the mla layout's
    ``Eagle3DeepseekV2ForCausalLM``), and those it shares from the target."""
    eagle = config.get("eagle_config") or {}
    num_aux = _num_aux(config, eagle)
    target_hidden = _cfg(config, "target_hidden_size", config["hidden_size"])
    if _is_mla(config):
        params = _head_params(config, num_aux, target_hidden) | _mla_layer_params("model.midlayer.", config, "fused_qkv_a_proj_with_mqa")
    else:
        params = _body_params(config, num_aux, target_hidden)
        if config.get("fc_norm") or config.get("use_aux_norm"):
            params.update({f"model.fc_norm.{i}.weight": Param((target_hidden,)) for i in range(num_aux)})
    if config.get("bias"):
        params["model.fc.bias"] = Param((config["hidden_size"],))
    shared = set()
    if target_hidden == config["hidden_size"]:
        shared.add("model.embed_tokens.weight")  # set_embed replaces it with the target's
    if config.get("tie_word_embeddings"):
        shared.add("lm_head.weight")  # lm_head is the embedding module itself
    else:
        vd = config.get("draft_vocab_size")
        params["lm_head.weight"] = Param((vd if vd is not None else config["vocab_size"], config["hidden_size"]))
        if vd is None:
            shared.add("lm_head.weight")  # load_lm_head_from_target: the target's full head
    return params, shared


def _is_mla(config: dict) -> bool:
    return config.get("architectures") == ["Eagle3DeepseekV2ForCausalLM"]


def vllm_params(config: dict, target_vocab: int | None) -> tuple[dict[str, Param], set[str]]:
    """vLLM's ``Eagle3LlamaForCausalLM`` parameters for a speculators config, or its
    ``Eagle3DeepseekV2ForCausalLM`` parameters for an mla config."""
    if _is_mla(config):
        num_aux = config.get("num_aux_hidden_states") or _num_aux({}, config.get("eagle_config") or {})
        target_hidden = _cfg(config, "target_hidden_size", config["hidden_size"])
        params = _head_params(config, num_aux, target_hidden) | _mla_layer_params("model.layers.0.", config, "fused_qkv_a_proj")
        vd = config.get("draft_vocab_size") or config["vocab_size"]
        params |= {"lm_head.weight": Param((vd, config["hidden_size"])), "draft_id_to_target_id": Param((vd,))}
        return params, set()
    layer = {**config.get("transformer_layer_config", {})}
    eagle = layer.get("eagle_config") or {}
    num_aux = _num_aux(layer, eagle)
    target_hidden = _cfg(config, "target_hidden_size", layer["hidden_size"])
    params = _body_params(layer, num_aux, target_hidden)
    if config.get("norm_before_fc"):
        params["model.input_norm.weight"] = Param((target_hidden * num_aux,))
    if config.get("fc_norm"):
        params.update({f"model.fc_norm.{i}.weight": Param((target_hidden,)) for i in range(num_aux)})
    vd = config.get("draft_vocab_size") or layer["vocab_size"]
    params["lm_head.weight"] = Param((vd, layer["hidden_size"]))
    if vd != (target_vocab if target_vocab is not None else layer["vocab_size"]):
        params["draft_id_to_target_id"] = Param((vd,))
    return params, set()


def _stack(name: str, table=STACKED) -> tuple[str, object] | None:
    for param, shard, shard_id in table:
        if shard in name:
            return name.replace(shard, param), shard_id
    return None


def _land(r: Replay, ckpt: str, param: str, shard, shape: Shape) -> None:
    spec = r.params[param]
    want = spec.shards[shard] if shard is not None else spec.shape
    if tuple(shape) != tuple(want):
        r.shape_errors.append((ckpt, param + (f"[{shard}]" if shard is not None else ""), tuple(shape), tuple(want)))
    r.landed[ckpt] = param
    r.set_params.setdefault(param, set()).add(shard)


def replay_sglang(config: dict, tensors: dict[str, Shape]) -> Replay:
    params, shared = sglang_params(config)
    r = Replay("sglang", params, shared_from_target=shared)
    if _is_mla(config):
        _replay_sglang_mla(r, tensors)
        return r
    for ckpt, shape in tensors.items():
        name = ckpt
        for legacy, new in SGLANG_LEGACY.items():
            name = name.replace(legacy, new) if legacy in name else name
        if "d2t" in name:
            r.landed[ckpt] = "hot_token_id (d2t + arange)"
            continue
        if "t2d" in name:
            r.landed[ckpt] = "(ignored by SGLang)"
            continue
        stacked = _stack(name)
        name, shard = stacked if stacked else (name, None)
        target = name if name in params else f"model.{name}"
        if target in params:
            _land(r, ckpt, target, shard, shape)
        else:
            r.dropped.append(ckpt)
    return r


def _replay_sglang_mla(r: Replay, tensors: dict[str, Shape]) -> None:
    """``Eagle3DeepseekV2ForCausalLM.load_weights``: the fused a-projection is written once both halves came."""
    fused_table = [(".fused_qkv_a_proj_with_mqa", shard, i) for _, shard, i in MLA_STACKED]
    halves: dict[str, tuple[str, int, Shape]] = {}  # the fused parameter -> the first half's (ckpt, shard, shape)
    for ckpt, shape in tensors.items():
        if ckpt == "d2t" or ckpt.endswith(".d2t"):
            r.landed[ckpt] = "hot_token_id (d2t + arange)"
            continue
        if ckpt == "t2d" or ckpt.endswith(".t2d"):
            r.landed[ckpt] = "(ignored by SGLang)"
            continue
        name = "midlayer." + ckpt.removeprefix("layers.0.") if ckpt.startswith("layers.0.") else ckpt
        name = name if name.startswith("lm_head.") else f"model.{name}"
        gate_up, fused = _stack(name), _stack(name, fused_table)
        if gate_up and gate_up[0] in r.params:
            _land(r, ckpt, *gate_up, shape)
        elif fused and fused[0] in r.params:
            if fused[0] not in halves:
                halves[fused[0]] = (ckpt, fused[1], shape)
                continue
            first, first_shard, first_shape = halves.pop(fused[0])
            _land(r, first, fused[0], first_shard, first_shape)
            _land(r, ckpt, *fused, shape)
        elif name in r.params:
            _land(r, ckpt, name, None, shape)
        else:
            r.dropped.append(ckpt)
    r.dropped.extend(ckpt for ckpt, _, _ in halves.values())  # held for a partner that never came: never written


def replay_vllm(config: dict, tensors: dict[str, Shape], target_vocab: int | None = None) -> Replay:
    params, shared = vllm_params(config, target_vocab)
    r = Replay("vllm", params, shared_from_target=shared)
    names = set(tensors)
    mla = _is_mla(config)
    if not any("embed_tokens" in n for n in names):
        r.shared_from_target.add("model.embed_tokens.weight")  # has_own_embed_tokens False: shared
    if not any("lm_head" in n for n in names):
        r.shared_from_target.add("lm_head.weight")  # has_own_lm_head False: the target's full head
    if mla and not any("d2t" in n for n in names):
        r.shared_from_target.add("draft_id_to_target_id")  # skipped from the load: the identity map
    stacked_table = STACKED + MLA_STACKED if mla else STACKED
    for ckpt, shape in tensors.items():
        if "t2d" in ckpt:
            r.landed[ckpt] = "(skipped by vLLM)"
            continue
        if "d2t" in ckpt:
            name = ckpt.replace("d2t", "draft_id_to_target_id")
        elif "lm_head" in ckpt:
            name = ckpt
        else:
            name = "model." + ckpt.replace("midlayer.", "layers.0.")
        stacked = _stack(name, stacked_table) if name.startswith("model.") else None
        name, shard = stacked if stacked else (name, None)
        if name in params:
            _land(r, ckpt, name, shard, shape)
        else:
            r.refused.append(ckpt)
    return r
