"""medusa-serve's command line: its flags reach the app and engine, the name served, the warnings, the loaders'
settings; and the test helper ``metric_value``."""

from __future__ import annotations

import socket
import types

import pytest

from medusa_infer.model import MedusaModel
from medusa_infer.serving import cli
from medusa_infer.serving.testing import metric_value, word_tokenizer


def free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        return probe.getsockname()[1]


def test_max_prefill_tokens_below_one_is_refused(capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(["--method", "lookup", "--max-prefill-tokens", "0"])
    assert "--max-prefill-tokens must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    # torch.set_num_threads failed with a traceback once the port was bound
    (["--threads", "99999999999999999999"], "--threads must be at most 4096, got 99999999999999999999"),
    # an empty --host listened on every interface, without a word
    (["--host", ""], "--host is empty (''): give an address of this machine, such as 127.0.0.1 (the default), or "
                     "0.0.0.0 to listen on every interface on purpose"),
    (["--host", " "], "--host is empty (' ')"),
    # empty names read as not given: plain decoding, the default model, the name served left as it was
    (["--heads", ""], "--heads is empty (''): name a heads folder or Hub repo"),
    (["--model", ""], "--model is empty (''): name the base model"),
    (["--served-model-name", ""], "--served-model-name is empty (''): name the model id clients send"),
    # a key no HTTP client sends as it is (headers are read as latin-1): every request was refused, without a word
    (["--api-key", "clé"], "--api-key must be printable ASCII (it travels in an HTTP header)"),
    (["--api-key", "a\x07b"], "--api-key must be printable ASCII"),
])
def test_out_of_range_and_empty_settings_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_args(["--method", "lookup", *argv])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_a_non_ascii_api_key_from_the_environment_is_refused(monkeypatch, capsys):
    monkeypatch.setenv(cli.API_KEY_ENV, "clé")
    with pytest.raises(SystemExit):
        cli.parse_args(["--method", "lookup"])
    assert f"${cli.API_KEY_ENV} must be printable ASCII" in capsys.readouterr().err


def test_typical_acceptance_is_refused_where_nothing_is_drafted(capsys):
    """Without heads the server decodes plainly: --acceptance typical accepted nothing, and made every sampled
    request with top_p or top_k a 400."""
    with pytest.raises(SystemExit):
        cli.parse_args(["--acceptance", "typical"])
    assert "--method autoregressive drafts none" in capsys.readouterr().err
    assert cli.parse_args(["--method", "lookup", "--acceptance", "typical"]).acceptance == "typical"


def test_the_servers_flags_reach_the_app_and_its_engine(monkeypatch):
    """medusa-serve's own settings (--max-prefill-tokens, --speculation-gate, --acceptance, the limits) reach
    build_app and the engine it builds: a flag dropped on the way is taken and silently ignored."""
    from medusa_infer.serving import app as app_module
    from tiny import tiny_model

    class Interrupted:
        def run(self, sockets):
            raise KeyboardInterrupt

    model = MedusaModel.without_heads(tiny_model("llama"), word_tokenizer())
    built, real = [], cli.build_app

    def spy(*args, **kwargs):
        built.append((args, kwargs, real(*args, **kwargs)))
        return built[-1][2]

    monkeypatch.setattr(cli, "load_model", lambda args: model)
    monkeypatch.setattr(cli, "warm_up", lambda *args: None)
    monkeypatch.setattr(cli, "build_app", spy)
    monkeypatch.setattr(app_module, "uvicorn_server", lambda *args, **kwargs: Interrupted())
    assert cli.main(["--method", "lookup", "--port", str(free_port()), "--max-prefill-tokens", "300",
                     "--speculation-gate", "off", "--acceptance", "typical", "--max-batch", "3", "--max-queue", "5",
                     "--request-timeout", "7", "--api-key", "k", "--served-model-name", "mine"]) == 130
    (args, kwargs, (_, engine)), = built
    assert args[1:3] == ("mine", "lookup")
    assert kwargs == {"options": kwargs["options"], "api_key": "k", "max_batch": 3, "max_queue": 5,
                      "max_prefill_tokens": 300, "request_timeout": 7.0, "acceptance": "typical",
                      "speculation_gate": False}
    assert engine.max_prefill_tokens == 300 and engine.gate is None  # off: no gate, speculating every step


def test_the_draft_schedule_reaches_the_served_drafts():
    """medusa-serve had no --draft-schedule, and its --draft-tokens help said "tokens a step": a draft or
    layerskip server's k grew from it to 16 while its drafts were accepted (trees of 3, 5, ... 13 nodes for 2)."""
    import httpx

    from medusa_infer.serving.testing import serve
    from tiny import word_medusa

    model = word_medusa()
    with pytest.raises(SystemExit):
        cli.parse_args(["--method", "lookup", "--draft-schedule", "constant"])  # lookup has no schedule
    for schedule, grows in (("constant", False), ("heuristic", True)):
        args = cli.parse_args(["--method", "layerskip", "--layerskip-layers", "2", "--draft-tokens", "2",
                               "--draft-schedule", schedule])  # (the tiny model's 2 layers: drafts always agree)
        with serve(model, args.method, options=args, speculation_gate=False) as (server, engine):
            sizes, step = [], engine._step

            def counted(running, step=step, sizes=sizes):
                step(running)
                sizes.append(running.batch.metrics.recent_tree_sizes[-1])

            engine._step = counted
            reply = httpx.post(server.base_url + "/v1/completions", timeout=60, json=dict(
                model="tiny", prompt="the cat", max_tokens=30, temperature=0, ignore_eos=True)).json()
        assert reply["usage"]["completion_tokens"] == 30
        assert (sizes[0], max(sizes) > 3) == (3, grows), sizes  # the root and k = 2 drafts, then k kept or grown


def test_the_served_model_name_is_the_one_asked_for():
    """Clients must send the name served (another gets a 404): --served-model-name first, then --model as given
    (not the path a default-model name was loaded from), then the loaded model's own name."""
    model = types.SimpleNamespace(base_model=types.SimpleNamespace(name_or_path="/cache/models/smollm2"))
    given = cli.parse_args(["--method", "lookup", "--model", "smollm2-135m-instruct", "--served-model-name", "mine"])
    assert cli.served_name(given, model) == "mine"
    assert cli.served_name(cli.parse_args(["--method", "lookup", "--model", "smollm2-135m-instruct"]), model) == \
        "smollm2-135m-instruct"
    assert cli.served_name(cli.parse_args(["--method", "lookup"]), model) == "/cache/models/smollm2"


@pytest.mark.parametrize("host, warned", [("0.0.0.0", True), ("10.1.2.3", True), ("127.0.0.1", False),
                                          ("localhost", False)])
def test_listening_beyond_loopback_without_an_api_key_is_warned(host, warned, caplog, monkeypatch):
    def stop(args):
        raise ValueError("stopped while loading")

    monkeypatch.delenv(cli.API_KEY_ENV, raising=False)  # a key the environment gives is a key: no warning
    monkeypatch.setattr(cli, "load_model", stop)
    with caplog.at_level("WARNING", logger="medusa_infer.serving"):
        try:
            assert cli.main(["--method", "lookup", "--host", host, "--port", str(free_port())]) == 1
        finally:
            caplog.handler.flush()
    assert ("without --api-key" in caplog.text) == warned, caplog.text


def test_ctrl_c_while_loading_ends_without_a_traceback(monkeypatch, capsys):
    """Ctrl-C while the model loads or warms up (minutes for a large model) printed a 50-line traceback."""
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "load_model", interrupted)
    try:
        assert cli.main(["--method", "lookup", "--port", str(free_port())]) == 130
    except KeyboardInterrupt:  # (escaping, it would stop the whole test session)
        pytest.fail("Ctrl-C escaped main() as a traceback")
    assert "Traceback" not in capsys.readouterr().err


def test_threads_sets_torchs_threads_before_loading(monkeypatch):
    import torch

    seen = []

    def loading(args):
        seen.append(torch.get_num_threads())
        raise ValueError("stopped while loading")

    monkeypatch.setattr(cli, "load_model", loading)
    assert cli.main(["--method", "lookup", "--threads", "3", "--port", str(free_port())]) == 1
    assert seen == [3]


def test_load_model_leaves_a_datastore_unread_unless_the_method_drafts_from_it(tmp_path):
    """As medusa-generate: a heads folder whose datastore does not load serves --method medusa (which drafts none
    from it) and --no-datastore; only lookup drafts (medusa with --lookup-tokens) read it."""
    from tiny import tiny_model

    tokenizer = word_tokenizer()
    tiny_model("llama", vocab_size=len(tokenizer)).save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    MedusaModel.from_base(tiny_model("llama", vocab_size=len(tokenizer))).save_pretrained(tmp_path / "heads")
    (tmp_path / "heads" / "datastore.safetensors").write_bytes(b"cut short")
    given = ["--model", str(tmp_path / "base"), "--heads", str(tmp_path / "heads")]
    assert cli.load_model(cli.parse_args(given)).datastore is None
    assert cli.load_model(cli.parse_args([*given, "--lookup-tokens", "2", "--no-datastore"])).datastore is None
    with pytest.raises(ValueError, match="is not a readable datastore"):
        cli.load_model(cli.parse_args([*given, "--lookup-tokens", "2"]))


def test_trust_remote_code_reaches_the_model_and_tokenizer_loaders(monkeypatch):
    import medusa_infer.models
    from tiny import tiny_model

    asked = []

    def base_model(name, trust_remote_code=False):
        asked.append(("model", name, trust_remote_code))
        return tiny_model("llama")

    def tokenizer(name, trust_remote_code=False):
        asked.append(("tokenizer", name, trust_remote_code))
        return word_tokenizer()

    monkeypatch.setattr(medusa_infer.models, "load_base_model", base_model)
    monkeypatch.setattr(medusa_infer.models, "load_tokenizer", tokenizer)
    cli.load_model(cli.parse_args(["--method", "lookup", "--model", "org/custom", "--trust-remote-code"]))
    cli.load_model(cli.parse_args(["--method", "lookup", "--model", "org/custom"]))
    assert asked == [("model", "org/custom", True), ("tokenizer", "org/custom", True),
                     ("model", "org/custom", False), ("tokenizer", "org/custom", False)]


def test_metric_value_sums_the_samples_whose_labels_match():
    text = "\n".join([
        "# TYPE vllm:request_success_total counter",
        'vllm:request_success_total{finished_reason="stop",model_name="tiny"} 3',
        'vllm:request_success_total{finished_reason="length",model_name="tiny"} 4',
        'vllm:request_success_total{finished_reason="length",model_name="other"} 100',
        "vllm:request_success_totalx 50",
    ])
    assert metric_value(text, "vllm:request_success_total", model_name="tiny") == 7.0
    assert metric_value(text, "vllm:request_success_total", finished_reason="length", model_name="tiny") == 4.0
    assert metric_value(text, "vllm:request_success_total", finished_reason="abort") == 0.0
    assert metric_value(text, "vllm:request_success_total") == 107.0
    # label values as the server writes them: escaped, and a "}" in one ended the labels (every lookup gave 0)
    from medusa_infer.serving.metrics import ServingMetrics

    for name in ("org/m{v2}", 'a"b', "back\\slash", "two\nlines"):
        metrics = ServingMetrics(name)
        metrics.generation_tokens.inc(5)
        assert metric_value(metrics.render(), "vllm:generation_tokens_total", model_name=name) == 5.0, name


def test_lookup_max_tokens_reaches_the_servers_options_and_is_refused_without_the_chain(capsys):
    args = cli.parse_args(["--heads", "h", "--lookup-tokens", "2", "--lookup-max-tokens", "4"])
    assert args.lookup_max_tokens == 4  # the options every batch's proposer is built from
    with pytest.raises(SystemExit):
        cli.parse_args(["--heads", "h", "--lookup-max-tokens", "4"])
    assert "add --lookup-tokens N" in capsys.readouterr().err


def test_lookup_max_tokens_on_heads_without_a_cost_profile_stops_the_server_at_start(monkeypatch, capsys):
    """As medusa-generate and medusa-bench: heads with no cost profile graft chains of --lookup-tokens, and the
    bound was taken and left unused."""
    from tiny import word_medusa

    monkeypatch.setattr(cli, "load_model", lambda args: word_medusa())
    assert cli.main(["--heads", "h", "--lookup-tokens", "2", "--lookup-max-tokens", "4", "--port",
                     str(free_port())]) == 1
    assert "--lookup-max-tokens bounds the lookup chain a cost profile chooses" in capsys.readouterr().err
