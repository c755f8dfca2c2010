"""The confirming tasks of the quality benchmark: real text from Debian packages, in domains and answer lengths
the deciding tasks (bench/realdata.py) do not have. They confirm a default; they never pick one.

- manpage: a C library function's man page (package manpages-dev, section 3): the first paragraph of its
  DESCRIPTION in, the one-line summary of its NAME section out (a summary of prose, 3-10 words);
- translate-fr: English -> French entries of the FreeDict English-French dictionary (package
  dict-freedict-eng-fra): a word or phrase in, its French translations out (a second language pair, 1-5 words);
- closes: a Debian changelog entry of the system's required and important packages (/usr/share/doc/*/
  changelog.Debian.gz) in, the bug numbers its upload closes out, or "none" (extraction, checked exactly).
"""

from __future__ import annotations

import gzip
import re
import subprocess
from pathlib import Path

MAN3 = "manpages-dev"
FREEDICT = Path("/usr/share/dictd/freedict-eng-fra")
PACKAGES = f"{MAN3} dict-freedict-eng-fra"

# troff: font changes, and the escapes these pages use, as plain text
_FONT = re.compile(r"\\f(?:[BIRP]|\(..|\[[^]]*\])")
_ESCAPES = {r"\-": "-", r"\(em": "-", r"\(en": "-", r"\e": "\\", r"\~": " ", r"\ ": " ", r"\&": "", r"\(aq": "'",
            r"\(dq": '"', r"\(lq": '"', r"\(rq": '"', r"\|": "", r"\^": "", r"\:": "", r"\%": "", r"\(bu": "*",
            r"\(rs": "\\", r"\(ti": "~", r"\(ha": "^", r"\(ga": "`", r"\*(lq": '"', r"\*(rq": '"'}
_BREAKS = {"PP", "P", "LP", "TP", "IP", "HP", "SS", "nf", "fi", "EX", "EE", "RS", "RE", "in", "sp", "br", "TH"}
_ALTERNATING = {"BR", "RB", "IR", "RI", "BI", "IB"}  # two fonts in turn, the words joined


def _plain(line: str) -> str:
    line = _FONT.sub("", line)
    for escape, text in _ESCAPES.items():
        line = line.replace(escape, text)
    return line


def man_sections(source: str) -> dict[str, list[str]]:
    """A man page's troff source as {SECTION: paragraphs of plain text}."""
    sections: dict[str, list[str]] = {}
    paragraphs: list[str] | None = None
    words: list[str] = []

    def close():
        if words and paragraphs is not None:
            paragraphs.append(" ".join(words))
        words.clear()

    for line in source.splitlines():
        if line.startswith(('.\\"', "'\\\"")):
            continue
        macro = re.match(r"^\.(\w+)\s*(.*)$", line)
        if line.startswith(".SH"):
            close()
            paragraphs = sections.setdefault(_plain(line[3:].strip().strip('"')).upper(), [])
        elif macro and macro[1] in _BREAKS:
            close()
        elif macro and macro[1] in ("B", "I", "SM", "SB"):
            words.append(_plain(macro[2].replace('"', "")))
        elif macro and macro[1] in _ALTERNATING:
            words.append("".join(_plain(p.strip('"')) for p in re.findall(r'"[^"]*"|\S+', macro[2])))
        elif not macro and line.strip() and paragraphs is not None:
            words.append(_plain(line.strip()))
    close()
    return sections


def _package_files(package: str) -> list[Path]:
    listed = subprocess.run(["dpkg", "-L", package], capture_output=True, text=True)
    return [Path(p) for p in listed.stdout.splitlines()]


def manpage_rows() -> list[dict]:
    """Pages of section 3 whose DESCRIPTION opens with a paragraph of 12-120 words (.so links left out)."""
    rows = []
    for path in sorted(p for p in _package_files(MAN3) if "/man3/" in str(p) and p.suffix == ".gz"):
        source = gzip.open(path, "rt", encoding="utf-8", errors="replace").read()
        if source.lstrip().startswith(".so"):
            continue
        page = man_sections(source)
        name, description = " ".join(page.get("NAME", [])), page.get("DESCRIPTION", [])
        if " - " not in name or not description or not 12 <= len(description[0].split()) <= 120:
            continue
        functions, summary = (s.strip() for s in name.split(" - ", 1))
        user = f"Summarize in one line what {functions} does, from its manual:\n\n{description[0].strip()}"
        rows.append({"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": summary}]})
    return rows


_B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def _dictd_number(text: str) -> int:
    """dictd's index numbers: base 64, most significant digit first."""
    n = 0
    for c in text:
        n = n * 64 + _B64.index(c)
    return n


def translate_fr_rows() -> list[dict]:
    """Each headword's entry: the headword, its pronunciation, then its translations on the next line."""
    data = gzip.open(FREEDICT.with_suffix(".dict.dz")).read()
    rows = []
    for line in FREEDICT.with_suffix(".index").read_text(encoding="utf-8").splitlines():
        word, offset, length = line.split("\t")[:3]
        if word.startswith("00database"):
            continue
        start = _dictd_number(offset)
        entry = data[start:start + _dictd_number(length)].decode("utf-8").strip().splitlines()
        if len(entry) >= 2 and entry[1].strip():
            rows.append({"instruction": "Translate into French.", "input": word, "output": entry[1].strip()})
    return rows


# Debian's rule for the bugs an upload closes (dpkg-parsechangelog, deb-changelog(5))
_CLOSES = re.compile(r"closes:\s*(?:bug)?#?\s?\d+(?:,\s*(?:bug)?#?\s?\d+)*", re.IGNORECASE)
_ENTRY = re.compile(r"\n(?=\S+ \([^)]+\) [^;\n]+; urgency=)")
CLOSES = ("Which Debian bugs does this upload close? Answer with their numbers, comma-separated, in the order they "
          "appear, or none.")


def closed_bugs(entry: str) -> list[str]:
    """The bugs a changelog entry closes, in order, each once."""
    return list(dict.fromkeys(n for m in _CLOSES.findall(entry) for n in re.findall(r"\d+", m)))


def _base_packages() -> list[str]:
    listed = subprocess.run(["dpkg-query", "-W", "-f=${Package} ${Priority}\n"], capture_output=True, text=True)
    return sorted({line.split()[0].split(":")[0] for line in listed.stdout.splitlines()
                   if line.split()[-1] in ("required", "important")})


def closes_rows() -> list[dict]:
    """Entries of at most 1,200 characters; a bug closed twice in one entry is named once."""
    rows = []
    for package in _base_packages():
        path = Path(f"/usr/share/doc/{package}/changelog.Debian.gz")
        if not path.is_file():
            continue
        for entry in _ENTRY.split(gzip.open(path, "rt", encoding="utf-8", errors="replace").read()):
            entry = entry.strip()
            if not entry or len(entry) > 1200:
                continue
            rows.append({"instruction": CLOSES, "input": entry, "output": ", ".join(closed_bugs(entry)) or "none"})
    return rows


SETS = {"manpage": manpage_rows, "translate-fr": translate_fr_rows, "closes": closes_rows}


def missing() -> list[str]:
    """What is not installed, for the error line."""
    gone = [] if _package_files(MAN3) else [f"package {MAN3}"]
    return gone + [str(p) for p in (FREEDICT.with_suffix(".index"),) if not p.exists()]
