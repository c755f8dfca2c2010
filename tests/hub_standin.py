"""A stand-in for the Hugging Face Hub, for tests: an HTTP server on 127.0.0.1 that answers the endpoints
huggingface_hub 2.x calls to upload a model (read from its source: hf_api.py, _commit_api.py, lfs.py) as the
Hub answers them, and records every request.

- GET /api/whoami-v2: the token's user, orgs and role; 401 for a token it does not know.
- POST /api/repos/create: a repo with .gitattributes on main (409 when it exists; 401/403 for a bad token).
- GET /api/models/OWNER/NAME[/revision/REV]: the repo's files at REV (404 RepoNotFound / RevisionNotFound).
- POST /api/models/OWNER/NAME/branch/BRANCH: a branch from main.
- POST /api/validate-yaml: the README's front matter must parse (yaml.safe_load).
- POST /api/models/OWNER/NAME/preupload/REV: "lfs" for weights (.safetensors, .gguf), "regular" for the rest,
  as the Hub's .gitattributes decides.
- POST /OWNER/NAME.git/info/lfs/objects/batch, PUT /lfs-objects/OID, POST .../verify: the LFS protocol (basic
  transfer). The Xet protocol (a CAS server of its own) is not spoken: tests set HF_HUB_DISABLE_XET=1, and
  huggingface_hub then uploads over LFS, as it does wherever hf_xet is not installed.
- POST /api/models/OWNER/NAME/commit/REV: the ndjson commit, applied to the branch only once the whole request
  has arrived and every LFS object it names is stored: a commit is whole or absent, as on the Hub.

`fail` makes one endpoint fail: {"commit": "drop"} closes the connection halfway through the commit's body,
{"commit": 500} answers a server error."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

import yaml

GITATTRIBUTES = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n*.gguf filter=lfs diff=lfs merge=lfs -text\n"
LFS_SUFFIXES = (".safetensors", ".gguf", ".bin")
REPO = r"(?P<repo>[\w.-]+/[\w.-]+)"


class StandInHub:
    def __init__(self, tokens: dict[str, dict] | None = None):
        # token -> {"name": user, "orgs": [...], "role": "write" | "read"}
        self.tokens = tokens or {"hf_good": {"name": "alice", "orgs": ["acme"], "role": "write"}}
        self.repos: dict[str, dict] = {}  # repo id -> {"private": bool, "branches": {name: {path: bytes}}, ...}
        self.lfs: dict[str, bytes] = {}  # oid -> content
        self.requests: list[dict] = []  # method, path, json (when JSON), token
        self.commits: list[dict] = []  # repo, revision, summary, paths
        self.fail: dict[str, object] = {}
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self) -> "StandInHub":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def add_repo(self, repo: str, files: dict[str, bytes] | None = None, private: bool = False) -> None:
        self.repos[repo] = {"private": private,
                            "branches": {"main": {".gitattributes": GITATTRIBUTES, **(files or {})}}}

    def files(self, repo: str, revision: str = "main") -> dict[str, bytes]:
        return dict(self.repos[repo]["branches"][revision])

    def calls(self, method: str, pattern: str) -> list[dict]:
        return [r for r in self.requests if r["method"] == method and re.search(pattern, r["path"])]


def free_port() -> int:
    """A port nothing listens on (bound, then closed): the Hub unreachable, connection refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _front_matter(text: str) -> dict | None:
    found = re.match(r"^---\n(.*?)\n---\n", text, re.S)
    return yaml.safe_load(found.group(1)) if found else None


def _handler(hub: StandInHub):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet
            pass

        # ------------------------------------------------------------ plumbing
        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                data = b""
                while True:
                    size = int(self.rfile.readline().strip().split(b";")[0], 16)
                    if size == 0:
                        self.rfile.readline()
                        return data
                    data += self.rfile.read(size)
                    self.rfile.readline()
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _send(self, status: int, payload=None, headers: dict | None = None) -> None:
            body = json.dumps(payload if payload is not None else {}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body)

        def _user(self) -> dict | None:
            auth = self.headers.get("Authorization", "")
            return hub.tokens.get(auth.removeprefix("Bearer ").strip()) if auth.startswith("Bearer ") else None

        def _record(self, body: bytes) -> None:
            try:
                parsed = json.loads(body) if body and self.headers.get("Content-Type", "").startswith(
                    "application/json") else None
            except ValueError:
                parsed = None
            with hub.lock:
                hub.requests.append({"method": self.command, "path": urlsplit(self.path).path,
                                     "query": urlsplit(self.path).query, "json": parsed,
                                     "token": self.headers.get("Authorization", "").removeprefix("Bearer ")})

        def _may_write(self, repo: str) -> bool:
            user = self._user()
            if user is None:
                self._send(401, {"error": "Invalid credentials in Authorization header"})
                return False
            if user["role"] != "write" or repo.split("/")[0] not in [user["name"], *user["orgs"]]:
                self._send(403, {"error": "You don't have the rights to create a model under this namespace"})
                return False
            return True

        # ------------------------------------------------------------ routes
        def do_GET(self) -> None:
            path = urlsplit(self.path).path
            self._record(b"")
            if path == "/api/whoami-v2":
                user = self._user()
                if user is None:
                    return self._send(401, {"error": "Invalid credentials in Authorization header"})
                return self._send(200, {"type": "user", "name": user["name"],
                                        "orgs": [{"name": o} for o in user["orgs"]],
                                        "auth": {"type": "access_token",
                                                 "accessToken": {"displayName": "test", "role": user["role"]}}})
            found = re.fullmatch(rf"/api/models/{REPO}(?:/revision/(?P<rev>[^/]+))?", path)
            if found:
                return self._model_info(found["repo"], unquote(found["rev"] or "main"))
            self._send(404, {"error": f"stand-in: no route GET {path}"})

        def _model_info(self, repo: str, rev: str) -> None:
            if repo not in hub.repos:
                return self._send(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
            branches = hub.repos[repo]["branches"]
            if rev not in branches:
                return self._send(404, {"error": f"Invalid rev id: {rev}"}, {"X-Error-Code": "RevisionNotFound"})
            files = branches[rev]
            readme = files.get("README.md")
            self._send(200, {"id": repo, "sha": hashlib.sha1(repr(sorted(files)).encode()).hexdigest(),
                             "private": hub.repos[repo]["private"],
                             "siblings": [{"rfilename": name} for name in sorted(files)],
                             **({"cardData": _front_matter(readme.decode())} if readme else {})})

        def do_PUT(self) -> None:
            path = urlsplit(self.path).path
            found = re.fullmatch(r"/lfs-objects/(?P<oid>[0-9a-f]{64})", path)
            body = self._body()
            self._record(b"")
            if not found:
                return self._send(404, {"error": f"stand-in: no route PUT {path}"})
            if hashlib.sha256(body).hexdigest() != found["oid"]:
                return self._send(400, {"error": "sha256 mismatch"})
            with hub.lock:
                hub.lfs[found["oid"]] = body
            self._send(200, {})

        def do_POST(self) -> None:
            path = urlsplit(self.path).path
            kind = next((name for name, pattern in ROUTES if re.fullmatch(pattern, path)), None)
            if kind == "commit" and hub.fail.get("commit") == "drop":  # half the body, then the connection is gone
                self.rfile.read(int(self.headers.get("Content-Length") or 0) // 2)
                self._record(b"")
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            body = self._body()
            self._record(body)
            if kind is None:
                return self._send(404, {"error": f"stand-in: no route POST {path}"})
            getattr(self, f"_{kind}")(re.fullmatch(dict(ROUTES)[kind], path), body)

        def _create(self, _, body: bytes) -> None:
            payload, user = json.loads(body), self._user() or {}
            repo = f"{payload.get('organization') or user.get('name')}/{payload['name']}"
            if not self._may_write(repo):
                return
            if repo in hub.repos:
                return self._send(409, {"error": "You already created this model repo", "url": f"{hub.url}/{repo}"})
            with hub.lock:
                hub.add_repo(repo, private=payload.get("visibility") == "private")
            self._send(200, {"url": f"{hub.url}/{repo}", "name": repo, "id": repo})

        def _branch(self, found, body: bytes) -> None:
            repo, branch = found["repo"], unquote(found["branch"])
            if not self._may_write(repo):
                return
            branches = hub.repos[repo]["branches"]
            if branch in branches:
                return self._send(409, {"error": "Reference already exists"})
            with hub.lock:
                branches[branch] = dict(branches[json.loads(body or b"{}").get("startingPoint") or "main"])
            self._send(200, {})

        def _validate_yaml(self, _, body: bytes) -> None:
            try:
                _front_matter(json.loads(body)["content"])
            except yaml.YAMLError as e:
                return self._send(400, {"errors": [{"message": f"invalid YAML: {e}"}]})
            self._send(200, {"errors": [], "warnings": []})

        def _preupload(self, found, body: bytes) -> None:
            if not self._may_write(found["repo"]):
                return
            files = json.loads(body)["files"]
            self._send(200, {"files": [{"path": f["path"], "shouldIgnore": False, "oid": None,
                                        "uploadMode": "lfs" if f["path"].endswith(LFS_SUFFIXES) else "regular"}
                                       for f in files]})

        def _lfs_batch(self, found, body: bytes) -> None:
            if not self._may_write(found["repo"]):
                return
            objects = []
            for obj in json.loads(body)["objects"]:
                entry = {"oid": obj["oid"], "size": obj["size"], "authenticated": True}
                if obj["oid"] not in hub.lfs:
                    entry["actions"] = {"upload": {"href": f"{hub.url}/lfs-objects/{obj['oid']}"},
                                        "verify": {"href": f"{hub.url}/{found['repo']}.git/info/lfs/objects/verify"}}
                objects.append(entry)
            self._send(200, {"transfer": "basic", "objects": objects})

        def _lfs_verify(self, _, body: bytes) -> None:
            oid = json.loads(body)["oid"]
            self._send(200 if oid in hub.lfs else 404, {})

        def _commit(self, found, body: bytes) -> None:
            repo, rev = found["repo"], unquote(found["rev"])
            if not self._may_write(repo):
                return
            if hub.fail.get("commit") is not None:
                return self._send(int(hub.fail["commit"]), {"error": "Internal Error - We're working hard to fix this"})
            if rev not in hub.repos[repo]["branches"]:
                return self._send(404, {"error": f"Invalid rev id: {rev}"}, {"X-Error-Code": "RevisionNotFound"})
            lines = [json.loads(line) for line in body.splitlines() if line.strip()]
            tree = dict(hub.repos[repo]["branches"][rev])
            for line in lines[1:]:
                value = line["value"]
                if line["key"] == "file":
                    tree[value["path"]] = base64.b64decode(value["content"])
                elif line["key"] == "lfsFile":
                    if value["oid"] not in hub.lfs:
                        return self._send(400, {"error": f"LFS object {value['oid']} not uploaded"})
                    tree[value["path"]] = hub.lfs[value["oid"]]
                elif line["key"] in ("deletedFile", "deletedFolder"):
                    tree = {k: v for k, v in tree.items()
                            if k != value["path"] and not k.startswith(value["path"] + "/")}
            sha = hashlib.sha1(body).hexdigest()
            with hub.lock:  # the whole commit at once
                hub.repos[repo]["branches"][rev] = tree
                hub.commits.append({"repo": repo, "revision": rev, "summary": lines[0]["value"]["summary"],
                                    "paths": [line["value"]["path"] for line in lines[1:]]})
            self._send(200, {"commitUrl": f"{hub.url}/{repo}/commit/{sha}", "commitOid": sha, "pullRequestUrl": None})

    return Handler


ROUTES = [("create", r"/api/repos/create"),
          ("branch", rf"/api/models/{REPO}/branch/(?P<branch>[^/]+)"),
          ("validate_yaml", r"/api/validate-yaml"),
          ("preupload", rf"/api/models/{REPO}/preupload/(?P<rev>[^/]+)"),
          ("lfs_batch", rf"/{REPO}\.git/info/lfs/objects/batch"),
          ("lfs_verify", rf"/{REPO}\.git/info/lfs/objects/verify"),
          ("commit", rf"/api/models/{REPO}/commit/(?P<rev>[^/]+)")]
