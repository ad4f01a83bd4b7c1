"""benchmarks/write_docs.py rewrites docs/benchmarks.md from a sweep: the sections written by hand from other
benchmarks (generation, start-up, real sizes ...) between the planning-speed section and the full tables stay."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

from write_docs import FULL_TABLES, written_by_hand  # noqa: E402


def test_sections_written_by_hand_are_kept(tmp_path):
    page = tmp_path / "benchmarks.md"
    page.write_text("# Benchmarks\n\n## Targets\n\nold\n\n## Planning speed (meta)\n\n| a |\n|---|\n\n"
                    "## Generation\n\ntext one\n\n## Real sizes\n\ntext two\n\n" + FULL_TABLES + "\n\nold tables\n")
    kept = "\n".join(written_by_hand(str(page)))
    assert kept.startswith("## Generation") and "text one" in kept and "## Real sizes\n\ntext two" in kept
    assert "Planning speed" not in kept and "old tables" not in kept and FULL_TABLES not in kept


def test_nothing_kept_without_a_page_or_its_sections(tmp_path):
    assert written_by_hand(str(tmp_path / "missing.md")) == []
    page = tmp_path / "benchmarks.md"
    page.write_text("# Benchmarks\n\n## Planning speed\n\n| a |\n\n" + FULL_TABLES + "\n")
    assert written_by_hand(str(page)) == []
