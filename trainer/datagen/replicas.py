"""Several generators at once (``--replicas N``), each in its own worker process.

SGLang's scheduler walks its running requests in Python at every decode step; with a small
target (SmolLM2-135M) that one process sits at 100 % of a CPU core while the GPU idles
(docs/BENCHMARKS.md, "Generation speed"). N replicas are N
engines on the same device, each with its own scheduler on its own core. A call deals its
prompts out round-robin (every replica gets the same mix of lengths), the replicas generate at
the same time, and the replies come back in prompt order.

The replicas start at once (an SGLang engine's start is mostly its own processes' imports and
graph captures, a minute or more each). SGLang sizes a KV pool from the memory free when that
engine starts, which replicas starting together would race for; so ``fit_generator`` caps each
SGLang engine's pool instead (``max_total_tokens``) at ``mem_fraction_static / N`` of the GPU memory
free before any started, in tokens of the target's KV cache, after checking that N engines with the
room each needs beyond its pool fit that memory (``trainer.datagen.gen_memory``; ``--replicas auto``:
as many as fit). Each engine keeps the whole ``mem_fraction_static`` for SGLang's own check of what
its weights leave. transformers replicas on the CPU split the cores between them.

A replica that fails to start or to generate stops the call with its traceback; one that dies
(killed, out of memory) is named with its exit code.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Sequence

from models.backends.sglang.generate import target_context
from models.generation import GenerationSettings, Generator, Reply
from trainer.datagen.gen_backend import GeneratorSettings, open_backend, resolve_generator, target_path
from trainer.datagen.gen_memory import GenTarget, plan_generation

STOP = None  # the message that ends a worker


def kv_bytes_per_token(text_config: dict) -> int:
    """Bytes a token takes in a 16-bit KV cache of a decoder with this config: keys and values of every layer."""
    heads = text_config["num_attention_heads"]
    head_dim = text_config.get("head_dim") or text_config["hidden_size"] // heads
    return 2 * text_config["num_hidden_layers"] * text_config.get("num_key_value_heads", heads) * head_dim * 2


def replica_settings(settings: GeneratorSettings, k: int) -> GeneratorSettings:
    """Replica ``k``'s settings: one engine and its own seed."""
    return replace(settings, replicas=1, seed=settings.seed + k)


def gen_target(path: Path, sglang_args: Sequence[tuple[str, object]] = ()) -> GenTarget:
    """The sizes of the target dir ``path`` its generation engines' memory depends on (its config, its weight files)."""
    from models.target_config import read_text_config

    weights = [f.stat().st_size for f in path.glob("*.safetensors")]
    if not weights:
        raise ValueError(f"{path}: no *.safetensors weights for SGLang to load")
    text = read_text_config(path)[1]
    return GenTarget(kv_bytes_per_token(text), text["vocab_size"], target_context(path, sglang_args), sum(weights))


def fit_generator(settings: GeneratorSettings, sampled: bool) -> GeneratorSettings:
    """``settings`` sized to this GPU before any engine starts: for SGLang, the engines that fit (``replicas``
    None: as many as fit) and each one's KV pool (``max_total_tokens``, a lower one given wins), refused with
    the values that fit when they do not (``sampled``: a pass samples, whose sampler needs more); transformers:
    one replica for None."""
    if resolve_generator(settings.name) != "sglang":
        return replace(settings, replicas=settings.replicas or 1)
    import torch

    free, _ = torch.cuda.mem_get_info()
    given = dict(settings.sglang_args)
    target = gen_target(target_path(settings), settings.sglang_args)
    plan = plan_generation(free, settings.mem_fraction_static, settings.replicas, target, sampled, given)
    args = tuple((key, v) for key, v in settings.sglang_args if key != "max_total_tokens") + (("max_total_tokens", plan.pool_tokens),)
    return replace(settings, replicas=plan.replicas, sglang_args=args)


def _serve(conn, settings: GeneratorSettings, threads: int) -> None:
    """A worker: open one backend, then answer (prompts, settings, seed) messages until STOP."""
    import torch

    torch.set_num_threads(threads)
    try:
        backend = open_backend(settings)
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    try:
        conn.send(("ready", backend.name, list(backend.stop_ids), backend.context_len))
        while (msg := conn.recv()) is not STOP:
            try:
                conn.send(("ok", backend.generate(*msg)))
            except Exception:
                conn.send(("error", traceback.format_exc()))
    finally:
        backend.close()


class ReplicatedBackend:
    """``settings.replicas`` backends in worker processes behind the one Generator interface."""

    def __init__(self, settings: GeneratorSettings):
        from models.target import load_tokenizer

        if settings.replicas < 2:
            raise ValueError(f"ReplicatedBackend needs replicas >= 2, got {settings.replicas}")
        self.path = target_path(settings)
        self.tokenizer = load_tokenizer(self.path)
        self.n = settings.replicas
        self.procs: list[mp.Process] = []
        self.conns = []
        threads = max(1, (os.cpu_count() or 1) // settings.replicas)
        ctx = mp.get_context("spawn")  # CUDA and SGLang's own subprocesses need a fresh interpreter
        try:
            for k in range(settings.replicas):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_serve, args=(child, replica_settings(settings, k), threads), name=f"replica-{k}")
                proc.start()
                child.close()
                self.procs.append(proc)
                self.conns.append(parent)
            for k in range(settings.replicas):
                _, name, stop_ids, context_len = self._receive(k, "ready")
            self.name, self.stop_ids, self.context_len = name, stop_ids, context_len
        except BaseException:
            self.close()
            raise

    def _died(self, k: int) -> RuntimeError:
        self.procs[k].join(timeout=5)
        return RuntimeError(f"generation replica {k} of {self.n} died (exit code {self.procs[k].exitcode})")

    def _receive(self, k: int, expected: str) -> tuple:
        try:
            msg = self.conns[k].recv()
        except EOFError:
            raise self._died(k) from None
        if msg[0] == "error":
            raise RuntimeError(f"generation replica {k} of {self.n} failed:\n{msg[1]}")
        if msg[0] != expected:
            raise RuntimeError(f"generation replica {k} answered {msg[0]!r}, expected {expected!r}")
        return msg

    def generate(self, prompts: Sequence[Sequence[int]], settings: GenerationSettings, seed: int) -> list[Reply]:
        n = self.n
        parts = [list(range(k, len(prompts), n)) for k in range(n)]  # round-robin: the same mix of lengths each
        sent, failures = [], []
        for k, part in enumerate(parts):
            if not part:
                continue
            try:
                self.conns[k].send(([list(prompts[i]) for i in part], settings, seed * n + k))
                sent.append(k)
            except OSError:  # BrokenPipeError: the worker is gone
                failures.append(self._died(k))
        replies: list[Reply | None] = [None] * len(prompts)
        for k in sent:  # every sent call is received, even after a failed one
            try:
                got = self._receive(k, "ok")[1]
            except RuntimeError as err:
                failures.append(err)
                continue
            for i, reply in zip(parts[k], got):
                replies[i] = reply
        if failures:
            raise failures[0]
        return replies  # type: ignore[return-value]

    def close(self) -> None:
        for conn, proc in zip(self.conns, self.procs):
            if proc.is_alive():
                try:
                    conn.send(STOP)
                except OSError:  # the worker is gone: joined below
                    pass
        for proc in self.procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []


def open_generator(settings: GeneratorSettings) -> Generator:
    """The backend ``settings`` (sized by ``fit_generator``) names: one engine in this process, or
    ``settings.replicas`` engines in worker processes."""
    if settings.replicas is None:
        raise ValueError("replicas None (auto) is resolved by fit_generator, before the generator opens")
    return ReplicatedBackend(settings) if settings.replicas > 1 else open_backend(settings)
