"""CPU linear kernels chosen per number of rows: same results as F.linear, training untouched, decoding exact."""

from __future__ import annotations

import copy
import io
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import nn

from medusa_infer.cpu_kernels import (
    CPULinear,
    MKL_PACKED_MAX_ROWS,
    KernelPlan,
    apply_cpu_kernels,
    forget_packed,
    kernel_plans,
    match_kernels,
    linear_kernels,
    pack_planned,
    machine_key,
    measure_kernel_plan,
    mkl_packed_works,
    onednn_works,
    read_plan_cache,
    restore_linear,
    use_cpu_kernels,
    write_plan_cache,
)
from medusa_infer.decoding import generate
from medusa_infer.model import MedusaModel
from tiny import VOCAB, tiny_model

pytestmark = pytest.mark.skipif(not onednn_works(), reason="this PyTorch build has no working oneDNN linear kernel")

MIXED = KernelPlan((1, 3, 5, 9), ("default", "onednn", "mkl-packed", "default"))  # every kernel, by number of rows


def mkl_packed_available() -> bool:
    return bool(torch._C.has_mkl) and hasattr(torch.ops.mkl, "_mkl_linear")



def cache_one_plan(cache: Path, model: nn.Module, plan: KernelPlan) -> None:
    """Write ``plan`` into the plan cache at ``cache`` for every linear layer shape of ``model``, under this
    machine's key (as ``use_cpu_kernels`` would find it measured)."""
    shapes = Counter("x".join(map(str, m.weight.shape)) for m in model.modules() if isinstance(m, nn.Linear))
    write_plan_cache(cache, {f"{machine_key()}|{shape}|layers={n}": plan for shape, n in shapes.items()})

def switched(layer: nn.Linear, plan: KernelPlan) -> nn.Linear:
    layer.__class__ = CPULinear
    layer.kernel_plan = plan
    return layer


@pytest.mark.parametrize("plan", [KernelPlan.uniform("onednn"), KernelPlan.uniform("default"),
                                  KernelPlan.uniform("mkl-packed"), MIXED])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 48), (5, 48), (2, 7, 48), (3, 40, 48)])
def test_results_match_f_linear(plan, bias, shape):
    torch.manual_seed(0)
    layer = nn.Linear(48, 80, bias=bias)
    x = torch.randn(*shape)
    with torch.no_grad():
        expected = layer(x)
        switched(layer, plan)
        found = layer(x)
        strided = layer(x.transpose(-1, -2).contiguous().transpose(-1, -2))  # non-contiguous input
    assert found.shape == expected.shape
    torch.testing.assert_close(found, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(strided, expected, atol=1e-5, rtol=1e-5)


def test_mkl_packed_is_checked_for_every_row_count_it_serves():
    torch.manual_seed(0)
    weight, bias = torch.randn(80, 48), torch.randn(80)
    assert mkl_packed_works(weight, bias) == mkl_packed_available()
    assert not mkl_packed_works(weight.double())
    layer = switched(nn.Linear(48, 80), KernelPlan.uniform("mkl-packed"))
    x = torch.randn(MKL_PACKED_MAX_ROWS + 6, 48)  # past its rows: F.linear
    with torch.no_grad():
        torch.testing.assert_close(layer(x), nn.functional.linear(x, layer.weight, layer.bias))
        assert set(layer._kernel_cache) == set()  # nothing was packed for it
        layer(x[:5])
    assert (layer._kernel_cache["mkl-packed"][2] is not None) == mkl_packed_available()


def test_a_shape_that_fails_the_mkl_check_takes_f_linear(monkeypatch):
    from medusa_infer import cpu_kernels

    monkeypatch.setitem(cpu_kernels._MKL_CHECKED, ((80, 48), torch.float32), False)
    layer = switched(nn.Linear(48, 80), KernelPlan.uniform("mkl-packed"))
    x = torch.randn(5, 48)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), nn.functional.linear(x, layer.weight, layer.bias))
    assert layer._kernel_cache["mkl-packed"][2] is None  # never packed for MKL


def test_training_still_gets_gradients():
    torch.manual_seed(0)
    layer = switched(nn.Linear(16, 8), KernelPlan.uniform("onednn"))
    layer(torch.randn(4, 16)).sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0


def test_the_packed_copy_follows_the_weight():
    torch.manual_seed(0)
    layer = switched(nn.Linear(16, 8), KernelPlan.uniform("onednn"))
    x = torch.randn(4, 16)
    with torch.no_grad():
        layer(x)  # packs the weight
        layer.weight.mul_(2)  # in place: a new version
        torch.testing.assert_close(layer(x), nn.functional.linear(x, layer.weight, layer.bias))
        layer.load_state_dict({"weight": torch.randn(8, 16), "bias": torch.randn(8)})
        torch.testing.assert_close(layer(x), nn.functional.linear(x, layer.weight, layer.bias))
        layer.weight = nn.Parameter(torch.randn(8, 16))  # another tensor
        torch.testing.assert_close(layer(x), nn.functional.linear(x, layer.weight, layer.bias))


@pytest.mark.parametrize("kernel", ["onednn", "mkl-packed"])
def test_a_weight_whose_data_is_replaced_twice_is_computed_with(kernel):
    """``.data = ...`` (as ``Module.to`` and ``.bfloat16().float()`` do) frees the storage packed; a second
    replacement could land at its address with the same version, and the copy of the first weights served it
    (stale in 5 to 14 of 20 tries): the copy now keeps the storage it was packed from alive."""
    if kernel == "mkl-packed" and not mkl_packed_available():
        pytest.skip("no MKL packed kernel in this build")
    torch.manual_seed(0)
    for _ in range(20):
        layer = switched(nn.Linear(64, 64), KernelPlan.uniform(kernel))
        x = torch.randn(4, 64)
        with torch.no_grad():
            layer(x)
            layer.weight.data = torch.randn(64, 64)
            layer.weight.data = torch.full((64, 64), 5.0)
            torch.testing.assert_close(layer(x), nn.functional.linear(x, layer.weight, layer.bias))
            layer.bfloat16()
            assert "_kernel_cache" not in layer.__dict__  # (nor the old float32 storage it kept alive)
            layer.float()
            torch.testing.assert_close(layer(x), nn.functional.linear(x, layer.weight, layer.bias))


def test_strided_biases_and_empty_layers_compute_as_f_linear():
    """oneDNN read a bias that is a strided view as if contiguous (other numbers, an expanded one 3.5e+31 off),
    and made no primitive for a layer of zero inputs or outputs (a RuntimeError where nn.Linear gives zeros)."""
    torch.manual_seed(0)
    x = torch.randn(3, 16)
    layer = switched(nn.Linear(16, 8), KernelPlan.uniform("onednn"))
    with torch.no_grad():
        for bias in (torch.randn(16)[::2], torch.randn(8, 3)[:, 1], torch.randn(1).expand(8)):
            assert not bias.is_contiguous()
            layer.bias = nn.Parameter(bias, requires_grad=False)
            torch.testing.assert_close(layer(x), nn.functional.linear(x, layer.weight, bias))
        for inputs, outputs in ((0, 8), (16, 0)):
            empty = switched(nn.Linear(inputs, outputs), KernelPlan.uniform("onednn"))
            given = torch.randn(3, inputs)
            torch.testing.assert_close(empty(given), nn.functional.linear(given, empty.weight, empty.bias))
    model = nn.Sequential(nn.Linear(16, 0), nn.Linear(16, 8))
    use_cpu_kernels(model, KernelPlan.uniform("onednn"))
    assert [type(m) for m in model] == [nn.Linear, CPULinear]  # no plan for an empty layer


def test_a_model_merged_with_peft_after_it_ran_is_computed_with_the_merged_weights():
    """The merge check_supported asks for (peft's merge_and_unload, which adds the delta through ``.data``) on a
    model that already ran with CPU kernels: MedusaModel computed with the weights from before the merge."""
    from peft import LoraConfig, get_peft_model

    ids = torch.tensor([[5, 6, 7, 8, 9]])

    def merged_logits(kernels: bool, wrap) -> torch.Tensor:
        base = tiny_model("llama")
        if kernels:
            use_cpu_kernels(base, KernelPlan.uniform("onednn"))
        torch.manual_seed(1)
        adapted = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"],
                                                  init_lora_weights=False))
        with torch.no_grad():
            adapted(ids)  # packs the weights
            return wrap(adapted.merge_and_unload())(ids).logits

    # as a draft model too (its own MedusaModel kept the old copies)
    from medusa_infer.proposers.draft import as_draft_model

    for wrap in (MedusaModel.without_heads, as_draft_model):
        torch.testing.assert_close(merged_logits(True, wrap), merged_logits(False, wrap), atol=1e-4, rtol=1e-4)


def test_every_kernel_a_plan_names_can_be_packed_before_the_first_product():
    """A layer packed its weight the first time a product of a row count its plan gives a packed kernel came:
    in a benchmark, inside whichever method met that count first. pack_planned makes them all at once."""
    kernels = ("onednn", "mkl-packed") if mkl_packed_available() else ("onednn",)
    torch.manual_seed(0)
    layers = nn.Sequential(switched(nn.Linear(16, 8), KernelPlan((1, 4)[:len(kernels)], kernels, ())),
                           switched(nn.Linear(8, 8), KernelPlan.uniform("onednn")), nn.Linear(8, 4))
    assert pack_planned(layers) == len(kernels) + 1
    made = {k: v[2] for k, v in layers[0]._kernel_cache.items()}
    assert set(made) == set(kernels)
    assert pack_planned(layers) == 0  # made once
    x = torch.randn(5, 16)
    with torch.no_grad():
        for rows in (1, 5):
            torch.testing.assert_close(layers(x[:rows]), nn.functional.linear(nn.functional.linear(
                nn.functional.linear(x[:rows], layers[0].weight, layers[0].bias), layers[1].weight, layers[1].bias),
                layers[2].weight, layers[2].bias))
    assert all(layers[0]._kernel_cache[k][2] is made[k] for k in kernels)  # the products took the copies made
    assert pack_planned(nn.Sequential(switched(nn.Linear(16, 8), KernelPlan.uniform("onednn")).to(torch.bfloat16))) == 0


@pytest.mark.parametrize("kernel", ["onednn", "mkl-packed"])
def test_a_fused_optimizers_update_is_computed_with(kernel):
    """AdamW(fused=True) updates the weight without bumping its version: the next no-grad forward took the
    packed copy of the old weight (off by up to 5.7 on a small model)."""
    if kernel == "mkl-packed" and not mkl_packed_available():
        pytest.skip("MKL's packed GEMM is not in this PyTorch build")
    torch.manual_seed(0)
    layer = switched(nn.Linear(16, 8), KernelPlan.uniform(kernel))
    x = torch.randn(4, 16)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.1, fused=True)
    with torch.no_grad():
        layer(x)  # packs the weight
    version = layer.weight._version
    layer(x).sum().backward()
    optimizer.step()
    assert layer.weight._version == version  # what hid the update
    with torch.no_grad():
        torch.testing.assert_close(layer(x), nn.functional.linear(x, layer.weight, layer.bias))


@pytest.mark.parametrize("kernel", ["onednn", "mkl-packed"])
def test_weights_loaded_in_place_under_inference_mode_are_computed_with(kernel):
    """A layer made under inference mode has inference tensors, whose version never changes: a state dict
    loaded in place there left every layer computing with the packed copy of the old weights."""
    torch.manual_seed(0)
    with torch.inference_mode():
        layer = switched(nn.Linear(16, 8), KernelPlan.uniform(kernel))
        x = torch.randn(4, 16)
        layer(x)  # packs the weight
        layer.load_state_dict({"weight": torch.randn(8, 16), "bias": torch.randn(8)})
        assert layer.weight.is_inference()
        torch.testing.assert_close(layer(x), nn.functional.linear(x, layer.weight, layer.bias))


def test_an_adapter_merged_into_a_model_that_already_ran_is_computed_with(tmp_path):
    """peft's merge adds the LoRA delta through ``.data`` (no new version, the same storage): the copies packed
    by earlier forwards must not outlive it, or the merged model computes with the weights before it."""
    from peft import LoraConfig, get_peft_model

    heads = tmp_path / "heads"
    MedusaModel.from_base(tiny_model("llama"), num_heads=2).save_pretrained(heads)
    adapted = get_peft_model(tiny_model("llama"), LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"],
                                                             init_lora_weights=False))
    adapted.save_pretrained(heads / "adapter")
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        expected = MedusaModel.from_pretrained(heads, base_model=tiny_model("llama"))(ids).logits
        used = tiny_model("llama")
        use_cpu_kernels(used, KernelPlan.uniform("onednn"))
        used(ids)  # packs the weights
        got = MedusaModel.from_pretrained(heads, base_model=used)(ids).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_shared_heads_of_a_reduced_vocabulary_follow_lm_head_weights_set_through_data():
    """Their gathered lm_head rows were kept by forget_packed, and new weights set through .data could take the old
    ones' address (version 0 both): the heads went on with the old rows (17 of 20 trials)."""
    import copy

    model = MedusaModel.from_base(tiny_model("llama"), num_heads=2, projection="shared", token_map=torch.arange(40))
    lm_head = model.base_model.get_output_embeddings()
    hidden = torch.randn(1, 3, model.base_model.config.hidden_size)
    with torch.no_grad():
        for _ in range(10):
            model.head_logits(hidden)
            lm_head.weight.data = torch.randn_like(lm_head.weight)
            lm_head.weight.data = torch.randn_like(lm_head.weight)  # (the first's storage freed: its address free)
            fresh = MedusaModel(model.base_model, copy.deepcopy(model.heads))  # (a copy keeps no gathered rows)
            torch.testing.assert_close(model.head_logits(hidden), fresh.head_logits(hidden))
            lm_head.weight.data.copy_(torch.randn_like(lm_head.weight))  # no version bumped: forget_packed
            forget_packed(model)
            fresh = MedusaModel(model.base_model, copy.deepcopy(model.heads))
            torch.testing.assert_close(model.head_logits(hidden), fresh.head_logits(hidden))


def test_shared_heads_use_the_lm_heads_packed_copy():
    """Heads projecting with the base ``lm_head`` itself (no reduced vocabulary) keep no second packed copy of
    it (vocabulary x hidden floats: 113 MiB for SmolLM2, about 670 MB for Gemma-3-270M)."""
    model = MedusaModel.from_base(tiny_model("llama"), num_heads=2, projection="shared")
    use_cpu_kernels(model.base_model, KernelPlan.uniform("onednn"))
    model = MedusaModel(model.base_model, model.heads)
    hidden = torch.randn(1, 3, model.base_model.config.hidden_size)
    with torch.no_grad():
        model.head_logits(hidden)
    lm_head = model.base_model.get_output_embeddings()
    assert "onednn" in lm_head.__dict__.get("_kernel_cache", {})
    assert not model.heads.__dict__.get("_kernel_cache")


def test_a_switched_model_copies_and_pickles_without_its_packed_weights():
    model = tiny_model("llama")
    use_cpu_kernels(model, "onednn")
    ids = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids).logits  # every layer now holds a packed copy, which cannot be copied
        clone = copy.deepcopy(model)
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)  # the whole module this test pickled above
        torch.testing.assert_close(clone(ids).logits, expected)
        torch.testing.assert_close(loaded(ids).logits, expected)
    assert set(kernel_plans(clone).values()) == {KernelPlan.uniform("onednn")}


def test_a_plan_names_a_kernel_for_every_row_count():
    assert [MIXED.kernel(n) for n in (1, 2, 3, 4, 5, 8, 9, 500)] == ["default", "default", "onednn", "onednn",
                                                                     "mkl-packed", "mkl-packed", "default", "default"]
    assert MIXED.describe() == "default for 1-2 rows, onednn for 3-4 rows, mkl-packed for 5-8 rows, default for 9+ rows"
    assert KernelPlan((1, 2, 4), ("default", "onednn", "onednn")).describe() == "default for 1 row, onednn for 2+ rows"
    assert KernelPlan.uniform("onednn").describe() == "onednn for every row count"
    # MKL's packed kernel serves at most MKL_PACKED_MAX_ROWS rows: a plan's span past them runs (and names) F.linear
    packed = KernelPlan((1, 32), ("onednn", "mkl-packed"))
    last = MKL_PACKED_MAX_ROWS
    assert [packed.kernel(n) for n in (31, 32, last, last + 1, 500)] == ["onednn"] + ["mkl-packed"] * 2 + ["default"] * 2
    assert packed.describe() == f"onednn for 1-31 rows, mkl-packed for 32-{last} rows, default for {last + 1}+ rows"
    assert KernelPlan.uniform("mkl-packed").describe() == f"mkl-packed for 1-{last} rows, default for {last + 1}+ rows"
    with pytest.raises(ValueError, match="must start at 1"):
        KernelPlan((2,), ("onednn",))
    with pytest.raises(ValueError, match="ascending distinct rows"):
        KernelPlan((1, 4, 4), ("onednn", "default", "onednn"))
    with pytest.raises(ValueError, match="unknown kernels"):
        KernelPlan((1,), ("mkl",))


def test_a_measured_plan_keeps_the_faster_kernel_for_each_row_count():
    layers = [nn.Linear(64, 96) for _ in range(3)]
    plan = measure_kernel_plan(layers, rows=(2, 8, MKL_PACKED_MAX_ROWS + 1), repeats=2)
    assert plan.rows == (1, 2, 8, MKL_PACKED_MAX_ROWS + 1)
    with pytest.raises(ValueError, match="one weight shape"):
        measure_kernel_plan([nn.Linear(64, 96), nn.Linear(64, 32)])
    every = {"default", "onednn"} | ({"mkl-packed"} if mkl_packed_available() else set())
    assert [set(s) for s in plan.seconds] == [every] * 3 + [{"default", "onednn"}]
    assert all(s[k] > 0 and s[k] == min(s.values()) for s, k in zip(plan.seconds, plan.kernels))
    model = tiny_model("llama")
    assert use_cpu_kernels(model) == sum(isinstance(m, nn.Linear) for m in model.modules())
    plans = kernel_plans(model)  # one plan per weight shape, each measured
    assert set(plans) == {"x".join(map(str, m.weight.shape)) for m in model.modules() if isinstance(m, nn.Linear)}
    assert len(plans) > 1 and all(plan.seconds for plan in plans.values()) and linear_kernels(model) == "tuned"
    assert all(m.kernel_plan is plans["x".join(map(str, m.weight.shape))]
               for m in model.modules() if isinstance(m, CPULinear))
    heads = nn.Sequential(nn.Linear(7, 5))
    assert match_kernels(heads, model) == 1 and kernel_plans(heads)["5x7"].seconds  # measured on its own layers
    assert match_kernels(nn.Linear(7, 5), tiny_model("llama")) == 0  # nothing switched to match


def test_measured_plans_are_kept_for_later_loads_on_the_same_machine(tmp_path, monkeypatch, caplog):
    import medusa_infer.cpu_kernels as ck

    cache = tmp_path / "cache" / "plans.json"
    model = tiny_model("llama")
    use_cpu_kernels(model, plan_cache=cache)
    first = kernel_plans(model)
    layers = Counter("x".join(map(str, m.weight.shape)) for m in model.modules() if isinstance(m, CPULinear))
    assert read_plan_cache(cache) == {f"{machine_key()}|{shape}|layers={layers[shape]}": plan
                                      for shape, plan in first.items()}
    assert cache.stat().st_mode & 0o044  # readable by others, as the rest of a cache under a usual umask

    def no_measuring(layers, *args, **kwargs):
        raise AssertionError("a cached plan was measured again")

    monkeypatch.setattr(ck, "measure_kernel_plan", no_measuring)
    again = tiny_model("llama")
    use_cpu_kernels(again, plan_cache=cache)
    assert kernel_plans(again) == first and all(p.seconds for p in kernel_plans(again).values())
    assert linear_kernels(again) == "tuned"
    # another machine (or thread count, or PyTorch) measures its own, added beside the first
    monkeypatch.undo()
    monkeypatch.setattr(ck, "machine_key", lambda: "another machine")
    use_cpu_kernels(tiny_model("llama"), plan_cache=cache)
    assert len(read_plan_cache(cache)) == 2 * len(first)
    # one bad entry is measured over, the others kept; a damaged file is measured over and written again
    import json

    entries = json.loads(cache.read_text())
    broken = next(key for key in entries if key.startswith(machine_key()))
    entries[broken]["rows"] = [2]
    cache.write_text(json.dumps(entries))
    assert len(read_plan_cache(cache)) == 2 * len(first) - 1 and "ignoring entry" in caplog.text
    cache.write_text("{not json")
    use_cpu_kernels(tiny_model("llama"), plan_cache=cache)
    assert "ignoring the kernel plan cache" in caplog.text and len(read_plan_cache(cache)) == len(first)
    # a row count past a float's range, and JSON nested past Python's stack: ignored, not a failed model load
    entries = json.loads(cache.read_text())
    entries[next(iter(entries))]["rows"] = [1e400]
    cache.write_text(json.dumps(entries).replace("Infinity", "1e400"))
    assert len(read_plan_cache(cache)) == len(first) - 1
    cache.write_text("[" * 100_000 + "]" * 100_000)
    caplog.clear()
    use_cpu_kernels(tiny_model("llama"), plan_cache=cache)
    assert "ignoring the kernel plan cache" in caplog.text and len(read_plan_cache(cache)) == len(first)
    assert not list(cache.parent.glob(".*.tmp"))


def test_switched_layers_follow_autocast(monkeypatch):
    """Under ``torch.autocast("cpu", dtype=torch.bfloat16)`` a switched layer computed float32 with oneDNN (an
    nn.Linear computes bfloat16), switching failed comparing float32 with bfloat16, and MKL's packed kernel,
    first checked there, was turned off for that weight shape for the rest of the process."""
    import medusa_infer.cpu_kernels as ck

    torch.manual_seed(0)
    x = torch.randn(4, 64)
    reference, layer = nn.Linear(64, 32), nn.Linear(64, 32)
    layer.load_state_dict(reference.state_dict())
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert use_cpu_kernels(layer, "onednn") == 1
        assert torch.equal(layer(x), reference(x)) and layer(x).dtype == torch.bfloat16
    if not mkl_packed_available():
        return
    monkeypatch.setattr(ck, "_MKL_CHECKED", {})
    packed = nn.Linear(64, 48)
    use_cpu_kernels(packed, KernelPlan.uniform("mkl-packed"))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        packed(x)
    assert mkl_packed_works(packed.weight)


def test_the_heads_plans_are_kept_for_later_loads_too(tmp_path, monkeypatch):
    """The heads matched a tuned base model's kernels with plans measured at every load and never kept (10 s a
    load of SmolLM2's heads with their own projections, in every process)."""
    import medusa_infer.cpu_kernels as ck

    monkeypatch.setenv("MEDUSA_FORGE_KERNEL_PLANS", str(tmp_path / "plans.json"))
    base = tiny_model("llama")
    use_cpu_kernels(base, plan_cache=tmp_path / "plans.json")
    first = MedusaModel.from_base(base, num_heads=2, projection="own")
    assert linear_kernels(first.heads) == "tuned"

    def no_measuring(layers, *args, **kwargs):
        raise AssertionError("a cached plan was measured again")

    monkeypatch.setattr(ck, "measure_kernel_plan", no_measuring)
    again = MedusaModel.from_base(base, num_heads=2, projection="own")
    assert kernel_plans(again.heads) == kernel_plans(first.heads)


def test_a_cached_plan_with_mkls_packed_kernel_is_not_checked_again(tmp_path, monkeypatch):
    """MKL's packed kernel competes only for a shape mkl_packed_works passes: a plan measured on this machine
    that took it was checked there. A later process checked it again at its first product (16 s for
    Gemma-3's 262144 x 640 lm_head, in every run of medusa-generate)."""
    import medusa_infer.cpu_kernels as ck

    if not mkl_packed_available():
        pytest.skip("MKL's packed GEMM is not in this PyTorch build")
    cache = tmp_path / "plans.json"
    model = tiny_model("llama")
    cache_one_plan(cache, model, KernelPlan((1,), ("mkl-packed",), ({"mkl-packed": 0.001, "default": 0.002},)))
    monkeypatch.setattr(ck, "_MKL_CHECKED", {})
    monkeypatch.setattr(ck, "_check_mkl_packed", lambda *a: pytest.fail("checked again"))
    monkeypatch.setattr(ck, "measure_kernel_plan", lambda *a, **k: pytest.fail("measured again"))
    use_cpu_kernels(model, plan_cache=cache)
    plain = copy.deepcopy(model)
    restore_linear(plain)
    with torch.no_grad():
        torch.testing.assert_close(model(torch.arange(3, 9)[None]).logits, plain(torch.arange(3, 9)[None]).logits)


def test_switch_keeps_parameters_ties_and_state_dict_and_can_be_undone():
    model = tiny_model("llama")
    before = {k: v.data_ptr() for k, v in model.state_dict().items()}
    linears = sum(type(m) is nn.Linear for m in model.modules())
    assert linear_kernels(model) == "default" and kernel_plans(model) == {}
    assert use_cpu_kernels(model, MIXED) == linears > 0
    assert linear_kernels(model) == MIXED.describe()
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == before
    assert restore_linear(model) == linears
    assert all(type(m) is not CPULinear for m in model.modules())
    with pytest.raises(ValueError, match="'tuned' or 'onednn'"):
        use_cpu_kernels(model, "mkl")


def test_only_float32_cpu_models_are_switched():
    assert apply_cpu_kernels(tiny_model("qwen3"), "onednn") > 0
    assert apply_cpu_kernels(tiny_model("qwen3"), "tuned") > 0
    assert apply_cpu_kernels(tiny_model("qwen3"), "default") == 0
    assert apply_cpu_kernels(tiny_model("qwen3").to(torch.bfloat16), "onednn") == 0
    # switched, then cast: heads added to it (match_kernels times float32 inputs) failed on its bf16 layers
    base = tiny_model("qwen3")
    assert apply_cpu_kernels(base, "tuned") > 0
    base.to(torch.bfloat16)
    model = MedusaModel.from_base(base, num_heads=2)
    assert use_cpu_kernels(base, "tuned") == 0 and linear_kernels(model.heads) == "default"
    model.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=2)
    partly = tiny_model("qwen3")
    partly.lm_head.to(torch.bfloat16)
    assert use_cpu_kernels(partly, "tuned") == sum(isinstance(m, nn.Linear) for m in partly.modules()) - 1
    with pytest.raises(ValueError, match="cpu_kernels must be one of"):
        apply_cpu_kernels(tiny_model("qwen3"), "mkl")


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "gpt2"])
def test_greedy_decoding_stays_identical_to_generate(arch):
    model = MedusaModel.from_base(tiny_model(arch), num_heads=4, next_token_input=True)
    torch.manual_seed(1)
    for p in model.heads.parameters():
        nn.init.normal_(p, std=0.3)
    assert use_cpu_kernels(model.base_model, MIXED) > 0
    for n in (3, 8):
        prompt = torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(n))
        out = generate(model, prompt[None], max_new_tokens=20, tree="tree-16", eos_token_id=[])
        hf = model.base_model.generate(prompt[None], attention_mask=torch.ones_like(prompt)[None], max_new_tokens=20,
                                       do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out.new_tokens[0] == hf[0, n:].tolist()


@pytest.mark.parametrize("projection, reduced", [("shared", None), ("shared", 40), ("own", None)])
def test_heads_take_the_base_models_kernels_and_give_the_same_logits(projection, reduced):
    token_map = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))[:reduced] if reduced else None
    plain = MedusaModel.from_base(tiny_model("llama"), num_heads=3, num_layers=2, projection=projection,
                                  token_map=token_map, next_token_input=True)
    torch.manual_seed(0)
    for p in plain.heads.parameters():
        nn.init.normal_(p, std=0.3)
    hidden = torch.randn(2, 5, plain.base_model.config.hidden_size)
    following = torch.randint(0, VOCAB, (2, 5))
    with torch.no_grad():
        expected = plain.head_logits(hidden, following)
    assert linear_kernels(plain.heads) == "default"
    use_cpu_kernels(plain.base_model, KernelPlan.uniform("onednn"))
    model = MedusaModel(plain.base_model, plain.heads)
    assert set(kernel_plans(model.heads).values()) == {KernelPlan.uniform("onednn")}
    with torch.no_grad():
        torch.testing.assert_close(model.head_logits(hidden, following), expected, atol=1e-4, rtol=1e-4)


def _write_plans(path: str, prefix: str, count: int) -> None:
    for i in range(count):
        write_plan_cache(path, {f"{prefix}{i}": KernelPlan.uniform("onednn")})


def test_processes_writing_the_plan_cache_at_once_keep_every_plan(tmp_path):
    import multiprocessing

    cache = tmp_path / "plans.json"
    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    writers = [context.Process(target=_write_plans, args=(str(cache), prefix, 40)) for prefix in ("a", "b", "c")]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(60)
    assert [writer.exitcode for writer in writers] == [0, 0, 0]
    assert sorted(read_plan_cache(cache)) == sorted(f"{p}{i}" for p in "abc" for i in range(40))


def test_measuring_a_plan_leaves_the_global_random_state_alone():
    """train_heads seeds before loading the model, whose first load on a machine measures its plans: the
    timing inputs drew from the global generator, so the same seed gave another Medusa-2 adapter init
    on a machine's first run than on later ones (max |diff| 0.335)."""
    layer = nn.Linear(16, 8)
    torch.manual_seed(0)
    expected = torch.rand(4)
    torch.manual_seed(0)
    measure_kernel_plan([layer], rows=(1, 2), repeats=1)
    assert torch.equal(torch.rand(4), expected)


@pytest.mark.skipif(not mkl_packed_available(), reason="no MKL")
def test_mkl_packed_serves_exactly_up_to_its_largest_row_count():
    layer = switched(nn.Linear(48, 80), KernelPlan.uniform("mkl-packed"))
    x = torch.randn(MKL_PACKED_MAX_ROWS, 48)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), nn.functional.linear(x, layer.weight, layer.bias))
    assert layer._kernel_cache["mkl-packed"][2] is not None  # 64 rows still take the packed kernel
    plan = measure_kernel_plan([nn.Linear(48, 80)], rows=(MKL_PACKED_MAX_ROWS, MKL_PACKED_MAX_ROWS + 1), repeats=1)
    assert [set(s) for s in plan.seconds][1:] == [{"default", "onednn", "mkl-packed"}, {"default", "onednn"}]
    # the counts past it are measured without it even where none were asked for: they run on the faster of the others
    plan = measure_kernel_plan([nn.Linear(48, 80)], rows=(8,), repeats=1)
    assert plan.rows == (1, 8, MKL_PACKED_MAX_ROWS + 1) and set(plan.seconds[-1]) == {"default", "onednn"}


@pytest.mark.parametrize("kernel", ["onednn", "mkl-packed"])
def test_a_weight_replaced_by_another_view_of_its_storage_is_computed_with(kernel):
    """A new Parameter on the same storage, shape and version counter (a transposed square weight) is
    another weight: its packed copy is made again."""
    torch.manual_seed(0)
    layer = switched(nn.Linear(32, 32), KernelPlan.uniform(kernel))
    x = torch.randn(5, 32)
    with torch.no_grad():
        layer(x)  # packs the weight
        layer.weight = nn.Parameter(layer.weight.detach().t())  # same data_ptr, shape and version
        torch.testing.assert_close(layer(x), nn.functional.linear(x, layer.weight, layer.bias))


def test_heads_of_other_shapes_are_measured_even_when_the_base_has_one_measured_plan():
    like = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    use_cpu_kernels(like, "tuned")
    (plan,) = set(kernel_plans(like).values())
    assert plan.seconds
    heads = nn.Sequential(nn.Linear(7, 5))
    assert match_kernels(heads, like) == 1
    assert kernel_plans(heads)["5x7"] is not plan and kernel_plans(heads)["5x7"].seconds


def test_a_cached_plan_without_mkls_packed_kernel_leaves_the_check_to_be_done(tmp_path, monkeypatch):
    """Only a cached plan that takes MKL's packed kernel vouches for it: a shape whose cached plan does not
    (MKL's kernel may have failed the check there) is still checked before a later plan may choose it."""
    import medusa_infer.cpu_kernels as ck

    if not mkl_packed_available():
        pytest.skip("no MKL")
    cache = tmp_path / "plans.json"
    model = tiny_model("llama")
    cache_one_plan(cache, model, KernelPlan((1,), ("onednn",), ({"onednn": 0.001, "default": 0.002},)))
    monkeypatch.setattr(ck, "_MKL_CHECKED", {})
    monkeypatch.setattr(ck, "_check_mkl_packed", lambda *a: False)  # MKL's packed kernel fails on this machine
    monkeypatch.setattr(ck, "measure_kernel_plan", lambda *a, **k: pytest.fail("measured again"))
    use_cpu_kernels(model, plan_cache=cache)
    assert not mkl_packed_works(model.lm_head.weight)


def test_a_plan_written_again_replaces_the_one_cached(tmp_path):
    from medusa_infer.cpu_kernels import read_plan_cache, write_plan_cache

    cache = tmp_path / "plans.json"
    write_plan_cache(cache, {"k": KernelPlan.uniform("onednn"), "other": KernelPlan.uniform("onednn")})
    write_plan_cache(cache, {"k": KernelPlan.uniform("default")})
    assert read_plan_cache(cache) == {"k": KernelPlan.uniform("default"), "other": KernelPlan.uniform("onednn")}
