"""LayerSkip-style self-speculation: the target's first N layers are the draft.

The draft is the target's embedding, its first ``N`` decoder layers, its final norm and its
``lm_head`` (an early exit, as in LayerSkip, Elhoushi et al. 2024). It is built as a *view*: a
shallow copy of the stock model whose decoder holds ``layers[:N]`` and a config copy with
``num_hidden_layers = N``; every parameter tensor is the target's own (no copies, no checkpoint,
no forked modeling code). The draft keeps its own KV cache for its N layers and drafts like any
draft model (``DraftProposer``). Models not trained for early exit accept fewer drafts than
LayerSkip checkpoints do; the output is exact (greedy) or lossless (sampling) either way.
"""

from __future__ import annotations

import copy

from torch import nn
from transformers import PreTrainedModel

from medusa_infer.proposers.base import whole_number
from medusa_infer.proposers.draft import DraftProposer

_LAYER_LISTS = ("layers", "h", "blocks", "layer")


def default_num_layers(total: int) -> int:
    """A third of the layers, at least one."""
    return max(1, total // 3)


def decoder_layers(decoder: nn.Module, total: int) -> str:
    """The dotted name of ``decoder``'s list of ``total`` decoder layers (``layers``, GPT-2's ``h``, OPT's
    ``decoder.layers``, ...)."""
    for name in _LAYER_LISTS:
        layers = getattr(decoder, name, None)
        if isinstance(layers, nn.ModuleList) and len(layers) == total:
            return name
    found = [n for n, m in decoder.named_modules() if isinstance(m, nn.ModuleList) and len(m) == total]
    if len(found) != 1:
        raise ValueError(f"cannot tell which module list of {type(decoder).__name__} holds its {total} "
                         "decoder layers; layerskip supports decoders with one such list")
    return found[0]


def _shallow_copy(module: nn.Module) -> nn.Module:
    """A new module object sharing ``module``'s submodules and parameters (own registries)."""
    view = copy.copy(module)
    view._modules = type(module._modules)(module._modules)
    view._parameters = type(module._parameters)(module._parameters)
    view._buffers = type(module._buffers)(module._buffers)
    return view


def truncated_model(model: PreTrainedModel, num_layers: int) -> PreTrainedModel:
    """A view of causal LM ``model`` that runs only its first ``num_layers`` decoder layers (then
    its final norm and ``lm_head``), sharing every parameter tensor with ``model``."""
    config = model.config
    text = config.get_text_config()
    total = text.num_hidden_layers
    num_layers = whole_number("layerskip layers", num_layers, 1, f" and at most {total} ({type(model).__name__} has "
                              f"{total} layers)")
    if not 1 <= num_layers <= total:
        raise ValueError(f"layerskip needs 1 <= layers <= {total} ({type(model).__name__} has {total} layers), "
                         f"got {num_layers}")
    if getattr(config.get_text_config(), "hidden_size_per_layer_input", None):
        raise ValueError(f"layerskip cannot run the first layers of {type(model).__name__} alone: its per-layer "
                         f"inputs (hidden_size_per_layer_input, Gemma-3n's) are made for all {total} layers; use "
                         "another method")
    decoder = model.base_model
    if decoder is model:
        raise ValueError(f"{type(model).__name__} has no separate decoder module; layerskip needs a *ForCausalLM model")
    name = decoder_layers(decoder, total)
    view_config = copy.deepcopy(config)
    view_text = view_config.get_text_config()
    view_text.num_hidden_layers = num_layers
    if getattr(view_text, "layer_types", None) is not None:
        view_text.layer_types = list(view_text.layer_types[:num_layers])
    configs = {id(config): view_config, id(text): view_text}
    view_decoder = _shallow_copy(decoder)
    view_decoder.config = view_config
    *parents, last = name.split(".")
    holder = view_decoder
    for part in parents:  # OPT's decoder.layers: a view of each module on the way
        inner = _shallow_copy(getattr(holder, part))
        if id(getattr(inner, "config", None)) in configs:
            inner.config = configs[id(inner.config)]
        setattr(holder, part, inner)
        holder = inner
    setattr(holder, last, getattr(holder, last)[:num_layers])
    view = _shallow_copy(model)
    setattr(view, model.base_model_prefix, view_decoder)
    view.config = view_config
    return view


class LayerSkipProposer(DraftProposer):
    """A ``DraftProposer`` whose draft is the target's first ``num_layers`` layers.

    Args:
        target: the target ``MedusaModel``.
        num_layers: layers of the draft (default: a third of the target's, at least one).
        num_tokens, schedule, max_tokens: as for ``DraftProposer``.
    """

    def __init__(self, target, num_layers: int | None = None, num_tokens: int = 4, schedule: str = "heuristic",
                 max_tokens: int | None = None) -> None:
        from medusa_infer.model import MedusaModel, said_as

        total = target.base_model.config.get_text_config().num_hidden_layers
        view = truncated_model(target.base_model, default_num_layers(total) if num_layers is None else num_layers)
        self.num_layers = view.config.get_text_config().num_hidden_layers
        said_as(view, target.base_model)  # the view's generation config is the target's: said once, not per build
        super().__init__(target, MedusaModel(view, None, target.tokenizer), num_tokens, schedule, max_tokens)
