"""The serving engine's speculation gate: the pure on/off rule, and the engine obeying it."""

from __future__ import annotations

import threading
import time

import openai
import pytest
import torch

from medusa_infer.adaptive import TreeController, tree_ladder
from medusa_infer.decoding import DecodeBatch, SamplingConfig, StopConfig, left_pad, stream
from medusa_infer.proposers import MedusaProposer, build_proposer
from medusa_infer.serving.scheduler import Request
from medusa_infer.serving.testing import metric_value, serve, torch_threads
from medusa_infer.speculation_gate import TIME_WINDOW, SpeculationGate
from medusa_infer.tree_fit import CostProfile
from tiny import word_medusa


def linear_time(tokens: float) -> float:
    """A CPU-like step time: a fixed cost plus a cost per token in the forward."""
    return 0.040 + 0.004 * tokens


def run(gate: SpeculationGate, batch: int, steps: int, tokens_per_row: float, verified_per_row: int = 5,
        seconds=linear_time) -> list[bool]:
    """Drive ``gate`` for ``steps`` steps of ``batch`` rows; the choices it made."""
    choices = []
    for _ in range(steps):
        speculate = gate.speculate(batch)
        choices.append(speculate)
        verified = batch * (verified_per_row if speculate else 1)
        tokens = batch * (tokens_per_row if speculate else 1)
        gate.record(batch, speculate, tokens, seconds(verified), verified)
    return choices


def test_speculates_where_it_pays_and_not_where_the_batch_fills_the_forward():
    # one row: 5 tokens cost 0.060 s against 0.044 s for one; 1.6 tokens a step pays (1.6 / 0.060 > 1 / 0.044)
    gate = SpeculationGate(warmup=2)
    choices = run(gate, batch=1, steps=30, tokens_per_row=1.6)
    assert choices[:2] == [True, True]  # the warm-up measures speculation
    assert choices[2:4] == [False, False]  # then two plain steps measure t(1) (MIN_PLAIN_TIMES)
    assert all(choices[4:])
    # sixteen rows: 80 tokens cost 0.36 s against 0.104 s for 16; 1.6 tokens a row does not pay
    choices = run(gate, batch=16, steps=40, tokens_per_row=1.6)
    assert choices[:2] == [False, False]  # t(16) unknown: plain steps measure it; t(80) is unknown too,
    assert choices[2] is True  # so a speculative one measures that
    assert not any(choices[3:])  # then plain: a probe here costs 2.5 plain steps, more than 40 steps earn


def test_probes_take_about_the_probe_budget():
    gate = SpeculationGate(probe_budget=0.05, warmup=1)
    choices = run(gate, batch=1, steps=400, tokens_per_row=1.0)  # drafts never accepted: speculation never pays
    plain, probe = linear_time(1), linear_time(5)
    probes = choices[2:].count(True)
    assert probes > 0, "speculation must be probed now and then while it is off"
    spent = probes * (probe - plain) / (len(choices[2:]) * plain)
    assert 0.03 < spent <= 0.05
    # probes are rarer where a speculative step costs more: sixteen rows
    gate16 = SpeculationGate(probe_budget=0.05, warmup=1)
    choices16 = run(gate16, batch=16, steps=400, tokens_per_row=1.0)
    assert 0 < choices16[2:].count(True) < probes


def test_what_one_batch_size_taught_serves_the_others():
    gate = SpeculationGate(warmup=1)
    run(gate, batch=1, steps=3, tokens_per_row=1.6)
    run(gate, batch=16, steps=3, tokens_per_row=1.6)
    assert gate.speculate(1) is True and gate.speculate(16) is False
    assert gate.speculate(14) is False  # a size never stepped: its forward sizes have been measured
    assert gate.step_seconds(16) == pytest.approx(linear_time(16))
    assert gate.step_seconds(12) == pytest.approx(linear_time(12), rel=0.05)  # interpolated
    assert gate.step_seconds(300) is None  # never measured near there


def test_close_calls_go_to_speculation():
    # one row, 1.3 tokens a speculative step: 1.3 / 0.060 = 21.7 tokens/s against 22.7 plain, 4% slower
    close = run(SpeculationGate(warmup=1), batch=1, steps=20, tokens_per_row=1.3)
    assert all(close[3:])
    strict = run(SpeculationGate(warmup=1, margin=0.0), batch=1, steps=20, tokens_per_row=1.3)
    assert strict[2:].count(False) > 10


def test_the_choice_follows_the_text():
    gate = SpeculationGate(probe_budget=0.2, smoothing=0.5, warmup=1)
    run(gate, batch=4, steps=10, tokens_per_row=1.0)  # nothing accepted: plain
    assert gate.speculate(4) is False
    # the text turns repetitive: 4 of 5 drafted tokens accepted; the probes find out
    run(gate, batch=4, steps=22, tokens_per_row=5.0)
    checks = gate.checks
    choices = run(gate, batch=4, steps=8, tokens_per_row=5.0)
    assert choices.count(False) == gate.checks - checks <= 2  # its plain steps are checks of t(4) alone
    summary = gate.summary()
    assert summary["tokens_per_row"] == pytest.approx(5.0, rel=0.01) and summary["verified_per_row"] == 5


def test_speculation_comes_back_within_a_few_probes_with_the_default_settings():
    # one row: 5 tokens cost 0.060 s against 0.044 s for one, so about 1.43 tokens a step pay
    gate = SpeculationGate()
    run(gate, batch=1, steps=60, tokens_per_row=1.0)  # a request whose drafts all miss: plain
    assert gate.speculate(1) is False
    # the next request's text suits the drafts (2.2 tokens a step): its first probe (credit earned
    # during the first request pays for it at once, or a step later) turns speculation back on for good;
    # with every probe weighed as an ordinary step it took three probes and 39 steps
    checks = gate.checks
    choices = run(gate, batch=1, steps=40, tokens_per_row=2.2)
    back = choices.index(True)
    assert back <= 1 and choices[back:].count(False) == gate.checks - checks <= 1  # then only a check of t(1)


def test_a_probe_whose_step_failed_is_forgotten():
    gate = SpeculationGate(warmup=1)
    run(gate, batch=1, steps=60, tokens_per_row=1.0)
    for _ in range(2):  # plain steps of 64 rows (MIN_PLAIN_TIMES)
        gate.record(64, False, 64, linear_time(64), 64)
    while not gate.speculate(1):  # plain steps until a probe is asked for; its step then fails, unrecorded
        gate.record(1, False, 1, linear_time(1), 1)
    # the next step speculates for an ordinary reason: 64 rows, whose speculative forward size the gate
    # has not measured yet
    before = gate.tokens_per_row
    assert gate.speculate(64) is True
    gate.record(64, True, 64 * 3, linear_time(64 * 5), 64 * 5)
    assert gate.tokens_per_row == pytest.approx(0.9 * before + 0.1 * 3)  # weighed as ordinary, not as a probe


@pytest.mark.parametrize("kwargs, message", [
    (dict(probe_budget=0.0), "probe_budget"), (dict(probe_budget=1.0), "probe_budget"),
    (dict(margin=1.0), "margin"), (dict(smoothing=0.0), "smoothing"), (dict(warmup=0), "warmup"),
    (dict(smoothing=0.2, probe_weight=0.1), "probe_weight")])
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SpeculationGate(**kwargs)


def test_bad_records_are_refused():
    gate = SpeculationGate()
    with pytest.raises(ValueError, match="batch size"):
        gate.speculate(0)
    with pytest.raises(ValueError, match="seconds"):
        gate.record(1, True, 3, 0.0, 5)
    with pytest.raises(ValueError, match="verified >= batch"):
        gate.record(4, False, 4, 0.1, 2)


# -- the decoding loop and the engine -----------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    with torch_threads(1):
        yield word_medusa()


def test_a_plain_step_proposes_nothing_and_decodes_the_same_tokens(model):
    ids, mask = left_pad([[5, 6, 7, 8], [9, 10]], 0)

    def decode(speculate_on_step):
        batch = DecodeBatch(model, ids, mask, build_proposer("medusa", model), SamplingConfig(),
                            StopConfig(12), None, None)
        batch.prefill()
        step = 0
        while not batch.done:
            batch.step(speculate=speculate_on_step(step))
            step += 1
        return batch.output(0).sequences.tolist(), batch.metrics

    always, always_metrics = decode(lambda i: True)
    alternating, metrics = decode(lambda i: i % 2 == 1)
    assert alternating == always  # greedy: the same tokens whichever steps speculate
    assert max(always_metrics.recent_tree_sizes) > 1
    sizes = list(metrics.recent_tree_sizes)
    assert len(sizes) == metrics.steps
    assert set(sizes[0::2]) == {1}, "a plain step verifies the root alone"
    assert min(sizes[1::2]) > 1
    assert metrics.plain_steps == len(sizes[0::2]) and metrics.fallback_fraction == metrics.plain_steps / metrics.steps
    assert metrics.mean_tree_size == sum(sizes) / len(sizes)


def test_plain_steps_teach_the_tree_controller_nothing(model):
    tree = [(0,), (1,), (0, 0), (0, 0, 0)]
    accuracy = [[0.6, 0.2], [0.4, 0.1], [0.3, 0.1]]
    cost = CostProfile([1, 2, 4, 8], [1.0, 1.05, 1.1, 1.2])
    controller = TreeController(tree_ladder(tree, sizes=(2,)), accuracy, cost)
    proposer = MedusaProposer(model, tree, controller=controller)
    assert controller.rung > 0, "the controller should start on a speculative rung"
    ids, mask = left_pad([[5, 6, 7, 8]], 0)
    batch = DecodeBatch(model, ids, mask, proposer, SamplingConfig(), StopConfig(8), None, None)
    batch.prefill()
    scales = list(proposer.controller.scales)
    for _ in range(4):
        batch.step(speculate=False)
    assert proposer.controller.scales == scales
    # nor do they spend the probes and neighbour steps falling due (cut to the root, they measured
    # nothing), nor count as the fallback's plain steps
    assert not controller.history and batch.metrics.fallback_steps == 0


class Forced(SpeculationGate):
    """A gate that answers ``speculate`` from a fixed rule and remembers what it was told."""

    def __init__(self, rule) -> None:
        super().__init__()
        self.rule, self.asked, self.records, self.proposing = rule, [], [], []
        self.kinds_asked, self.row_tokens = [], []

    def speculate(self, batch: int, kinds=None) -> bool:
        self.asked.append(batch)
        self.kinds_asked.append(kinds)
        return self.rule(batch)

    def record(self, batch: int, speculated: bool, tokens: float, seconds: float, verified: int,
               proposing: float | None = None, kinds=None, row_tokens=None) -> None:
        self.records.append((batch, speculated, tokens, verified))
        self.proposing.append(proposing)
        self.row_tokens.append((kinds, row_tokens))
        super().record(batch, speculated, tokens, seconds, verified, proposing, kinds, row_tokens)


def answer(server, **kwargs) -> tuple[str, dict]:
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        out = client.completions.create(model="tiny", prompt="the cat sat on the mat", max_tokens=12,
                                        extra_body={"ignore_eos": True}, **kwargs)
    return out.choices[0].text, out.usage.model_extra["speculative"]


def test_the_engine_decodes_plainly_where_the_gate_says_so(model):
    with serve(model, "medusa", speculation_gate=False) as (server, engine):
        assert engine.gate is None
        free_text, free = answer(server, temperature=0)
    with serve(model, "medusa") as (server, engine):
        engine.gate = gate = Forced(lambda batch: False)
        text, spec = answer(server, temperature=0)
        gated = metric_value(__import__("httpx").get(server.base_url + "/metrics", timeout=10).text,
                             "medusa:gated_steps_total")
    assert text == free_text  # greedy output does not depend on the gate
    assert spec["accepted_tokens"] == 0 and spec["tau"] == 1.0
    assert free["accepted_tokens"] > 0, "the tiny heads should get some drafts accepted when not gated"
    assert gate.asked and set(gate.asked) == {1}
    assert gated == len(gate.asked)
    assert [(r[0], r[1], r[3]) for r in gate.records] == [(1, False, 1)] * len(gate.records)
    assert sum(r[2] for r in gate.records) == 11  # the prefill gave the first of the 12 tokens


def test_a_seeded_request_is_never_gated(model):
    with serve(model, "medusa") as (server, engine):
        engine.gate = gate = Forced(lambda batch: False)
        first, _ = answer(server, temperature=0.9, seed=3)
        assert gate.asked == []
        engine.gate = Forced(lambda batch: True)
        second, _ = answer(server, temperature=0.9, seed=3)
    assert first == second


def _forward_seconds(n):  # a forward of n tokens on a CPU a batch already fills
    return 0.010 * (1 + 0.25 * (n - 1))


def test_each_kind_of_row_has_its_own_yield_and_shares_the_step_times():
    """A sampled batch's drafts are accepted far less than a greedy one's: with one yield for both, the
    sampled batch's turned speculation off for the greedy batch beside it."""
    rows, verified = 2, 3  # two rows, a 2-token draft each
    yields = {"greedy": 2.2, "lossless": 1.05}  # tokens a speculative step emits per row
    gate = SpeculationGate()
    speculated = dict.fromkeys(yields, 0)
    for step in range(3000):
        kind = ("greedy", "lossless")[step % 2]
        spec = gate.speculate(rows, [kind] * rows)
        emitted = yields[kind] if spec else 1.0
        gate.record(rows, spec, rows * emitted, _forward_seconds(rows * verified if spec else rows),
                    rows * verified if spec else rows, None, [kind] * rows, [emitted] * rows)
        speculated[kind] += spec
    # greedy: 1.22x plain when speculating; lossless: 0.58x (measured alone, each kind's yield decides so)
    assert speculated["greedy"] > 1400 and speculated["lossless"] < 150, speculated
    assert gate.expected_yield(rows, ["greedy"] * rows)[0] > 2 > 1.1 > gate.expected_yield(rows, ["lossless"] * 2)[0]


def test_a_batch_mixing_kinds_expects_the_mean_of_its_rows_yields():
    """One forward for greedy and sampled rows together: the gate expects a speculative step to yield its rows'
    kinds' yields, row for row: speculation pays for a batch of mostly greedy rows, not for one of mostly
    sampled rows, and a kind's yield is learnt from its own rows' tokens in a mixed batch."""
    rows, verified = 4, 3
    yields = {"greedy": 2.6, "lossless": 1.0}
    gate = SpeculationGate()
    mixes = {"greedy": ["greedy"] * 3 + ["lossless"], "sampled": ["greedy"] + ["lossless"] * 3}
    speculated = dict.fromkeys(mixes, 0)
    for step in range(3000):
        name = ("greedy", "sampled")[step % 2]
        kinds = mixes[name]
        spec = gate.speculate(rows, kinds)
        row_tokens = [yields[k] if spec else 1.0 for k in kinds]
        gate.record(rows, spec, sum(row_tokens), _forward_seconds(rows * verified if spec else rows),
                    rows * verified if spec else rows, None, kinds, row_tokens)
        speculated[name] += spec
    # mostly greedy: a = 2.2 a row, 1.22x plain; mostly sampled: a = 1.4, 0.78x
    assert speculated["greedy"] > 1400 and speculated["sampled"] < 150, speculated
    greedy, sampled = gate.expected_yield(1, ["greedy"])[0], gate.expected_yield(1, ["lossless"])[0]
    assert greedy == pytest.approx(2.6, rel=0.01) and sampled == pytest.approx(1.0, rel=0.01)
    assert gate.expected_yield(rows, mixes["greedy"]) == pytest.approx(((3 * 2.6 + 1.0) / 4, 3.0), rel=0.01)
    assert gate.tokens_per_row == pytest.approx(gate.summary()["tokens_per_row"])
    assert set(gate.summary()["tokens_per_row_by_kind"]) == {"greedy", "lossless"}


def test_a_kind_new_to_the_gate_is_speculated_on_until_it_has_yielded_warmup_steps():
    gate = SpeculationGate(warmup=2)
    for _ in range(6):  # greedy rows whose drafts never pay: the gate turns speculation off for them
        spec = gate.speculate(1, ["greedy"])
        gate.record(1, spec, 1.0, _forward_seconds(5 if spec else 1), 5 if spec else 1, None, ["greedy"], [1.0])
    assert not gate.speculate(1, ["greedy"])
    assert gate.speculate(2, ["greedy", "typical"])  # a typical row: its yield is not known yet
    for bad in (["greedy"], ["greedy", "greedy", "greedy"]):
        with pytest.raises(ValueError, match=f"kinds names {len(bad)} rows for a batch of 2"):
            gate.speculate(2, bad)
    with pytest.raises(ValueError, match="kinds need row_tokens"):
        gate.record(2, True, 3.0, 0.1, 6, None, ["greedy", "typical"])


def test_one_slow_step_does_not_turn_speculation_off():
    """A 1 s hiccup among 0.13 s speculative steps (batch 16, where speculating is 1.23x plain): as a
    moving average it kept speculation off for hundreds of steps, probes being rare while it is off."""
    rows, verified, tokens = 16, 2, 1.6
    seconds = {rows: 0.100, rows * verified: 0.130}
    gate = SpeculationGate()

    def step(hiccup=False):
        spec = gate.speculate(rows)
        gate.record(rows, spec, rows * (tokens if spec else 1), 1.0 if hiccup and spec else
                    seconds[rows * verified if spec else rows], rows * (verified if spec else 1))
        return spec

    assert sum(step() for _ in range(50)) > 40
    assert step(hiccup=True)
    assert all(step() for _ in range(20))


def test_one_slow_first_plain_step_does_not_turn_speculation_on_for_good():
    """Batch 8, where speculating is 1.9x slower per token: the gate's one plain step after warm-up, 3x slow
    (another process on the cores), was its only sample of t(8), and it speculated on every later step."""
    rows, verified, tokens = 8, 5, 1.6
    gate, first = SpeculationGate(), [True]

    def step():
        spec = gate.speculate(rows)
        seconds = linear_time(rows * (verified if spec else 1))
        if not spec and first:
            seconds, first[:] = seconds * 3, []
        gate.record(rows, spec, rows * (tokens if spec else 1), seconds, rows * (verified if spec else 1))
        return spec

    choices = [step() for _ in range(200)]
    assert sum(choices[20:]) < 10, sum(choices[20:])


def test_two_slow_first_plain_steps_do_not_turn_speculation_on_for_good():
    """Both plain steps measuring t(8) were slow (another process on the cores): the gate then speculated on every
    later step, 1.9x slower per token, and no plain step measured t(8) again. Checks (plain steps taken while
    speculation is on) measure it again and outvote the two."""
    rows, verified, tokens = 8, 5, 1.6
    gate, slow = SpeculationGate(), [2]

    def step():
        spec = gate.speculate(rows)
        seconds = linear_time(rows * (verified if spec else 1))
        if not spec and slow[0]:
            seconds, slow[0] = seconds * 3, slow[0] - 1
        gate.record(rows, spec, rows * (tokens if spec else 1), seconds, rows * (verified if spec else 1))
        return spec

    choices = [step() for _ in range(600)]
    assert not slow[0] and gate.checks > 0
    assert sum(choices[-200:]) < 20, sum(choices[-200:])


def test_one_slow_first_proposing_time_at_a_new_batch_size_does_not_turn_speculation_off_there():
    """A range of batch sizes priced its speculative steps with its own proposing times alone: its first one slow,
    speculation went off there, and the probes (steps after plain ones) recorded none to outvote it."""
    def t(n):
        return 0.010 + 0.001 * n  # 3 tokens of 5 verified a row: speculating pays about 2x at 1 and 8 rows

    gate, after_plain, slow, eight = SpeculationGate(), False, True, []
    for step in range(1040):
        rows = 1 if step < 40 else 8
        spec = gate.speculate(rows)
        proposing = None if not spec or after_plain else 0.002
        if proposing is not None and rows == 8 and slow:
            proposing, slow = proposing + 0.2, False
        gate.record(rows, spec, rows * (3 if spec else 1), t(rows * (5 if spec else 1)), rows * (5 if spec else 1),
                    proposing)
        after_plain = not spec
        if rows == 8:
            eight.append(spec)
    assert not slow and sum(eight[-500:]) > 450, sum(eight[-500:])


def test_very_slow_plain_steps_are_checked_within_a_few_dozen_steps():
    """The check waited for credit worth the t(B) believed, the very value slow samples inflated: 2 s slow plain
    steps kept a batch of 8 speculating (at 0.72x plain's speed) for a thousand steps."""
    rows, verified, tokens = 8, 5, 1.6
    gate, slow = SpeculationGate(), [2]
    choices = []
    for _ in range(300):
        spec = gate.speculate(rows)
        seconds = linear_time(rows * (verified if spec else 1))
        if not spec and slow[0]:
            seconds, slow[0] = seconds + 2.0, slow[0] - 1
        gate.record(rows, spec, rows * (tokens if spec else 1), seconds, rows * (verified if spec else 1))
        choices.append(spec)
    assert not slow[0] and sum(choices[-150:]) < 10, sum(choices[-150:])


def test_each_batch_size_range_pays_for_its_own_checks():
    """One credit for checks, spent at whichever batch size came first: in a server whose batches went between 1
    and 12 rows every check landed on one row, and t(12), two slow samples, was never measured again."""
    import random

    gate, slow, rng = SpeculationGate(), [2], random.Random(0)
    late = []
    for step in range(1500):
        rows = rng.choice((1, 12))
        spec = gate.speculate(rows)
        verified = rows * (5 if spec else 1)
        seconds = linear_time(verified)
        if rows == 12 and not spec and slow[0]:
            seconds, slow[0] = seconds + 0.4, slow[0] - 1
        gate.record(rows, spec, rows * (1.6 if spec else 1), seconds, verified)
        if step >= 1000 and rows == 12:
            late.append(spec)  # 12 rows: 1.6 tokens in 0.28 s against 1 in 0.088 (1 row: 0.06 against 0.044)
    assert not slow[0] and sum(late) < 0.1 * len(late), (sum(late), len(late))


def test_checks_never_take_every_step():
    gate = SpeculationGate(probe_budget=0.9, warmup=1)
    choices = run(gate, batch=1, steps=100, tokens_per_row=3.0)  # a check's credit earned in one step
    assert choices[10:].count(True) >= 40


def test_checks_take_about_the_probe_budget_where_speculation_pays():
    gate = SpeculationGate(warmup=1)
    choices = run(gate, batch=1, steps=600, tokens_per_row=2.0)  # 2 tokens in 0.060 s against 1 in 0.044
    spent = gate.checks * linear_time(1) / (choices.count(True) * linear_time(5) + gate.checks * linear_time(1))
    assert choices[3:].count(False) == gate.checks and 0.01 < spent <= 0.021, (gate.checks, spent)


def test_proposing_is_priced_apart_from_the_forward():
    """A draft model's k forwards cost the same whatever the verified forward's size: a lone row's speculative
    step, its drafting counted in the time of its 5-token forward, priced the range a batch of 8's plain step
    reads (5 to 8 tokens) at nearly twice its time. The table holds the forward's time; drafting is priced
    beside it, per range of batch sizes, on the speculative side."""
    gate, drafting = SpeculationGate(warmup=2), 0.05
    choices = []
    for _ in range(60):
        spec = gate.speculate(1)
        verified = 5 if spec else 1
        gate.record(1, spec, 1.6 if spec else 1, linear_time(verified), verified, drafting if spec else None)
        choices.append(spec)
    assert gate.step_seconds(5) == pytest.approx(linear_time(5))  # the forward's time alone
    assert gate.step_seconds(8) == pytest.approx(linear_time(8))  # what a batch of 8's plain step reads
    assert gate.summary()["proposing_seconds"] == pytest.approx(drafting)
    assert sum(choices[4:]) < 6  # 1.6 tokens in 0.11 s against 1 in 0.044: plain, but for a probe or two
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="proposing None or finite >= 0"):
            gate.record(1, True, 1, 0.1, 5, bad)
        # a NaN count or time: kept for good, no comparison held, and the gate speculated on its probes only
        for tokens, seconds in ((bad, 0.1), (1, bad)):
            with pytest.raises(ValueError, match="finite tokens >= 0 and seconds > 0"):
                gate.record(1, True, tokens, seconds, 5)


def test_one_slow_proposing_step_does_not_turn_speculation_off():
    """Proposing's cost as a moving average set by the first speculative step: one slow one (0.1 s among 1 ms ones)
    kept speculation off for the rest of a call, the probes that would have corrected it priced with it. A median
    of the last ones outvotes it, as for the step times."""
    rows, gate = 4, SpeculationGate()
    choices = []
    for step in range(300):
        spec = gate.speculate(rows)
        verified = rows * (5 if spec else 1)
        gate.record(rows, spec, rows * (2.5 if spec else 1), linear_time(verified), verified,
                    (0.1 if step == 0 else 0.001) if spec else None)
        choices.append(spec)
    assert sum(choices[-100:]) > 90, sum(choices[-100:])  # 2.5 tokens in 0.121 s against 1 in 0.056: it pays


def test_a_draft_models_catching_up_after_plain_steps_is_no_proposing_time(model):
    """After plain steps a draft model's drafting also feeds it their tokens: not a proposing time to price steps
    with. A proposer that keeps up without them (the heads, lookup) records its proposing time after them too."""
    from medusa_infer.proposers import LayerSkipProposer

    ids, mask = left_pad([[5, 6, 7, 8, 5, 6, 7], [9, 10, 9, 10, 9]], 0)
    for proposer, catches_up in ((LayerSkipProposer(model, num_layers=1), True),
                                 (build_proposer("lookup", model), False)):
        gate = Forced(lambda batch, turn=iter([True, False, False, True, True] * 10): next(turn))
        stream(model, ids, mask, max_new_tokens=20, eos_token_id=[], proposer=proposer,
               speculation_gate=gate).result()
        taken = [(spec, value) for (_, spec, _, _), value in zip(gate.records, gate.proposing)]
        assert all(value is None for spec, value in taken if not spec)
        after_plain = [value for (spec, value), (before, _) in zip(taken[1:], taken) if spec and not before]
        after_speculative = [value for (spec, value), (before, _) in zip(taken[1:], taken) if spec and before]
        assert after_plain and after_speculative and all(value is not None for value in after_speculative)
        assert all((value is None) == catches_up for value in after_plain), (proposer, after_plain)


def test_a_step_with_no_room_for_a_draft_is_plain_and_asks_the_gate_nothing(model):
    """Every row's last token: the step can verify the root alone. Asked, a gate due a probe spent it on that step
    and learnt that speculating yields one token for one verified."""
    ids, mask = left_pad([[5, 6, 7, 8, 5, 6, 7], [9, 10, 9, 10, 9], [5, 6, 5, 6], [7, 8, 9]], 0)
    gate = Forced(lambda batch: True)
    out = stream(model, ids, mask, max_new_tokens=2, eos_token_id=[], speculation_gate=gate).result()
    assert [len(t) for t in out.new_tokens] == [2, 2, 2, 2]
    assert gate.asked == [] and gate.records == [(4, False, 4, 4)]
    assert gate.speculative_steps == 0 and gate.verified_per_row == 1.0


def test_a_draft_size_between_measured_ones_is_interpolated():
    """Drafts of 9 tokens on every other step, the root alone on the others (a plain rung, lookup rows
    without a match): the average forward size falls in a range no step verifies, and the gate took
    every step as the one to measure it (speculating on 2000 of 2000 at 5x the cost for 1.25x the tokens)."""
    rows, gate, speculated = 4, SpeculationGate(), 0
    for step in range(2000):
        spec = gate.speculate(rows)
        per_row = (9, 1)[step % 2] if spec else 1
        gate.record(rows, spec, rows * (1.5 if per_row > 1 else 1.0), 0.001 * rows * per_row, rows * per_row)
        speculated += spec
    assert speculated < 100, speculated


def test_a_slow_small_step_does_not_price_a_larger_forward_below_it():
    """Past the largest size measured a forward costs at least that size's time: one slow 3-token step
    and faster 5-token ones extended a falling segment, down to 1e-9 s, and a batch whose drafts were
    never accepted speculated on that price. Sizes measured keep their own times."""
    gate = SpeculationGate(warmup=1)
    gate.record(1, True, 1, 0.030, 3)
    gate.record(1, False, 1, 0.010, 1)
    gate.record(1, False, 1, 0.010, 1)
    for _ in range(4):
        gate.record(1, True, 1, 0.020, 5)  # no draft ever accepted: 1 token a step
    gate.record(2, False, 2, 0.011, 2)
    gate.record(2, False, 2, 0.011, 2)
    assert [gate.step_seconds(n) for n in (1, 2, 3, 5, 8)] == pytest.approx([0.010, 0.011, 0.030, 0.020, 0.020])
    assert not gate.speculate(2)
    # below the smallest size measured likewise: 8-token steps, 12-token ones, then plain 5-row steps, whose
    # range (5-8) the 8-token ones share: the segment through both ranges' average sizes went below zero
    gate = SpeculationGate(warmup=1)
    for _ in range(4):
        gate.record(1, True, 1, 0.010, 8)
        gate.record(1, True, 1, 0.030, 12)
    gate.record(5, False, 5, 0.009, 5)
    gate.record(5, False, 5, 0.009, 5)
    assert gate.step_seconds(5) >= 0.009


def test_each_batch_size_range_has_its_own_yield():
    """The adaptive fallback fits a 16-node tree at batch 1 and a 2-token step at batch 12, both paying:
    with one yield for every batch size, a lone request's steps priced batch 12 at 12 x 17 tokens and
    the gate took plain steps where speculating measured 1.39x."""

    def seconds(n):  # flat up to 16 tokens, then linear: a GPU-like forward
        return 0.02 * max(1.0, n / 16)

    gate = SpeculationGate()
    # rows -> (verified per row, emitted per row) when speculating; a burst of 32 rows on a bigger tree
    # measures the large forward sizes too
    shapes = {1: (17, 3.0), 12: (2, 1.5), 32: (17, 3.0)}

    def step(rows):
        spec = gate.speculate(rows)
        verified, emitted = shapes[rows] if spec else (1, 1.0)
        gate.record(rows, spec, rows * emitted, seconds(rows * verified), rows * verified)
        return spec

    for rows in (1, 12, 32):
        for _ in range(30):
            step(rows)
    plain = []
    for _ in range(5):
        for _ in range(60):
            step(1)
        checks = gate.checks
        plain.append(sum(not step(12) for _ in range(60)) - (gate.checks - checks))  # checks of t(12) aside
    assert sum(plain) < 10 and gate.checks < 25, (plain, gate.checks)


def test_the_engine_gates_greedy_and_sampled_rows_in_one_batch_by_their_rules(model):
    """A greedy and a sampled request share a batch, one forward a step: the gate is asked once a step for
    both rows, told each row's acceptance rule, and learns each rule's tokens from its own row."""
    def key(sampling, seed=None):
        return Request([5], sampling, StopConfig(3, (), ()), lambda update: None, seed=seed).batch_key

    shared = key(SamplingConfig())
    assert key(SamplingConfig(acceptance="lossless", temperature=0.5, top_p=0.9)) == shared
    assert key(SamplingConfig(acceptance="typical", temperature=0.7)) == shared == key(SamplingConfig(), seed=4)
    with serve(model, "medusa") as (server, engine):
        assert engine._gate_for(shared) is engine.gate
        assert engine._gate_for(("seeded", 3)) is None
        engine.gate = gate = Forced(lambda batch: True)  # a gate put in its place is the one asked
        assert engine._gate_for(shared) is gate
        with engine.hold():  # both requests admitted in one turn: one batch
            threads = [threading.Thread(target=answer, args=(server,), kwargs=kwargs)
                       for kwargs in ({"temperature": 0}, {"temperature": 1.0})]
            for thread in threads:
                thread.start()
            deadline = time.monotonic() + 30
            while len(engine._waiting) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
        for thread in threads:
            thread.join(60)
    assert gate.asked[0] == 2 and sorted(gate.kinds_asked[0]) == ["greedy", "lossless"]
    assert all(len(kinds) == rows for rows, kinds in zip(gate.asked, gate.kinds_asked))
    assert all(len(row_tokens) == rows and sum(row_tokens) == total
               for (_, row_tokens), (rows, _, total, _) in zip(gate.row_tokens, gate.records))
    assert sum(t for kinds, row_tokens in gate.row_tokens for k, t in zip(kinds, row_tokens) if k == "greedy") == 11


def test_autoregressive_has_no_gate(model):
    with serve(model, "autoregressive") as (_, engine):
        assert engine.gate is None


def test_greedy_batches_are_gated_and_decode_the_same_tokens(model):
    ids, mask = left_pad([[5, 6, 7, 8, 5, 6, 7], [9, 10, 9, 10, 9]], 0)
    free = stream(model, ids, mask, max_new_tokens=30, eos_token_id=[], speculation_gate=False)
    assert free.gate is None
    gate = Forced(lambda batch: False)
    gated = stream(model, ids, mask, max_new_tokens=30, eos_token_id=[], speculation_gate=gate)
    assert torch.equal(gated.result().sequences, free.result().sequences)
    assert gate.asked and set(gate.asked) <= {1, 2} and gated.result().metrics.tau == 1.0
    assert free.result().metrics.tau > 1.0, "the tiny heads should get some drafts accepted when not gated"
    # the defaults: a fresh gate for a greedy batch, none for one row, for sampling, or for plain decoding
    assert isinstance(stream(model, ids, mask, max_new_tokens=4).gate, SpeculationGate)
    assert stream(model, ids[:1], mask[:1], max_new_tokens=4).gate is None
    assert stream(model, ids, mask, max_new_tokens=4, do_sample=True, seed=0).gate is None
    plain = build_proposer("autoregressive", model)
    assert stream(model, ids, mask, max_new_tokens=4, proposer=plain, speculation_gate=True).gate is None


def step_seconds(n):
    return 0.010 + 0.001 * n


def test_each_batch_size_range_prices_its_own_proposing():
    """Proposing for a batch of 8 (a draft model's k forwards of 8 rows, say) costs 50x a lone row's.
    Steps of one row outnumber them 3 to 1, so the proposing times over every batch size are the lone
    row's: priced with those, a batch of 8 speculated at 0.57x plain's speed. Its range's own median
    (once it holds MIN_PROPOSING_SAMPLES) keeps it plain, while one row keeps speculating."""
    gate = SpeculationGate()
    cost = {1: 0.001, 8: 0.05}
    spec_at = {1: [], 8: []}
    for step in range(2000):
        rows = 8 if step % 4 == 3 else 1
        spec = gate.speculate(rows)
        verified = rows * (5 if spec else 1)
        gate.record(rows, spec, rows * (3 if spec else 1), step_seconds(verified), verified,
                    cost[rows] if spec else None)
        spec_at[rows].append(spec)
    # 8 rows: 3 tokens a row in 0.050 + 0.05 s against 1 in 0.018 s; 1 row: 3 in 0.016 s against 1 in 0.011 s
    assert sum(spec_at[1][-400:]) > 380
    assert sum(spec_at[8][-200:]) < 20, sum(spec_at[8][-200:])


def test_a_batch_sizes_range_uses_its_own_proposing_times_from_the_third():
    """MIN_PROPOSING_SAMPLES (3) of a range's own proposing times price its speculative steps."""
    gate = SpeculationGate()
    for _ in range(5):
        gate.record(1, True, 3, step_seconds(5), 5, 0.001)
    for _ in range(2):
        gate.record(8, True, 24, step_seconds(40), 40, 0.05)
    assert gate._proposing_at(8) == 0.001  # two of its own: the median over every size
    gate.record(8, True, 24, step_seconds(40), 40, 0.05)
    assert gate._proposing_at(8) == 0.05  # three: its own


def test_a_ranges_step_time_is_the_median_of_its_last_steps_only():
    """Each range keeps its last TIME_WINDOW steps: slow steps long gone (another process held the cores
    at the start) no longer count, and the table stays bounded in a server that runs for days."""
    gate = SpeculationGate()
    for _ in range(20):
        gate.record(1, False, 1, 1.0, 1)  # slow, early
    for _ in range(TIME_WINDOW):
        gate.record(1, False, 1, 0.011, 1)
    assert gate.step_seconds(1) == 0.011
    assert len(gate._times[0].recent) == TIME_WINDOW


def test_proposing_is_priced_by_the_last_steps_only():
    """Proposing's price is the median of the last TIME_WINDOW speculative steps' (over every batch size and
    per range): slow proposing long ago (a draft model's first, cold forwards) no longer counts."""
    gate = SpeculationGate()
    for _ in range(20):
        gate.record(1, True, 3, step_seconds(5), 5, 0.5)  # slow, early
    for _ in range(TIME_WINDOW):
        gate.record(1, True, 3, step_seconds(5), 5, 0.001)
    assert gate.proposing_seconds == 0.001 and gate._proposing_at(1) == 0.001
    assert len(gate._proposing_all) == len(gate._proposing[0]) == TIME_WINDOW


def test_a_batch_size_sharing_its_range_with_larger_ones_is_priced_at_its_own_steps():
    """A review's simulation: batches of 5 and 6 rows share the 5-8 range, whose one point (its median step) was
    at 6 rows, so plain steps of 5 rows were priced at no less than 6's: the gate kept speculating at 5 rows where
    that was 15% slower per token (at 98% of those steps on the tests' CPU cost line)."""
    from medusa_infer.speculation_gate import SpeculationGate

    t = lambda n: 0.0198 + 0.00974 * n  # noqa: E731
    gate, speculated_at_5 = SpeculationGate(), []
    for step in range(3000):
        rows = (5, 6, 6)[step % 3]
        speculate = gate.speculate(rows)
        if speculate:
            gate.record(rows, True, 1.45 * rows, t(2 * rows), 2 * rows)
        else:
            gate.record(rows, False, rows, t(rows), rows)
        if rows == 5 and step >= 1500:
            speculated_at_5.append(speculate)
    assert gate.step_seconds(5) == pytest.approx(t(5), abs=1e-9)
    assert sum(speculated_at_5) / len(speculated_at_5) < 0.5
