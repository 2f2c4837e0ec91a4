"""What SGLang generation engines on one GPU need of its memory, reckoned before any starts.

``replicas`` engines share ``mem_fraction_static`` of the memory free before any started as their
KV pools, each pool capped at its share (``trainer.datagen.replicas``). Each engine needs room
beyond its pool as well: its weights, its process's CUDA context, SGLang's request table, and the
sampler's tensors at the largest decode batch SGLang runs, which is as many requests as its
scheduler admits (``max_running_requests``). For a small target with a large vocabulary the sampler
dominates: the pytorch sampling backend (the one the generator sets) turns the logits of every
running request into float32 probabilities, sorts them with their int64 indices and sums them up
(SGLang 0.5.14 layers/sampler.py, ``top_k_top_p_min_p_sampling_from_probs_torch``), all of it
[requests, vocab]. An engine count or fraction that does not fit is refused with what fits.
"""

from __future__ import annotations

from dataclasses import dataclass

from models.memory_plan import CONTEXT_BYTES, EXTRA_CONTEXT

GB = 1e9
GREEDY_BYTES = 6  # a [request, vocab] element of greedy decoding: the bf16 logits and their float32 copy (logits_processor.py)
# sampled (top-p): float32 probabilities 4, sorted 4, their int64 indices 8, the cumulative sum 4, its difference
# with the sorted probabilities 4 and that comparison's mask 1, all alive at once
SAMPLED_BYTES = 25
# --replicas auto: at most this many, the most measured, where the host's cores rather than the GPU bound a small
# target's generation (docs/BENCHMARKS.md, "Generation speed")
MOST_REPLICAS = 4


@dataclass(frozen=True)
class GenTarget:
    """The sizes of a target that its generation engines' memory depends on."""

    kv_bytes_per_token: int
    vocab: int
    context: int  # SGLang's context_len
    weight_bytes: int


@dataclass(frozen=True)
class GenPlan:
    replicas: int
    pool_tokens: int  # each engine's KV pool (its max_total_tokens)


def running_requests(pool_tokens: int, context: int, given: int | None = None) -> int:
    """The requests SGLang 0.5.14 runs at once with a pool of ``pool_tokens`` (``given``: a max_running_requests
    set), its rule in model_executor/model_runner_kv_cache_mixin.py, ``_resolve_max_num_reqs``."""
    if given is not None:
        return min(given, pool_tokens // 2)
    return min(max(min(int(pool_tokens / context * 512), 4096), 2048), pool_tokens // 2)


def room_bytes(t: GenTarget, pool_tokens: int, sampled: bool, given_requests: int | None = None) -> int:
    """What one engine needs beyond its KV pool: weights, CUDA context, the request table (int32
    [requests + 1, context + 4]) and the sampler's [requests, vocab] tensors."""
    requests = running_requests(pool_tokens, t.context, given_requests)
    table = (requests + 1) * (t.context + EXTRA_CONTEXT) * 4
    sampler = (SAMPLED_BYTES if sampled else GREEDY_BYTES) * requests * t.vocab
    return int(t.weight_bytes + CONTEXT_BYTES + table + sampler)


def pool_tokens(free: float, fraction: float, replicas: int, t: GenTarget, given: int | None = None) -> int:
    """Each engine's KV pool: its share of ``fraction`` of ``free`` bytes, in tokens (a ``given`` lower cap wins)."""
    share = int(fraction * free / replicas / t.kv_bytes_per_token)
    return share if given is None else min(given, share)


def need_bytes(free: float, fraction: float, replicas: int, t: GenTarget, sampled: bool, given: dict) -> int:
    """What ``replicas`` engines at ``fraction`` hold at their peak: pools and rooms (``given``: max_total_tokens,
    max_running_requests set)."""
    pool = pool_tokens(free, fraction, replicas, t, given.get("max_total_tokens"))
    return replicas * (pool * t.kv_bytes_per_token + room_bytes(t, pool, sampled, given.get("max_running_requests")))


def plan_generation(free: float, fraction: float, replicas: int | None, t: GenTarget, sampled: bool, given: dict) -> GenPlan:
    """The engines and their pools for ``free`` bytes; ``replicas`` None: as many as fit, up to MOST_REPLICAS.
    ValueError naming ``--replicas`` and ``--mem-fraction-static`` with values that fit when they do not."""
    fits = [n for n in range(1, max(MOST_REPLICAS, replicas or 0) + 1) if need_bytes(free, fraction, n, t, sampled, given) <= free]
    n = replicas or max(fits, default=1)
    if n in fits:
        return GenPlan(n, pool_tokens(free, fraction, n, t, given.get("max_total_tokens")))
    raise ValueError(refusal(free, fraction, n, t, sampled, given, max(fits, default=0)))


def fitting_fraction(free: float, replicas: int, t: GenTarget, sampled: bool, given: dict) -> float:
    """The largest mem_fraction_static, in hundredths, at which ``replicas`` engines fit ``free``; 0 if none."""
    return next((f / 100 for f in range(95, 4, -1) if need_bytes(free, f / 100, replicas, t, sampled, given) <= free), 0.0)


def refusal(free: float, fraction: float, replicas: int, t: GenTarget, sampled: bool, given: dict, fitting: int) -> str:
    """Why ``replicas`` engines at ``fraction`` do not fit, what each needs, and the settings that do."""
    pool = pool_tokens(free, fraction, replicas, t, given.get("max_total_tokens"))
    requests = running_requests(pool, t.context, given.get("max_running_requests"))
    room = room_bytes(t, pool, sampled, given.get("max_running_requests"))
    need = need_bytes(free, fraction, replicas, t, sampled, given)
    fit = fitting_fraction(free, replicas, t, sampled, given)
    fixes = ([f"--replicas {fitting}"] if fitting else []) + ([f"--mem-fraction-static {fit:g} with {replicas}"] if fit else [])
    return (
        f"--replicas {replicas} at --mem-fraction-static {fraction:g}: {replicas} SGLang engine(s) would need about "
        f"{need / GB:.1f} GB of the {free / GB:.1f} GB free on this GPU: KV pools of {pool:,} tokens each "
        f"({pool * t.kv_bytes_per_token / GB:.1f} GB) and {room / GB:.1f} GB beyond each pool (weights, CUDA context, "
        f"and the {'sampled' if sampled else 'greedy'} decoding's [{requests} running requests x {t.vocab} vocab] "
        f"tensors); " + (f"what fits: {' or '.join(fixes)}" if fixes else "no fraction fits one engine on this GPU")
    )
