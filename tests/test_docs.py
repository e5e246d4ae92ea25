"""The README and docs/ checked against the repository they describe.

- Every relative link and ``#anchor`` in README.md and docs/*.md resolves: the file exists, and
  the anchor is a heading of it under GitHub's slug rules.
- Every ``hetero ...`` command in README.md's shell blocks parses with the CLI's own parser
  (``training.cli.build_parser``: parsed, never run); every ``make`` target it shows exists.
- The README bootstraps CDK before ``hetero preflight`` (whose bootstrap row fails until then),
  and its ``tensorboard --logdir`` commands are the ones ``hetero status --tensorboard`` and
  ``hetero local`` print.
- Every ``npx cdk deploy|destroy|diff`` (and, in the README, ``synth``) names its spec with
  ``-c spec=``: the stack names come from the spec's ``name`` (``infra/assembly.py``), and without
  ``-c spec=`` the app reads ``cluster.toml`` (cdk.json's context), not the spec deployed.
- docs/spec.md lists every key of every section of the spec with the value the spec reader gives
  when it is left out, and every choice of a key with a fixed set of values; cluster.toml's
  comments list every choice of the keys they annotate.

Each check is a function that returns its problems, so the tests at the end can show that it
finds a broken link, a wrong flag, a missing ``-c spec=`` and a stale default.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import re
import shlex
import tomllib
import typing
from collections.abc import Iterator
from enum import StrEnum
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest

from training.cli import SUBCOMMANDS, build_parser
from training.spec import SpecError, parse_spec, schema

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
SPEC_DOC = REPO / "docs" / "spec.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]
SHELL_LANGUAGES = {"bash", "sh", "shell", "console"}

# --------------------------------------------------------------------------------------------
# Markdown, as GitHub reads it


@dataclasses.dataclass(frozen=True)
class Block:
    """A fenced code block: its info string's first word and its lines."""

    language: str
    lines: list[str]


_FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)")


def split_fences(text: str) -> tuple[str, list[Block]]:
    """The text outside fenced code blocks (each block's lines blanked) and the blocks."""
    prose: list[str] = []
    blocks: list[Block] = []
    fence: str | None = None
    for line in text.splitlines():
        match = _FENCE.match(line)
        if fence is None and match:
            fence = match.group(1)
            blocks.append(Block(match.group(2).lower(), []))
            prose.append("")
        elif fence is not None and line.strip().startswith(fence[0] * len(fence)):
            fence = None
            prose.append("")
        elif fence is not None:
            blocks[-1].lines.append(line)
            prose.append("")
        else:
            prose.append(line)
    return "\n".join(prose), blocks


_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)


def code_spans(prose: str) -> list[str]:
    """Inline code spans of text outside fences, whitespace (line breaks too) made single."""
    return [" ".join(m.group(2).split()) for m in _CODE_SPAN.finditer(prose)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the text as rendered (links as their text, no code
    marks or emphasis), lowercased, every character but letters, digits, spaces, '-' and '_'
    removed, each space made '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").replace("*", "")
    text = re.sub(r"<[^>]+>", "", text)
    text = "".join(c for c in text.lower() if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading's anchor, repeated headings numbered as GitHub numbers them."""
    prose, _ = split_fences(text)
    seen: dict[str, int] = {}
    found: set[str] = set()
    for line in prose.splitlines():
        match = re.match(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def links(text: str) -> list[str]:
    """The targets of inline links and images outside code."""
    prose, _ = split_fences(text)
    prose = _CODE_SPAN.sub("", prose)
    return [m.group(1) for m in _LINK.finditer(prose)]


def link_problems(page: Path, text: str, repo: Path = REPO) -> list[str]:
    """Relative links of ``page`` whose file is missing or whose #anchor is not a heading."""
    problems = []
    for target in links(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
            continue
        path, _, anchor = target.partition("#")
        where = (page.parent / path).resolve() if path else page
        if path and (not where.is_relative_to(repo.resolve()) or not where.exists()):
            problems.append(f"{page.name}: {target}: no such file")
            continue
        if not anchor:
            continue
        if where.suffix != ".md" or where.is_dir():
            problems.append(f"{page.name}: {target}: an anchor into a file that is not Markdown")
        elif anchor not in anchors(where.read_text() if where != page else text):
            problems.append(f"{page.name}: {target}: no heading with that anchor")
    return problems


# --------------------------------------------------------------------------------------------
# Shell commands


def shell_commands(blocks: list[Block]) -> Iterator[list[str]]:
    """Each simple command of the shell blocks, as words: continuation lines joined, prompts
    and comments dropped, split at ``&&``, ``||``, ``;`` and ``|``."""
    for block in blocks:
        if block.language not in SHELL_LANGUAGES:
            continue
        logical = ""
        for raw in block.lines:
            line = raw.rstrip()
            if line.endswith("\\"):
                logical += line[:-1] + " "
                continue
            logical += line
            text, logical = logical.strip(), ""
            text = text[2:] if text.startswith("$ ") else text
            lexer = shlex.shlex(without_comment(text), posix=True, punctuation_chars=";&|")
            lexer.whitespace_split = True
            lexer.commenters = ""
            command: list[str] = []
            for word in lexer:
                if word in {"&&", "||", ";", "|", "&"}:
                    if command:
                        yield command
                    command = []
                else:
                    command.append(word)
            if command:
                yield command


def without_comment(line: str) -> str:
    """A shell line up to its comment: a ``#`` that starts a word outside quotes."""
    quote = ""
    for i, c in enumerate(line):
        if quote:
            quote = "" if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def program(words: list[str]) -> tuple[str, list[str]]:
    """The program a command runs (its path's last part, after ``VAR=value`` words) and its
    arguments."""
    i = 0
    while i < len(words) and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[i]):
        i += 1
    if i == len(words):
        return "", []
    return words[i].rsplit("/", 1)[-1], words[i + 1 :]


def placeholder(word: str) -> str:
    """A shell variable (``$X``, ``${X}``) or a ``<placeholder>`` as a value every argument type
    of the CLI takes (a path, a name, a number)."""
    if re.fullmatch(r"\$\{?\w+\}?|<[^>]+>", word):
        return "1"
    return word


def subcommand(arguments: list[str]) -> str | None:
    """The subcommand of ``hetero ARGUMENTS``: the first argument that names one."""
    return next((a for a in arguments if a in SUBCOMMANDS), None)


def hetero_problems(arguments: list[str]) -> list[str]:
    """What the CLI's own parser says about ``hetero ARGUMENTS`` (nothing when it parses)."""
    shown = "hetero " + " ".join(arguments)
    sub = subcommand(arguments)  # as training.cli.main finds it
    if sub is None:
        return [f"{shown}: no subcommand; the CLI has {', '.join(SUBCOMMANDS)}"]
    parser = build_parser(sub)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            parser.parse_args([placeholder(a) for a in arguments])
        except SystemExit as e:
            if e.code not in (0, None):
                return [f"{shown}: {err.getvalue().strip().splitlines()[-1]}"]
    return []


_CDK = re.compile(r"npx cdk (deploy|destroy|synth|diff)\b")


def cdk_problems(name: str, text: str, *, synth_may_default: bool) -> list[str]:
    """``npx cdk`` commands of a page that act on a spec's stacks without ``-c spec=``. The stack
    names are ``<spec name>-network`` and ``<spec name>-cluster``, and the app reads
    ``cluster.toml`` when no spec is given: a destroy without the deployed spec acts on other
    stacks. A synth deploys nothing; outside the README it may stand for the default's."""
    prose, blocks = split_fences(text)
    lines = [" ".join(words) for words in shell_commands(blocks)] + code_spans(prose)
    problems = []
    for line in lines:
        for match in _CDK.finditer(line):
            rest = line[match.start() :]
            if "-c spec=" in rest or (match.group(1) == "synth" and synth_may_default):
                continue
            problems.append(f"{name}: `{rest}` does not name its spec (-c spec=FILE)")
    return problems


# --------------------------------------------------------------------------------------------
# The spec's keys


MINIMAL_GROUP = {"name": "trainer", "role": "trainer", "instance_types": ["g5.xlarge"], "count": 1}
MINIMAL = {"groups": [MINIMAL_GROUP]}


@dataclasses.dataclass(frozen=True)
class Section:
    """One table of the spec: its TOML name, its dataclass, and each key's value when left out
    (``REQUIRED`` when the spec is refused without it, ``SUB_TABLE`` for a table of its own)."""

    table: str
    cls: type
    defaults: dict[str, Any]


REQUIRED = object()
SUB_TABLE = object()


def sections() -> list[Section]:
    """Every table the spec reader reads, from the dataclasses: the top level, ``[[groups]]``,
    ``[job]`` and each of its dataclass-valued fields as ``[job.<field>]``; the defaults are
    what ``parse_spec`` gives a minimal spec."""
    spec = parse_spec(MINIMAL)

    def required_at_top(key: str) -> bool:
        try:
            parse_spec({k: v for k, v in MINIMAL.items() if k != key})
        except SpecError:
            return True
        return False

    def required_in_group(key: str) -> bool:
        group = {k: v for k, v in MINIMAL_GROUP.items() if k != key}
        try:
            parse_spec({"groups": [group]})
        except SpecError:
            return True
        return False

    def values(
        cls: type, parsed: Any, required: Any, internal: tuple[str, ...] = ()
    ) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name in internal:
                continue
            value = getattr(parsed, f.name)
            if dataclasses.is_dataclass(value) or f.name in ("groups", "job"):
                out[f.name] = REQUIRED if required(f.name) else SUB_TABLE
            else:
                out[f.name] = REQUIRED if required(f.name) else value
        return out

    def never(key: str) -> bool:
        return False

    found = [
        Section("top level", schema.ClusterSpec, values(
            schema.ClusterSpec, spec, required_at_top, internal=("source",))),
        Section("[[groups]]", schema.InstanceGroup, values(
            schema.InstanceGroup, spec.groups[0], required_in_group)),
        Section("[job]", schema.JobSpec, values(schema.JobSpec, spec.job, never)),
    ]  # fmt: skip
    for f in dataclasses.fields(schema.JobSpec):
        value = getattr(spec.job, f.name)
        if dataclasses.is_dataclass(value):
            found.append(Section(f"[job.{f.name}]", type(value), values(type(value), value, never)))
    return found


def shown_default(cell: str, value: Any) -> bool:
    """Whether a default cell of docs/spec.md says ``value``: required, not set, a TOML literal
    in backticks (numbers may be written as fractions such as 2/3)."""
    cell = cell.strip()
    if value is REQUIRED:
        return cell == "required"
    if value is SUB_TABLE:
        return cell.startswith("(")
    if value is None:
        return cell == "not set"
    if not (cell.startswith("`") and cell.endswith("`")):
        return False
    literal = cell.strip("`")
    if isinstance(value, bool):
        return literal == ("true" if value else "false")
    if isinstance(value, StrEnum):
        return literal == f'"{value.value}"'
    if isinstance(value, str):
        return literal == json.dumps(value)
    if isinstance(value, int | float):
        try:
            return float(Fraction(literal.replace("_", ""))) == pytest.approx(float(value))
        except (ValueError, ZeroDivisionError):
            return False
    if isinstance(value, tuple | list) and not value:
        return literal == "[]"
    if isinstance(value, dict) and not value:
        return literal == "{}"
    return literal == repr(value)


def doc_tables(text: str) -> dict[str, dict[str, tuple[str, str]]]:
    """docs/spec.md's tables by section: ``## Top level`` or a heading naming a TOML table in
    backticks (`` `[job.dataset]` ``), then ``| key | default | meaning |`` rows."""
    prose, _ = split_fences(text)
    tables: dict[str, dict[str, tuple[str, str]]] = {}
    current: str | None = None
    for line in prose.splitlines():
        heading = re.match(r"^##\s+(.*)$", line)
        if heading:
            named = re.search(r"`(\[\[?[\w.]+\]\]?)`", heading.group(1))
            current = named.group(1) if named else heading.group(1).strip().lower()
            continue
        row = re.match(r"^\|\s*`([\w]+)`\s*\|([^|]*)\|(.*)\|\s*$", line)
        if row and current is not None:
            tables.setdefault(current, {})[row.group(1)] = (row.group(2), row.group(3))
    return tables


def choices(cls: type, key: str) -> list[str]:
    """The values a key with a fixed set of choices takes (its StrEnum's), else none."""
    hint = typing.get_type_hints(cls)[key]
    for kind in (hint, *typing.get_args(hint)):
        if isinstance(kind, type) and issubclass(kind, StrEnum):
            return [e.value for e in kind]
    return []


FROM_THE_DATA = {("[job.dataset]", "num_classes")}
"""Keys whose default is the data's (docs/spec.md: "the data's"); the minimal spec's synthetic
data gets the value ``parse_spec`` gives, which the meaning must state in backticks."""


def spec_doc_problems(text: str) -> list[str]:
    """Where docs/spec.md and the spec reader disagree."""
    tables = doc_tables(text)
    problems = []
    for section in sections():
        rows = tables.get(section.table)
        if rows is None:
            problems.append(f"docs/spec.md: no table for {section.table}")
            continue
        for key, value in section.defaults.items():
            if key not in rows:
                problems.append(f"docs/spec.md {section.table}: {key} is missing")
                continue
            default, meaning = rows[key]
            if (section.table, key) in FROM_THE_DATA:
                if default.strip() != "the data's" or f"`{value}`" not in meaning:
                    problems.append(
                        f"docs/spec.md {section.table}: {key}'s default should read \"the "
                        f"data's\", its meaning give synthetic data's `{value}`"
                    )
            elif not shown_default(default, value):
                problems.append(
                    f"docs/spec.md {section.table}: {key}'s default reads {default.strip()!r}; "
                    f"the spec reader gives {'required' if value is REQUIRED else repr(value)}"
                )
            for choice in choices(section.cls, key):
                if f'`"{choice}"`' not in meaning:
                    problems.append(
                        f'docs/spec.md {section.table}: {key} does not list `"{choice}"`'
                    )
        for key in rows.keys() - section.defaults.keys():
            problems.append(f"docs/spec.md {section.table}: {key} is not a key of the spec")
    return problems


def comment_choice_problems(text: str) -> list[str]:
    """Lines of a spec file whose comment lists choices (``key = ...  # a | b | c``) that are
    not every choice the spec reader takes for that key."""
    by_key: dict[str, list[str]] = {}
    for section in sections():
        for key in section.defaults:
            by_key.setdefault(key, choices(section.cls, key))
    by_key["augmentation"] = choices(schema.AugmentationSpec, "preset")
    problems = []
    for line in text.splitlines():
        match = re.match(r"^(\w+)\s*=.*#\s*(\w[\w-]*(?:\s*\|\s*\w[\w-]*)+)", line)
        if not match:
            continue
        key, listed = match.group(1), [c.strip() for c in match.group(2).split("|")]
        if sorted(listed) != sorted(by_key.get(key, [])):
            problems.append(f"{key}: the comment lists {listed}; the spec takes {by_key.get(key)}")
    return problems


# --------------------------------------------------------------------------------------------
# The checks on the repository


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    assert link_problems(page, page.read_text()) == []


def test_every_hetero_command_the_readme_shows_parses() -> None:
    _, blocks = split_fences(README.read_text())
    shown = [args for name, args in map(program, shell_commands(blocks)) if name == "hetero"]
    problems = [p for args in shown for p in hetero_problems(args)]
    assert problems == []
    # The README walks through each step with a command: the checks before a deploy, the data,
    # another job, the watch, the model and the plan.
    subcommands = {subcommand(args) for args in shown}
    assert {"spec", "preflight", "dataset", "job", "status", "export", "plan"} <= subcommands


def test_the_readme_keeps_its_two_setup_commands_and_its_make_targets_exist() -> None:
    _, blocks = split_fences(README.read_text())
    made = [args for name, args in map(program, shell_commands(blocks)) if name == "make"]
    assert ["local"] in made and ["test"] in made  # CI runs the README's `make test`
    targets = set(re.findall(r"(?m)^([\w-]+):", (REPO / "Makefile").read_text()))
    assert {a for args in made for a in args} <= targets


def readme_commands() -> list[list[str]]:
    """The README's shell commands, in order, as words."""
    return list(shell_commands(split_fences(README.read_text())[1]))


def test_the_readme_bootstraps_before_the_preflight() -> None:
    # hetero preflight reports FAIL and exits 1 while the account has no CDKToolkit stack
    # (training/preflight/account.py), so the prerequisites bootstrap first.
    commands = [" ".join(words) for words in readme_commands()]
    bootstrap = next(i for i, c in enumerate(commands) if c.startswith("npx cdk bootstrap"))
    preflight = next(i for i, c in enumerate(commands) if " preflight " in f" {c} ")
    assert bootstrap < preflight


def test_the_readme_tensorboard_commands_are_the_ones_the_cli_prints() -> None:
    from training.common.names import CHECKPOINT_PREFIX
    from training.common.tensorboard_paths import FOLDER
    from training.workstation.status import tensorboard_lines

    shown = {
        " ".join(words[1:]) for words in readme_commands() if program(words)[0] == "tensorboard"
    }
    # `hetero status --tensorboard`'s "every job of the stack" line, for a job folder of the
    # stack's checkpoint prefix (the CheckpointUri output: s3://<bucket>/checkpoints/).
    every_job = tensorboard_lines(f"s3://BUCKET/{CHECKPOINT_PREFIX}/JOB/")[0]
    assert every_job.split(": ", 1)[1].split(" ", 1)[1] in shown
    # `hetero local` prints the command for tensorboard/ of its run folder (--run-dir).
    run_dir = build_parser("local").parse_args(["local", "--spec", "x"]).run_dir
    assert f"--logdir {Path(run_dir) / FOLDER}" in shown


def test_every_cdk_command_names_its_spec() -> None:
    # The app's default spec, which a command without -c spec= acts on.
    assert json.loads((REPO / "cdk.json").read_text())["context"]["spec"] == "cluster.toml"
    problems = cdk_problems("README.md", README.read_text(), synth_may_default=False)
    for page in PAGES[1:]:
        problems += cdk_problems(page.name, page.read_text(), synth_may_default=True)
    assert problems == []


def test_the_spec_reference_lists_every_key_with_its_default() -> None:
    # The parsed defaults are the dataclasses' own where they have one, except num_classes:
    # the reader gives synthetic data 1000 and leaves the others' to the data (None).
    for section in sections():
        for f in dataclasses.fields(section.cls):
            if f.name not in section.defaults or f.default is dataclasses.MISSING:
                continue  # internal (ClusterSpec.source), or given by the reader alone
            if (section.table, f.name) in FROM_THE_DATA:
                continue
            value = section.defaults[f.name]
            if value is not REQUIRED and value is not SUB_TABLE:
                assert value == f.default, (section.table, f.name)
    assert spec_doc_problems(SPEC_DOC.read_text()) == []


def toml_blocks(text: str) -> list[str]:
    """The ``toml`` code blocks of a page."""
    return ["\n".join(b.lines) for b in split_fences(text)[1] if b.language == "toml"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_toml_block_parses_and_every_whole_spec_is_valid(page: Path) -> None:
    for block in toml_blocks(page.read_text()):
        doc = tomllib.loads(block)
        if "groups" in doc:  # a whole spec, not a fragment of one
            parse_spec(doc, source=f"{page.name}'s example")


def test_the_readme_spec_edit_makes_a_valid_spec_of_cluster_toml() -> None:
    """Your own data: cluster.toml with the README's [job] keys and [job.dataset] table (its
    epochs instead of cluster.toml's steps; the checksum placeholder filled in) is a valid spec."""
    (snippet,) = toml_blocks(README.read_text())
    edit = tomllib.loads(snippet)
    doc = tomllib.loads((REPO / "cluster.toml").read_text())
    doc["job"].pop("steps")
    doc["job"].update(edit["job"])
    for key, value in doc["job"]["dataset"].items():
        if isinstance(value, str) and re.fullmatch(r"<[^>]+>", value):
            doc["job"]["dataset"][key] = "0" * 64
    spec = parse_spec(doc)
    assert spec.job.dataset.source.value == "shards" and spec.job.dataset.has_validation


@pytest.mark.parametrize(
    "path", ["cluster.toml", *sorted(p.name for p in (REPO / "specs").iterdir())]
)
def test_spec_comments_list_every_choice(path: str) -> None:
    file = REPO / path if path == "cluster.toml" else REPO / "specs" / path
    assert comment_choice_problems(file.read_text()) == []


# --------------------------------------------------------------------------------------------
# Each check finds what it is for


def test_the_link_check_finds_a_missing_file_and_a_missing_anchor(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    other = tmp_path / "docs" / "other.md"
    other.write_text("# Other\n\n## The `x` section: a/b\n\n## Twice\n\n## Twice\n")
    page = tmp_path / "README.md"
    good = (
        "[a](docs/other.md) [b](docs/other.md#the-x-section-ab) [c](#here) "
        "[d](docs/other.md#twice-1) ![e](docs/other.md) [f](https://example.com/x#y) "
        "`[g](nowhere.md)`\n\n## Here\n\n```\n[h](nowhere.md)\n```\n"
    )
    assert link_problems(page, good, repo=tmp_path) == []
    bad = "[a](docs/gone.md) [b](docs/other.md#the-y-section) [c](#nowhere)\n\n## Here\n"
    assert link_problems(page, bad, repo=tmp_path) == [
        "README.md: docs/gone.md: no such file",
        "README.md: docs/other.md#the-y-section: no heading with that anchor",
        "README.md: #nowhere: no heading with that anchor",
    ]


def test_github_slugs() -> None:
    # Anchors the docs link to, as GitHub makes them.
    assert slug("Model files: `model.safetensors` + `config.json`") == (
        "model-files-modelsafetensors--configjson"
    )
    assert slug("3. On a GPU: ViT-B/16 on one H100 (`python -m benchmarks trainer_gpu`)") == (
        "3-on-a-gpu-vit-b16-on-one-h100-python--m-benchmarks-trainer_gpu"
    )


def test_the_command_check_finds_a_wrong_flag_a_missing_value_and_an_unknown_subcommand() -> None:
    blocks = [
        Block(
            "bash",
            [
                "export AWS_REGION=us-east-1   # a comment",
                ".venv/bin/hetero spec check --spec cluster.toml && \\",
                "  hetero job start --spec my.toml --max-usd $CAP",
                "$ hetero status --spec my.toml --tensorboard | head",
            ],
        ),
        Block("python", ["hetero spec check --nonsense"]),
    ]
    commands = [args for name, args in map(program, shell_commands(blocks)) if name == "hetero"]
    assert commands == [
        ["spec", "check", "--spec", "cluster.toml"],
        ["job", "start", "--spec", "my.toml", "--max-usd", "$CAP"],
        ["status", "--spec", "my.toml", "--tensorboard"],
    ]
    assert [p for args in commands for p in hetero_problems(args)] == []
    assert hetero_problems(["spec", "check", "--spec-file", "x.toml"]) == [
        "hetero spec check --spec-file x.toml: hetero: error: unrecognized arguments: "
        "--spec-file x.toml"
    ]
    assert hetero_problems(["job", "start", "--max-usd", "lots"]) == [
        "hetero job start --max-usd lots: hetero job start: error: argument --max-usd: invalid "
        "float value: 'lots'"
    ]
    assert hetero_problems(["deploy", "--spec", "x"])[0].startswith(
        "hetero deploy --spec x: no subcommand; the CLI has spec, serve"
    )


def test_the_cdk_check_finds_a_command_without_its_spec() -> None:
    text = (
        "Stop it with `npx cdk destroy --all`, or `npx cdk\n  destroy --all -c spec=my.toml`.\n"
        "```bash\nnpx cdk deploy --all -c spec=my.toml   # fine\nnpx cdk diff\nnpx cdk synth\n```\n"
    )
    assert cdk_problems("x.md", text, synth_may_default=True) == [
        "x.md: `npx cdk diff` does not name its spec (-c spec=FILE)",
        "x.md: `npx cdk destroy --all` does not name its spec (-c spec=FILE)",
    ]
    assert cdk_problems("x.md", text, synth_may_default=False)[1:2] == [
        "x.md: `npx cdk synth` does not name its spec (-c spec=FILE)"
    ]


def test_the_spec_reference_check_finds_a_stale_default_a_missing_key_and_a_missing_choice() -> (
    None
):
    text = SPEC_DOC.read_text()
    stale = text.replace("| `batch_size` | `64` |", "| `batch_size` | `32` |", 1)
    assert spec_doc_problems(stale) == [
        "docs/spec.md [job]: batch_size's default reads '`32`'; the spec reader gives 64"
    ]
    gone = re.sub(r"(?m)^\| `cache_gb` \|.*\n", "", text)
    assert spec_doc_problems(gone) == ["docs/spec.md [job.dataset]: cache_gb is missing"]
    unlisted = text.replace('`"shards"`: a dataset', "a dataset", 1)
    assert spec_doc_problems(unlisted) == [
        'docs/spec.md [job.dataset]: source does not list `"shards"`'
    ]
    extra = text.replace("| `seed` |", "| `sed` | `0` | a typo |\n| `seed` |", 1)
    assert spec_doc_problems(extra) == ["docs/spec.md [job]: sed is not a key of the spec"]


def test_the_comment_check_finds_a_choice_left_out() -> None:
    assert comment_choice_problems('source = "synthetic"  # synthetic | folder | s3 | shards') == []
    assert comment_choice_problems('source = "synthetic"  # synthetic | folder | s3') == [
        "source: the comment lists ['synthetic', 'folder', 's3']; the spec takes "
        "['synthetic', 'folder', 's3', 'shards']"
    ]
