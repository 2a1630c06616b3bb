"""More transformers architectures than tests/tiny.py builds: each decodes exactly as Hugging Face
``generate`` does (tree steps with random acceptance, batched and left-padded), or is refused with
an error that names why, never decoded wrongly."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from medusa_infer.decoding import generate
from medusa_infer.model import MedusaModel
from medusa_infer.trees import TREE_PRESETS
from test_decoding import OracleProposer, left_pad, reference

VOCAB = 96
_BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
             tie_word_embeddings=False)
_NO_KV_HEADS = {"num_key_value_heads": None}
_NO_MLP = {"intermediate_size": None, "num_key_value_heads": None}

CONFIGS: dict[str, dict] = {
    "phi3": {"head_dim": 8},
    "phi3-sliding": {"head_dim": 8, "sliding_window": 6},
    "phi": {**_NO_KV_HEADS, "partial_rotary_factor": 0.5},
    "gpt_neox": {**_NO_KV_HEADS, "rotary_pct": 0.25, "use_parallel_residual": True},
    "falcon": {**_NO_MLP, "parallel_attn": True, "alibi": False},
    "opt": {**_NO_MLP, "ffn_dim": 64, "word_embed_proj_dim": 32},
    "stablelm": {"partial_rotary_factor": 0.25},
    "olmo2": {"head_dim": 8},
    "starcoder2": {"sliding_window": 6},
    "gptj": {**_NO_MLP, "rotary_dim": 4},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 6},
    "gemma2": {"head_dim": 8, "sliding_window": 6, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
               "query_pre_attn_scalar": 8},
    "granite": {"embedding_multiplier": 2.0, "residual_multiplier": 0.5, "attention_multiplier": 0.3,
                "logits_scaling": 1.0},
    "gpt_neo": {**_NO_MLP, "attention_types": [[["global"], 2]]},
    "deepseek_v3": {"num_key_value_heads": 4, "moe_intermediate_size": 16, "kv_lora_rank": 8, "q_lora_rank": 16,
                    "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 8, "n_routed_experts": 4,
                    "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1},
    "deepseek_v2": {"num_key_value_heads": 4, "moe_intermediate_size": 16, "kv_lora_rank": 8, "q_lora_rank": 16,
                    "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 8, "n_routed_experts": 4,
                    "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1},
    "qwen3_moe": {"head_dim": 8, "moe_intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2},
    "gpt_oss": {"head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 6,
                "layer_types": ["sliding_attention", "full_attention"]},
    "gemma3n_text": {"num_hidden_layers": 4, "head_dim": 8, "sliding_window": 6, "num_kv_shared_layers": 2,
                     "layer_types": ["sliding_attention", "full_attention"] * 2, "hidden_size_per_layer_input": 8,
                     "vocab_size_per_layer_input": VOCAB, "laurel_rank": 4, "activation_sparsity_pattern": [0.0] * 4},
    "smollm3": {"no_rope_layers": [1, 0]},
    "olmoe": {"num_experts": 4, "num_experts_per_tok": 2},
    "granitemoe": {"num_local_experts": 4, "num_experts_per_tok": 2, "embedding_multiplier": 2.0},
    "exaone4": {"head_dim": 8, "sliding_window": 6, "sliding_window_pattern": 2,
                "layer_types": ["sliding_attention", "full_attention"]},
    "ministral": {"head_dim": 8, "sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"]},
    "glm4": {"head_dim": 8},
    "ernie4_5": {"head_dim": 8},
    "cohere2": {"logit_scale": 1.0, "sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"]},
    "olmo": {},
    "gemma": {"head_dim": 8},
    "codegen": {**_NO_MLP, "rotary_dim": 4},
    "persimmon": {**_NO_KV_HEADS},
    "nemotron": {"head_dim": 8},
    "phimoe": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 6},
}
REFUSED: dict[str, tuple[dict, str]] = {
    "falcon-alibi": ({**_NO_MLP, "alibi": True}, "adds ALiBi position biases"),
    "bloom": ({**_NO_MLP, "max_position_embeddings": None}, "adds ALiBi position biases"),
    "mpt": ({"d_model": 32, "n_heads": 4, "n_layers": 2, "max_seq_len": 256, "expansion_ratio": 2},
            "adds ALiBi position biases"),
    "cohere": ({"logit_scale": 0.0625}, r"scales its logits \(logit_scale=0.0625\)"),
    "llama4_text-chunked": ({"head_dim": 8, "intermediate_size_mlp": 64, "num_local_experts": 2,
                             "num_experts_per_tok": 1, "attention_chunk_size": 6, "interleave_moe_layer_step": 1,
                             "no_rope_layers": [1, 0]}, "has chunked_attention layers"),
    "gpt_neo-local": ({**_NO_MLP, "attention_types": [[["global", "local"], 1]], "window_size": 4},
                      "has local attention layers"),
    "rwkv": ({**_NO_MLP, "attention_hidden_size": 32}, "keeps no key/value cache"),
    "bert": ({"is_decoder": True}, "applies its output projection inside a larger LM head"),
    "electra": ({"is_decoder": True, "embedding_size": 32}, "applies its output projection inside a larger LM head"),
    "modernbert-decoder": ({"local_attention": 8, "cls_token_id": 1, "sep_token_id": 2},
                           "applies its output projection inside a larger LM head"),
    "openai-gpt": ({"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 256}, "keeps no key/value cache"),
    "bart": ({"d_model": 32, "encoder_layers": 1, "decoder_layers": 2, "encoder_attention_heads": 4,
              "decoder_attention_heads": 4, "decoder_ffn_dim": 64, "encoder_ffn_dim": 64, "is_decoder": True},
             "takes no position_ids"),
    "trocr": ({"d_model": 32, "decoder_layers": 2, "decoder_attention_heads": 4, "decoder_ffn_dim": 64},
              "takes no position_ids"),
}


def tiny(name: str, settings: dict, seed: int = 0) -> torch.nn.Module:
    model_type = name if name in ("modernbert-decoder", "openai-gpt") else name.split("-")[0]
    values = {k: v for k, v in {**_BASE, **settings}.items() if v is not None}
    if model_type == "mpt":
        values = {k: values[k] for k in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")} | settings
    config = AutoConfig.for_model(model_type, **values)
    config.initializer_range = 0.2
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_tree_steps_in_a_padded_batch_decode_as_generate(name):
    """Rows of different lengths, left-padded, accepting a different depth of the tree at every step."""
    model = MedusaModel.from_base(tiny(name, CONFIGS[name]), num_heads=4, num_layers=1)
    prompts = [torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in (2, 11, 5)]
    futures = [reference(model, p, 24) for p in prompts]
    ids, mask = left_pad(prompts)
    oracle = OracleProposer(futures, TREE_PRESETS["tree-16"], seed=3)
    out = generate(model, ids, attention_mask=mask, max_new_tokens=24, proposer=oracle, eos_token_id=[],
                   speculation_gate=False)  # every step a tree step, whatever the machine's timings
    assert out.new_tokens == futures
    assert out.metrics.tau > 1.5


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_what_cannot_decode_exactly_is_refused_by_name(name):
    settings, message = REFUSED[name]
    with pytest.raises(NotImplementedError, match=message):
        MedusaModel.from_base(tiny(name, settings), num_heads=2)


def _oracle_batch_matches_generate(base: torch.nn.Module) -> None:
    model = MedusaModel.from_base(base, num_heads=4, num_layers=1)
    prompts = [torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in (2, 11, 5)]
    futures = [reference(model, p, 16) for p in prompts]
    ids, mask = left_pad(prompts)
    out = generate(model, ids, attention_mask=mask, max_new_tokens=16, eos_token_id=[], speculation_gate=False,
                   proposer=OracleProposer(futures, TREE_PRESETS["tree-16"], seed=3))
    assert out.new_tokens == futures and out.metrics.tau > 1.5


def llama4_unchunked(no_rope_layers: list[int]) -> torch.nn.Module:
    """A tiny Llama 4 text model without chunked attention (``tiny`` drops a None setting; transformers 5.17 made
    chunked layers of a None chunk size: the layer types are given)."""
    config = AutoConfig.for_model("llama4_text", **{**_BASE, "head_dim": 8, "intermediate_size_mlp": 64,
                                                    "num_local_experts": 2, "num_experts_per_tok": 1,
                                                    "attention_chunk_size": None, "interleave_moe_layer_step": 1,
                                                    "layer_types": ["full_attention"] * _BASE["num_hidden_layers"],
                                                    "no_rope_layers": no_rope_layers, "initializer_range": 0.2})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


def test_models_whose_base_model_prefix_names_no_submodule_find_their_decoder():
    """Mllama's and Llama 4's CausalLM name their decoder "language_model" (base_model_prefix) but hold it as
    .model: the whole model was taken for the decoder, and the first forward failed (no last_hidden_state)."""
    from transformers import MllamaForCausalLM
    from transformers.models.mllama.configuration_mllama import MllamaTextConfig

    torch.manual_seed(0)
    mllama = MllamaForCausalLM(MllamaTextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, cross_attention_layers=[1], bos_token_id=1,
        eos_token_id=2, pad_token_id=0, initializer_range=0.2)).eval()
    assert mllama.base_model is mllama
    _oracle_batch_matches_generate(mllama)
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) < Version("5.18"):  # (the oldest this project takes is 5.17)
        pytest.skip("transformers < 5.18 builds Llama 4's chunked-attention mask whatever its layers are")
    llama4 = llama4_unchunked([1, 1])
    assert llama4.base_model is llama4
    _oracle_batch_matches_generate(llama4)


def test_models_that_cannot_decode_here_for_other_reasons_are_refused_by_name():
    """A model without a language-model head failed on its missing lm_head's weight; Llama 4's no-RoPE layers
    scale attention by cache slot (attn_temperature_tuning), which tree steps and padding do not keep."""
    from transformers import LlamaModel

    with pytest.raises(NotImplementedError, match=r"LlamaModel has no language-model head .*AutoModelForCausalLM"):
        MedusaModel.from_base(LlamaModel(tiny("llama", {}).config), num_heads=2)
    with pytest.raises(NotImplementedError, match="scales attention in its no-RoPE layers by cache slot index"):
        MedusaModel.from_base(llama4_unchunked([1, 0]), num_heads=2)


def test_flex_attention_is_refused_by_name():
    """Tree steps' float masks under flex attention failed at the first tree step on the CPU (or aborted
    the process in a padded batch)."""
    from tiny import tiny_model

    with pytest.raises(NotImplementedError, match="is loaded with flex attention"):
        MedusaModel.from_base(tiny_model("llama", attn_implementation="flex_attention"), num_heads=2)


def test_longrope_models_decode_up_to_their_original_context(caplog):
    """Past ``original_max_position_embeddings`` a LongRoPE model (Phi-3-128k) switches its rotary factors for
    the whole forward by its largest position, and ``generate`` re-encodes the history: decoding stops there
    (finish "context"), exact up to it, rather than go on with other tokens than the model's."""
    longrope = {"head_dim": 8, "original_max_position_embeddings": 20,
                "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 4,
                                    "long_factor": [4.0, 8.0, 16.0, 32.0], "original_max_position_embeddings": 20}}
    model = MedusaModel.from_base(tiny("phi3", longrope), num_heads=4, num_layers=1)
    assert "Phi3ForCausalLM uses LongRoPE: medusa-forge decodes it within original_max_position_embeddings=20" \
        in caplog.text
    prompt = torch.tensor([10, 20, 30, 40, 50] * 2 + [10])
    expected = reference(model, prompt, 24)
    oracle = OracleProposer([expected], TREE_PRESETS["tree-16"], seed=3)
    out = generate(model, prompt[None], max_new_tokens=24, proposer=oracle, eos_token_id=[])
    assert out.new_tokens == [expected[: 20 - len(prompt)]] and out.finish_reasons == ["context"]


@pytest.mark.parametrize("tree", ["tree-16", "tree-64"])
def test_gpt_neo_decodes_to_the_end_of_its_context(tree):
    """GPT-Neo's attention slices a causal buffer (its context long) by cache slots, not positions: a tree
    step near the context's end (nodes past the last position's slot), or over a padded batch's cache with
    holes (rows accepting different lengths), failed with a size mismatch though every position fitted."""
    model = MedusaModel.from_base(tiny("gpt_neo", {**CONFIGS["gpt_neo"], "max_position_embeddings": 48}),
                                  num_heads=4, num_layers=1)
    prompts = [torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in (14, 30, 22)]
    futures = [reference(model, p, 48 - len(p)) for p in prompts]  # to the last position
    ids, mask = left_pad(prompts)
    oracle = OracleProposer(futures, TREE_PRESETS[tree], seed=3)
    out = generate(model, ids, attention_mask=mask, max_new_tokens=48, proposer=oracle, eos_token_id=[],
                   speculation_gate=False)  # every step a tree step, whatever the machine's timings
    assert out.new_tokens == futures and out.finish_reasons == ["context"] * 3
    assert out.metrics.tau > 1.5
    # the widened buffer is no inference tensor: the model still trains
    model.base_model(ids[:, :8], labels=ids[:, :8]).loss.backward()


def test_layerskip_drafts_with_opts_nested_layers():
    """OPT keeps its layers at model.decoder.layers: layerskip refused it ("cannot tell which module list")."""
    from medusa_infer.proposers.layerskip import LayerSkipProposer, truncated_model

    base = tiny("opt", {**CONFIGS["opt"], "num_hidden_layers": 3})
    view = truncated_model(base, 1)
    assert len(view.model.decoder.layers) == 1 and len(base.model.decoder.layers) == 3
    model = MedusaModel.without_heads(base)
    prompts = [torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in (2, 11, 5)]
    ids, mask = left_pad(prompts)
    out = generate(model, ids, attention_mask=mask, max_new_tokens=16, eos_token_id=[],
                   proposer=LayerSkipProposer(model, num_layers=1, num_tokens=3))
    assert out.new_tokens == [reference(model, p, 16) for p in prompts]
    with torch.no_grad():  # the view runs one layer: other logits than the whole model's
        assert not torch.allclose(view(ids).logits, base(ids).logits)


def test_a_model_that_soft_caps_attention_is_loaded_with_attention_that_applies_the_cap(tmp_path, monkeypatch):
    """transformers 5.17 (the oldest this project takes) gave Gemma 2 sdpa, which dropped its attention soft-cap
    without a word (later ones give it eager): its logits were another model's. Where transformers gives it sdpa
    (as 5.17 does, done here by hand), it is loaded with eager attention, and its logits are the eager ones."""
    from medusa_infer import models

    gemma2 = tiny("gemma2", {**CONFIGS["gemma2"], "attn_logit_softcapping": 0.5})  # (a cap that changes the scores)
    gemma2.save_pretrained(tmp_path / "gemma2")
    loader = AutoModelForCausalLM.from_pretrained

    def as_in_5_17(*args, **kwargs):
        model = loader(*args, **kwargs)
        if kwargs.get("attn_implementation") is None:  # (later ones refuse to set it: the config's field, set)
            model.config._attn_implementation = "sdpa"
        return model

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", as_in_5_17)
    assert as_in_5_17(tmp_path / "gemma2").config._attn_implementation == "sdpa"
    model = models.load_base_model(str(tmp_path / "gemma2"), cpu_kernels="default")
    assert model.config._attn_implementation == "eager"
    ids = torch.tensor([[5, 9, 14, 3, 7, 11]])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, gemma2(ids).logits, atol=1e-5)
    # given as an object with sdpa attention (as 5.17 loads it): refused by name, before any decoding
    given = as_in_5_17(tmp_path / "gemma2")
    with pytest.raises(NotImplementedError, match=r"Gemma2ForCausalLM soft-caps its attention scores "
                                                  r"\(attn_logit_softcapping=0.5\), which sdpa attention drops"):
        MedusaModel.without_heads(given)
    # Gemma 3's config holds the field and its attention ignores it: taken under sdpa (and sdpa_gqa given it)
    from tiny import tiny_config

    config = tiny_config("gemma3_text")
    config.attn_logit_softcapping = 50.0
    gemma3 = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    MedusaModel.without_heads(gemma3)
    gemma3.save_pretrained(tmp_path / "gemma3")
    monkeypatch.undo()
    assert models.load_base_model(str(tmp_path / "gemma3")).config._attn_implementation == "sdpa_gqa"


def test_lora_targets_that_peft_moves_onto_fused_experts_are_refused_by_name():
    """On MoE models whose routed experts transformers 5 fuses, peft maps gate_proj / up_proj / down_proj onto the
    experts' fused parameters, not the dense (first layer) or shared-expert linear layers of that name the check
    found: a Medusa-2 run failed after its data stage ("ParamWrapper does not work with lora_dropout != 0") or, with
    dropout 0, trained other weights than those named. Refused before anything runs; attention targets pass."""
    import re

    from medusa_train.lora import check_lora_targets

    pytest.importorskip("peft.utils.transformers_weight_conversion")  # (peft 0.19: earlier ones adapt them as named)
    glm = tiny("glm4_moe", {"head_dim": 8, "moe_intermediate_size": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
                            "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "partial_rotary_factor": 0.5})
    assert any(name.endswith("shared_experts.gate_proj") for name, _ in glm.named_modules())
    with pytest.raises(ValueError, match=r"\['gate_proj', 'up_proj', 'down_proj'\] are mapped by peft, on glm4_moe, "
                                         r"onto the routed experts' fused parameters .*lora.target_modules=\[q_proj,"):
        check_lora_targets(glm, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    with pytest.raises(ValueError, match=r"cannot be adapted on glm4_moe as named: .*gate_proj"):
        check_lora_targets(glm, ["q_proj", "gate_proj"])
    check_lora_targets(glm, ["q_proj", "k_proj", "v_proj", "o_proj"])
    deepseek = tiny("deepseek_v3", CONFIGS["deepseek_v3"])
    with pytest.raises(ValueError, match=r"\['gate_proj', 'up_proj'\] are mapped by peft, on deepseek_v3"):
        check_lora_targets(deepseek, ["q_a_proj", "kv_a_proj_with_mqa", "gate_proj", "up_proj"])
    check_lora_targets(deepseek, ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"])
    for model, targets in ((glm, ["down_proj"]), (glm, ["gate_proj", "up_proj"]), (glm, ["q_proj", "gate_proj"]),
                           (deepseek, ["gate_proj", "up_proj", "down_proj"]), (deepseek, ["q_a_proj", "gate_proj"])):
        with pytest.raises(ValueError) as refused:  # the targets the refusal offers pass
            check_lora_targets(model, targets)
        offered = re.search(r"lora.target_modules=\[([^\]]+)\]", str(refused.value)).group(1).split(",")
        check_lora_targets(model, offered)
