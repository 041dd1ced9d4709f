"""What README.md and docs/ tell a reader to type or open exists: every ``prm-pipeline …``
invocation names a command and only flags of that command (checked against the argparse
parser, not by running anything), every repository path names a file or folder of the
tree, and every dotted name of the project's packages names a module and what it defines."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

from prm_pipeline.cli import BENCHMARKS, COMMANDS, build_parser, command_parser

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
PACKAGES = ("infra", "producers", "scoring_workers", "shaper", "prm_pipeline")
TOP_FOLDERS = sorted(
    p.name
    for p in ROOT.iterdir()
    if p.is_dir()
    and not p.name.startswith(".")
    and p.name not in ("build", "dist")
    and not p.name.endswith(".egg-info")
)


def _code(text: str) -> list[str]:
    """The code a page shows: fenced blocks, then inline spans outside them."""
    fences = re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S)
    prose = re.sub(r"```[^\n]*\n.*?```", "", text, flags=re.S)
    return fences + re.findall(r"`([^`\n]+)`", prose)


def invocations(code: str) -> list[list[str]]:
    """The words of each ``prm-pipeline COMMAND …`` in ``code``, up to a comment, a pipe or
    another shell command (``&&``, ``;``, ``&``)."""
    found = []
    for line in code.splitlines():
        for match in re.finditer(r"(?:^|[\s$(])prm-pipeline\s+(?=[a-z])(.*)", line):
            rest = re.split(r"\s#|\s\|\s|&&|;|\s&(?:\s|$)|\s[12]?>", match.group(1))[0]
            found.append(rest.split())
    return found


def _problems(words: list[str]) -> list[str]:
    command = words[0]
    if command not in COMMANDS:
        return [f"no command {command!r}"]
    if command == "bench":  # the flags after NAME are the benchmark's own (tests/perf)
        name = next((w for w in words[1:] if not w.lstrip("[").startswith("-")), None)
        return [] if name in (None, "NAME") or name in BENCHMARKS else [f"no benchmark {name!r}"]
    parser = command_parser(build_parser(), command)
    known = {s for action in parser._actions for s in action.option_strings}
    flags = {m for w in words[1:] for m in re.findall(r"(?:^|[\[|])(--?[a-zA-Z][\w-]*)", w)}
    return [f"{command}: no flag {flag}" for flag in sorted(flags - known)]


def test_every_prm_pipeline_invocation_in_the_docs_names_a_command_and_its_flags() -> None:
    wrong = []
    count = 0
    for page in PAGES:
        for code in _code(page.read_text()):
            for words in invocations(code):
                count += 1
                wrong += [f"{page.relative_to(ROOT)}: `prm-pipeline {' '.join(words)}`: {p}" for p in _problems(words)]
    assert count > 50  # the extraction finds the docs' commands
    assert wrong == []


def test_every_command_in_the_readme_table_takes_the_flags_it_lists() -> None:
    """The README's table of commands (``| `verdicts [--from-beginning] …` | … |``)."""
    text = (ROOT / "README.md").read_text()
    table = text[text.index("| command | what it does |") :]
    rows = table[: table.index("\n\n")].splitlines()[2:]
    wrong = []
    for row in rows:
        cell = re.split(r"(?<!\\)\|", row)[1]
        for usage in re.findall(r"`([^`]+)`", cell):
            words = usage.replace("\\|", "|").split()
            wrong += [f"README.md: `{usage}`: {p}" for p in _problems(words)]
    assert len(rows) >= len(COMMANDS) - 1  # `up` … `bench`: the table lists them (topics create as one)
    assert wrong == []


def test_the_invocation_check_catches_a_mistyped_flag_and_command() -> None:
    (words,) = invocations("prm-pipeline verdicts --from-begining --max 3 | jq . # --not-checked")
    assert words == ["verdicts", "--from-begining", "--max", "3"]
    assert _problems(words) == ["verdicts: no flag --from-begining"]
    assert _problems(["verdict"]) == ["no command 'verdict'"]
    assert _problems(["trainer", "[--device", "auto|cpu|cuda]", "[--no-exclude-neutral-turns]"]) == []
    assert _problems(["bench", "capacity", "--broker", "noida"]) == [] and _problems(["bench", "nope"])


_FOLDERS = "|".join(map(re.escape, TOP_FOLDERS))
_PATH = re.compile(rf"(?<![\w./-])((?:{_FOLDERS})/[\w./-]*\w)(?![\w./<{{*-])")
"""A path of the tree; not one with a placeholder (``tests/ecosystem/test_<name>.py``)."""


def test_every_repository_path_in_the_docs_exists() -> None:
    missing = sorted(
        {
            f"{page.relative_to(ROOT)}: {m.group(1)}"
            for page in PAGES
            for m in _PATH.finditer(page.read_text())
            if not (ROOT / m.group(1)).exists()
        }
    )
    assert missing == []


@cache
def _defined(path: Path) -> dict[str, set[str]]:
    """Top-level names of a module ("" key) and the names defined in each of its classes."""
    tree = ast.parse(path.read_text())
    names: dict[str, set[str]] = {"": set()}
    body = [
        n for top in tree.body for n in ([top, *top.body, *top.orelse] if isinstance(top, (ast.If, ast.Try)) else [top])
    ]  # `if TYPE_CHECKING:` imports, try/except imports
    for node in body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names[""].add(node.name)
            if isinstance(node, ast.ClassDef):
                names[node.name] = {
                    n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                }
                names[node.name] |= {
                    t.id
                    for n in node.body
                    if isinstance(n, (ast.Assign, ast.AnnAssign))
                    for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                    if isinstance(t, ast.Name)
                }
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            names[""] |= {
                t.id
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                if isinstance(t, ast.Name)
            }
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names[""] |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def dotted_problem(name: str) -> str | None:
    """Why ``pkg.module.Name[.attr]`` names nothing in the tree (None when it does); read from
    the source, so that an integration module whose framework is not installed is checked too."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:i])
        module = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if module.is_file():
            break
    else:
        return f"no module {parts[0]}"
    rest = parts[i:]
    if not rest:
        return None
    defined = _defined(module)
    if rest[0] not in defined[""]:
        return f"{'.'.join(parts[:i])} defines no {rest[0]}"
    if len(rest) > 1 and rest[0] in defined and rest[1] not in defined[rest[0]]:
        return f"{'.'.join(parts[: i + 1])} has no {rest[1]}"
    return None


def test_every_dotted_name_of_the_project_in_the_docs_exists() -> None:
    pattern = re.compile(rf"`((?:{'|'.join(PACKAGES)})(?:\.\w+)+)")
    wrong = sorted(
        {
            f"{page.relative_to(ROOT)}: {m.group(1)}: {why}"
            for page in PAGES
            for m in pattern.finditer(page.read_text())
            if (why := dotted_problem(m.group(1)))
        }
    )
    assert wrong == [], "\n".join(wrong)
    assert dotted_problem("producers.TrajectoryPublisher") == "producers defines no TrajectoryPublisher"
    assert dotted_problem("producers.publisher.TrajectoryPublisher") is None
