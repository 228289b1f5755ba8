"""The documentation (docs/, README.md) against the code: the site builds in strict mode, every
marked program runs, every Python block parses, every message quoted in Troubleshooting is one
the code can raise, and text that the code repeats (the hook order, the summary line) is equal."""

import ast
import glob
import inspect
import os
import re
import subprocess
import sys
import textwrap

import conftest
import pytest
import yaml

from conftest import subprocess_timeout
from xtrainer.callbacks import Callback

TESTS = os.path.dirname(os.path.abspath(conftest.__file__))
ROOT = os.path.dirname(TESTS)
DOCS = os.path.join(ROOT, "docs")
PAGES = sorted(glob.glob(os.path.join(DOCS, "**", "*.md"), recursive=True))
README = os.path.join(ROOT, "README.md")

#: A fenced block that a test uses: ``<!-- test: run -->`` (a complete program, run as a script)
#: or ``<!-- test: config -->`` (a run configuration, checked as ``xtrainer config`` does) on the
#: line before the fence.
MARKED = re.compile(r"^<!-- test: (\w+) -->\n```(\w+)\n(.*?)^```", re.M | re.S)
FENCED = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)


def read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def section(path: str, title: str) -> str:
    """The text of the section headed ``title`` (any level), up to the next heading of its level
    or above."""
    text = read(path)
    match = re.search(rf"^(#+) {re.escape(title)}\b.*$", text, re.M)
    assert match, f"{os.path.relpath(path, ROOT)} has no section {title!r}"
    level = len(match.group(1))
    end = re.compile(rf"^#{{1,{level}}} ", re.M).search(text, match.end())
    return text[match.start():end.start() if end else len(text)]


def marked(kind: str) -> list[tuple[str, str]]:
    found = []
    for path in PAGES:
        for index, (what, lang, body) in enumerate(MARKED.findall(read(path))):
            if what == kind:
                found.append((f"{os.path.relpath(path, DOCS)}#{index}", body))
    return found


def blocks(lang: str) -> list[tuple[str, str]]:
    found = []
    for path in [README, *PAGES]:
        for index, (fence, body) in enumerate(FENCED.findall(read(path))):
            if fence == lang:
                found.append((f"{os.path.relpath(path, ROOT)}#{index}", body))
    return found


# --------------------------------------------------------------------------------------------
# Code blocks: every one parses; the marked ones run.
# --------------------------------------------------------------------------------------------
def test_every_python_block_in_the_docs_parses():
    found = blocks("python")
    assert len(found) >= 6, found  # the quick start (twice), the Lightning imports, manual optimization, ...
    for where, body in found:
        try:
            ast.parse(body)
        except SyntaxError as err:
            pytest.fail(f"{where}: the python block does not parse: {err}")


def test_every_yaml_block_in_the_docs_parses():
    found = blocks("yaml")
    assert found
    for where, body in found:
        assert isinstance(yaml.safe_load(body), dict), where


def test_marks_only_mark_what_this_file_knows():
    kinds = {what for path in PAGES for what, _, _ in MARKED.findall(read(path))}
    assert kinds == {"run", "config"}, kinds
    for path in PAGES:  # a mark must sit right above its fence, or the block would go unrun
        text = read(path)
        assert text.count("\n<!-- test: ") == len(MARKED.findall(text)), path


PROGRAMS = marked("run")


def test_the_docs_have_programs_to_run():
    names = [name for name, _ in PROGRAMS]
    assert any(name.startswith("getting-started.md") for name in names), names  # the quick start
    assert 2 <= len(PROGRAMS) <= 4, names  # each one costs a process and a torch_xla import


@pytest.mark.slow  # the quick start trains to accuracy
@pytest.mark.parametrize("name, program", PROGRAMS, ids=[name for name, _ in PROGRAMS])
def test_a_program_in_the_docs_runs(name, program, tmp_path):
    script = tmp_path / "program.py"
    script.write_text(program)
    env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=subprocess_timeout(480))
    assert done.returncode == 0, f"{name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    if "callback_metrics[\"val_acc\"]" in program:  # the quick start prints its validation accuracy
        printed = done.stdout.split()[-1]  # a 0-dim tensor, as Lightning's callback_metrics hold: tensor(0.95)
        assert float(printed.removeprefix("tensor(").removesuffix(")")) > 0.9, done.stdout[-2000:]


@pytest.mark.parametrize("name, config", marked("config"), ids=[name for name, _ in marked("config")])
def test_a_configuration_in_the_docs_is_valid(name, config, tmp_path, monkeypatch):
    from xtrainer import config as cfg

    path = tmp_path / "run.yaml"
    path.write_text(config)
    monkeypatch.chdir(ROOT)  # its _target_s are the examples', imported from the current folder
    monkeypatch.syspath_prepend(ROOT)
    run = cfg.load(["--config", str(path)])
    cfg.check_run(run, "fit")  # as `xtrainer config` does: everything but building the model and data
    with pytest.raises(cfg.ConfigError, match="Did you mean 'trainer.max_epochs'"):  # and it is checked at all
        cfg.load(["--config", str(path), "trainer.max_epoch=3"])


# --------------------------------------------------------------------------------------------
# The quick start (getting-started.md, repeated in the README).
# --------------------------------------------------------------------------------------------
def _quick_start(path: str) -> str:
    (code,) = re.findall(r"```python\n(.*?)```", section(path, "Quick start"), re.S)
    return code


def test_the_readme_quick_start_is_the_docs_quick_start():
    assert _quick_start(README) == _quick_start(os.path.join(DOCS, "getting-started.md"))


def test_the_quick_start_keeps_its_work_under_the_main_guard():
    page = os.path.join(DOCS, "getting-started.md")
    code = _quick_start(page)
    tree = ast.parse(code)
    for node in tree.body:
        allowed = isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef))
        guard = isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'"
        assert allowed or guard, f"runs on import (devices=N imports the script again): {ast.unparse(node)}"
    assert "if __name__ == \"__main__\":" in code and "a new process that imports the script" in section(page, "Quick start")
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    assert {"train_loader", "val_loader"} <= names and "digits_loaders" in defined  # pasted, it runs


# --------------------------------------------------------------------------------------------
# Text the code repeats.
# --------------------------------------------------------------------------------------------
def test_the_hook_order_is_written_once_the_docs_show_the_callbacks_docstring():
    page = read(os.path.join(DOCS, "training-loop.md"))
    start = page.index("```text\n") + len("```text\n")
    documented = page[start:page.index("```", start)]
    docstring = inspect.cleandoc(Callback.__doc__)
    start = docstring.index("::\n\n") + 3
    block = textwrap.dedent(docstring[start:docstring.index("\n\n``validate``", start)]).strip("\n")
    assert block == documented.strip("\n")
    # and every hook named there exists on Callback
    names = set(re.findall(r"\bon_[a-z_]+", documented))
    assert names and all(hasattr(Callback, name) for name in names), names - set(dir(Callback))


def test_the_sample_summary_is_in_the_format_fit_prints():
    from xtrainer.callbacks.health import summary_line

    (sample,) = re.findall(r"`(fit: \d+ steps in [^`]*)`", section(os.path.join(DOCS, "observability.md"), "XLA health"))
    numbers = re.findall(r"\d+(?:\.\d+)?", sample)
    steps, seconds, per_s, samples, compiles, compile_s, recompiles, transfers = numbers
    totals = {"steps": int(steps), "seconds": float(seconds), "steps_per_second": float(per_s),
              "samples_per_second": float(samples), "compilations": int(compiles),
              "compile_seconds": float(compile_s), "recompilations": int(recompiles),
              "transfers_per_step": float(transfers)}
    assert summary_line(totals) == sample
    assert int(compiles) == 7  # what examples/digits.py compiles (8 epochs on the CPU runtime)


def test_every_trainer_argument_is_in_the_lightning_table():
    from xtrainer import Trainer

    table = read(os.path.join(DOCS, "lightning.md"))
    table = table.replace("`limit_*_batches`", " ".join(f"`limit_{s}_batches`" for s in ("train", "val", "test", "predict")))
    arguments = [p for p in inspect.signature(Trainer.__init__).parameters if p not in ("self", "unexpected")]
    assert len(arguments) > 30
    missing = [name for name in arguments if f"`{name}`" not in table]
    assert not missing, f"Trainer arguments docs/lightning.md does not name (the error for a mistyped one points there): {missing}"


def test_every_strategy_has_its_page_and_its_row_in_the_readme():
    from xtrainer.strategies import STRATEGIES

    readme = read(README)
    with open(os.path.join(ROOT, "mkdocs.yml")) as f:
        nav = f.read()
    for name in STRATEGIES:
        assert os.path.exists(os.path.join(DOCS, "strategies", f"{name}.md")), name
        assert f"[`{name}`](docs/strategies/{name}.md)" in readme and f"strategies/{name}.md" in nav, name
        assert f"`\"{name}\"`" in read(os.path.join(DOCS, "strategies", "index.md")), name  # the table's row


def _source() -> str:
    return "\n".join(read(path) for path in glob.glob(os.path.join(ROOT, "xtrainer", "**", "*.py"), recursive=True))


def test_every_message_in_troubleshooting_is_one_the_code_says():
    page = read(os.path.join(DOCS, "troubleshooting.md"))
    quoted = []
    for paragraph in re.findall(r"^\*\*(?:Messages?|Note on the error):\*\*(.*?)(?:\n\n|\Z)", page, re.M | re.S):
        quoted += re.findall(r"`([^`]+)`", paragraph)
    assert len(quoted) >= 40, quoted
    source = _source()
    missing = [text for text in quoted if text not in source]
    assert not missing, f"quoted in docs/troubleshooting.md but said nowhere in xtrainer/: {missing}"
    # every entry quotes its message
    entries = re.findall(r"^### .*?(?=^##|\Z)", page, re.M | re.S)
    assert entries and all(re.search(r"^\*\*(?:Messages?|Note on the error):\*\*", e, re.M) for e in entries), \
        [e.splitlines()[0] for e in entries if not re.search(r"^\*\*(?:Messages?|Note", e, re.M)]


# --------------------------------------------------------------------------------------------
# The README and the site.
# --------------------------------------------------------------------------------------------
def test_the_readme_is_short_and_links_into_the_site():
    text = read(README)
    assert len(text.splitlines()) <= 160
    links = re.findall(r"\]\((docs/[^)#]+)(?:#[^)]*)?\)", text)
    assert len(links) >= 10, links
    missing = [link for link in links if not os.path.exists(os.path.join(ROOT, link))]
    assert not missing, missing
    assert "./dev example" in text and "./dev test" in text


def test_every_page_is_in_the_navigation():
    with open(os.path.join(ROOT, "mkdocs.yml")) as f:
        nav = f.read()
    pages = [os.path.relpath(path, DOCS) for path in PAGES]
    assert pages and not [page for page in pages if page not in nav]


def test_the_site_builds_in_strict_mode(tmp_path):
    """What ./dev docs and CI run: a broken link, a missing anchor or an API reference that does
    not resolve fails the build."""
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=subprocess_timeout(300),
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    html = read(str(tmp_path / "site" / "reference" / "trainer" / "index.html"))
    assert "log_every_n_steps" in html and "max_epochs" in html  # the docstrings made it into the reference
    assert os.path.exists(tmp_path / "site" / "compare_strategies.png")
    results = read(str(tmp_path / "site" / "benchmark-results" / "index.html"))
    assert "What the numbers say" in results  # benchmarks/RESULTS.md was included
