"""The tracked text speaks of the product as it is.

README, docs, code comments and tests describe what the product does and what it measures now;
how the work that produced them was organised (its sessions, the order of its runs, the machine
it was written on, what a figure was until some date) is what git log is for. This scans every
tracked text file for the words that narrate that history, with an allow-list for the
legitimate uses of the same words (pytest's fixture scopes, Unix process sessions).
"""

import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
THIS_FILE = os.path.relpath(os.path.abspath(__file__), ROOT).replace(os.sep, "/")

_LOW = r"first|second|third"
_HIGH = r"fourth|fifth|sixth|seventh|eighth|ninth|tenth"
_VERY_HIGH = (r"eleventh|twelfth|[a-z]+teenth|twentieth|thirtieth|fortieth|"
              r"(?:twenty|thirty|forty)-(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth)")
_QUALIFIER = r"(?:(?:GPU|H100|device|benchmark)\s+)?"
_OCCASION = r"(?:runs?|calls?|attempts?|sessions?)\b"

# (what it is, the pattern): each match is a forbidden word
FORBIDDEN = [
    ("session", re.compile(r"\bsessions?\b", re.I)),
    ("lent", re.compile(r"\blent\b", re.I)),
    ("this VM", re.compile(r"\bthis\s+(?:VM|virtual\s+machine)\b", re.I)),
    ("the new GPU machine", re.compile(r"\bnew\s+GPU\s+machine\b", re.I)),
    ("previously", re.compile(r"\bpreviously\b", re.I)),
    # "the thirty-first", "until the eighteenth": a fraction ("a twentieth of them") is not one
    ("a run ordinal", re.compile(rf"(?<!\ba )(?<!\bone )\b(?:{_VERY_HIGH})\b", re.I)),
    # "the sixth run", "the fourth call", "the fifth GPU session"
    ("a run ordinal", re.compile(rf"\b(?:{_HIGH})\s+{_QUALIFIER}{_OCCASION}", re.I)),
    # "the first GPU run", "the second H100 call": a first attempt of a run is product text
    ("a run ordinal", re.compile(rf"\b(?:{_LOW}|{_HIGH})\s+(?:GPU|H100|device)\s+{_OCCASION}", re.I)),
    ("a run ordinal", re.compile(rf"\b(?:{_LOW}|{_HIGH}|{_VERY_HIGH})\s+of\s+the\s+day\b", re.I)),
    # "8% until 2026-11-26", "since 2026-11-27's model": dated history (a dated figure is fine)
    ("dated history", re.compile(r"\b(?:until|since|before)\s+(?:the\s+)?\d{4}-\d{2}-\d{2}\b", re.I)),
    ("dated history", re.compile(r"\b\d{4}-\d{2}-\d{2}'s\b")),
]

# legitimate uses of the same words, blanked out before the forbidden ones are looked for
ALLOWED = re.compile(
    r"""scope\s*=\s*["']session["']"""        # pytest's fixture scope
    r"|\bstart_new_session\b"                 # subprocess: the child in a new process session
    r"|\bsession_(?:latest|dir|name|id)\b"    # Ray's session directories
    r"|\b(?:unix|posix|process|login)\s+sessions?\b"
    r"|\bsessions?\s+(?:id|leader)s?\b",      # setsid(2)'s terms
    re.I)


def forbidden_words(text: str) -> list[tuple[int, str, str]]:
    """(line number, what it is, the words) for every forbidden match in `text`, in order."""
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        line = ALLOWED.sub(lambda m: " " * len(m.group(0)), line)
        hits = sorted((m.start(), -len(m.group(0)), name, m.group(0))
                      for name, pattern in FORBIDDEN for m in pattern.finditer(line))
        end = 0
        for start, minus_length, name, words in hits:  # the longest at each place; none inside it
            if start >= end:
                found.append((number, name, words))
                end = start - minus_length
    return found


def _is_text(path: str) -> bool:
    with open(path, "rb") as f:
        head = f.read(8192)
    if b"\0" in head:
        return False
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as exc:  # a multi-byte character cut at the end is still text
        return exc.start >= len(head) - 3
    return True


def scan(root: str, paths: list[str]) -> list[str]:
    """'path:line: "words" (what it is)' for every forbidden word in the text files among `paths`
    (relative to `root`); JSON (measured results) and this file (its word list) are not read."""
    problems = []
    for rel in paths:
        path = os.path.join(root, rel)
        if rel == THIS_FILE or rel.endswith(".json") or not os.path.isfile(path) or not _is_text(path):
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        problems += [f'{rel}:{number}: "{words}" ({name})' for number, name, words in forbidden_words(text)]
    return problems


def _tracked_files() -> list[str]:
    if not os.path.isdir(os.path.join(ROOT, ".git")) and not os.path.isfile(os.path.join(ROOT, ".git")):
        pytest.skip("not a git checkout: the tracked files are git's to list")
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    return [p for p in listed.stdout.decode("utf-8").split("\0") if p]


def test_no_tracked_text_narrates_how_the_work_was_organised():
    files = _tracked_files()
    assert "README.md" in files and "elixir_ray/__init__.py" in files  # the listing is the repository's
    problems = scan(ROOT, files)
    assert not problems, "words that narrate history, not the product:\n" + "\n".join(problems)


def test_the_scan_names_file_line_and_word_of_a_planted_one(tmp_path):
    planted = tmp_path / "notes.md"
    planted.write_text("The pool loads chunks ahead.\n\nMeasured in the sixth run on the H100.\n"
                       "Written during a session on this VM; lent for it.\n"
                       "The margin was 8% until 2026-11-26, in the thirty-first attempt.\n")
    (tmp_path / "result.json").write_text('{"note": "the sixth session"}')  # measured data: not read
    problems = scan(str(tmp_path), ["notes.md", "result.json"])
    assert problems == ['notes.md:3: "sixth run" (a run ordinal)',
                        'notes.md:4: "session" (session)',
                        'notes.md:4: "this VM" (this VM)',
                        'notes.md:4: "lent" (lent)',
                        'notes.md:5: "until 2026-11-26" (dated history)',
                        'notes.md:5: "thirty-first" (a run ordinal)']


@pytest.mark.parametrize("text", [
    '@pytest.fixture(scope="session")',
    "@pytest.fixture(scope='session')",
    "subprocess.Popen(cmd, start_new_session=True)  # its own process session, its session id",
    "os.setsid() makes the child a session leader",
    "Ray keeps its logs under /tmp/ray/session_latest",
    "A second run given the same outputs is refused; the first attempt profiles the workers.",
    "over made-up orders, a twentieth of them at less than 0.76 of the depth",
    "measured on one H100 (2026-11-27, commit 0befa46)",
    "every 4th host chunk by Deep Optimizer States; the first call each new worker answers",
])
def test_the_scan_leaves_legitimate_uses_alone(text):
    assert forbidden_words(text) == []
