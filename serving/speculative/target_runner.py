"""The target model as a speculative-decoding verifier: KV-cached greedy forwards that also
hand out the features the draft reads.

``TargetRunner.forward(tokens)`` appends ``tokens`` to the KV cache and returns, for each
of them, the target's greedy next token and its feature vector:

* ``feature="aux"`` (a correctly wired server): the outputs of decoder layers
  ``aux_layer_ids`` concatenated in layer order, ``output_hidden_states[k + 1]`` for id k:
  the tensors SGLang captures at the input of layer k + 1 and vLLM at the input of layer
  k + 1 in its own numbering;
* ``feature="final"`` (a miswired server whose target class does not capture aux states):
  the final normed hidden state, which is what such a server hands the draft.

``crop(length)`` drops rejected positions from the cache.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel

from models.aux_ids import AuxLayerIds

FEATURES = ("aux", "final")


def _cache_kwarg(model: PreTrainedModel) -> str:
    """transformers >= 5.x renamed ``past_key_values`` to ``cache`` on the forward."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class TargetRunner:
    def __init__(self, model: PreTrainedModel, aux_layer_ids: list[int] | tuple[int, ...], feature: str = "aux"):
        if feature not in FEATURES:
            raise ValueError(f"feature must be one of {FEATURES}, got {feature!r}")
        self.model = model.eval()
        self.aux = AuxLayerIds.of(aux_layer_ids, model.config.num_hidden_layers)
        self.aux_layer_ids = self.aux.ids
        self.feature = feature
        self._cache_key = _cache_kwarg(model)
        self.cache = DynamicCache()

    @property
    def length(self) -> int:
        """Positions held in the KV cache."""
        return self.cache.get_seq_length()

    def reset(self) -> None:
        self.cache = DynamicCache()

    @torch.no_grad()
    def forward(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """tokens [T] -> (greedy next tokens [T], features [T, F]); the cache grows by T."""
        out = self.model(input_ids=tokens[None], use_cache=True, output_hidden_states=True, **{self._cache_key: self.cache})
        hidden = out.hidden_states  # num_layers + 1 tensors [1, T, H]; the last one is final-normed
        if self.feature == "aux":
            features = torch.cat([hidden[i] for i in self.aux.hidden_states_index], dim=-1)  # [1, T, A*H]
        else:
            features = hidden[-1]  # [1, T, H]
        return out.logits[0].argmax(-1), features[0]

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions of the cache."""
        extra = self.length - length
        if extra < 0:
            raise ValueError(f"cannot crop a {self.length}-position cache to {length}")
        if extra:
            self.cache.crop(-extra)


@torch.no_grad()
def greedy_generate(target: TargetRunner, prompt: Tensor, max_new_tokens: int, stop_ids: set[int]) -> list[int]:
    """Plain greedy decoding, one target forward per token: the reference output."""
    target.reset()
    greedy, _ = target.forward(prompt)
    out = [int(greedy[-1])]
    while len(out) < max_new_tokens and out[-1] not in stop_ids:
        greedy, _ = target.forward(torch.tensor([out[-1]], device=prompt.device))
        out.append(int(greedy[-1]))
    return out
