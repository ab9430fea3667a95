"""Texts of the eight-domain demo corpus that are read from the Debian system (demo-e32).

Each domain is a sorted list of files, split by position (every ``HELD_OUT_EVERY``-th
file is held out, as :mod:`moejax.demo.corpus` splits the Python sources), capped at
``MAX_FILES`` files per domain by taking evenly spaced ones, and cut into windows of
consecutive non-blank lines. The file lists are what the training log records, so the
corpus can be rebuilt and its size is known.

* ``c``         -- C headers under ``/usr/include``;
* ``shell``     -- shell scripts (a ``sh``/``bash`` first line, or ``*.sh``) under
  ``/usr/bin``, ``/usr/sbin``, ``/etc``, ``/usr/share`` and Debian's ``/usr/lib`` dirs;
* ``config``    -- ``*.conf``, ``*.cfg``, ``*.ini``, ``*.yaml``, ``*.yml``, ``*.toml`` and
  ``/etc/default`` files under ``/etc`` and ``/usr/share``;
* ``debian``    -- ``changelog.Debian.gz`` files and English man pages (roff source).
"""

from __future__ import annotations

import functools
import gzip
import os
import re
from pathlib import Path
from typing import Callable, Iterator, Literal

Split = Literal["train", "eval"]
HELD_OUT_EVERY = 7
MAX_FILES = 400            # per domain and both splits together; bounds the log and the read time
MAX_FILE_BYTES = 1 << 18   # a longer file contributes its first 256 KiB
MAX_LINE_CHARS = 100

SHELL_ROOTS = ("/usr/bin", "/usr/sbin", "/etc", "/usr/share", "/usr/lib/x86_64-linux-gnu",
               "/usr/lib/init", "/usr/lib/dpkg", "/usr/lib/apt", "/usr/lib/systemd")
CONFIG_ROOTS = ("/etc", "/usr/share")
CONFIG_SUFFIXES = (".conf", ".cfg", ".ini", ".yaml", ".yml", ".toml")
# Directories whose files are not this domain's text (translations, docs, time zones).
SKIP_DIRS = frozenset({"locale", "man", "doc", "zoneinfo", "i18n", "perl", "perl5", "info",
                       "help", "icons", "fonts", "mime", "terminfo"})
SHEBANGS = (b"#!/bin/sh", b"#! /bin/sh", b"#!/bin/bash", b"#! /bin/bash", b"#!/usr/bin/env bash",
            b"#!/usr/bin/env sh", b"#!/bin/dash")


def _walk(roots: tuple[str, ...]) -> Iterator[Path]:
    """Regular files (not links) under ``roots``, skipping :data:`SKIP_DIRS` and Python
    package trees; sorted walk so the order never depends on the file system."""
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS
                                 and not d.startswith("python") and d != "node_modules")
            for name in sorted(filenames):
                path = Path(dirpath, name)
                if not path.is_symlink() and path.is_file():
                    yield path


def _is_shell(path: Path) -> bool:
    if path.suffix == ".sh":
        return True
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            return False
        with open(path, "rb") as fh:
            return fh.read(32).startswith(SHEBANGS)
    except OSError:
        return False


def _c_files() -> list[Path]:
    return sorted(Path("/usr/include").rglob("*.h"))


def _shell_files() -> list[Path]:
    return sorted({p for p in _walk(SHELL_ROOTS) if _is_shell(p)})


def _config_files() -> list[Path]:
    return sorted({p for p in _walk(CONFIG_ROOTS)
                   if p.suffix in CONFIG_SUFFIXES or p.parent == Path("/etc/default")})


def _debian_files() -> list[Path]:
    changelogs = sorted(Path("/usr/share/doc").glob("*/changelog.Debian.gz"))
    manuals = sorted(p for section in sorted(Path("/usr/share/man").glob("man[1-8]"))
                     for p in section.glob("*.gz"))
    # Half changelogs, half man pages, so neither crowds out the other.
    half = MAX_FILES // 2
    return _evenly(changelogs, half) + _evenly(manuals, half)


FINDERS: dict[str, Callable[[], list[Path]]] = {
    "c": _c_files, "shell": _shell_files, "config": _config_files, "debian": _debian_files}


def _evenly(paths: list[Path], count: int) -> list[Path]:
    """At most ``count`` of ``paths``, evenly spaced (deterministic)."""
    if len(paths) <= count:
        return list(paths)
    return [paths[i * len(paths) // count] for i in range(count)]


@functools.lru_cache(maxsize=None)
def domain_files(domain: str) -> tuple[str, ...]:
    """Every file the domain reads (both splits), sorted; raises if there are none."""
    if domain not in FINDERS:
        raise ValueError(f"no system texts for domain {domain!r}; known: {sorted(FINDERS)}")
    paths = _evenly(FINDERS[domain](), MAX_FILES)
    if not paths:
        raise RuntimeError(f"found no files for the demo corpus domain {domain!r} on this "
                           "machine (it reads what Debian installs; see moejax/demo/system_texts.py)")
    return tuple(os.fspath(p) for p in sorted(paths))


def split_files(domain: str, split: Split) -> list[str]:
    """The domain's files of ``split`` (every :data:`HELD_OUT_EVERY`-th one is held out)."""
    files = domain_files(domain)
    held = {i for i in range(len(files)) if i % HELD_OUT_EVERY == 3}
    return [p for i, p in enumerate(files) if (i in held) == (split == "eval")]


def read_text(path: str) -> str:
    """ASCII text of a file (gzip-decompressed if ``*.gz``), first :data:`MAX_FILE_BYTES`."""
    try:
        if path.endswith(".gz"):
            with gzip.open(path, "rb") as fh:
                raw = fh.read(MAX_FILE_BYTES)
        else:
            with open(path, "rb") as fh:
                raw = fh.read(MAX_FILE_BYTES)
    except (OSError, EOFError):
        return ""
    return raw.decode("utf-8", "ignore").encode("ascii", "ignore").decode()


def line_windows(text: str, step: int = 7) -> list[str]:
    """Windows of 4-10 consecutive non-blank lines (shorter than :data:`MAX_LINE_CHARS`),
    every ``step`` lines, that contain a letter."""
    lines = [ln.rstrip() for ln in text.splitlines()]
    lines = [ln for ln in lines if ln.strip() and len(ln) < MAX_LINE_CHARS]
    out = []
    for start in range(0, max(0, len(lines) - 4), step):
        chunk = "\n".join(lines[start:start + 4 + (start // step) % 7])
        if re.search(r"[A-Za-z]", chunk):
            out.append(chunk)
    return out


def domain_chunks(domain: str, split: Split) -> list[str]:
    """The line windows of every file of the domain's split."""
    return [chunk for path in split_files(domain, split) for chunk in line_windows(read_text(path))]
