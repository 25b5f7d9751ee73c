"""Every measured figure in README.md and docs/*.md names, next to it, the command that prints it.

A block is a paragraph, a list item (with its parent items and the paragraph that leads its list) or a table (with
the block right before it, its caption). A block reports a measurement when it says so: measured, measures, took,
here, p50, p95, p99, median, load average, spread, cores, H200. Then every figure in it, a number with a unit of
time, rate, size or share (ms, s, tok/s, req/s, MB, GiB, %, J, W) or a ratio (1.4x, 0.98×), is a measured figure, and
the block must name its command in a code span: a `perf/NAME.py` line, a `./panel test ...` line, a `... pytest ...`
line, or `(command: ...)` for anything else. Code spans and code blocks are commands and settings, not reports;
a setting (a default, a limit, a size) in a block that reports nothing is not a measured figure. A block that reads
like a report but holds only settings is marked `<!-- not-measured -->` on the line before it: an exclusion is
written in the doc, never made by loosening the patterns here.

Every `perf/NAME.py` the docs name must exist, and every --flag written after it (in a code span or a line of a
code block) must be one the script, or a perf module it imports, defines.
"""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
UNIT = r"(?:ms|µs|s|min|minutes|seconds|h|%|tok/s|req/s|requests a second|MB/s|[KMG]i?B|J|W|[x×])"
FIGURE = re.compile(rf"(?<![\w.])\d[\d,]*(?:\.\d+)?\s?{UNIT}(?![\w/])")
REPORT = re.compile(r"\b(?:measured|measures|measuring|took|here|p50|p95|p99|median|load average|spread|cores?|H200)\b",
                    re.IGNORECASE)
COMMAND = re.compile(r"perf/\w+\.py|^(?:\w+=\S+ )*\./panel test\b|\bpytest ")  # matched against a code span
SCRIPT = re.compile(r"perf/(\w+)\.py([^`#]*(?:#.*)?)")
SKIP = "<!-- not-measured -->"


def chunks(text: str):
    """(line, indent, kind, text) of each paragraph, list item, table, heading and exclusion mark, outside code."""
    current, fenced = None, False
    for number, line in enumerate(text.splitlines() + [""], 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            fenced, stripped = not fenced, ""
        stripped = "" if fenced else stripped
        kind = ("table" if stripped.startswith("|") else "item" if re.match(r"([-*]|\d+\.) ", stripped)
                else "heading" if stripped.startswith("#") else "skip" if stripped == SKIP else "paragraph")
        if current and stripped and (kind, current[2]) in {("paragraph", "paragraph"), ("paragraph", "item"),
                                                           ("table", "table")}:
            current = (*current[:3], current[3] + " " + stripped)
            continue
        if current:
            yield current
        current = (number, len(line) - len(line.lstrip()), kind, stripped) if stripped else None


def blocks(text: str):
    """(line, text, context) of each block not marked; its context is where its command may stand: itself, a list
    item's parents and the paragraph that leads its list, an indented paragraph's item, a table's caption."""
    items, lead, previous, skip = [], "", "", False
    for line, indent, kind, body in chunks(text):
        if kind in ("heading", "skip"):
            items, lead, previous, skip = ([], "", "", False) if kind == "heading" else (items, lead, previous, True)
            continue
        if kind == "table":
            context = previous + " " + body
        elif kind == "item" or indent:
            items = [(i, t) for i, t in items if i < indent]
            context = " ".join([lead] + [t for _, t in items] + [body])
            if kind == "item":
                items.append((indent, body))
        else:
            items, lead, context = [], body, body
        if not skip:
            yield line, body, context
        previous, skip = body, False


def measured(text: str) -> list[str]:
    """The measured figures of a block: its figures outside code spans and link targets, when it reports."""
    text = re.sub(r"\]\([^)]*\)", "]", re.sub(r"`[^`]*`", "", text))
    return [m.group(0) for m in FIGURE.finditer(text)] if REPORT.search(text) else []


def names_a_command(context: str) -> bool:
    return "(command: `" in context or any(COMMAND.search(span) for span in re.findall(r"`([^`]*)`", context))


def code(text: str):
    """(line, text) of each code span and each line of a code block: where commands are written."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip().startswith("```"):
            fenced = not fenced
        else:
            yield from ([(number, line)] if fenced else [(number, span) for span in re.findall(r"`([^`]*)`", line)])


def script_errors(command: str) -> list[str]:
    """What is wrong with each perf script `command` names: it is missing, or has no such --flag."""
    errors = []
    for name, rest in SCRIPT.findall(command):
        path = ROOT / "perf" / f"{name}.py"
        if not path.is_file():
            errors.append(f"perf/{name}.py does not exist")
            continue
        source = path.read_text()
        for module in re.findall(r"^(?:from|import) (?:perf\.)?(\w+)", source, re.MULTILINE):
            source += (ROOT / "perf" / f"{module}.py").read_text() if (ROOT / "perf" / f"{module}.py").is_file() else ""
        for flag in re.findall(r"(?<![\w-])--[a-z][\w-]*", rest):  # --no-X: an argparse.BooleanOptionalAction's --X
            if f'"{flag}"' not in source and f'"--{flag.removeprefix("--no-")}"' not in source:
                errors.append(f"perf/{name}.py has no {flag}")
    return errors


def offenders(path: Path, text: str) -> list[str]:
    where = path.relative_to(ROOT)
    found = [f"{where}:{line}: {', '.join(figures[:4])} without the command that prints them"
             for line, body, context in blocks(text) if (figures := measured(body)) and not names_a_command(context)]
    return found + [f"{where}:{line}: {error}" for line, command in code(text) for error in script_errors(command)]


def test_a_figure_without_its_command_or_with_a_wrong_one_is_found_and_a_setting_is_not():
    doc = ROOT / "docs" / "x.md"
    assert offenders(doc, "Measured here: p95 70.1 ms.\n")
    assert offenders(doc, "Measured with `perf/fleet_scale.py --no-such-flag`: p95 70.1 ms.\n")
    assert offenders(doc, "Measured with `perf/no_such_script.py`: p95 70.1 ms.\n")
    assert offenders(doc, "```bash\n.venv/bin/python perf/swap.py --swap 3\n```\n")
    assert not offenders(doc, "`perf/fleet_scale.py --nodes 128` measured p95 70.1 ms.\n")
    assert not offenders(doc, "`perf/gateway_overhead.py --no-pin` measured 0.2 ms here.\n")
    assert not offenders(doc, "Each gateway polls it every 0.25 s (default 10 s).\n")
    assert not offenders(doc, "<!-- not-measured -->\nA limit measured at the p99: 5 ms.\n")
    table = "Measured by `perf/swap.py`:\n\n| a | b |\n|---|---|\n| p50 | 0.14 s |\n"
    assert not offenders(doc, table)
    assert offenders(doc, table.replace("`perf/swap.py`", "the script"))
    nested = "- `perf/swap.py` measured:\n  - p50 0.14 s, p95 0.18 s\n"
    assert not offenders(doc, nested)
    assert offenders(doc, nested.replace("`perf/swap.py`", "it"))


def test_every_measured_figure_in_the_docs_names_its_command():
    found = [problem for path in DOCS for problem in offenders(path, path.read_text())]
    assert not found, "a measured figure names the command that prints it (tests/test_docs_figures.py says how):\n" + \
        "\n".join(found)
