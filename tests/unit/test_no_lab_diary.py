"""Code says what it does and why, in the present tense: numbered trials, rounds, sessions and per-call machine
stories belong in docs/decisions.md, never in comments, docstrings or messages under src/, csrc/, benchmarks/
or CMakeLists.txt."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("src", "csrc", "benchmarks", "scripts")
SUFFIXES = {".py", ".cpp", ".h", ".inc", ".cu", ".sh", ".txt", ".cmake"}

DIARY = re.compile("|".join((
    r"\bsessions? \d+",                  # "session 16", "sessions 14-15"
    r"\b(device )?rounds? r\d+",         # "round r2", "device round r1"
    r"\br\d+ of session",
    r"\bcalls? \d+(-\d+)?'s",            # "call 3's machine", "calls 3-4's"
    r"'s trials?\b|\btrials? (of|knobs?|switch(es)?|runs?)\b",  # "session 17's trial", "the trial knobs"
    r"\bnot kept\b",
    r"\btried (in|and|on|it|a|an|the)\b",  # "tried in session 16", "Tried a 16th worker"
    r"\bwas reverted\b",
)), re.IGNORECASE)


def code_files():
    files = [ROOT / "CMakeLists.txt"]
    for top in SOURCES:
        files += [p for p in sorted((ROOT / top).rglob("*")) if p.suffix in SUFFIXES and p.is_file()]
    return files


def test_the_scan_sees_the_code():
    names = {p.relative_to(ROOT).as_posix() for p in code_files()}
    assert {"CMakeLists.txt", "src/hybridmoe/config.py", "csrc/moe/moe_layer.cpp"} <= names


@pytest.mark.parametrize("phrase", ["session 16's trial", "device round r2", "call 3's machine", "recorded, not kept",
                                    "Tried a 16th worker", "r2 of session 6"])
def test_the_pattern_catches_diary_phrases(phrase):
    assert DIARY.search(phrase)


@pytest.mark.parametrize("phrase", ["the next round of items", "rows r0..r7", "called 3 times", "a sessions table",
                                    "median over `trials` timed runs", "could not load libcudart; tried:"])
def test_the_pattern_leaves_plain_code_words_alone(phrase):
    assert not DIARY.search(phrase)


def test_no_lab_diary_in_code():
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()[:120]}"
             for p in code_files() for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
             if DIARY.search(line)]
    assert not found, "lab-diary phrases in code (move them to docs/decisions.md):\n" + "\n".join(found)
