"""The corpus builder on a fake package tree: domains, skipped files, the fixed held-out split, sources."""

from __future__ import annotations

import json

from locus.training.corpus import (Document, arithmetic, build_corpus, code_blocks, documents, package_licence,
                                   read_corpus, sources_table, split_of)
from tests.training.conftest import PY


def test_documents_per_domain_skip_indexes_symlinks_tests_and_offensive(fake_tree):
    docs = list(documents(fake_tree))
    by_domain = {}
    for d in docs:
        by_domain.setdefault(d.domain, []).append(d)
    assert set(by_domain) == {"en", "de", "python", "c", "math"}
    assert len(by_domain["en"]) == 6 and len(by_domain["de"]) == 5  # .u8 symlink, .dat, off/ not read
    assert by_domain["en"][0].text == "A penny saved is a penny earned.\n"
    assert all("test_skipped" not in d.source for d in docs)
    assert "".join(d.text for d in by_domain["python"]) == PY.replace("add", "add0")
    assert len(by_domain["math"]) == 200
    assert len({d.id for d in docs}) == len(docs)


def test_split_is_a_fixed_function_of_the_document_id():
    ids = [f"/usr/share/games/fortunes/x#{i}" for i in range(4000)]
    held = [i for i in ids if split_of(i) == "heldout"]
    assert 0.03 < len(held) / len(ids) < 0.07
    assert split_of(ids[0]) == split_of(ids[0])
    assert Document(ids[1], "en", "x", "t").split == split_of(ids[1])
    # pinned: a change of the rule would silently mix old held-out documents into training
    assert [split_of(f"doc#{i}") for i in range(60)].count("heldout") == sum(
        int.from_bytes(__import__("hashlib").sha1(f"doc#{i}".encode()).digest()[:4], "big") % 1000 < 50 for i in range(60))


def test_arithmetic_is_correct_and_seeded():
    docs = list(arithmetic(20, seed=3))
    assert docs == list(arithmetic(20, seed=3)) and docs != list(arithmetic(20, seed=4))
    for doc in docs:
        for line in doc.splitlines():
            lhs, rhs = line.split(" = ")
            assert eval(lhs) == int(rhs)


def test_code_blocks_cut_at_top_level_and_cap_length():
    text = "\n\n".join(f"def f{i}():\n    return {i}" for i in range(50))
    blocks = list(code_blocks(text, max_chars=100))
    assert all(len(b) <= 100 for b in blocks) and len(blocks) > 5
    assert "".join(blocks) == text
    assert all(b.startswith("def f") for b in blocks)


def test_build_corpus_writes_documents_and_sources(fake_tree, tmp_path):
    summary = build_corpus(fake_tree, tmp_path / "corpus")
    rows = list(read_corpus(tmp_path / "corpus"))
    assert {r["split"] for r in rows} <= {"train", "heldout"}
    assert all(r["split"] == split_of(r["id"]) for r in rows)
    on_disk = json.loads((tmp_path / "corpus" / "sources.json").read_text())
    assert on_disk == summary
    assert summary["domains"]["math"]["packages"][0]["package"] == "generated"
    assert summary["domains"]["en"]["packages"][0]["package"] == "none"  # not installed by a package here
    total = sum(d["documents"]["train"] + d["documents"]["heldout"] for d in summary["domains"].values())
    assert total == len(rows)
    assert "| math |" in sources_table(summary)


def test_package_licence_reads_dep5_names_only(tmp_path):
    doc = tmp_path / "doc" / "libfoo-dev"
    doc.mkdir(parents=True)
    doc.joinpath("copyright").write_text("Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/\n"
                                         "Files: *\nLicense: MIT\n\nFiles: b/*\nLicense: GPL-2+ or BSD-3-clause\n"
                                         "License: This prose line is not a licence name, it says more\n")
    assert package_licence("libfoo-dev", tmp_path / "doc") == "GPL-2+ or BSD-3-clause, MIT"
    assert package_licence("libpython3.11-stdlib", tmp_path / "doc") == "PSF-2.0"
    assert package_licence("absent", tmp_path / "doc").startswith("unknown")
