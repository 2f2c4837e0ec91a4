"""Aux layer ids: which decoder layers' outputs the draft reads, validated once and translated
for each consumer.

An id ``k`` means *the output of decoder layer k* (0-based): StreamDraft's training semantics.
The consumers number the same tensor differently:

* transformers: ``output_hidden_states[k + 1]`` (index 0 is the embeddings);
* SGLang: ``set_eagle3_layers_to_capture`` / ``eagle_aux_hidden_state_layer_ids`` take ``k``
  unchanged and capture the *input* of layer ``k + 1`` (llama.py:812-824). The DeepSeek-V2/V3
  family (Kimi-K2.5 included) adds 1 only when the first id is 1 and otherwise takes the ids as
  layer inputs (deepseek_v2.py:2799-2814), so ids that do not start at 1 land one layer early;
* vLLM: ``eagle_aux_hidden_state_layer_ids`` are inputs of layer ``k``, so ours + 1.

Because SGLang captures layer inputs, the last layer's output (``k = N - 1``) is never an aux
layer: ids lie in ``[0, N - 2]``.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_DEFAULT_LAYERS = 7  # below 7 layers the three default ids collide


@dataclass(frozen=True)
class AuxLayerIds:
    ids: tuple[int, ...]  # outputs of decoder layers k, strictly increasing
    num_layers: int | None = None  # the target's decoder layers, when known (bounds the ids)

    @classmethod
    def of(cls, ids, num_layers: int | None = None, num_aux: int | None = None) -> "AuxLayerIds":
        """Validated ids: ints, ``num_aux`` of them when given, strictly increasing, in
        ``[0, num_layers - 2]`` (``[0, ...)`` when the layer count is unknown)."""
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
            raise ValueError(f"aux layer ids must be a list of ints, got {ids!r}")
        ids = list(ids)
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ValueError(f"aux layer ids must be a list of ints, got {ids!r}")
        if not ids:
            raise ValueError("aux layer ids are empty: EAGLE-3 needs at least one aux layer")
        if ids[0] < 0:
            raise ValueError(f"aux layer ids {ids} out of range: they are outputs of decoder layers k and must be non-negative")
        if any(b <= a for a, b in zip(ids, ids[1:])):
            raise ValueError(f"aux layer ids {ids} must be strictly increasing (SGLang concatenates the captured layers in layer order)")
        if num_layers is not None and ids[-1] > num_layers - 2:
            raise ValueError(
                f"aux layer ids {ids} out of range for a {num_layers}-layer target: ids are outputs of decoder layer k "
                f"and must be <= {num_layers - 2} (the last layer's output is not capturable: SGLang captures the "
                "input of layer k + 1)"
            )
        found = cls(tuple(ids), num_layers)
        return found if num_aux is None else found.check_count(num_aux)

    def check_count(self, num_aux: int) -> "AuxLayerIds":
        """These ids, when the draft's ``fc`` reads ``num_aux`` aux states; else ValueError."""
        if len(self.ids) != num_aux:
            raise ValueError(f"{len(self.ids)} aux layer ids {list(self.ids)} for a draft whose fc reads {num_aux} aux states")
        return self

    @classmethod
    def default(cls, num_layers: int) -> "AuxLayerIds":
        """SGLang's default EAGLE-3 capture for an N-layer target: [1, N//2 - 1, N - 4]."""
        if num_layers < MIN_DEFAULT_LAYERS:
            raise ValueError(f"default aux ids need at least {MIN_DEFAULT_LAYERS} layers, got {num_layers}: pass aux_layer_ids")
        return cls.of([1, num_layers // 2 - 1, num_layers - 4], num_layers)

    @classmethod
    def resolve(cls, ids, num_layers: int) -> "AuxLayerIds":
        """``ids`` validated for an N-layer target; None: the default ids."""
        return cls.default(num_layers) if ids is None else cls.of(ids, num_layers)

    @classmethod
    def from_vllm(cls, ids, num_layers: int | None = None, num_aux: int | None = None) -> "AuxLayerIds":
        """Ours from vLLM's ids (inputs of layer k): each minus 1, then validated."""
        if isinstance(ids, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            ids = [k - 1 for k in ids]
        return cls.of(ids, num_layers, num_aux)

    @property
    def sglang_argument(self) -> list[int]:
        """What SGLang takes: ``set_eagle3_layers_to_capture`` and the export's config, unchanged."""
        return list(self.ids)

    @property
    def sglang_layer_inputs(self) -> list[int]:
        """The layers whose input SGLang captures (its ``layers_to_capture``): k + 1."""
        return [k + 1 for k in self.ids]

    @property
    def sglang_deepseek_layer_inputs(self) -> list[int]:
        """What SGLang's DeepSeek-V2/V3 class captures for explicit ids: k + 1 only when the first id is 1."""
        return self.sglang_layer_inputs if self.ids[0] == 1 else list(self.ids)

    @property
    def hidden_states_index(self) -> list[int]:
        """Indices into transformers' ``output_hidden_states`` (index 0 = the embeddings): k + 1."""
        return [k + 1 for k in self.ids]

    @property
    def vllm(self) -> list[int]:
        """vLLM's ``eagle_aux_hidden_state_layer_ids`` (inputs of layer k): k + 1."""
        return [k + 1 for k in self.ids]
