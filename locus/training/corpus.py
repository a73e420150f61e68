"""A multi-domain training corpus built only from text that installed Debian packages ship.

Domains (each document carries its own):
    en, de, es, it, fr   fortune cookies of the `fortunes*` packages (a language whose package is missing
                         is simply absent; Debian 12 has no `fortunes-fr`)
    python               the Python standard library's source (`libpython3.X-minimal` / `-stdlib`)
    c                    C headers under /usr/include (`libc6-dev`, `linux-libc-dev`, ...)
    math                 generated arithmetic (seeded), no package at all

The held-out split is fixed by a hash of each document's id (its source file and index), so it does not
depend on which other documents exist, on the order of the files, or on the seed. Every source file's
owning package is looked up in dpkg's database; the corpus records each package's version and the
licences its copyright file states (`sources.json`), which the model card lists.

Nothing is downloaded: `install_packages` runs `apt-get install` by package name (opt-in).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import subprocess
import sysconfig
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

from locus.errors import LocusError

FORTUNE_ROOT = Path("/usr/share/games/fortunes")
C_ROOT = Path("/usr/include")
DPKG_INFO = Path("/var/lib/dpkg/info")
# language -> (sub-directory of the fortune root, the Debian package that ships it); "" = the root itself
FORTUNE_LANGUAGES = {"en": ("", "fortunes"), "de": ("de", "fortunes-de"), "es": ("es", "fortunes-es"),
                     "it": ("it", "fortunes-it"), "fr": ("fr", "fortunes-fr")}
DOMAINS = ("en", "de", "es", "it", "fr", "python", "c", "math")
PACKAGES = ("fortunes", "fortunes-min", "fortunes-de", "fortunes-es", "fortunes-it")
# licences of packages whose copyright file is not machine-readable (DEP-5 `License:` fields)
KNOWN_LICENCES = {
    "fortunes": "BSD-4-clause (fortune-mod); the cookies are quotations, see the copyright file",
    "fortunes-min": "BSD-4-clause (fortune-mod); the cookies are quotations, see the copyright file",
    "fortunes-it": "not copyrighted: a collection of attributed quotations (fortune-it COPYING-POLICY)",
    "libc6-dev": "LGPL-2.1+ (GNU C Library, some files under other free licences; see the copyright file)",
    "linux-libc-dev": "GPL-2 WITH Linux-syscall-note", "zlib1g-dev": "Zlib", "libssl-dev": "Apache-2.0",
    "libffi-dev": "MIT", "libexpat1-dev": "MIT", "libsqlite3-dev": "public-domain", "liblzma-dev": "public-domain",
    "libbz2-dev": "BSD-style (bzip2 licence)", "libxml2-dev": "MIT",
}
PYTHON_LICENCE = "PSF-2.0"  # libpython3.X-minimal / -stdlib
# the packages whose headers make up the C domain (clear, permissive or library-exception licences)
C_PACKAGES = ("libc6-dev", "linux-libc-dev", "zlib1g-dev", "libssl-dev", "libffi-dev", "libexpat1-dev",
              "libsqlite3-dev", "liblzma-dev", "libbz2-dev", "libxml2-dev")
PYTHON_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "lib2to3",
                    "idlelib", "turtledemo", "config-3.11-x86_64-linux-gnu"}
HELDOUT_PERMILLE = 50  # 5% of the documents
MAX_DOC_CHARS = 4000


@dataclass(frozen=True)
class Document:
    id: str  # source and index: what the held-out split hashes
    domain: str
    source: str  # the file it came from ("generated" for math)
    text: str

    @property
    def split(self) -> str:
        return split_of(self.id)


def split_of(doc_id: str, heldout_permille: int = HELDOUT_PERMILLE) -> str:
    """'heldout' for a fixed ~5% of document ids, 'train' for the rest."""
    h = int.from_bytes(hashlib.sha1(doc_id.encode()).digest()[:4], "big")
    return "heldout" if h % 1000 < heldout_permille else "train"


def _read_text(path: Path) -> str:
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data.decode("latin-1")


def _by_hash(paths: list[Path]) -> list[Path]:
    """A fixed order that spreads a byte cap over all sub-directories (not the first ones alphabetically)."""
    return sorted(paths, key=lambda p: hashlib.sha1(str(p).encode()).digest())


def fortune_files(root: Path, language: str) -> list[Path]:
    sub = FORTUNE_LANGUAGES[language][0]
    d = root / sub if sub else root
    if not d.is_dir():
        return []
    return sorted(p for p in d.iterdir()
                  if p.is_file() and not p.is_symlink() and p.suffix not in (".dat", ".u8", ".gz"))


def fortunes(path: Path) -> Iterator[str]:
    """The cookies of a fortune file: texts between lines holding only '%'."""
    for cookie in re.split(r"^%\s*$", _read_text(path), flags=re.M):
        cookie = cookie.strip("\n").rstrip()
        if cookie.strip() and len(cookie) <= MAX_DOC_CHARS:
            yield cookie + "\n"


def code_blocks(text: str, max_chars: int = MAX_DOC_CHARS) -> Iterator[str]:
    """A source file cut after blank lines followed by an unindented line (top-level definitions), the
    pieces joined up to max_chars; a longer piece is cut at line ends. The blocks concatenate back to
    the file's text exactly (blank lines included)."""
    cuts = [0, *(m.end() for m in re.finditer(r"\n[ \t]*\n(?=\S)", text)), len(text)]
    buf = ""
    for a, b in zip(cuts, cuts[1:]):
        piece = text[a:b]
        if buf and len(buf) + len(piece) > max_chars:
            yield buf
            buf = ""
        buf += piece
        while len(buf) > max_chars:
            cut = buf.rfind("\n", 0, max_chars) + 1 or max_chars
            yield buf[:cut]
            buf = buf[cut:]
    if buf.strip():
        yield buf


def source_files(root: Path, suffix: str, skip_dirs: set[str] = frozenset()) -> list[Path]:
    if not root.is_dir():
        return []
    out = []
    for p in root.rglob(f"*{suffix}"):
        rel = p.relative_to(root).parts[:-1]
        if p.is_file() and not p.is_symlink() and not any(part in skip_dirs for part in rel):
            out.append(p)
    return _by_hash(out)


def arithmetic(n_docs: int, seed: int = 0, lines: int = 8) -> Iterator[str]:
    """Documents of `lines` exercises: sums, differences and products of 1-3 digit numbers."""
    rng = random.Random(seed)
    for _ in range(n_docs):
        rows = []
        for _ in range(lines):
            op = rng.choice("+-*")
            a = rng.randint(0, 10 ** rng.randint(1, 3) - 1)
            b = rng.randint(0, 10 ** rng.randint(1, 2 if op == "*" else 3) - 1)
            value = a + b if op == "+" else a - b if op == "-" else a * b
            rows.append(f"{a} {op} {b} = {value}")
        yield "\n".join(rows) + "\n"


def system_python_root() -> Path:
    """The Debian python3's standard library (a virtual environment's interpreter may live elsewhere)."""
    found = sorted(Path("/usr/lib").glob("python3.[0-9]*"), key=lambda p: int(p.name.split(".")[1]))
    return found[-1] if found else Path(sysconfig.get_paths()["stdlib"])


@dataclass
class CorpusSpec:
    fortune_root: Path = FORTUNE_ROOT
    python_root: Path = field(default_factory=system_python_root)
    c_root: Path = C_ROOT
    c_packages: tuple[str, ...] | None = C_PACKAGES  # None: every header under c_root
    dpkg_info: Path = DPKG_INFO
    max_bytes: int = 3_000_000  # per domain (text characters, roughly bytes)
    math_docs: int = 20_000
    seed: int = 0


def documents(spec: CorpusSpec) -> Iterator[Document]:
    """Every document of the corpus, domain by domain, each domain capped at spec.max_bytes."""
    for language in FORTUNE_LANGUAGES:
        yield from _capped(((f"{p}#{i}", language, str(p), text)
                            for p in fortune_files(spec.fortune_root, language)
                            for i, text in enumerate(fortunes(p))), spec.max_bytes)
    headers = source_files(spec.c_root, ".h")
    if spec.c_packages is not None:
        owners = owning_packages({str(p) for p in headers}, spec.dpkg_info)
        headers = [p for p in headers if owners.get(str(p)) in spec.c_packages]
    for domain, files in (("python", source_files(spec.python_root, ".py", PYTHON_SKIP_DIRS)), ("c", headers)):
        yield from _capped(((f"{p}#{i}", domain, str(p), text)
                            for p in files
                            for i, text in enumerate(code_blocks(_read_text(p)))), spec.max_bytes)
    yield from _capped(((f"math#{spec.seed}#{i}", "math", "generated", text)
                        for i, text in enumerate(arithmetic(spec.math_docs, spec.seed))), spec.max_bytes)


def _capped(items: Iterator[tuple[str, str, str, str]], max_bytes: int) -> Iterator[Document]:
    total = 0
    for doc_id, domain, source, text in items:
        if total >= max_bytes:
            return
        total += len(text)
        yield Document(doc_id, domain, source, text)


# --- packages and licences -------------------------------------------------------------------------

def owning_packages(paths: set[str], dpkg_info: Path = DPKG_INFO) -> dict[str, str]:
    """path -> the Debian package that installed it (paths no package lists are absent)."""
    owners: dict[str, str] = {}
    if not dpkg_info.is_dir():
        return owners
    for listing in dpkg_info.glob("*.list"):
        package = listing.stem.split(":")[0]
        try:
            for line in listing.read_text(errors="replace").splitlines():
                if line in paths:
                    owners[line] = package
        except OSError:
            continue
    return owners


def package_version(package: str) -> str:
    try:
        out = subprocess.run(["dpkg-query", "-W", "-f", "${Version}", package], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def package_licence(package: str, doc_root: Path = Path("/usr/share/doc")) -> str:
    """The licences a package's copyright file names (DEP-5 `License:` fields), or a known summary."""
    if package in KNOWN_LICENCES:
        return KNOWN_LICENCES[package]
    if package.startswith(("libpython3", "python3-distutils", "python3-lib2to3")):
        return PYTHON_LICENCE
    copyright_file = doc_root / package / "copyright"
    try:
        text = copyright_file.read_text(errors="replace")
    except OSError:
        return "unknown (no copyright file)"
    # DEP-5 licence short names only (free-text copyright files also say "License: ..." in prose)
    names = sorted({m.strip() for m in re.findall(r"^License:[ \t]*([\w.+-]+(?: (?:or|and|with|WITH) [\w.+-]+)*)[ \t]*$",
                                                   text, flags=re.M)})
    return ", ".join(names) if names else f"see {copyright_file}"


def install_packages(packages: tuple[str, ...] = PACKAGES) -> list[str]:
    """apt-get install the corpus packages not yet installed (by name); returns those it installed.
    A package the archive lacks is skipped (its domain is then absent)."""
    missing = [p for p in packages if not package_version(p)]
    installed = []
    for package in missing:
        out = subprocess.run(["apt-get", "install", "-y", "-q", package], capture_output=True, text=True)
        if out.returncode == 0:
            installed.append(package)
    return installed


# --- building ----------------------------------------------------------------------------------------

def build_corpus(spec: CorpusSpec, out_dir: str | Path) -> dict:
    """Write documents.jsonl (one JSON object per document: id, domain, split, text) and sources.json
    (per domain: documents and characters per split, and the packages the files came from with their
    versions and licences). Returns the sources summary."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stats: dict[str, dict] = {}
    files_of: dict[str, set[str]] = {}
    tmp = out_dir / "documents.jsonl.tmp"
    with tmp.open("w") as f:
        for doc in documents(spec):
            split = doc.split
            s = stats.setdefault(doc.domain, {"documents": {"train": 0, "heldout": 0}, "chars": {"train": 0, "heldout": 0}})
            s["documents"][split] += 1
            s["chars"][split] += len(doc.text)
            files_of.setdefault(doc.domain, set()).add(doc.source)
            f.write(json.dumps({"id": doc.id, "domain": doc.domain, "split": split, "text": doc.text}) + "\n")
    tmp.replace(out_dir / "documents.jsonl")
    if not stats:
        raise LocusError("the corpus is empty: no source files found (install the packages with --install-packages?)")
    owners = owning_packages({p for paths in files_of.values() for p in paths}, spec.dpkg_info)
    domains = {}
    for domain, s in stats.items():
        counts: dict[str, int] = {}
        for path in files_of[domain]:
            package = "generated" if path == "generated" else owners.get(path, "none")
            counts[package] = counts.get(package, 0) + 1
        packages = []
        for package, n in sorted(counts.items()):
            if package == "generated":
                packages.append({"package": "generated", "files": 0, "licence": "generated by locus (Apache-2.0)"})
            elif package == "none":
                packages.append({"package": "none", "files": n, "licence": "unknown (files no installed package owns)"})
            else:
                packages.append({"package": package, "version": package_version(package), "files": n,
                                 "licence": package_licence(package)})
        domains[domain] = {**s, "packages": packages}
    summary = {"format": "locus-corpus", "version": 1, "spec": {k: str(v) for k, v in asdict(spec).items()},
               "heldout_permille": HELDOUT_PERMILLE, "domains": domains}
    (out_dir / "sources.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def read_corpus(corpus_dir: str | Path) -> Iterator[dict]:
    path = Path(corpus_dir) / "documents.jsonl"
    if not path.is_file():
        raise LocusError(f"{path}: no corpus here (build it with `locus train corpus --out DIR`)")
    with path.open() as f:
        for line in f:
            yield json.loads(line)


def sources_table(summary: dict) -> str:
    """A markdown table of the corpus sources (for the model card)."""
    rows = ["| domain | documents (train / held-out) | characters (train / held-out) | packages (version): licence |",
            "|---|---|---|---|"]
    for domain, d in summary["domains"].items():
        pk = "; ".join(f"`{p['package']}`" + (f" ({p['version']})" if p.get("version") else "") + f": {p['licence']}"
                       for p in d["packages"])
        rows.append(f"| {domain} | {d['documents']['train']} / {d['documents']['heldout']} | "
                    f"{d['chars']['train']} / {d['chars']['heldout']} | {pk} |")
    return "\n".join(rows)
