"""README.md stays true: its quickstart snippets, its links (and the docs' links), its tables.

`quickstart_snippets` pulls the runnable blocks out of the README's Quickstart section: every
```python block, and every ```bash block of curl commands. They run as written, against a fresh
`serve run serve_config.yaml`, in tests/test_serve_cli.py (the module that already starts that
app, so no second app is started for them). The tests here are cheap: the extraction itself, and
facts the README states that the repository can check without an engine.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from replicas.engine.architectures import ARCHITECTURES

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
QUICKSTART = "Quickstart"
MAX_README_LINES = 250
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@dataclass(frozen=True)
class Snippet:
    kind: str  # "python" or "curl"
    code: str


def section(markdown: str, title: str) -> str:
    """The text of the `## title` section, up to the next `## ` heading."""
    match = re.search(rf"^## {re.escape(title)}\s*$(.*?)(?=^## |\Z)", markdown, re.MULTILINE | re.DOTALL)
    if match is None:
        raise ValueError(f"README has no '## {title}' section")
    return match.group(1)


def commands(code: str) -> list[str]:
    """Shell lines that are not blank or comments."""
    return [line for line in code.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def quickstart_snippets(markdown: str) -> list[Snippet]:
    """The Quickstart's Python blocks and curl blocks, in order. A bash block that mixes curl with
    other commands is refused, so no HTTP example goes untested by being next to a `serve run`."""
    snippets = []
    for language, code in FENCE.findall(section(markdown, QUICKSTART)):
        if language == "python":
            snippets.append(Snippet("python", code))
        elif language == "bash" and any(line.startswith("curl ") for line in commands(code)):
            others = [line for line in commands(code) if not line.startswith("curl ")]
            if others:
                raise ValueError(f"a Quickstart bash block mixes curl with other commands: {others}")
            snippets.append(Snippet("curl", code))
    return snippets


def with_port(code: str, port: int) -> str:
    """The snippet aimed at `port` when the test app could not have the README's 8000."""
    return code.replace("localhost:8000", f"localhost:{port}")


SAMPLE = """# x
## Quickstart
```bash
serve run serve_config.yaml
```
```python
print(1)
```
```bash
# ask
curl -s localhost:8000/v1/info
```
## Next
```python
print(2)
```
"""


def test_the_quickstart_python_and_curl_blocks_are_extracted_and_nothing_else():
    assert quickstart_snippets(SAMPLE) == [Snippet("python", "print(1)\n"), Snippet("curl", "# ask\ncurl -s localhost:8000/v1/info\n")]
    assert with_port("curl -s localhost:8000/v1/info", 8123) == "curl -s localhost:8123/v1/info"


def test_a_bash_block_mixing_curl_with_other_commands_is_refused():
    mixed = SAMPLE.replace("serve run serve_config.yaml", "serve run serve_config.yaml\ncurl -s localhost:8000/readyz")
    with pytest.raises(ValueError, match="mixes curl"):
        quickstart_snippets(mixed)
    with pytest.raises(ValueError, match="no '## Quickstart'"):
        quickstart_snippets("# nothing here\n")


def test_the_readme_quickstart_has_its_handle_openai_and_curl_snippets_and_they_compile():
    snippets = quickstart_snippets(README.read_text())
    python = [s.code for s in snippets if s.kind == "python"]
    assert any("serve.get_app_handle" in code for code in python)
    assert any("from openai import OpenAI" in code for code in python)
    assert any(s.kind == "curl" for s in snippets)
    for code in python:
        compile(code, "README.md", "exec")


def test_the_readme_is_a_page_with_the_two_setup_commands_and_live_links():
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_README_LINES
    install = section(text, "Install")
    assert "bash scripts/serve.sh" in install and "bash scripts/test.sh" in install
    missing = [target for target in LINK.findall(text) if "://" not in target and not (ROOT / target).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"


def test_links_in_the_docs_point_to_files_that_exist():
    pages = [ROOT / "CHANGELOG.md", ROOT / "bench" / "results" / "INDEX.md", *sorted((ROOT / "docs").rglob("*.md"))]
    missing = [
        f"{page.relative_to(ROOT)} -> {target}" for page in pages for target in LINK.findall(page.read_text())
        if "://" not in target and not (page.parent / target).exists()
    ]
    assert not missing, f"links to files that do not exist: {missing}"


def test_every_declared_architecture_has_a_row_in_the_supported_models_table():
    table = section(README.read_text(), "Supported models")
    assert not [arch for arch in ARCHITECTURES if f"`{arch}`" not in table]


def test_every_result_file_has_one_line_in_the_results_index():
    results = ROOT / "bench" / "results"
    index = (results / "INDEX.md").read_text()
    files = sorted(str(p.relative_to(results)) for p in results.rglob("*") if p.is_file() and p.name != "INDEX.md")
    assert not [name for name in files if f"`{name}`" not in index]
    listed = re.findall(r"^\| `([^`]+)`", index, re.MULTILINE)
    assert sorted(listed) == files, "INDEX.md lists a file that is not there, or one twice"
