"""Medusa-2's LoRA adapter on the backbone (peft).

The adapter is injected into the base model in place, so ``peft_model.get_base_model()`` is the
same stock ``*ForCausalLM`` object, now with LoRA layers, and ``MedusaModel`` wraps it unchanged.
LoRA's B matrices start at zero: at step 0 the adapted model computes exactly the original one.
``peft_model.disable_adapter()`` gives the original model back for the KL teacher.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from medusa_infer.checkpoint import ADAPTER_DIR  # noqa: F401  (where heads folders keep the adapter)
from medusa_infer.model import embedding_lora_targets, lora_selects


def add_lora(base_model: nn.Module, r: int, alpha: int, dropout: float, target_modules: list[str]) -> Any:
    """Wrap ``base_model`` with a fresh LoRA adapter; only the adapter's weights require grad.

    Each entry of ``target_modules`` names modules as peft matches them: a module's name, or a
    dotted suffix of its path (``q_proj``, ``self_attn.q_proj``).

    Raises:
        ValueError: from ``check_lora_targets``.
    """
    from peft import LoraConfig, get_peft_model

    check_lora_targets(base_model, target_modules)
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(target_modules),
                        bias="none", task_type="CAUSAL_LM")
    return get_peft_model(base_model, config)


def check_lora_targets(base_model: nn.Module, target_modules: list[str]) -> None:
    """``ValueError`` where an entry of ``target_modules`` names no module of ``base_model``, they select
    a module LoRA cannot adapt (a block, an attention module, a norm), or its input or output embeddings.
    Needs only the module tree (a meta-device model will do)."""
    paths = [name for name, _ in base_model.named_modules() if name]
    # the layers to name as targets: linear ones (GPT-2's Conv1D too: it was left out, and the list offered lm_head,
    # then refused it), the embeddings the heads read excepted
    read = [getattr(base_model, get)() for get in ("get_input_embeddings", "get_output_embeddings")
            if hasattr(base_model, get)]
    linear = sorted({n.rsplit(".", 1)[-1] for n, m in base_model.named_modules()
                     if (isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D") and not any(m is e for e in read)})
    unmatched = [t for t in target_modules if not any(lora_selects([t], p) for p in paths)]
    if unmatched:
        raise ValueError(f"lora.target_modules {unmatched} match no module of {type(base_model).__name__}; "
                         f"its linear layers are named {linear}")
    # peft adapts linear, embedding and convolution layers (and GPT-2's Conv1D) only: a name selecting
    # another module (mlp, self_attn, a norm) passed this check and failed at the start of training
    adaptable = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d)
    other = sorted({f"{p} ({type(m).__name__})" for p, m in base_model.named_modules() if p
                    and any(lora_selects([t], p) for t in target_modules)
                    and not isinstance(m, adaptable) and type(m).__name__ != "Conv1D"})
    if other:
        raise ValueError(f"lora.target_modules {list(target_modules)} select {other[:3]}"
                         f"{f' and {len(other) - 3} more' if len(other) > 3 else ''}, which LoRA cannot adapt "
                         f"(it adapts linear layers); name linear layers, e.g. among {linear}")
    embeddings = embedding_lora_targets(base_model, target_modules)
    if embeddings:
        raise ValueError(f"lora.target_modules {list(target_modules)} select {embeddings}, the embeddings the "
                         "heads read directly (trained against the unadapted weight, decoded with the merged "
                         "one; tied embeddings would change the input too): leave them out, e.g. "
                         f"lora.target_modules=[{','.join(linear[:4])}]")
    check_peft_conversion(base_model, target_modules, linear)


def check_peft_conversion(base_model: nn.Module, target_modules: list[str], linear: list[str]) -> None:
    """``ValueError`` where peft would move targets elsewhere: on MoE models whose experts transformers 5 fuses
    into one parameter (DeepSeek, GLM-4-MoE, Qwen3-MoE, OLMoE, Mixtral, ...), peft maps ``gate_proj`` / ``up_proj`` /
    ``down_proj`` onto the routed experts' fused weights, not the dense or shared-expert linear layers of that name
    that this check found: the run failed after its data stage ("ParamWrapper does not work with lora_dropout !=
    0"), or with dropout 0 trained other weights than the ones named, without a word."""
    try:
        from peft import LoraConfig
        from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers
    except ImportError:  # a peft from before transformers 5's fused experts: it adapts the modules named
        return

    def converted(names: list[str]) -> LoraConfig:  # (peft's conversion changes the config alone)
        probe = LoraConfig(r=1, target_modules=list(names), task_type="CAUSAL_LM")
        convert_peft_config_for_transformers(probe, base_model, None)
        return probe

    def as_named(name: str) -> bool:
        try:
            probe = converted([name])
        except ValueError:
            return False
        return not probe.target_parameters and name in (probe.target_modules or ())

    def example() -> str:  # targets that pass as named: those given, else the model's own linear layers
        safe = [t for t in target_modules if as_named(t)] or [n for n in linear if as_named(n)][:4]
        return f"lora.target_modules=[{','.join(safe)}]"

    kind = getattr(getattr(base_model, "config", None), "model_type", type(base_model).__name__)
    try:
        probe = converted(target_modules)
    except ValueError as err:
        raise ValueError(f"lora.target_modules {list(target_modules)} cannot be adapted on {kind} as named: {err} "
                         f"(peft); leave the experts' projections out, e.g. {example()}") from None
    if probe.target_parameters:
        moved = [t for t in target_modules if not as_named(t)]  # (peft 0.22 keeps them among target_modules too)
        raise ValueError(f"lora.target_modules {moved} are mapped by peft, on {kind}, onto the routed experts' fused "
                         f"parameters {sorted(probe.target_parameters)}, not the dense or shared-expert linear layers "
                         f"of that name (and need lora.dropout=0); leave them out, e.g. {example()}")
