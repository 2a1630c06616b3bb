"""Reading and writing heads checkpoints: ``config.json``, ``model.safetensors``, ``README.md``.

A checkpoint folder holds the heads only. With ``shared`` projection the base model's ``lm_head``
is not stored; it comes from the base model named in the config when the heads are loaded. Heads
trained in Medusa-2 mode also have a peft LoRA adapter for the base model in ``ADAPTER_DIR``
inside the folder; ``MedusaModel.from_pretrained`` merges it into the base model.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path, PureWindowsPath
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from medusa_infer.config import FREE_FORM_RECORDS, MedusaConfig, plain_record
from medusa_infer.datastore import DATASTORE_NAME

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
FASTERDECODING_WEIGHTS = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
"""The weights files of the FasterDecoding/Medusa layout (``interop``), which a heads folder must not hold."""
CARD_NAME = "README.md"
ADAPTER_DIR = "adapter"
"""Sub-folder of a heads folder holding the Medusa-2 LoRA adapter, as peft saves it."""
DEFAULT_COMMIT_MESSAGE = "Upload Medusa heads with medusa-forge"


MODEL_WEIGHTS = ("model-*-of-*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin")
"""A model's weights files (sharded, or PyTorch's), which no heads folder holds."""


def foreign_config(directory: Path, layout: str) -> str | None:
    """What ``directory/config.json`` is, where it is not a heads config of ``layout`` ("medusa-forge" or
    "FasterDecoding") that a save may replace: None where there is none or it is one. A base model's
    config (``model_type``) written over leaves that model unloadable, as does one beside a model's
    weights (FasterDecoding's Medusa-2 releases: a whole model whose config has the heads' keys too)."""
    weights = sorted(p.name for pattern in MODEL_WEIGHTS for p in directory.glob(pattern))
    if weights:
        return f"a model's weights ({weights[0]}) and their config.json"
    try:
        data = json.loads((directory / CONFIG_NAME).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        return (f"a config.json this package cannot read ({type(err).__name__}; if it is these heads' own, damaged, "
                "delete it and save again)")
    if not isinstance(data, dict):
        return "a config.json that is not a JSON object"
    model = "model_type" in data or "architectures" in data
    fd = "medusa_num_heads" in data and "medusa_num_layers" in data and not model
    ours = "num_heads" in data and not model and not fd
    if (layout == "FasterDecoding" and fd) or (layout == "medusa-forge" and ours):
        return None
    if fd:
        return "heads in the FasterDecoding layout (their config.json)"
    if ours:
        return "heads saved with save_pretrained (their config.json)"
    if model:
        return f"a model's config.json (model_type {data.get('model_type')!r})"
    return f"a config.json of another kind (keys {sorted(data)[:6]})"


def save_heads(
    directory: str | Path,
    config: MedusaConfig,
    state_dict: dict[str, torch.Tensor],
    base_model_id: str | None = None,
    chat: bool = True,
) -> Path:
    """Write ``config.json``, ``model.safetensors`` and a model card into ``directory``.

    Args:
        directory: created if missing.
        config: the heads' configuration.
        state_dict: the heads' tensors (``MedusaHeads.state_dict()``).
        base_model_id: Hub id for the card's ``base_model`` field (defaults to the config's).
        chat: whether the base model's tokenizer renders chats (the card's example then does).
    """
    directory = heads_path(directory)
    check_heads_target(directory)
    # everything made before anything is written, each file written beside and moved into place (a failure
    # while making the card left a new config.json beside the old weights)
    tensors = {name: t.detach().to("cpu").contiguous().clone() for name, t in state_dict.items()}
    check_finite(tensors, f"the heads to save in {directory}")
    # read back as a load reads it: settings changed after the config was made (a tree deeper than the heads)
    # were saved, and the folder then failed to load
    settings = MedusaConfig.from_dict(config.to_dict()).to_json()
    # the card from the config as written (a NaN there is null: the card showed NaN and inf where config.json held
    # null, until saved again)
    card = model_card(MedusaConfig.from_dict(json.loads(settings)), base_model_id, chat)
    directory.mkdir(parents=True, exist_ok=True)
    # One metadata key: safetensors writes the metadata map in random order, and identical heads
    # must give identical bytes (the Hub skips unchanged files by their hash).
    write_in_place(directory, [(WEIGHTS_NAME, lambda path: save_file(tensors, str(path), metadata={"format": "pt"})),
                               (CONFIG_NAME, lambda path: path.write_text(settings, encoding="utf-8")),
                               (CARD_NAME, lambda path: path.write_text(card, encoding="utf-8"))])
    return directory


FULL_DISK_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
TORCH_WRITE_FAILURES = ("inline_container", "PytorchStreamWriter", "iostream error", "file write failed")
"""What ``torch.save`` says (a ``RuntimeError``) when a write fails, a full disk's included."""


def _failed_errno(err: BaseException) -> int | None:
    """The system's error number ``err`` carries: an ``OSError``'s, the one safetensors writes into its message
    ("I/O error: No space left on device (os error 28)"), ENOSPC for torch.save's failed write (it says no more)."""
    if isinstance(err, OSError):
        return err.errno
    if isinstance(err, SafetensorError):
        found = re.search(r"\(os error (\d+)\)", str(err))
        return int(found.group(1)) if found else None
    if isinstance(err, RuntimeError) and any(mark in str(err) for mark in TORCH_WRITE_FAILURES):
        return errno.ENOSPC
    return None


def write_failure(err: BaseException) -> str | None:
    """What to do about ``err`` (or the error it was raised from) where it says that a file could not be written or
    opened for the machine's sake (a full disk, a read-only disk, permissions), not the program's: a clause for the
    error line, None for any other error (whose traceback is the bug report)."""
    cause: BaseException | None = err
    while cause is not None:
        code = _failed_errno(cause)
        if code in FULL_DISK_ERRNOS:
            return "the disk is full (or the file too large for it): free space"
        name = getattr(cause, "filename", None)
        if code == errno.EROFS:
            return f"{name or 'the file'} is on a read-only disk: give a place that can be written"
        if code in (errno.EACCES, errno.EPERM) and name:
            return f"this user may not open {name}: change its permissions, or give another place"
        cause = cause.__cause__
    return None


def write_in_place(directory: Path, files: Sequence[tuple[str, Callable[[Path], Any]]]) -> None:
    """Write each of ``files`` (a name and what writes it to a path) beside its place (``NAME.partial``), then move
    them all in, in order: a write that fails leaves no partial file behind (a copy of the weights stayed) and the
    folder's files as they were (other heads' config.json stayed beside new weights when stopped between). A
    safetensors error, or torch.save's failed write, is an ``OSError`` naming the file (their own types: a
    traceback where OSError is said)."""
    partials = [directory / (name + ".partial") for name, _ in files]
    writing = partials[0]
    try:
        for writing, (_, write) in zip(partials, files):
            write(writing)
        for partial, (name, _) in zip(partials, files):
            os.replace(partial, directory / name)
    except BaseException as err:
        for partial in partials:
            if partial.is_file():
                partial.unlink()
        if isinstance(err, SafetensorError) or isinstance(err, RuntimeError) and write_failure(err):  # (torch.save's)
            raise OSError(f"{writing} could not be written: {str(err).splitlines()[0]}") from err  # (write_failure
            # reads the cause's)
        raise


def heads_path(directory: str | os.PathLike) -> Path:
    """``directory`` as the heads folder to write (``~`` expanded); ``ValueError`` for an empty string (an unset
    variable: the heads were written into the working directory)."""
    if not isinstance(directory, (str, os.PathLike)):  # (pathlib's "expected str, bytes or os.PathLike object")
        raise ValueError(f"the heads folder must be a path (a str or os.PathLike), got {type(directory).__name__}: "
                         f"{directory!r:.60}")
    if not str(directory).strip():
        raise ValueError("the heads folder is an empty string: give a folder path")
    return Path(directory).expanduser()


def first_existing(path: Path) -> Path | None:
    """``path``, or the nearest of its parents that exists (None: none does): a file there means no folder can
    be made at ``path``."""
    return next((p for p in (path, *path.parents) if p.exists()), None)


def check_heads_target(directory: str | Path) -> None:
    """``ValueError`` where ``save_heads`` would refuse ``directory``: it is (or lies under) a file, cannot be
    written by this user, or holds heads in the FasterDecoding layout or another config.json (``foreign_config``).
    For a caller to check before work that ends in a save."""
    directory = heads_path(directory)
    existing = first_existing(directory)
    if existing is not None and not existing.is_dir():  # (the folder itself, or one on its way)
        raise ValueError(f"{existing} is a file, not a folder: save the heads into a folder")
    if existing is not None and not os.access(existing, os.W_OK | os.X_OK):  # (after minutes of calibrating: a
        raise ValueError(f"{existing} cannot be written by this user: save the heads into another folder")  # crash)
    held = [name for name in FASTERDECODING_WEIGHTS if (directory / name).exists()]
    if held:
        raise ValueError(f"{directory} holds heads in the FasterDecoding layout ({held[0]}); saving here would replace "
                         "their config.json: save into another folder")
    other = foreign_config(directory, "medusa-forge")
    if other is not None:
        raise ValueError(f"{directory} holds {other}, which saving heads there would replace: save into another "
                         "folder")


def unreadable_weights(path: Path, err: BaseException | str, what: str = "the file",
                       fix: str = "re-download it or export the heads again") -> ValueError:
    """The error for a weights file that does not read (``err``): a Git LFS pointer (a repository cloned
    without git-lfs) is named as one, anything else as truncated or corrupted."""
    from medusa_infer.models import LFS_POINTER

    try:
        with open(path, "rb") as handle:
            head = handle.read(32)
    except OSError:
        head = b""
    if head.startswith(LFS_POINTER):
        return ValueError(f"{path} is a Git LFS pointer, not the weights (a clone made without git-lfs): run "
                          "`git lfs pull` in its repository, or download the file itself")
    return ValueError(f"{path} could not be read ({err}): {what} is truncated or corrupted; {fix}")


def load_heads_state(directory: str | Path) -> tuple[MedusaConfig, dict[str, torch.Tensor]]:
    """Read a medusa-forge checkpoint folder; corrupted or missing files raise ``ValueError``."""
    directory = Path(directory).expanduser()
    config_path, weights_path = directory / CONFIG_NAME, directory / WEIGHTS_NAME
    for path in (config_path, weights_path):
        if not path.is_file():
            held = [name for name in FASTERDECODING_WEIGHTS if (directory / name).is_file()]
            layout = (f"; it holds {held[0]} of the FasterDecoding layout, whose config.json (medusa_num_heads, "
                      "medusa_num_layers, base_model_name_or_path) is missing or lacks those keys") if held else ""
            if not held and (directory / "heads" / CONFIG_NAME).is_file():  # (train_heads.py's run folder)
                layout = f"; a training run's folder? its heads are in {directory / 'heads'}"
            raise ValueError(f"{path} is missing: {directory} is not a medusa-forge heads checkpoint{layout}")
    try:
        config = MedusaConfig.load(config_path)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{config_path} is not valid JSON ({err}); re-export or re-download it") from err
    try:
        state_dict = load_file(str(weights_path))
    except (SafetensorError, OSError) as err:
        raise unreadable_weights(weights_path, err) from err
    return config, state_dict


def push_folder_to_hub(
    folder: str | Path,
    repo_id: str,
    private: bool | None = None,
    revision: str | None = None,
    token: str | None = None,
    commit_message: str = DEFAULT_COMMIT_MESSAGE,
    retry_hint: str | None = None,
) -> str:
    """Upload a saved heads folder (with its adapter, if any) to the Hub; returns the commit URL.

    An adapter, datastore or FasterDecoding weights file that the repo holds from an earlier upload
    and the folder does not is deleted in the same commit (they would load with these heads).

    Creates ``repo_id`` (``private=None``: the Hub's default visibility) and the ``revision``
    branch when missing. ``private=True`` on a repo that exists and is public is a ``ValueError``
    (nothing is uploaded: the folder may hold a datastore of training conversations). ``token=None``
    uses the locally stored login. A folder that holds no heads (a run folder, a mistyped path) is
    refused before the repo is created; errors of the Hub name the repo and the fix (``ValueError``).
    Heads that would not load after the download (weights cut short, of other heads than config.json's) are
    refused before the repo is created. The uploaded config.json shows the local paths of its training record by
    their last part, as the card does (``_public``); the uploaded card names ``repo_id`` where it says "this repo
    or folder", and a folder without one gets one made from its config (``model_card``); the folder's own files
    are left as they are. ``retry_hint``: how to try again, said where the
    upload fails (default: upload the folder again; ``MedusaModel.push_to_hub`` uploads a temporary folder, gone
    by then, which its error named).
    """
    from huggingface_hub import HfApi, constants

    folder = Path(folder).expanduser()
    again = retry_hint or f"upload {folder} again (push_folder_to_hub)"
    if constants.is_offline_mode():  # (it saved, then failed at the network, naming a temporary folder)
        raise ValueError(f"uploading to {repo_id} needs the Hub, but HF_HUB_OFFLINE is set: unset it and {again}")
    layouts = [name for name in (WEIGHTS_NAME, *FASTERDECODING_WEIGHTS) if (folder / name).is_file()]
    if not (folder / CONFIG_NAME).is_file() or not layouts or foreign_config(
            folder, "medusa-forge" if WEIGHTS_NAME in layouts else "FasterDecoding") is not None:
        raise ValueError(f"{folder} holds no saved heads (a config.json of heads beside their weights): pass the heads "
                         "folder (a run's heads/, or what save_pretrained wrote), not a run folder")
    config = _loadable(folder, WEIGHTS_NAME in layouts)  # (else every download failed to load them)
    with tempfile.TemporaryDirectory() as stage:  # (staged before the repo is made: a failure here is no Hub's)
        published = _published(folder, Path(stage), repo_id, config)
        return _create_and_upload(HfApi(token=token), published, folder, repo_id, private, revision, token,
                                  commit_message, again)


def _create_and_upload(api: Any, published: Path, folder: Path, repo_id: str, private: bool | None,
                       revision: str | None, token: str | None, commit_message: str, again: str) -> str:
    """``push_folder_to_hub``'s Hub part: the repo and branch made where missing, ``published`` uploaded;
    the Hub's errors named with the repo and the fix (``ValueError``)."""
    try:
        repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id  # (a bare name: the user's)
        _name_card(published / CARD_NAME, repo_id, revision)  # (as created: the bare name did not load)
        if private:  # create_repo leaves an existing repo as it is
            check_private_upload(repo_id, token)
        if revision is not None:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        return _upload(api, published, repo_id, revision, commit_message)
    except ValueError:  # (ours, saying what to do: a public repo for a private upload)
        raise
    except Exception as err:  # the Hub's (HTTP, network): a traceback after hours of training said nothing to do
        raise ValueError(f"uploading to the Hub repo {repo_id} failed ({type(err).__name__}: "
                         f"{str(err).splitlines()[0] if str(err) else err!r}): check the network and that the token "
                         f"may write there (`hf auth login` with a write token), then {again}") from err


def _loadable(folder: Path, ours: bool) -> MedusaConfig | None:
    """The config of the heads ``folder`` holds, read as a download of it would be; ``ValueError`` naming the file
    where they would not load (weights cut short or of other heads than config.json's: the upload went through,
    and every download failed). ``ours``: saved by ``save_heads``, else in the FasterDecoding layout, whose shared
    heads may need the base model's sizes to be read (None then: they are read where they are loaded)."""
    if not ours:
        from medusa_infer.interop import SizesUnknown, read_medusa_layout  # (interop reads this module)

        try:
            return read_medusa_layout(folder)[0]
        except SizesUnknown:
            return None
        except ValueError as err:
            raise ValueError(f"{err}. Nothing was uploaded") from err
    from medusa_infer.heads import MedusaHeads

    config, state = load_heads_state(folder)
    with torch.device("meta"):  # (the shapes only: no memory for a large vocabulary's projections)
        expected = MedusaHeads(config).state_dict()
    check_state_dict(expected, state, str(folder / WEIGHTS_NAME), "Nothing was uploaded: save the heads again "
                     "(save_pretrained, or export them again) and upload that folder.")
    return config


PLACEHOLDER = "<this repo or folder>"
"""What a saved card's usage names the heads by: an upload's card names its repo there."""


def _published(folder: Path, stage: Path, repo_id: str, config: MedusaConfig | None) -> Path:
    """``stage`` made a copy of ``folder`` by links, whose card names ``repo_id`` where it says ``PLACEHOLDER``
    (made from ``config`` by ``model_card`` where the folder has none and ``config`` is known: the repo's page
    would say nothing of its base model or figures) and whose config.json shows local paths of the training
    record (a home folder, a user's name) by their last part."""
    settings = json.loads((folder / CONFIG_NAME).read_text(encoding="utf-8"))
    nonfinite: list[str] = []  # a folder an earlier release wrote NaN into: published as strict JSON, null there
    plain = {key: plain_record(value, key, nonfinite) if key in FREE_FORM_RECORDS and isinstance(value, dict) else value
             for key, value in settings.items()}
    training = settings.get("training")
    for path in folder.rglob("*"):  # (files linked one by one: a linked folder's files may not be walked)
        if path.is_file():
            (stage / path.relative_to(folder)).parent.mkdir(parents=True, exist_ok=True)
            try:
                (stage / path.relative_to(folder)).symlink_to(path.resolve())
            except OSError:  # no links here (Windows without developer mode, some file systems): a copy
                shutil.copy2(path, stage / path.relative_to(folder))
    if nonfinite or (isinstance(training, dict) and _public(training) != training):
        (stage / CONFIG_NAME).unlink()
        published = {**plain, "training": _public(plain["training"])} if isinstance(training, dict) else plain
        (stage / CONFIG_NAME).write_text(json.dumps(published, indent=2) + "\n", encoding="utf-8")
    card = (folder / CARD_NAME).read_text(encoding="utf-8", errors="replace") if (folder / CARD_NAME).is_file() \
        else model_card(config) if config is not None else None
    if card is not None:  # (a copy of its own: the repo's full id is named in it once the repo is made)
        (stage / CARD_NAME).unlink(missing_ok=True)
        (stage / CARD_NAME).write_text(card, encoding="utf-8")
    return stage


def _name_card(card: Path, repo_id: str, revision: str | None) -> None:
    """The staged ``card`` naming ``repo_id`` (and the branch ``revision``) where it says ``PLACEHOLDER``: the Python
    usage loads that branch; the command lines, which load a repo's main branch, a download of it."""
    if not card.is_file():
        return
    text = card.read_text(encoding="utf-8")
    if revision is not None:
        text = text.replace(f'from_pretrained("{PLACEHOLDER}"',
                            f"from_pretrained({json.dumps(repo_id)}, revision={json.dumps(revision)}")
        text = text.replace(f'medusa-generate --heads "{PLACEHOLDER}"',
                            f"# the heads are on the branch {revision}: hf download {repo_id} --revision {revision} "
                            f'--local-dir medusa-heads\nmedusa-generate --heads "{PLACEHOLDER}"', 1)
        text = text.replace(f'--heads "{PLACEHOLDER}"', '--heads "medusa-heads"')
    card.write_text(text.replace(PLACEHOLDER, repo_id), encoding="utf-8")


def _upload(api: Any, folder: Path, repo_id: str, revision: str | None, commit_message: str) -> str:
    """Upload ``folder`` into ``repo_id``, deleting what an earlier upload left that the folder does not hold."""
    # Files an earlier upload left that change how the repo loads (another adapter would be merged
    # under these heads, another datastore searched, other layout's weights read instead) are deleted
    # in the same commit; files the folder holds are uploaded, not deleted.
    # (an upload of the FasterDecoding layout over ours left our weights, which loaded first, and card)
    stale = [ADAPTER_DIR + "/*", DATASTORE_NAME, *FASTERDECODING_WEIGHTS, WEIGHTS_NAME, CARD_NAME]
    info = api.upload_folder(  # (a save cut short leaves *.partial files: not the heads')
        repo_id=repo_id, folder_path=str(folder), revision=revision, commit_message=commit_message,
        delete_patterns=[*stale, "*.partial", "*.partial/*"], ignore_patterns=["*.partial", "*.partial/*"],
    )
    return str(getattr(info, "commit_url", info))


def check_private_upload(repo_id: str, token: str | None = None) -> None:
    """``ValueError`` where ``repo_id`` exists on the Hub and is public: a private upload would land there
    (``create_repo`` leaves an existing repo's visibility as it is). A repo not there yet passes; other
    Hub errors (unreachable, no access) are raised as they are."""
    from huggingface_hub import HfApi
    from huggingface_hub.utils import RepositoryNotFoundError

    try:
        public = not HfApi(token=token).repo_info(repo_id).private
    except RepositoryNotFoundError:
        return
    if public:
        raise ValueError(f"{repo_id} exists and is public, and the upload was asked to be private: nothing was "
                         f"uploaded; make the repo private first (huggingface_hub.update_repo_settings("
                         f"{repo_id!r}, private=True), or its settings page) or upload without private")


def _wrong_type(name: str, tensor: Any) -> str | None:
    """What is wrong with the type of the heads' tensor ``name``, or None: token ids are integers, weights
    floating point."""
    if not isinstance(tensor, torch.Tensor):
        return f"{name}: not a tensor ({type(tensor).__name__})"
    dtype = str(tensor.dtype).replace("torch.", "")
    if name.split(".")[-1] == "token_map":
        return f"{name}: {dtype}, where token ids are integers" if tensor.is_floating_point() or \
            tensor.dtype == torch.bool else None
    return None if tensor.is_floating_point() else f"{name}: {dtype}, where weights are floating point"


def check_finite(tensors: dict[str, torch.Tensor], source: str) -> None:
    """``ValueError`` naming the floating-point tensors that hold NaN or infinity: heads trained while the numbers
    overflowed (float16), which decoding would load and run at tau 1.0 without a word."""
    bad = sorted(name for name, t in tensors.items()
                 if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all()))
    if bad:
        raise ValueError(f"{source}: tensors holding NaN or infinity: {_listed(bad)}; these heads were trained while "
                         "the numbers overflowed (float16?): train them again in bfloat16 or float32")


def check_state_dict(expected: dict[str, torch.Tensor], found: dict[str, torch.Tensor], source: str,
                     fix: str = "The checkpoint is incomplete or was written for another configuration; re-export "
                                "it.") -> None:
    """Raise ``ValueError`` naming every missing, unexpected, mis-shaped or mis-typed tensor (a token map
    of floats was cut to integers, weights of integers loaded, without a word), then ``fix``."""
    kinds = [problem for name, t in found.items() if (problem := _wrong_type(name, t))]
    if kinds:
        raise ValueError(f"{source}: tensors of the wrong type: {'; '.join(kinds)}; re-export the heads")
    check_finite(found, source)
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    shapes = [
        f"{name}: checkpoint {tuple(found[name].shape)}, heads {tuple(t.shape)}"
        for name, t in expected.items()
        if name in found and found[name].shape != t.shape
    ]
    problems = []
    if missing:
        problems.append(f"missing tensors {_listed(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors {_listed(unexpected)}")
    if shapes:
        problems.append("shape mismatches " + "; ".join(shapes))
    if problems:
        raise ValueError(
            f"{source} does not fit the heads its config describes: " + ", ".join(problems) + ". " + fix
        )


LISTED_NAMES = 8
"""Tensor names an error lists at most (a config.json saying 60 heads for 3 listed 228 missing ones)."""


def _listed(names: list[str]) -> str:
    """``names`` in natural order (heads.2 before heads.10), the first ``LISTED_NAMES`` of them and how many more."""
    ordered = sorted(names, key=lambda name: [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)])
    if len(ordered) <= LISTED_NAMES:
        return str(ordered)
    return f"{ordered[:LISTED_NAMES]} and {len(ordered) - LISTED_NAMES} more ({len(ordered)} in all)"


def _looks_like_hub_id(name: str) -> bool:
    """Whether ``name`` can be a Hub model id rather than a local folder (``models.is_path_like``, or one
    that exists)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    from medusa_infer.models import is_path_like

    if name == "unknown" or is_path_like(name) or Path(name).exists():
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _gguf_note(config: MedusaConfig) -> list[str]:
    """For a default model's heads, the lines saying which weights they were trained and measured on."""
    from medusa_infer.models import DEFAULT_MODELS, names_default_model

    name = config.base_model_name_or_path
    if not name or not names_default_model(name):
        return []
    model = DEFAULT_MODELS[name]
    return [f"They were trained and measured on weights dequantized from the GGUF file `{model.gguf_file}` "
            f"of {model.hub_id} (medusa-forge's default model `{name}`, which `from_pretrained` loads by that name), "
            "not on the original checkpoint.", ""]


def _local_base(config: MedusaConfig) -> bool:
    """Whether the config names its base model by a local folder, which a copy of the heads elsewhere lacks, or
    names none (heads on a model built from a config): either way ``from_pretrained`` needs ``base_model=``."""
    from medusa_infer.models import is_path_like, names_default_model

    name = config.base_model_name_or_path
    if not name:
        return True
    if names_default_model(name):  # loaded by its name wherever the heads go
        return False
    return is_path_like(name) or Path(name).expanduser().is_dir()


def model_card(config: MedusaConfig, base_model_id: str | None = None, chat: bool = True,
               exported: bool = False) -> str:
    """A Hugging Face model card with front matter, usage and the measured figures when known.

    ``base_model`` is ``base_model_id``, else the Hub id the config's base model stands for
    (``models.hub_id``: a default model's original repository, not its short name); the front
    matter names it only when it can be a Hub id (not a local folder, which the Hub would refuse).
    ``chat``: whether chats can be rendered (``renders_chats``): the usage example sends a chat, else text.
    ``exported``: the card of a FasterDecoding-layout export (``interop.write_medusa_layout``), whose config.json
    keeps no adapter, no calibration questions, and the chat template under ``medusa_forge_chat_template``.
    """
    from medusa_infer.models import DEFAULT_MODELS, hub_id, names_default_model

    base = base_model_id or hub_id(config.base_model_name_or_path) or "unknown"
    shown = base if _looks_like_hub_id(base) else _public(base, "path")  # (a local folder by its last part, as the
    lines = ["---"]  # training record shows it: a home folder's or a project's name is not published)
    if _looks_like_hub_id(base):  # the Hub refuses a commit whose card names a local folder here
        lines.append(f"base_model: {json.dumps(base)}")  # (quoted: a name such as "null" or "1.0" read as YAML's)
    name = config.base_model_name_or_path
    if name and names_default_model(name) and DEFAULT_MODELS[name].license and \
            base_model_id in (None, DEFAULT_MODELS[name].hub_id):
        lines.append(f"license: {DEFAULT_MODELS[name].license}")  # (heads trained on a model are bound by its terms)
    lines += [
        "library_name: medusa-forge",
        "tags:",
        "- medusa",
        "- speculative-decoding",
        "---",
        "",
        f"# Medusa heads for {shown}",
        "",
        f"{config.num_heads} Medusa heads, {config.num_layers} residual block(s) each, "
        f"{config.projection} vocabulary projection"
        + (f" over a reduced vocabulary of {config.reduced_vocab_size} tokens" if config.reduced_vocab_size else "")
        + (", each also reading the base model's next token (the tree's root)" if config.next_token_input else "")
        + (" and the candidate path it extends (reading the candidate path: Hydra-style)" if config.path_input else "")
        + provenance(config),
        "",
        *_gguf_note(config),
        "## Usage",
        "",
        "```python",
        "from medusa_infer.model import MedusaModel",
        "",
        *([f'model = MedusaModel.from_pretrained("{PLACEHOLDER}")'] if not _local_base(config) else [
            f"# config.json names the base model by a local folder ({_public(config.base_model_name_or_path, 'path')}):"
            " give it" if config.base_model_name_or_path else "# config.json names no base model: give it",
            f'model = MedusaModel.from_pretrained("{PLACEHOLDER}", base_model="'
            f'{base if _looks_like_hub_id(base) else "<base model folder or Hub id>"}")']),
        *(["# a chat, rendered with the chat template as the heads' training data was (prompt= takes text as it is)",
           'out = model.generate(messages=[{"role": "user", "content": "What is the capital of France?"}], '
           "max_new_tokens=64)"] if chat else [
            "# text as it is (the base model's tokenizer has no chat template)",
            'out = model.generate(prompt="The capital of France is", max_new_tokens=64)']),
        "print(model.tokenizer.decode(out.new_tokens[0], skip_special_tokens=True))",
        "```",
        "",
        "From the command line, with medusa-forge installed (its README says how):",
        "",
        "```bash",
        *([] if not _local_base(config) else ["# add --model <base model folder or Hub id>, as above"]),
        f'medusa-generate --heads "{PLACEHOLDER}" ' + ("--chat" if chat else '"The capital of France is"')
        + "  # " + ("an interactive chat" if chat else "text as it is"),
        f'medusa-serve --heads "{PLACEHOLDER}"  # an OpenAI-compatible server on 127.0.0.1:8000',
        "```",
        "",
        *([] if exported else [
            "Where this folder holds `adapter/` (Medusa-2), `from_pretrained` merges that LoRA adapter into the base "
            "model, which the heads were trained to read: answers are the adapted model's. Other engines need those "
            "merged weights: `model.base_model.save_pretrained(DIR)` and `model.tokenizer.save_pretrained(DIR)` "
            "after loading write them.", ""]),
    ]
    if config.trained_with_adapter:
        lines += ["These heads were trained with a Medusa-2 LoRA adapter on the backbone (`training.recipe.training."
                  "mode`): the figures on this card were measured with it merged, and on a base model without it "
                  "the heads draft worse than they say.", ""]
    system = _trained_system_prompt(config)
    if system is not None:
        lines += [f"The heads were trained on conversations opened by the system prompt {json.dumps(system)} "
                  "(`data.system_prompt`): chats that open with it match their training data best "
                  "(`medusa-bench --system-prompt` measures them so); others are answered alike, with fewer drafts "
                  "accepted.", ""]
    if config.chat_template:
        key = "medusa_forge_chat_template" if exported else "chat_template"  # (interop.CHAT_TEMPLATE_KEY)
        lines += ["The heads were trained on conversations rendered with the chat template in `config.json` "
                  f"(`{key}`), not the tokenizer's own: `from_pretrained` installs it on the tokenizer, "
                  "and `model.generate(messages=[...])` renders chats with it.", ""]
    # training's held-out count is the sample size of training's accuracy table, no acceptance figure
    positions = (config.acceptance or {}).get("heldout_positions")
    counted = [f"Held-out positions per head: {positions}.", ""] if positions is not None else []
    trained_table = config.training.get("heldout_head_accuracies")  # training's, kept by calibration beside its own
    if not _is_table(trained_table):  # (the training record is free-form: a hand-edited one stopped the save)
        trained_table = None
    if config.head_accuracies:
        source = (config.acceptance or {}).get("head_accuracies_measured_on", "held-out data")
        lines += accuracy_table(f"Measured head accuracy ({source})", config.head_accuracies)
        lines += counted if not trained_table else []
    if trained_table:
        lines += accuracy_table("Head accuracy on held-out data at the end of training", trained_table) + counted
    calibrated = "head_accuracies_measured_on" in (config.acceptance or {})
    # (a config calibrated by an earlier release keeps training's tree's figure, for a tree calibration replaced)
    acceptance = {key: value for key, value in (config.acceptance or {}).items()
                  if key not in PROVENANCE_KEYS and key != "heldout_positions"
                  and not (calibrated and key == "expected_tokens_per_step_fitted_tree")}
    estimated = {key: value for key, value in acceptance.items() if is_estimate(key)}
    measured = {key: value for key, value in acceptance.items() if key not in estimated}
    calibrated_on = (config.acceptance or {}).get("calibration_questions")
    if not isinstance(calibrated_on, dict) or not isinstance(calibrated_on.get("ids") or [], list):  # (as above:
        calibrated_on = None  # an AttributeError or a TypeError stopped the save)
    if calibrated_on and calibrated_on.get("file") and exported:  # (the layout keeps no question ids: said here)
        ids = ",".join(str(i) for i in calibrated_on.get("ids") or [])
        lines += [f"Calibrated on {len(calibrated_on.get('ids') or [])} questions of `{calibrated_on['file']}`: "
                  f"benchmarks of these heads on that file should leave them out (`medusa-bench --exclude-ids {ids}`; "
                  "this layout keeps no record of them).", ""]
    elif calibrated_on and calibrated_on.get("file"):
        lines += [f"Calibrated on {len(calibrated_on.get('ids') or [])} questions of `{calibrated_on['file']}`, which "
                  "`medusa-bench` leaves out of later benchmarks of these heads on that file.", ""]
    elif calibrated_on:  # questions read from a pipe: no file to leave them out of
        lines += [f"Calibrated on {len(calibrated_on.get('ids') or [])} questions read from a pipe.", ""]
    for title, figures in (("Measured acceptance", measured),
                           ("Expected acceptance (estimated from the measured accuracies and, for speedups, "
                            "the cost model; not measured)", estimated)):
        if figures:
            lines += [f"## {title}", "", "| metric | value |", "|---|---|"]
            lines += [f"| {key} | {value} |" for key, value in figures.items()]
            lines.append("")
            profile = config.cost_profile or {}
            if figures is estimated and profile.get("device"):  # a CPU's speedup is not a GPU's
                longer = profile.get("longer") if isinstance(profile.get("longer"), dict) else None
                also = (f" (also {longer.get('context', 0)}, by which decoding prices steps over longer contexts; "
                        "the estimates are at the first)") if longer else ""
                lines += [f"The cost model was measured on {profile['device']}, {profile.get('context', 0)} cached "
                          f"tokens before each forward{also}: speedups estimated elsewhere differ.", ""]
    lines += _data_sources_section(config.training.get("data_sources"))
    if config.training:  # (local paths by their last part: a home folder's name, a dataset's place, published)
        lines += ["## Training", "", "```json", json.dumps(_public(config.training), indent=2), "```", ""]
    return "\n".join(lines)


def _data_sources_section(sources: Any) -> list[str]:
    """The card's section on the data the heads were trained on: the rows each prompt source gave (the training
    record's ``data_sources``, ``train_heads.data_sources``); none where not recorded (or not a table of counts)."""
    if not isinstance(sources, dict) or not sources or not all(
            isinstance(n, int) and not isinstance(n, bool) for n in sources.values()):
        return []
    return ["## Training data", "", f"The heads were trained (and evaluated on a held-out part) on "
            f"{sum(sources.values())} rows of conversations, whose prompts came from these sources; each source's "
            "terms apply to what was learned from it (check them before publishing these heads or using them "
            "commercially).", "", "| source | rows |", "|---|---|",
            *(f"| {_table_cell(name)} | {count} |" for name, count in _public(sources, "data_sources").items()), ""]


def _table_cell(text: str) -> str:
    """``text`` as one cell of a markdown table row: its ``|`` escaped, line breaks and other control characters
    made spaces (a source named ``a|b`` added a column; one holding a newline ended the table)."""
    return "".join(" " if ch.isspace() or not ch.isprintable() else ch for ch in str(text)).replace("|", "\\|")


DATASTORE_HEADING = "## Datastore"


def card_section(text: str, heading: str) -> tuple[int, int] | None:
    """Where the section of model card ``text`` under ``heading`` lies, up to the next section: ``(start, end)``;
    None where there is none."""
    start = text.find(heading)
    if start < 0:
        return None
    end = text.find("\n## ", start + 1)
    return start, end + 1 if end >= 0 else len(text)


def note_datastore(directory: str | Path, tokens: int, origin: str | None) -> None:
    """Say in the folder's model card what its ``datastore.safetensors`` holds: text others can read
    back from the upload. ``origin`` (``Datastore.origin``): where the text comes from, in words; None:
    not recorded. A section an earlier store left is replaced. The card is replaced whole (``write_in_place``): a
    write cut short (a full disk) left it cut, after the heads were saved."""
    card = Path(directory) / CARD_NAME
    text = card.read_text(encoding="utf-8") if card.is_file() else ""
    span = card_section(text, DATASTORE_HEADING)
    if span:
        text = text[:span[0]] + text[span[1]:]
    source = origin or "text whose origin was not recorded (a store set in code, or built by an earlier release)"
    section = (f"{DATASTORE_HEADING}\n\n`{DATASTORE_NAME}` holds {tokens} tokens of text that lookup drafts search: "
               f"{source}, as token ids, which anyone with the folder can decode; it shares that text's licence "
               "and privacy.\n")
    append_card(Path(directory), text, section)


def append_card(directory: Path, text: str, section: str) -> None:
    """Write the folder's model card as ``text`` followed by ``section``, replaced whole (``write_in_place``)."""
    whole = text.rstrip("\n") + "\n\n" + section
    write_in_place(directory, [(CARD_NAME, lambda path: path.write_text(whole, encoding="utf-8"))])


def renders_chats(config: MedusaConfig, tokenizer: Any) -> bool:
    """Whether chats can be rendered for the heads (the config's chat template, or the tokenizer's own), and so
    the card's example sends one (``save_heads``' ``chat``); True where no tokenizer is known."""
    return tokenizer is None or bool(config.chat_template or getattr(tokenizer, "chat_template", None))


def _trained_system_prompt(config: MedusaConfig) -> str | None:
    """The system prompt training rendered its conversations with (the recipe's ``data.system_prompt``), or None
    (ready examples, ``data.tokenized``, are taken as they are: the setting went unread)."""
    recipe = config.training.get("recipe")
    data = recipe.get("data") if isinstance(recipe, dict) else None
    system = data.get("system_prompt") if isinstance(data, dict) and not data.get("tokenized") else None
    return system if isinstance(system, str) else None


PATH_KEYS = ("name", "prompts", "rows", "tokenized", "output_dir", "init_from", "dir", "path")
"""Keys of a training record (last part of a dotted name) whose values are paths: a model, the data, folders."""


def _public(value: Any, key: str = "") -> Any:
    """``value`` (a training record) with the local paths of ``PATH_KEYS`` (absolute, home-relative or of a
    drive) shown by their last part; other text as it is (a system prompt such as "/no_think" is none)."""
    if isinstance(value, dict):  # (the keys of data_sources are the rows' sources: a path among them by its name)
        return {(_public(name, "path") if key == "data_sources" else name): _public(item, str(name))
                for name, item in value.items()}
    if isinstance(value, list):
        return [_public(item, key) for item in value]
    local = isinstance(value, str) and "\n" not in value and (
        value.startswith(("/", "~")) or (len(value) > 2 and value[1] == ":" and value[2] in "\\/"))
    if not local or key.rsplit(".", 1)[-1] not in PATH_KEYS:
        return value
    # (a Windows path's parts, read on any system: Path took C:\Users\alice\x.jsonl for one name)
    return f"<local>/{PureWindowsPath(value).name if value[1:2] == ':' else Path(value).name}"


def _is_table(value: Any) -> bool:
    """Whether ``value`` is a table of accuracies: non-empty rows of numbers."""
    return (isinstance(value, list) and bool(value) and all(isinstance(row, list) and row for row in value)
            and all(isinstance(x, (int, float)) and not isinstance(x, bool) for row in value for x in row))


def accuracy_table(title: str, accuracies: list[list[float]]) -> list[str]:
    """A model card section: each head's cumulative top-1/3/5/10 accuracy (those the rows hold)."""
    shown = [k for k in (1, 3, 5, 10) if k <= max(len(a) for a in accuracies)]
    lines = [f"## {title}", "", "| head | " + " | ".join(f"top-{k}" for k in shown) + " |",
             "|---|" + "---|" * len(shown)]
    for i, acc in enumerate(accuracies):
        lines.append(f"| {i + 1} | " + " | ".join(f"{acc[k - 1]:.3f}" if k <= len(acc) else "" for k in shown) + " |")
    return lines + [""]


PROVENANCE_KEYS = ("head_accuracies_measured_on", "calibration_questions")
"""``acceptance`` entries that say what the figures were measured on; the model card says it in words."""

CALIBRATION_RECORDS = ("heldout_head_accuracies", "heldout_path_accuracies")
"""``training`` keys calibration adds (``medusa-bench --calibrate``): no record of training."""
IMPORTED_FROM = "imported_from"
"""``training`` key of heads read from another layout (trained elsewhere): the layout's name."""


def provenance(config: MedusaConfig) -> str:
    """The model card's words on where the heads come from: trained here (``training`` holds more than
    calibration's keys), imported from another layout, or never trained."""
    link = "[medusa-forge](https://pypi.org/project/medusa-forge/)"
    if config.training.get(IMPORTED_FROM):
        return f", imported with {link} from the {config.training[IMPORTED_FROM]} (no record of their training)."
    if set(config.training) - set(CALIBRATION_RECORDS):
        return f", trained with {link}."
    return (f", made with {link} and not trained (their config holds no training record): their drafts are "
            "random and rarely accepted.")


def is_estimate(key: str) -> bool:
    """Whether an ``acceptance`` figure is a model estimate (an expected tau or speedup of a fitted tree,
    the tree calibration fitted) rather than a measurement."""
    return "expected" in key or key.startswith("calibrated_")
