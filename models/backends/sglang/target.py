"""The target in SGLang (``engine=sglang``, docs/SGLANG.md): the features ``models.target``
hands out, from SGLang's own EAGLE-3 aux capture.

Each engine process (one per trainer rank, ``trainer.stream.engine_process``) is one tensor-parallel
rank of an SGLang ``ModelRunner`` on its own GPU; ``tp_size`` consecutive local ranks hold one
copy of the target. Per batch the ranks of a group gather their token batches, prefill them as
one batch, and each keeps its own rows: every rank's features go into its own trainer's ring.

Why a ``ModelRunner`` and not ``sglang.Engine``: the Engine returns hidden states as Python lists
through its scheduler and detokenizer processes, and with EAGLE-3 capture on, its
``CaptureHiddenMode.FULL`` output is the concatenated aux states alone: the final normed hidden
state the trainer's target logits need is gone. Driving the ModelRunner, as SGLang's own
``bench_one_batch`` does, keeps every tensor on the GPU and gives both, for every token:

* aux: ``set_eagle3_layers_to_capture(ids)``, the call SGLang's serving makes
  (model_runner.py:1002-1011) with the ids the export writes (``models.backends.sglang.preflight``),
  and ``CaptureHiddenMode.FULL``: ``logits_output.hidden_states`` is then ``cat(aux, -1)``
  (logits_processor.py:595-600), the tensor SGLang's EAGLE-3 worker hands the draft's ``fc``;
* final: the hidden-state argument of the logits processor, read by a forward pre-hook
  (nothing in SGLang is patched).

CUDA graphs are off (prefills of varying shape; hooks run only in eager mode), there is no
prefix cache, and the KV pools are cleared after each batch: every batch is a fresh prefill.
"""

from __future__ import annotations

import sys
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from torch import Tensor, nn

from models.aux_ids import AuxLayerIds
from models.backends.sglang.preflight import INSTALL_HINT, check_target, choose_attention_backend, read_target_shape
from models.batch import FeatureBatch, TokenBatch
from models.target import TargetInfo

SGLANG_VERSION = "0.5.14"  # the ModelRunner / ScheduleBatch API this module drives
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
# sglang.Engine keywords of a run that hands token ids in and reads token ids out: no tokenizer, and no multimodal
# processor, which SGLang otherwise builds for a vision-wrapped target (KimiK25ForConditionalGeneration) from
# processor files a text-only checkpoint dir does not have
TOKEN_IDS_ENGINE = {"skip_tokenizer_init": True, "enable_multimodal": False}


@dataclass(frozen=True)
class SGLangTarget:
    """The target factory of one tensor-parallel rank of a target in SGLang (``SGLangTargetEngine``, docs/SGLANG.md).

    The ``tp_size`` engine processes of a group (consecutive local ranks) each hold one of these
    with their own ``tp_rank`` and the group's ``dist_port``; ``trainer.target_setup.sglang_rank_factory``
    derives both from the config and the local rank.
    """

    path: str  # local model dir (config.json; weights unless load_format is dummy)
    aux_layer_ids: tuple[int, ...] | None = None  # output of decoder layer k; None: [1, N//2-1, N-4]
    dtype: torch.dtype = torch.bfloat16
    tp_size: int = 1
    tp_rank: int = 0
    dist_port: int = 29650  # the group's rendezvous port on 127.0.0.1
    mem_fraction_static: float = 0.5  # of the GPU memory free at start: weights + KV pool
    attention_backend: str | None = None  # None: fa3 on Hopper where sgl_kernel carries it, else triton (models.backends.sglang.preflight)
    load_format: str = "auto"  # auto | dummy (random weights, for benchmarks)
    max_total_tokens: int | None = None  # KV pool tokens; None: what mem_fraction_static leaves
    prefill_tokens: int | None = None  # the largest prefill (tp_size x slot tokens): SGLang's input buffers; None: its default

    def build(self, device: torch.device) -> SGLangTargetEngine:
        return SGLangTargetEngine.start(self, device)


def import_sglang(needed_by: str = "engine=sglang"):
    """The ``sglang`` module, or ImportError saying what needs which version and how to install it."""
    try:
        import sglang
    except ImportError as err:
        raise ImportError(f"{needed_by} needs SGLang {SGLANG_VERSION}: {INSTALL_HINT}") from err
    if sglang.__version__ != SGLANG_VERSION:
        raise ImportError(f"{needed_by} is written against SGLang {SGLANG_VERSION}'s API, found {sglang.__version__}: {INSTALL_HINT}")
    return sglang


# --------------------------------------------------------------------------- batch layout (no SGLang)


def documents(tokens: TokenBatch) -> list[list[int]]:
    """The sequences SGLang prefills, in row order: each row's valid tokens, or each document
    of a packed row (documents sit back to back from the row's start)."""
    docs = [d.tolist() for d in tokens.documents()]
    if not all(docs):
        raise ValueError("engine=sglang: a batch row (or document) without tokens")
    return docs


def rank_span(tokens_per_rank: Sequence[int], rank: int) -> slice:
    """Where ``rank``'s tokens sit in the group's prefill (ranks in order)."""
    start = sum(tokens_per_rank[:rank])
    return slice(start, start + tokens_per_rank[rank])


def to_rows(flat: Tensor, lengths: Sequence[int], width: int) -> Tensor:
    """[N, W] tokens (N = sum(lengths)) as right-padded rows [B, width, W], zeros on padding."""
    rows = flat.new_zeros(len(lengths), width, flat.shape[-1])  # [B, T, W]
    valid = torch.arange(width, device=flat.device)[None, :] < torch.tensor(lengths, device=flat.device)[:, None]  # [B, T]
    rows[valid] = flat
    return rows


def prefill_buffer_tokens(tokens: int | None) -> int | None:
    """SGLang's ``chunked_prefill_size`` for prefills of up to ``tokens``: rounded up to a multiple of
    256, which every KV page size SGLang uses divides; None keeps SGLang's default."""
    return None if tokens is None else -(-tokens // 256) * 256


def check_aux_width(aux: Tensor | None, info: TargetInfo, version: str) -> None:
    """The field failure, caught per batch: a class that did not capture hands over H values a token."""
    want = len(info.aux_layer_ids) * info.hidden_size
    got = None if aux is None else aux.shape[-1]
    if got != want:
        raise ValueError(
            f"SGLang {version} {info.architecture} handed {got} values a token instead of {want} "
            f"({len(info.aux_layer_ids)} aux layers x {info.hidden_size}): aux capture is not active for this class"
        )


# --------------------------------------------------------------------------- the engine


class SGLangTargetEngine:
    """One tensor-parallel rank of a frozen SGLang target that hands out aux + final hidden states."""

    def __init__(self, runner, info: TargetInfo, factory: SGLangTarget, version: str):
        self.runner, self.info, self.version = runner, info, version
        self.tp_size, self.tp_rank = factory.tp_size, factory.tp_rank
        self.device = torch.device("cuda", runner.gpu_id)
        self.dtype: torch.dtype = runner.model_config.dtype
        self._final: list[Tensor] = []
        self._width_said = False  # the first checked batch says the width once (the engine log's proof)
        _logits_processor(runner.model).register_forward_pre_hook(self._keep_final, with_kwargs=True)

    @classmethod
    def start(cls, factory: SGLangTarget, device: torch.device) -> "SGLangTargetEngine":
        """Preflight (from source), then load the target into a ModelRunner with aux capture on."""
        sglang = import_sglang()
        shape = read_target_shape(factory.path)
        ids = AuxLayerIds.resolve(factory.aux_layer_ids, shape.num_layers)
        source = Path(sglang.__file__).parent
        checked = check_target(factory.path, ids.ids, source_dir=source)
        backend = choose_attention_backend(factory.attention_backend, torch.cuda.get_device_capability(device), source_dir=source)
        if factory.attention_backend is None:  # chosen here, not by the trainer (which prints its choice)
            print(f"engine=sglang on {device}: {backend.describe()}", flush=True)
        runner = _model_runner(factory, backend.backend, device)
        _switch_on_capture(runner, checked.ids, sglang.__version__)
        runner.init_attention_backends()
        runner.init_cuda_graphs()  # graphs are disabled: this builds the eager runner
        config = runner.model_config
        info = TargetInfo(
            architecture=config.hf_config.architectures[0],
            model_type=config.hf_text_config.model_type,
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            vocab_size=config.vocab_size,
            aux_layer_ids=ids.ids,
            source=factory.path,
        )
        return cls(runner, info, factory, sglang.__version__)

    def _keep_final(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._final.append(args[1] if len(args) > 1 else kwargs["hidden_states"])  # [N, H], final normed

    @torch.no_grad()
    def features(self, tokens: TokenBatch) -> FeatureBatch:
        """Aux-layer outputs and the final normed hidden state of a right-padded or packed batch
        (zeros on padding)."""
        group = self._gather(documents(tokens))  # every rank's documents, in rank order
        aux, final = self._prefill([doc for docs in group for doc in docs])  # [N, A*H], [N, H]
        mine = rank_span([sum(map(len, docs)) for docs in group], self.tp_rank)
        lengths, width = tokens.lengths.tolist(), tokens.input_ids.shape[1]
        return FeatureBatch(tokens.to(self.device), to_rows(aux[mine], lengths, width), to_rows(final[mine], lengths, width))

    def _gather(self, docs: list[list[int]]) -> list[list[list[int]]]:
        if self.tp_size == 1:
            return [docs]
        group: list = [None] * self.tp_size
        torch.distributed.all_gather_object(group, docs, group=self.runner.tp_group.cpu_group)
        return group

    def _prefill(self, docs: list[list[int]]) -> tuple[Tensor, Tensor]:
        """One extend (prefill) of ``docs`` with full hidden-state capture, as bench_one_batch.extend runs it."""
        r, tokens = self.runner, sum(map(len, docs))
        buffers = r.server_args.chunked_prefill_size
        if buffers is not None and 0 < buffers < tokens:
            raise ValueError(
                f"a prefill of {tokens} tokens (the batches of {self.tp_size} TP ranks) exceeds SGLang's prefill buffers of "
                f"{buffers} tokens: set engine.slot_tokens to the largest batch (default ${{data.max_tokens}})"
            )
        if tokens > r.max_total_num_tokens:
            raise ValueError(
                f"a prefill of {tokens} tokens (the batches of {self.tp_size} TP ranks) does not fit SGLang's KV pool of "
                f"{r.max_total_num_tokens}: raise engine.sglang.mem_fraction_static or max_total_tokens, or lower data.max_tokens"
            )
        self._final.clear()
        out = extend(r, docs)
        assert len(self._final) == 1, f"the logits processor ran {len(self._final)} times in one prefill"
        check_aux_width(out.hidden_states, self.info, self.version)
        if not self._width_said:
            n, h = len(self.info.aux_layer_ids), self.info.hidden_size
            print(
                f"aux width check: SGLang {self.version} {self.info.architecture} hands {n * h} values a token "
                f"({n} aux layers x {h}), checked on every batch",
                file=sys.stderr,
                flush=True,
            )
            self._width_said = True
        return out.hidden_states, self._final.pop()


def extend(runner, docs: list[list[int]]):
    """The logits output of one fresh extend (prefill) of ``docs`` with ``CaptureHiddenMode.FULL``:
    its ``hidden_states`` are what SGLang's EAGLE-3 worker hands the draft. The KV pools are cleared after."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.chunk_cache import ChunkCache
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    r = runner
    pools = CacheInitParams(
        disable=True,
        req_to_token_pool=r.req_to_token_pool,
        token_to_kv_pool_allocator=r.token_to_kv_pool_allocator,
        page_size=r.page_size,
    )
    batch = ScheduleBatch.init_new(
        reqs=[_request(i, doc) for i, doc in enumerate(docs)],
        req_to_token_pool=r.req_to_token_pool,
        token_to_kv_pool_allocator=r.token_to_kv_pool_allocator,
        tree_cache=ChunkCache(pools),
        model_config=r.model_config,
        enable_overlap=False,
        spec_algorithm=SpeculativeAlgorithm.NONE,
    )
    batch.prepare_for_extend()
    if batch.input_ids is None:  # ids staged on pinned CPU memory for an overlapped copy
        batch.input_ids, batch.prefill_input_ids_cpu = batch.prefill_input_ids_cpu.to(batch.device, non_blocking=True), None
    batch.capture_hidden_mode = CaptureHiddenMode.FULL
    try:
        return r.forward(ForwardBatch.init_new(batch, r)).logits_output
    finally:
        r.req_to_token_pool.clear()
        r.token_to_kv_pool_allocator.clear()


def served_width(factory: SGLangTarget, draft_path: str, device: torch.device, tokens: Sequence[int]) -> tuple[str, int | None]:
    """(the class SGLang builds for the target, the values a token its logits output hands the draft)
    when SGLang serves the target with the EAGLE-3 draft at ``draft_path``: the ModelRunner is built
    with SGLang's own speculative settings, so the capture is switched on (or not) by SGLang's serving
    code, from the draft's own ``eagle_config``, not by StreamDraft."""
    import_sglang("the served width check")
    backend = choose_attention_backend(factory.attention_backend, torch.cuda.get_device_capability(device))
    runner = _model_runner(factory, backend.backend, device, draft_path=draft_path)
    runner.init_attention_backends()
    runner.init_cuda_graphs()  # graphs are disabled: this builds the eager runner
    out = extend(runner, [list(tokens)])
    width = None if out.hidden_states is None else int(out.hidden_states.shape[-1])
    return type(runner.model).__name__, width


def _request(rid: int, doc: list[int]):
    """A fresh request for ``doc``: no prefix, no input logprobs (bench_one_batch's recipe)."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_new_tokens=1)
    req = Req(rid=str(rid), origin_input_text="", origin_input_ids=array("q", doc), sampling_params=params)
    req.full_untruncated_fill_ids = req.origin_input_ids
    req.fill_len = len(doc)
    req.logprob_start_len = -1
    req.set_extend_input_len(req.fill_len - len(req.prefix_indices))
    return req


def _model_runner(factory: SGLangTarget, attention_backend: str, device: torch.device, draft_path: str | None = None):
    """The ModelRunner of this TP rank, weights loaded and KV pools allocated (bench_one_batch.load_model);
    ``draft_path``: the target of an EAGLE-3 server with that draft (a one-step chain)."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.entrypoints.engine import _set_envs_and_config
    from sglang.srt.layers.moe import initialize_moe_config
    from sglang.srt.layers.quantization.fp4_utils import initialize_fp4_gemm_config
    from sglang.srt.layers.quantization.fp8_utils import initialize_fp8_gemm_config
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(
        model_path=factory.path,
        skip_tokenizer_init=True,
        dtype=DTYPE_NAMES[factory.dtype],
        tp_size=factory.tp_size,
        mem_fraction_static=factory.mem_fraction_static,
        attention_backend=attention_backend,
        load_format=factory.load_format,
        max_total_tokens=factory.max_total_tokens,
        chunked_prefill_size=prefill_buffer_tokens(factory.prefill_tokens),  # sizes the eager runner's input buffers
        disable_radix_cache=True,
        disable_prefill_cuda_graph=True,
        disable_decode_cuda_graph=True,
        random_seed=0,
        **(
            {}
            if draft_path is None
            else dict(
                speculative_algorithm="EAGLE3",
                speculative_draft_model_path=draft_path,
                speculative_num_steps=1,
                speculative_eagle_topk=1,
                speculative_num_draft_tokens=2,
            )
        ),
    )
    _set_envs_and_config(args)
    initialize_moe_config(args)
    initialize_fp8_gemm_config(args)
    initialize_fp4_gemm_config(args)
    runner = ModelRunner(
        model_config=ModelConfig.from_server_args(args),
        mem_fraction_static=args.mem_fraction_static,
        gpu_id=device.index,
        tp_rank=factory.tp_rank,
        tp_size=factory.tp_size,
        moe_ep_rank=factory.tp_rank // (factory.tp_size // args.ep_size),
        moe_ep_size=args.ep_size,
        pp_rank=0,
        pp_size=1,
        nccl_port=factory.dist_port,
        server_args=args,
    )
    runner.alloc_memory_pool()
    return runner


def _switch_on_capture(runner, ids: AuxLayerIds, version: str) -> None:
    """SGLang's EAGLE-3 switch with our ids, then the live model must capture what the preflight replayed."""
    model = runner.model
    if not hasattr(model, "set_eagle3_layers_to_capture"):
        raise ValueError(f"SGLang {version}: {type(model).__name__} has no set_eagle3_layers_to_capture: it cannot capture aux states")
    model.set_eagle3_layers_to_capture(ids.sglang_argument)
    captured = [list(m.layers_to_capture) for m in model.modules() if getattr(m, "layers_to_capture", None)]
    if captured != [ids.sglang_layer_inputs]:
        raise ValueError(
            f"SGLang {version}: {type(model).__name__}.set_eagle3_layers_to_capture({ids.sglang_argument}) set layers_to_capture "
            f"{captured}, expected [{ids.sglang_layer_inputs}] (the inputs of layers k + 1 = the outputs of layers k we train on)"
        )


def _logits_processor(model: nn.Module) -> nn.Module:
    from sglang.srt.layers.logits_processor import LogitsProcessor

    found = [m for m in model.modules() if isinstance(m, LogitsProcessor)]
    if len(found) != 1:
        raise ValueError(f"{type(model).__name__} has {len(found)} logits processors; the final hidden state is read at exactly one")
    return found[0]
