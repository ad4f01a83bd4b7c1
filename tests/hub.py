"""A local Hugging Face hub for tests: a cache laid out as huggingface_hub lays it out, and a
loopback HTTP server that answers the hub's download protocol and counts the requests.

Cache layout (what ``hf_hub_download`` reads with HF_HUB_OFFLINE=1)::

    <cache>/models--org--name/blobs/<sha256>
    <cache>/models--org--name/refs/main              (the commit hash)
    <cache>/models--org--name/snapshots/<commit>/<file> -> ../../blobs/<sha256>
"""
from __future__ import annotations

import hashlib
import os
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def commit_of(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()  # 40 hex digits, like a git commit


def repo_folder(cache_dir: str, repo_id: str) -> str:
    return os.path.join(cache_dir, "models--" + repo_id.replace("/", "--"))


def add_to_cache(cache_dir: str, repo_id: str, files: dict, *, revision: str = "main", commit: str = None) -> str:
    """Put ``files`` ({name in repo: local path}) in the cache as one commit; returns the snapshot directory."""
    commit = commit or commit_of(repo_id + revision + ",".join(sorted(files)))
    root = repo_folder(cache_dir, repo_id)
    snapshot = os.path.join(root, "snapshots", commit)
    os.makedirs(os.path.join(root, "blobs"), exist_ok=True)
    os.makedirs(os.path.join(root, "refs"), exist_ok=True)
    for name, path in files.items():
        with open(path, "rb") as f:
            data = f.read()
        blob = os.path.join(root, "blobs", hashlib.sha256(data).hexdigest())
        if not os.path.exists(blob):
            with open(blob, "wb") as f:
                f.write(data)
        link = os.path.join(snapshot, name)
        os.makedirs(os.path.dirname(link), exist_ok=True)
        os.symlink(os.path.relpath(blob, os.path.dirname(link)), link)
    if revision is not None:
        with open(os.path.join(root, "refs", revision), "w") as f:
            f.write(commit)
    return snapshot


def checkpoint_files(directory: str, skip=()) -> dict:
    """{name: path} of every file of a saved checkpoint directory (minus ``skip``)."""
    return {f: os.path.join(directory, f) for f in sorted(os.listdir(directory)) if f not in skip}


class FakeHub:
    """A hub on 127.0.0.1 serving ``repos`` ({repo_id: {file name: local path}}) at one commit.

    Point ranks at it with HF_ENDPOINT=hub.url and HF_HUB_OFFLINE=0. ``gets`` counts the
    GET requests per (repo_id, file name), i.e. how often each file was downloaded.
    """

    def __init__(self, repos: dict):
        self.repos = repos
        self.gets = Counter()
        self.heads = Counter()
        self.authorizations = set()  # Authorization headers seen (token= reaches the hub)
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _resolve(self):
                if self.headers.get("Authorization"):
                    hub.authorizations.add(self.headers["Authorization"])
                # /<org>/<name>/resolve/<revision>/<file>
                parts = self.path.split("?")[0].lstrip("/").split("/")
                if len(parts) < 5 or parts[2] != "resolve":
                    return self.path, None, "RepoNotFound"
                repo_id, filename = "/".join(parts[:2]), "/".join(parts[4:])
                if repo_id not in hub.repos:
                    return repo_id, filename, "RepoNotFound"
                if filename not in hub.repos[repo_id]:
                    return repo_id, filename, "EntryNotFound"
                return repo_id, filename, None

            def _headers(self, repo_id, filename, error):
                if error:
                    self.send_response(404)
                    self.send_header("X-Error-Code", error)
                    self.send_header("X-Error-Message", f"{error}: {repo_id}/{filename}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return None
                path = hub.repos[repo_id][filename]
                size = os.path.getsize(path)
                self.send_response(200)
                self.send_header("X-Repo-Commit", commit_of(repo_id))
                self.send_header("ETag", '"' + commit_of(repo_id + filename + str(size)) + '"')
                self.send_header("Content-Length", str(size))
                self.end_headers()
                return path

            def do_HEAD(self):  # noqa: N802
                repo_id, filename, error = self._resolve()
                hub.heads[(repo_id, filename)] += 1
                self._headers(repo_id, filename, error)

            def do_GET(self):  # noqa: N802
                repo_id, filename, error = self._resolve()
                hub.gets[(repo_id, filename)] += 1
                path = self._headers(repo_id, filename, error)
                if path is not None:
                    with open(path, "rb") as f:
                        self.wfile.write(f.read())

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
