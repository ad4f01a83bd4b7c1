"""Planned graphs on disk, one file per key, in a folder only this user can write.

Where: ``$FXPARALLEL_GRAPH_CACHE`` when set to a directory (``0`` / ``off``: no cache; ``1`` / ``on``:
the default place, not a directory named ``1``), else ``$XDG_CACHE_HOME/fxparallel/graphs``
(``~/.cache/fxparallel/graphs``): the user's own cache, not ``$HF_HOME``, which teams often share.

An entry holds generated Python that fxparallel runs, so it is read as ssh reads ``authorized_keys``
(StrictModes), and authenticated:

- the cache folder, its subfolders and each file must be owned by this user, be no symlink, and not be
  writable by group or others (checked on the opened descriptor: ``O_NOFOLLOW``, ``fstat``); a folder
  fxparallel creates is made ``0700``;
- each file carries an HMAC-SHA256 of its key and entry under a per-user secret, ``<cache>/secret.key``
  (32 random bytes, mode ``0600``, made on first use). A file with a wrong MAC, in a folder or of an owner
  that fails a check, is never decoded: a warning names it, the graph is rebuilt (and, where the folder
  passes, the file replaced).

Files are written to a temporary name and renamed into place, so concurrent ranks and processes see a
whole file or none (writers of the same key write the same bytes)."""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import stat
import tempfile
from typing import Optional

log = logging.getLogger("fxparallel")

ENV = "FXPARALLEL_GRAPH_CACHE"
_OFF = ("0", "off", "false", "no", "")
_ON = ("1", "on", "true", "yes")
SECRET = "secret.key"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0)  # a planted FIFO must not block


class Untrusted(Exception):
    """A cache folder or file fails an ownership / permission / authenticity check (the reason says which)."""


def cache_dir() -> Optional[str]:
    """The directory planned graphs are kept in, or None when the cache is off."""
    value = os.environ.get(ENV)
    if value is not None and value.strip().lower() not in _ON:
        return None if value.strip().lower() in _OFF else os.path.expanduser(value)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "fxparallel", "graphs")


def _check(fd: int, what: str, directory: bool) -> os.stat_result:
    """StrictModes on an open descriptor: owned by this user, not writable by others, of the right kind."""
    st = os.fstat(fd)
    if directory != stat.S_ISDIR(st.st_mode) or (not directory and not stat.S_ISREG(st.st_mode)):
        raise Untrusted(f"{what} is not a {'folder' if directory else 'regular file'}")
    if st.st_uid != os.geteuid():
        raise Untrusted(f"{what} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise Untrusted(f"{what} is writable by {'others' if st.st_mode & stat.S_IWOTH else 'its group'} "
                        f"(mode {stat.S_IMODE(st.st_mode):04o}); keep it writable by you only (chmod go-w)")
    return st


def _open_dir(name: str, parent: Optional[int], create: bool) -> int:
    """A checked descriptor of folder ``name`` (under the descriptor ``parent``, else a path)."""
    if create:
        try:
            os.mkdir(name, 0o700, dir_fd=parent)
        except FileExistsError:
            pass
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    except FileNotFoundError:
        raise
    except OSError as err:  # ELOOP / ENOTDIR: a symlink or a file where a folder should be
        raise Untrusted(f"{name} cannot be opened as a folder without following links ({err.strerror})") from err
    try:
        _check(fd, name, directory=True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_file(name: str, folder: int, what: str, private: bool = False) -> bytes:
    """The bytes of a checked regular file (``private``: also unreadable by others)."""
    try:
        fd = os.open(name, _FILE_FLAGS, dir_fd=folder)
    except FileNotFoundError:
        raise
    except OSError as err:
        raise Untrusted(f"{what} cannot be opened without following links ({err.strerror})") from err
    with os.fdopen(fd, "rb") as f:
        mode = _check(f.fileno(), what, directory=False).st_mode
        if private and mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise Untrusted(f"{what} is open to others (mode {stat.S_IMODE(mode):04o}); it must be 0600")
        return f.read()


def _write_file(name: str, folder_path: str, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=folder_path, prefix=".tmp-")  # mode 0600, O_EXCL
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, os.path.join(folder_path, name))
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise


def _secret(root_fd: int, root: str, create: bool) -> Optional[bytes]:
    """This user's MAC key, made on first use (linked into place whole, so a concurrent rank reads it whole)."""
    try:
        key = _read_file(SECRET, root_fd, os.path.join(root, SECRET), private=True)
    except FileNotFoundError:
        if not create:
            return None
        fd, tmp = tempfile.mkstemp(dir=root, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(32))
            try:
                os.link(tmp, os.path.join(root, SECRET))
            except FileExistsError:
                pass  # another process made it first: use theirs
        finally:
            os.unlink(tmp)
        key = _read_file(SECRET, root_fd, os.path.join(root, SECRET), private=True)
    if len(key) != 32:
        raise Untrusted(f"{os.path.join(root, SECRET)} holds {len(key)} bytes, not 32")
    return key


def _mac(secret: bytes, key: dict, entry: dict) -> str:
    return hmac.new(secret, json.dumps([key, entry], sort_keys=True).encode(), hashlib.sha256).hexdigest()


def _folders(root: str, name: str, create: bool):
    """(root fd, subfolder fd, subfolder path): both checked; the caller closes them."""
    if create:
        os.makedirs(os.path.dirname(os.path.abspath(root)), exist_ok=True)
    root_fd = _open_dir(root, None, create)
    try:
        sub_fd = _open_dir(name[:2], root_fd, create)
    except BaseException:
        os.close(root_fd)
        raise
    return root_fd, sub_fd, os.path.join(root, name[:2])


def read(name: str, key: dict) -> Optional[dict]:
    """The entry stored for ``key`` (file ``name``), or None when there is none or it cannot be trusted."""
    root = cache_dir()
    if root is None:
        return None
    path = os.path.join(root, name[:2], name + ".json")
    try:
        root_fd, sub_fd, _ = _folders(root, name, create=False)
    except FileNotFoundError:
        return None
    except (Untrusted, OSError) as why:
        log.warning("graph cache: not used: %s (in %s)", why, root)
        return None
    try:
        secret = _secret(root_fd, root, create=False)
        if secret is None:
            return None
        stored = json.loads(_read_file(name + ".json", sub_fd, path))
    except FileNotFoundError:
        return None
    except Untrusted as why:
        log.warning("graph cache: %s is not trusted (%s); rebuilding it", path, why)
        return None
    except (OSError, ValueError) as err:
        log.warning("graph cache: %s is unreadable (%s); rebuilding it", path, err)
        return None
    finally:
        os.close(sub_fd)
        os.close(root_fd)
    if not isinstance(stored, dict) or not isinstance(stored.get("mac"), str) or not hmac.compare_digest(
            stored["mac"], _mac(secret, stored.get("key"), stored.get("entry"))):
        log.warning("graph cache: %s is not authenticated by this user's key (damaged, edited, or written by "
                    "someone else); rebuilding it", path)
        return None
    if stored["key"] != key:
        changed = sorted(k for k in set(key) | set(stored["key"]) if key.get(k) != stored["key"].get(k))
        log.warning("graph cache: %s was built for another key (%s differ); rebuilding it", path, ", ".join(changed))
        return None
    return stored["entry"]


def write(name: str, key: dict, entry: dict) -> None:
    """Store ``entry`` for ``key``; a cache that cannot be written or trusted is skipped with a warning."""
    root = cache_dir()
    if root is None:
        return
    path = os.path.join(root, name[:2], name + ".json")
    try:
        root_fd, sub_fd, folder = _folders(root, name, create=True)
        try:
            secret = _secret(root_fd, root, create=True)
        finally:
            os.close(sub_fd)
            os.close(root_fd)
        text = json.dumps({"key": key, "entry": entry, "mac": _mac(secret, key, entry)}, sort_keys=True)
        _write_file(name + ".json", folder, text.encode("utf-8"))
    except Untrusted as why:
        log.warning("graph cache: not written: %s (in %s)", why, root)
    except OSError as err:
        log.warning("graph cache: cannot write %s (%s); continuing without it", path, err)
