"""MedusaModel.push_to_hub against a loopback stand-in for the Hub API (no network)."""

from __future__ import annotations

import base64
import importlib.util
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import unquote, urlsplit

import pytest
import torch
import yaml
from huggingface_hub import close_session, constants
from safetensors.torch import load as load_safetensors

from medusa_infer.config import MedusaConfig
from medusa_infer.model import MedusaModel
from tiny import tiny_model

REPO_ID = "tester/tiny-medusa"
TOKEN = "hf_dummy"
COMMIT_OID = "c0ffee" + "0" * 34


@dataclass
class FakeHub:
    """What the loopback Hub was asked to do."""

    endpoint: str = ""
    repos: dict[str, dict[str, Any]] = field(default_factory=dict)  # repo id -> create payload
    branches: dict[str, set[str]] = field(default_factory=dict)  # repo id -> branch names
    commits: list[dict[str, Any]] = field(default_factory=list)  # revision, header, files {path: bytes}
    calls: list[str] = field(default_factory=list)  # "create", "branch", "preupload", "commit", ...
    unexpected: list[str] = field(default_factory=list)  # requests the stand-in does not implement
    authorizations: set[str] = field(default_factory=set)
    files: dict[tuple[str, str], dict[str, bytes]] = field(default_factory=dict)  # (repo, branch) -> its files


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    """Just enough of the Hub API for create_repo, create_branch, upload_folder (regular files only,
    with deletions) and the file listing it reads."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:  # keep pytest output clean
            pass

        def reply(self, status: int, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                chunks = []
                while size := int(self.rfile.readline().split(b";")[0], 16):
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()
                self.rfile.readline()
                return b"".join(chunks)
            return self.rfile.read(int(self.headers.get("Content-Length", 0)))

        def do_GET(self) -> None:
            parts = unquote(urlsplit(self.path).path).removeprefix("/api/").split("/")
            if self.path == "/api/agent-harnesses":
                # huggingface_hub's best-effort agent-detection registry (fetched from ENDPOINT by its
                # progress display); a 404 makes it fall back to "no agent" and cache nothing.
                hub.calls.append("agent-harnesses")
            elif len(parts) == 3 and parts[0] == "models":  # repo_info
                hub.calls.append("info")
                repo_id = f"{parts[1]}/{parts[2]}"
                if repo_id not in hub.repos:
                    return self.reply(404, {"error": "Repository not found"})
                return self.reply(200, {"id": repo_id, "private": hub.repos[repo_id].get("visibility") == "private",
                                        "sha": COMMIT_OID + "0" * 6, "siblings": []})
            elif len(parts) == 5 and parts[0] == "models" and parts[3] == "tree":  # list_repo_files, one page
                hub.calls.append("tree")
                held = hub.files.get((f"{parts[1]}/{parts[2]}", parts[4]), {})
                return self.reply(200, [{"type": "file", "path": path, "size": len(data), "oid": "0" * 40}
                                        for path, data in sorted(held.items())])
            else:
                hub.unexpected.append(f"GET {self.path}")
            self.reply(404, {"error": "not implemented by the test Hub"})

        def do_POST(self) -> None:
            hub.authorizations.add(self.headers.get("Authorization", ""))
            path, raw = unquote(urlsplit(self.path).path), self.body()
            parts = path.removeprefix("/api/").split("/")
            if path == "/api/repos/create":
                payload = json.loads(raw)
                repo_id = f"{payload['organization']}/{payload['name']}"
                hub.calls.append("create")
                if repo_id in hub.repos:
                    return self.reply(409, {"error": "You already created this model repo",
                                            "url": f"{hub.endpoint}/{repo_id}"})
                hub.repos[repo_id] = payload
                hub.branches[repo_id] = {"main"}
                return self.reply(200, {"url": f"{hub.endpoint}/{repo_id}", "name": repo_id})
            if path == "/api/validate-yaml":
                hub.calls.append("validate-yaml")
                return self.reply(200, {"errors": [], "warnings": []})
            if len(parts) == 5 and parts[0] == "models":
                repo_id, action, revision = f"{parts[1]}/{parts[2]}", parts[3], parts[4]
                if repo_id not in hub.repos:
                    return self.reply(404, {"error": "Repository not found"})
                if action == "branch":
                    hub.calls.append("branch")
                    if revision in hub.branches[repo_id]:
                        return self.reply(409, {"error": "Reference already exists"})
                    hub.branches[repo_id].add(revision)
                    return self.reply(200, {})
                if revision not in hub.branches[repo_id]:
                    return self.reply(404, {"error": f"Invalid rev id: {revision}"})
                if action == "preupload":
                    hub.calls.append("preupload")
                    files = json.loads(raw)["files"]
                    return self.reply(200, {"files": [
                        {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files
                    ]})
                if action == "commit":
                    hub.calls.append("commit")
                    if self.headers.get("Content-Type") != "application/x-ndjson":
                        hub.unexpected.append(f"commit with Content-Type {self.headers.get('Content-Type')}")
                    lines = [json.loads(line) for line in raw.splitlines() if line.strip()]
                    commit = {"revision": revision, "header": None, "files": {}, "other": []}
                    held = hub.files.setdefault((repo_id, revision), {})
                    for line in lines:
                        if line["key"] == "header":
                            commit["header"] = line["value"]
                        elif line["key"] == "file" and line["value"]["encoding"] == "base64":
                            commit["files"][line["value"]["path"]] = base64.b64decode(line["value"]["content"])
                            held[line["value"]["path"]] = commit["files"][line["value"]["path"]]
                        elif line["key"] == "deletedFile":
                            commit["deleted"] = commit.get("deleted", []) + [line["value"]["path"]]
                            held.pop(line["value"]["path"], None)
                        else:
                            commit["other"].append(line)
                    hub.commits.append(commit)
                    return self.reply(200, {"commitUrl": f"{hub.endpoint}/{repo_id}/commit/{COMMIT_OID}",
                                            "commitOid": COMMIT_OID})
            hub.unexpected.append(f"POST {self.path}")
            self.reply(404, {"error": "not implemented by the test Hub"})

    return Handler


@pytest.fixture
def hub(monkeypatch) -> Iterator[FakeHub]:
    """A Hub stand-in on 127.0.0.1 at a free port; huggingface_hub is pointed at it for the test."""
    fake = FakeHub()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(fake))
    server.daemon_threads = True
    host, port = server.server_address
    fake.endpoint = f"http://{host}:{port}"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    # huggingface_hub read HF_ENDPOINT at import: patch the constant that HfApi() reads.
    monkeypatch.setenv("HF_ENDPOINT", fake.endpoint)
    monkeypatch.setattr(constants, "ENDPOINT", fake.endpoint)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # only loopback is reached
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    close_session()  # the shared HTTP client reads proxy settings when it is created
    try:
        yield fake
    finally:
        close_session()
        server.shutdown()
        server.server_close()
        thread.join()


def _xet_installed() -> bool:
    return importlib.util.find_spec("hf_xet") is not None


def tiny_heads() -> MedusaModel:
    base = tiny_model("llama")
    base.name_or_path = "tiny-random/llama"
    model = MedusaModel.from_base(base, num_heads=3, num_layers=2, projection="own")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.heads.parameters():
            param.copy_(torch.randn(param.shape, generator=generator))
    return model


@pytest.mark.parametrize("upload", [
    pytest.param("xet-pipeline", marks=pytest.mark.skipif(not _xet_installed(), reason="hf_xet not installed")),
    "create-commit",
])
@pytest.mark.parametrize(("private", "revision"), [(True, None), (False, "medusa-v1")])
def test_push_to_hub_uploads_what_save_pretrained_writes(hub, monkeypatch, tmp_path, private, revision, upload):
    # With hf_xet installed, upload_folder streams through its xet pipeline; else through create_commit.
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", upload == "create-commit")
    model = tiny_heads()

    url = model.push_to_hub(REPO_ID, private=private, revision=revision, token=TOKEN)

    assert not hub.unexpected
    assert hub.authorizations == {f"Bearer {TOKEN}"}
    assert hub.repos[REPO_ID]["visibility"] == ("private" if private else "public")
    api_calls = [c for c in hub.calls if c != "agent-harnesses"]
    assert api_calls[0] == "create" and api_calls[-1] == "commit"
    assert api_calls.count("branch") == (revision is not None)
    assert url == f"{hub.endpoint}/{REPO_ID}/commit/{COMMIT_OID}"

    [commit] = hub.commits
    assert commit["revision"] == (revision or "main")
    assert commit["header"]["summary"] == "Upload Medusa heads with medusa-forge"
    assert not commit["other"]
    uploaded = commit["files"]
    assert sorted(uploaded) == ["README.md", "config.json", "model.safetensors"]

    model.save_pretrained(tmp_path)
    assert uploaded["config.json"] == (tmp_path / "config.json").read_bytes()
    # the card as saved, naming the repo where it says "this repo or folder" (its usage, its commands)
    saved, card = (tmp_path / "README.md").read_text(), uploaded["README.md"].decode()
    assert saved.count("<this repo or folder>") == 3 and "<this repo or folder>" not in card
    if revision is None:
        assert card == saved.replace("<this repo or folder>", REPO_ID)
        assert f'from_pretrained("{REPO_ID}")' in card and f'medusa-serve --heads "{REPO_ID}"' in card
    else:  # the branch loaded (the card's usage loaded main), the command lines on a download of it
        assert f'from_pretrained("{REPO_ID}", revision="{revision}")' in card
        assert f"hf download {REPO_ID} --revision {revision} --local-dir medusa-heads\nmedusa-generate --heads " \
               '"medusa-heads"' in card and 'medusa-serve --heads "medusa-heads"' in card
    tensors = load_safetensors(uploaded["model.safetensors"])
    expected = model.heads.state_dict()
    assert sorted(tensors) == sorted(expected)
    for name, tensor in expected.items():
        assert tensors[name].dtype == tensor.dtype and torch.equal(tensors[name], tensor), name
    assert uploaded["model.safetensors"] == (tmp_path / "model.safetensors").read_bytes()


def test_a_private_upload_to_a_public_repo_is_refused(hub, monkeypatch):
    """create_repo(private=True, exist_ok=True) leaves an existing public repo public: the heads, and a
    datastore of training conversations, were uploaded there without a word."""
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    model = tiny_heads()
    model.push_to_hub(REPO_ID, private=False, token=TOKEN)
    with pytest.raises(ValueError, match=f"{REPO_ID} exists and is public.*nothing was uploaded"):
        model.push_to_hub(REPO_ID, private=True, token=TOKEN)
    assert len(hub.commits) == 1 and not hub.unexpected
    hub.repos[REPO_ID]["visibility"] = "private"  # made private on the Hub
    model.push_to_hub(REPO_ID, private=True, token=TOKEN)
    assert len(hub.commits) == 2


def test_push_to_existing_repo_and_branch_succeeds(hub, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    model = tiny_heads()
    model.push_to_hub(REPO_ID, revision="medusa-v1", token=TOKEN)
    model.push_to_hub(REPO_ID, revision="medusa-v1", token=TOKEN, commit_message="Retrain heads")

    assert not hub.unexpected
    assert hub.calls.count("create") == hub.calls.count("branch") == 2  # the second pair answered 409
    assert [c["header"]["summary"] for c in hub.commits] == ["Upload Medusa heads with medusa-forge", "Retrain heads"]
    assert [c["revision"] for c in hub.commits] == ["medusa-v1", "medusa-v1"]  # (not main, once the branch exists)
    assert "visibility" not in hub.repos[REPO_ID]  # private=None leaves the Hub's default



def test_push_without_heads_fails_before_touching_the_hub(hub, tmp_path, monkeypatch):
    model = MedusaModel.without_heads(tiny_model("llama"))
    with pytest.raises(ValueError, match="has no heads"):
        model.push_to_hub(REPO_ID, revision="medusa-v1", token=TOKEN)
    assert not hub.repos and not hub.commits  # no empty repo or branch left behind
    # a folder of no heads (a run folder: its distilled conversations were uploaded; a mistyped path: the repo and
    # branch were made first)
    from medusa_infer.checkpoint import push_folder_to_hub

    tiny_heads().save_pretrained(tmp_path / "run" / "heads")
    (tmp_path / "run" / "data").mkdir()
    for folder in (tmp_path / "run", tmp_path / "no-such-folder"):
        with pytest.raises(ValueError, match="holds no saved heads .*not a run folder"):
            push_folder_to_hub(folder, REPO_ID, revision="v1", token=TOKEN)
    assert not hub.repos and not hub.commits
    # the Hub not reached: named with the fix (a bare connection error, after training)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(ValueError, match=f"uploading to the Hub repo {REPO_ID} failed .*check the network.*then "
                                         f"upload .*heads again \\(push_folder_to_hub\\)"):
        push_folder_to_hub(tmp_path / "run" / "heads", REPO_ID, token=TOKEN)
    # from push_to_hub, which uploads a temporary folder: that folder, gone once the error is read, was named
    with pytest.raises(ValueError, match="check the network.*then push again, or save_pretrained\\(DIR\\) and "
                                         "upload it with medusa_infer.checkpoint.push_folder_to_hub") as failed:
        tiny_heads().push_to_hub(REPO_ID, token=TOKEN)
    assert "/tmp" not in str(failed.value).replace(str(tmp_path), "")
    # offline, it is refused at once (it saved, then failed at the network, naming the temporary folder)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match=f"uploading to {REPO_ID} needs the Hub, but HF_HUB_OFFLINE is set: unset "
                                         "it and push again"):
        tiny_heads().push_to_hub(REPO_ID, token=TOKEN)


def test_a_push_names_a_base_model_given_and_says_an_unread_datastore_goes(hub, monkeypatch, tmp_path, caplog):
    """push_to_hub took no base_model_id (save_pretrained did); heads loaded with datastore=False deleted the repo's
    datastore as stale without a word (a save into their own folder keeps it)."""
    from medusa_infer.datastore import Datastore

    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    model = tiny_heads()
    model.datastore = Datastore.from_sequences([[3, 4, 5, 6]])
    model.save_pretrained(tmp_path / "heads")
    unread = MedusaModel.from_pretrained(tmp_path / "heads", base_model=model.base_model, datastore=False)
    with caplog.at_level("WARNING", logger="medusa_infer.model"):
        unread.push_to_hub(REPO_ID, token=TOKEN, base_model_id="org/llama")
    assert "loaded with datastore=False: the upload holds no datastore" in caplog.text
    front = hub.commits[-1]["files"]["README.md"].decode().split("---")[1]
    assert yaml.safe_load(front)["base_model"] == "org/llama"


def test_a_new_upload_deletes_what_an_earlier_one_left_that_would_load_with_the_heads(hub, monkeypatch, tmp_path):
    """Heads pushed without an adapter or datastore over a repo holding them from an earlier push: the
    earlier adapter (which from_pretrained would merge under the new heads), datastore and a
    FasterDecoding weights file are deleted in the same commit; other files are left alone."""
    from medusa_infer.checkpoint import push_folder_to_hub

    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    model = tiny_heads()
    earlier = tmp_path / "earlier"
    model.save_pretrained(earlier)
    (earlier / "adapter").mkdir()
    for name in ("adapter/adapter_config.json", "adapter/adapter_model.safetensors", "datastore.safetensors",
                 "medusa_lm_head.pt", "notes.txt"):
        (earlier / name).write_bytes(b"earlier " + name.encode())
    (earlier / "model.safetensors.partial").write_bytes(b"a save cut short")  # not the heads': not uploaded
    push_folder_to_hub(earlier, REPO_ID, token=TOKEN)
    assert "deleted" not in hub.commits[0]
    assert "model.safetensors.partial" not in hub.files[(REPO_ID, "main")]

    model.push_to_hub(REPO_ID, token=TOKEN, commit_message="Heads without an adapter")

    assert not hub.unexpected
    assert sorted(hub.commits[1]["deleted"]) == ["adapter/adapter_config.json", "adapter/adapter_model.safetensors",
                                                 "datastore.safetensors", "medusa_lm_head.pt"]
    assert sorted(hub.files[(REPO_ID, "main")]) == ["README.md", "config.json", "model.safetensors", "notes.txt"]


def test_a_folder_an_earlier_release_wrote_nan_into_is_uploaded_as_strict_json(hub, monkeypatch, tmp_path):
    """An earlier release wrote a diverged run's NaN loss into config.json as NaN, which strict JSON readers refuse:
    uploaded as it was (linked, or its paths shown by their last part). The staged copy holds null there."""
    from medusa_infer.checkpoint import push_folder_to_hub

    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    folder = tmp_path / "old"
    tiny_heads().save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["training"] = {"final_train_record": {"loss": float("nan")}}
    (folder / "config.json").write_text(json.dumps(config))  # (NaN, as json.dumps writes it)
    assert "NaN" in (folder / "config.json").read_text()
    push_folder_to_hub(folder, REPO_ID, token=TOKEN)
    uploaded = hub.files[(REPO_ID, "main")]["config.json"].decode()
    assert json.loads(uploaded, parse_constant=pytest.fail)["training"] == {"final_train_record": {"loss": None}}
    assert "NaN" in (folder / "config.json").read_text()  # (the folder itself as it was)


def test_a_fasterdecoding_export_has_a_card_and_its_upload_over_ours_leaves_none_of_ours(hub, monkeypatch, tmp_path):
    """An upload in the FasterDecoding layout over heads pushed in ours left our model.safetensors (which loads
    first) and card (of the earlier heads: their count, accuracies and tree) in the repo; the export wrote none."""
    from medusa_infer.checkpoint import push_folder_to_hub

    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    tiny_heads().push_to_hub(REPO_ID, token=TOKEN)
    model = MedusaModel.from_base(tiny_model("llama"), num_heads=4, num_layers=1, projection="own")
    model.config.base_model_name_or_path = "tiny-random/llama"
    model.config.head_accuracies = [[0.5, 0.75], [0.25, 0.5], [0.125, 0.25], [0.0625, 0.125]]
    card = (model.export_medusa_layout(tmp_path / "fd") / "README.md").read_text()
    assert card.startswith("---\nbase_model: \"tiny-random/llama\"") and "4 Medusa heads" in card
    assert "| 1 | 0.500 |\n| 2 | 0.250 |" in card  # the figures the layout's config.json has no place for
    assert "FasterDecoding/Medusa layout (`config.json`, `medusa_lm_head.safetensors`, version 1)" in card
    assert "Where this folder holds `adapter/`" not in card  # (the layout holds none)
    model.config.acceptance = {"calibration_questions": {"file": "spec.jsonl", "ids": [3, 7]}}
    model.config.chat_template = "{{ messages }}"
    exported = (model.export_medusa_layout(tmp_path / "fd2") / "README.md").read_text()
    # what the layout keeps no record of is said, not promised (the ids were not left out after an import)
    assert "benchmarks of these heads on that file should leave them out (`medusa-bench --exclude-ids 3,7`" in exported
    assert "(`medusa_forge_chat_template`)" in exported
    push_folder_to_hub(tmp_path / "fd", REPO_ID, token=TOKEN)
    assert not hub.unexpected and hub.commits[1]["deleted"] == ["model.safetensors"]
    uploaded = hub.files[(REPO_ID, "main")]
    assert sorted(uploaded) == ["README.md", "config.json", "medusa_lm_head.safetensors"]
    assert uploaded["README.md"].decode() == card.replace("<this repo or folder>", REPO_ID)
    assert MedusaModel.from_pretrained(tmp_path / "fd", base_model=tiny_model("llama")).config.num_heads == 4


def test_a_push_refuses_heads_that_would_not_load_and_makes_a_missing_card(hub, monkeypatch, tmp_path):
    """Weights cut short, or of other heads than config.json's, were uploaded (every download then failed to
    load them); a folder without its card was uploaded without one (no base model, no figures on the page)."""
    from safetensors.torch import save_file

    from medusa_infer.checkpoint import push_folder_to_hub

    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    folder = tmp_path / "heads"
    tiny_heads().save_pretrained(folder)
    weights = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(weights[:200])
    with pytest.raises(ValueError, match="model.safetensors could not be read"):
        push_folder_to_hub(folder, REPO_ID, token=TOKEN)
    other = MedusaModel.from_base(tiny_model("llama"), num_heads=2, num_layers=2, projection="own")
    other.config.base_model_name_or_path = "tiny-random/llama"
    save_file({k: v.contiguous() for k, v in other.heads.state_dict().items()}, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="does not fit the heads its config describes: missing tensors .*Nothing "
                                         "was uploaded"):
        push_folder_to_hub(folder, REPO_ID, token=TOKEN)
    fd = other.export_medusa_layout(tmp_path / "fd")
    (fd / "medusa_lm_head.safetensors").write_bytes(b"version https://git-lfs.github.com/spec/v1\n")
    with pytest.raises(ValueError, match="Git LFS pointer.*Nothing was uploaded"):
        push_folder_to_hub(fd, REPO_ID, token=TOKEN)
    assert not hub.repos and not hub.commits  # refused before the repo was made
    (folder / "model.safetensors").write_bytes(weights)
    saved = (folder / "README.md").read_text()
    (folder / "README.md").unlink()
    push_folder_to_hub(folder, REPO_ID, token=TOKEN)
    assert hub.files[(REPO_ID, "main")]["README.md"].decode() == saved.replace("<this repo or folder>", REPO_ID)
    assert not (folder / "README.md").exists()  # the folder's own files as they were


def test_the_uploaded_config_shows_the_training_records_local_paths_by_their_last_part(hub, monkeypatch, tmp_path):
    """The card hid the training record's local paths (a home folder, a user's name), and the config.json
    uploaded beside it published them; the folder's own config keeps them."""
    from medusa_infer.checkpoint import push_folder_to_hub

    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    model = tiny_heads()
    model.config.training = {"recipe": {"model": {"name": "/home/alice/models/llama"},
                                        "data": {"prompts": "~/data/prompts.jsonl", "system_prompt": "/no_think"}},
                             "changed": {"model.name": "/home/alice/models/llama"}}
    folder = tmp_path / "heads"
    model.save_pretrained(folder)
    (folder / "adapter").mkdir()
    (folder / "adapter" / "adapter_model.safetensors").write_bytes(b"weights")
    local = (folder / "config.json").read_bytes()
    push_folder_to_hub(folder, REPO_ID, token=TOKEN)
    uploaded = hub.files[(REPO_ID, "main")]
    assert sorted(uploaded) == ["README.md", "adapter/adapter_model.safetensors", "config.json", "model.safetensors"]
    assert uploaded["adapter/adapter_model.safetensors"] == b"weights"
    assert uploaded["model.safetensors"] == (folder / "model.safetensors").read_bytes()
    assert uploaded["README.md"] == (folder / "README.md").read_bytes().replace(b"<this repo or folder>",
                                                                               REPO_ID.encode())
    config = json.loads(uploaded["config.json"])
    assert "/home/alice" not in uploaded["config.json"].decode() and "~/data" not in uploaded["config.json"].decode()
    assert config["training"]["recipe"]["model"]["name"] == "<local>/llama"
    assert config["training"]["changed"]["model.name"] == "<local>/llama"
    assert config["training"]["recipe"]["data"] == {"prompts": "<local>/prompts.jsonl", "system_prompt": "/no_think"}
    assert {k: v for k, v in config.items() if k != "training"} == {
        k: v for k, v in json.loads(local).items() if k != "training"}
    assert (folder / "config.json").read_bytes() == local
    assert MedusaConfig.from_dict(config).training == config["training"]  # (still a heads config)
    # no links on this file system (Windows without developer mode): copies; the error was taken for the Hub's,
    # after the repo was made
    def no_links(self, target):
        raise OSError(1314, "A required privilege is not held by the client")

    monkeypatch.setattr(type(folder), "symlink_to", no_links)
    push_folder_to_hub(folder, REPO_ID + "-copied", token=TOKEN)
    copied = hub.files[(REPO_ID + "-copied", "main")]
    assert copied == {**uploaded, "README.md": (folder / "README.md").read_bytes().replace(
        b"<this repo or folder>", (REPO_ID + "-copied").encode())} and not hub.unexpected


def test_the_card_names_a_base_model_in_its_front_matter_only_when_it_can_be_a_hub_id(tmp_path, monkeypatch):
    """The Hub refuses a README whose ``base_model`` is no model id: a base loaded from a local folder is
    named in the card's text only."""
    from medusa_infer.checkpoint import model_card

    config = tiny_heads().config
    front = lambda card: card.split("---")[1]  # noqa: E731
    config.base_model_name_or_path = "smollm2-135m-instruct"  # a default model: its original repository
    assert 'base_model: "HuggingFaceTB/SmolLM2-135M-Instruct"\n' in front(model_card(config))
    # and its licence, which binds heads trained on it (the Hub said "unknown"); no other model's is known
    assert yaml.safe_load(front(model_card(config)))["license"] == "apache-2.0"
    config.base_model_name_or_path = "gemma3-270m"
    assert yaml.safe_load(front(model_card(config)))["license"] == "gemma"
    assert "license" not in yaml.safe_load(front(model_card(config, base_model_id="org/gemma-finetune")))
    config.base_model_name_or_path = "smollm2-135m-instruct"
    assert "dequantized from the GGUF file `SmolLM2-135M-Instruct.Q4_1.gguf`" in model_card(config)  # said nowhere
    assert 'base_model: "org/llama"\n' in front(model_card(config, base_model_id="org/llama"))
    config.training = {"recipe": {"model": {"name": "/home/alice/models/llama"}, "output_dir": "~/runs/x",
                                  "data": {"rows": "C:/Users/alice/rows.jsonl", "system_prompt": "/no_think",
                                           "prompts": "D:\\Users\\bob\\prompts.jsonl"}},
                       "changed": {"model.name": "/home/alice/models/llama"}}
    card = model_card(config)  # local paths of the training record by their last part (a home folder published)
    assert "/home/alice" not in card and "~/runs" not in card and "C:/Users" not in card
    assert '"<local>/llama"' in card and '"<local>/rows.jsonl"' in card
    assert '"<local>/prompts.jsonl"' in card and "bob" not in card  # (read as one name on Linux)
    assert '"system_prompt": "/no_think"' in card  # text that is no path, as it is
    config.training = {}
    for name in ("null", "true", "1.0"):  # repo names YAML read as another type (None, True, 1.0)
        assert yaml.safe_load(front(model_card(config, base_model_id=name)))["base_model"] == name
    # an absolute folder by its last part, as the training record shows it (a home folder's name was published)
    for local, shown in (("/home/me/models/llama", "<local>/llama"), (str(tmp_path), f"<local>/{tmp_path.name}"),
                         ("runs/demo/model", "runs/demo/model")):
        config.base_model_name_or_path = local
        card = model_card(config)
        assert "base_model" not in front(card) and f"# Medusa heads for {shown}\n" in card, local
        assert local not in card or local == shown, local
    # its usage snippet gives the base model a copy elsewhere cannot find by the folder (it failed as written)
    config.base_model_name_or_path = "/home/me/models/llama"
    assert 'from_pretrained("<this repo or folder>", base_model="org/llama")' in model_card(config, "org/llama")
    assert 'base_model="<base model folder or Hub id>")' in model_card(config)
    config.base_model_name_or_path = "org/llama"
    assert 'from_pretrained("<this repo or folder>")\n' in model_card(config)
    (tmp_path / "mymodels" / "llama").mkdir(parents=True)  # a relative folder, as a recipe names it
    monkeypatch.chdir(tmp_path)
    config.base_model_name_or_path = "mymodels/llama"
    assert 'base_model="<base model folder or Hub id>")' in model_card(config)
    (tmp_path / "smollm2-135m-instruct").mkdir()  # a folder named like a default model, which loads by name
    config.base_model_name_or_path = "smollm2-135m-instruct"
    assert 'from_pretrained("<this repo or folder>")\n' in model_card(config)
    config.base_model_name_or_path = None  # heads on a model built from a config: from_pretrained refused the usage
    card = model_card(config)
    assert "# config.json names no base model: give it\n" in card
    assert 'base_model="<base model folder or Hub id>")' in card and "# add --model <base model folder" in card


def test_the_uploaded_card_names_the_repo_as_created(tmp_path, monkeypatch):
    """A bare name is the user's repo: the card said from_pretrained("heads"), which loads nothing."""
    from types import SimpleNamespace

    import huggingface_hub

    from medusa_infer.checkpoint import push_folder_to_hub

    uploaded = {}

    class Api:
        def __init__(self, token=None):
            pass

        def create_repo(self, repo_id, private=None, exist_ok=False):
            return SimpleNamespace(repo_id=repo_id if "/" in repo_id else f"me/{repo_id}")

        def upload_folder(self, repo_id, folder_path, **options):
            uploaded[repo_id] = (Path(folder_path) / "README.md").read_text()
            return SimpleNamespace(commit_url="https://hub.example/commit")

    monkeypatch.setattr(huggingface_hub, "HfApi", Api)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    tiny_heads().save_pretrained(tmp_path / "heads")
    push_folder_to_hub(tmp_path / "heads", "heads")
    assert 'from_pretrained("me/heads")' in uploaded["me/heads"] and "<this repo or folder>" not in uploaded["me/heads"]
