"""Every repository path that README.md and docs/*.md name exists.

A path counts as named when it sits in an inline code span (`router/server.py`,
`python bench/compare.py --rounds 2`, `router/http/app.py:create_app`,
`tests/test_e2e.py::test_x`) or is a relative link's target. Inside a code span
each word is a candidate:

- a word that starts with one of the repository's top-level folders
  (`disagg/`, `tests/`, `bench/`, `deploy/`, ...) must exist as that path;
- a word with a source file's extension but no such folder in front
  (`decode_loop.py`, `backends/slot_kv_cache.py`: a path relative to a folder the
  sentence named) must be the tail of some file in the repository;
- `python -m pkg.module` must name a module of this repository;
- a `:name` or `::name` after a file must be defined in that file.

Addresses (`HOST:PORT`, `127.0.0.1:50050`, `dns:///NAME:PORT`), URL paths
(`/v1/completions`), dotted Python names outside `python -m`, and paths
outside the repository (`/tmp/...`, `~/.cache/...`) are not paths of the
repository and are left alone. A link into a Markdown file with a `#anchor`
must find a heading with that anchor.

The benchmarks' dated history (bench/results/HISTORY.md) is not among them:
its runs are kept as written, and the paths in them were true for the commits
they were measured on.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXEMPT: set[str] = set()  # documents under docs/ left unchecked (none now; see the docstring)
# Outputs the documented commands write (git-ignored), named as where to look, not as sources.
GENERATED = ("bench/results/", "bench/peers/.venv-vllm/")
# A bare file name with one of these extensions names a source of ours; other bare names (`config.json`,
# `worker.json`) are usually files a user or the code writes, and are left alone.
SOURCE_EXTENSIONS = (".py", ".pyi", ".c", ".h", ".proto", ".md", ".sh", ".yaml", ".yml", ".tpl")
SKIPPED_DIRS = {".git", ".venv", ".venv-nxdi-transformers", "__pycache__", ".pytest_cache", "build", "dist", ".cache"}

CODE_SPAN = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"\]\(([^)\s]+)\)")
PYTHON_M = re.compile(r"python3? -m ([A-Za-z_][\w.]*)")
# What separates words in a command: spaces and the punctuation around paths in prose and flags.
WORD_SPLIT = re.compile(r"[\s,;()\[\]{}\"'=|<>]+")
DEFINITION = "^[ \t]*(?:async[ \t]+)?(?:def|class)[ \t]+{name}\\b|^{name}[ \t]*[:=]"


@dataclass(frozen=True)
class Mention:
    doc: str  # the document, relative to the repository root
    line: int
    text: str  # the path as the document wrote it

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: {self.text}"


def documents() -> list[Path]:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return [doc for doc in docs if doc.relative_to(ROOT).as_posix() not in EXEMPT]


def repository_files(root: Path = ROOT) -> list[str]:
    """Every file under the root as a relative posix path, without virtualenvs and caches."""
    files = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [name for name in subfolders if name not in SKIPPED_DIRS]
        files += [(Path(folder) / name).relative_to(root).as_posix() for name in names]
    return files


def top_level_folders(root: Path = ROOT) -> set[str]:
    return {path.name for path in root.iterdir() if path.is_dir() and path.name not in SKIPPED_DIRS}


def prose_lines(text: str):
    """(line number, line) for every line outside fenced code blocks (those are shell sessions, not mentions)."""
    fenced = False
    for number, line in enumerate(text.splitlines(), start=1):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        elif not fenced:
            yield number, line


def candidate_words(span: str) -> list[str]:
    return [word.rstrip(".:") for word in WORD_SPLIT.split(span) if word.rstrip(".:")]


def split_suffix(word: str) -> tuple[str, str | None]:
    """`a/b.py::test_x` -> (`a/b.py`, `test_x`); `a/b.py:create_app` -> (`a/b.py`, `create_app`)."""
    path, sep, name = word.partition("::")
    if not sep:
        path, sep, name = word.partition(":")
    return path, (name or None) if sep else None


def is_placeholder(word: str) -> bool:
    return "..." in word or "NAME" in word or "$" in word or word.startswith(("/", "~", "http:", "https:", "dns:"))


def check_word(word: str, roots: set[str], files: list[str], root: Path) -> str | None:
    """Why `word` is a broken repository path, or None when it exists or is not a repository path."""
    if is_placeholder(word):
        return None
    path, name = split_suffix(word)
    path = path.removeprefix("./")
    first = path.split("/", 1)[0]
    if "/" in path and first in roots:
        if path.startswith(GENERATED):
            return None
        if "*" in path:
            return None if list(root.glob(path)) else "matches no file"
        if not (root / path).exists():
            return "does not exist"
        return check_name(root / path, name)
    if path.endswith(SOURCE_EXTENSIONS) and re.fullmatch(r"[\w./-]+", path) and not path.startswith("."):
        tails = [file for file in files if file == path or file.endswith("/" + path)]
        if not tails:
            return "is no file's name or tail in the repository"
        return None if name is None else min((check_name(root / tail, name) for tail in tails), key=lambda why: why is not None)
    return None


def check_name(file: Path, name: str | None) -> str | None:
    """`name` (a function, class or test; `Class.method` checks the last part) is defined in `file`."""
    if name is None or file.is_dir():
        return None
    if name.isdigit():
        return None if int(name) <= len(file.read_text(errors="replace").splitlines()) else f"has no line {name}"
    last = name.rsplit(".", 1)[-1]
    if not re.fullmatch(r"[A-Za-z_]\w*", last):
        return None
    pattern = DEFINITION.format(name=re.escape(last))
    return None if re.search(pattern, file.read_text(errors="replace"), re.MULTILINE) else f"defines no {last}"


def check_module(module: str, roots: set[str], root: Path) -> str | None:
    parts = module.split(".")
    if parts[0] not in roots:
        return None  # another project's module (pytest, grpc_tools, ...)
    base = root.joinpath(*parts)
    found = base.with_suffix(".py").is_file() or (base / "__init__.py").is_file() or (base / "__main__.py").is_file()
    return None if found else "is no module of this repository"


def heading_anchors(markdown: str) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    anchors = set()
    for _, line in prose_lines(markdown):
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", match.group(1)).strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", text).replace(" ", "-"))
    return anchors


def check_link(target: str, doc: Path, root: Path) -> str | None:
    if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#") and not target[1:]:
        return None  # http:, https:, mailto:
    path_part, _, anchor = target.partition("#")
    file = (doc.parent / path_part).resolve() if path_part else doc
    if not file.exists():
        return "does not exist"
    if root not in file.parents and file != root:
        return "lies outside the repository"
    if anchor and file.suffix == ".md" and anchor not in heading_anchors(file.read_text()):
        return f"has no heading with the anchor #{anchor}"
    return None


def broken_mentions(doc: Path, root: Path = ROOT, files: list[str] | None = None) -> list[str]:
    """Every broken path `doc` names, as 'doc:line: path (why)'."""
    files = repository_files(root) if files is None else files
    roots = top_level_folders(root)
    name = doc.relative_to(root).as_posix()
    broken = []
    for number, line in prose_lines(doc.read_text()):
        for span in (match.group(2) for match in CODE_SPAN.finditer(line)):
            for module in PYTHON_M.findall(span):
                why = check_module(module, roots, root)
                if why:
                    broken.append(f"{Mention(name, number, 'python -m ' + module)} ({why})")
            for word in candidate_words(PYTHON_M.sub(" ", span)):
                why = check_word(word, roots, files, root)
                if why:
                    broken.append(f"{Mention(name, number, word)} ({why})")
        for target in LINK.findall(CODE_SPAN.sub("", line)):
            why = check_link(target, doc, root)
            if why:
                broken.append(f"{Mention(name, number, target)} ({why})")
    return broken


@pytest.fixture(scope="module")
def files() -> list[str]:
    return repository_files()


@pytest.mark.parametrize("doc", documents(), ids=lambda doc: doc.relative_to(ROOT).as_posix())
def test_every_path_a_doc_names_exists(doc: Path, files: list[str]):
    broken = broken_mentions(doc, files=files)
    assert not broken, "paths named in the docs that the repository does not have:\n" + "\n".join(broken)


def test_the_docs_are_found():
    names = {doc.relative_to(ROOT).as_posix() for doc in documents()}
    assert {"README.md", "docs/architecture.md", "docs/benchmarks.md"} <= names
    assert not names & EXEMPT


def test_a_missing_path_is_reported_with_its_file_and_line(tmp_path: Path):
    """The checker itself: each kind of broken mention fails, naming the line; what is not a path passes."""
    (tmp_path / "pkg" / "engine").mkdir(parents=True)
    (tmp_path / "pkg" / "engine" / "sampler.py").write_text("def sample():\n    pass\n\nclass Sampler:\n    pass\n")
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "other.md").write_text("# Other page\n\n## The KV hand-off: gRPC and NIXL\n")
    doc = tmp_path / "docs" / "page.md"
    doc.write_text(
        "\n".join(
            [
                "Fine: `pkg/engine/sampler.py`, `pkg/engine/sampler.py:sample`, `pkg/engine/sampler.py::Sampler`,",
                "`python pkg/engine/sampler.py --x 1`, `engine/sampler.py`, `./sampler.py`, `python -m pkg`, `pkg/engine/`.",
                "Not paths: `HOST:PORT`, `127.0.0.1:50050`, `dns:///NAME:PORT`, `/v1/completions`, `pkg.engine.sampler`,",
                "`~/.cache/disagg`, `/tmp/bench-cdf.png`, `UCX_TLS=tcp`, [a site](https://example.com), [p](other.md#other-page).",
                "```",
                "cat pkg/inside_a_fence.py",
                "```",
                "Broken: `pkg/engine/kv_wire.py`",
                "`python pkg/gone.py --flag`, `pkg/engine/sampler.py:decode`, `kv_wire.py`, `python -m pkg.gone`,",
                "[missing](../pkg/nothing.md), [bad anchor](other.md#no-such-heading), [good](other.md#the-kv-hand-off-grpc-and-nixl)",
            ]
        )
    )
    broken = broken_mentions(doc, root=tmp_path)
    assert broken == [
        "docs/page.md:8: pkg/engine/kv_wire.py (does not exist)",
        "docs/page.md:9: pkg/gone.py (does not exist)",
        "docs/page.md:9: pkg/engine/sampler.py:decode (defines no decode)",
        "docs/page.md:9: kv_wire.py (is no file's name or tail in the repository)",
        "docs/page.md:9: python -m pkg.gone (is no module of this repository)",
        "docs/page.md:10: ../pkg/nothing.md (does not exist)",
        "docs/page.md:10: other.md#no-such-heading (has no heading with the anchor #no-such-heading)",
    ]
