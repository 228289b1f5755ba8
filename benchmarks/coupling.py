"""How tangled the package is around the ``Trainer``, counted from the source (no run):

    python benchmarks/coupling.py          # one line per measure
    python benchmarks/coupling.py -v       # and where each count comes from

- ``private``: uses of the Trainer's private attributes (``trainer._x``, ``self.trainer._x``,
  ``module.trainer._x``...) outside ``xtrainer/trainer.py``;
- ``writers``: the files outside ``trainer.py`` that assign an attribute of the Trainer
  (``trainer.x = ...``) other than Lightning's public settables (``LIGHTNING_SETTABLES``), with
  the attributes they write (target: none);
- ``settables``: the files that assign Lightning's public settables (``should_stop``...), which
  Lightning's callbacks and loops write too;
- ``init``: attributes ``Trainer.__init__`` sets (and how many of them are private);
- ``circles``: import circles among xtrainer's modules, counting imports under ``if TYPE_CHECKING:``
  and imports inside functions (the files in the largest one);
- ``long``: modules over 500 lines (those in ``loop/``).

``tests/stories/project/test_contract.py`` asserts the ones that must stay at zero.
"""

from __future__ import annotations

import argparse
import ast
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "xtrainer")
#: names that hold the Trainer where the code reads it
TRAINER_NAMES = {"trainer", "_trainer"}
#: The Trainer attributes Lightning 2.6 lets anyone assign: properties with a setter
#: (``should_stop``, ``ckpt_path``, ``logger``, ``loggers``) and the plain attributes its
#: ``Trainer.__init__`` sets for callbacks and loops to change (``callbacks``, the flags of
#: accumulation, clipping, validation and batch limits). Its ``callback_metrics``,
#: ``logged_metrics``, ``progress_bar_metrics``, ``datamodule``, ``log_dir``, ``max_epochs``...
#: are read-only properties.
LIGHTNING_SETTABLES = frozenset({
    "should_stop", "ckpt_path", "logger", "loggers", "callbacks", "accumulate_grad_batches",
    "gradient_clip_val", "gradient_clip_algorithm", "val_check_interval", "check_val_every_n_epoch",
    "num_sanity_val_steps", "log_every_n_steps", "reload_dataloaders_every_n_epochs", "fast_dev_run",
    "overfit_batches", "limit_train_batches", "limit_val_batches", "limit_test_batches", "limit_predict_batches",
})


def sources() -> dict[str, str]:
    """Every module of the package: its path relative to the package's parent -> its text."""
    found = {}
    for folder, _, files in os.walk(ROOT):
        for file in files:
            if file.endswith(".py"):
                path = os.path.join(folder, file)
                found[os.path.relpath(path, os.path.dirname(ROOT))] = open(path).read()
    return found


def _is_trainer(node: ast.AST) -> bool:
    """``trainer``, ``self.trainer``, ``module.trainer``, ``self._trainer``..."""
    if isinstance(node, ast.Name):
        return node.id in TRAINER_NAMES
    return isinstance(node, ast.Attribute) and node.attr in TRAINER_NAMES


def private_uses(texts: dict[str, str]) -> list[tuple[str, int, str]]:
    """``(file, line, attribute)`` of every use of a private Trainer attribute outside trainer.py."""
    found = []
    for path, text in texts.items():
        if path == os.path.join("xtrainer", "trainer.py"):
            continue
        for node in ast.walk(ast.parse(text)):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and _is_trainer(node.value)):
                found.append((path, node.lineno, node.attr))
    return sorted(found)


def trainer_writes(texts: dict[str, str]) -> dict[str, set[str]]:
    """File -> the Trainer attributes it assigns (``trainer.x = ...``, ``trainer.x += ...``)."""
    found: dict[str, set[str]] = {}
    for path, text in texts.items():
        if path == os.path.join("xtrainer", "trainer.py"):
            continue
        for node in ast.walk(ast.parse(text)):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for target in targets:
                for sub in ast.walk(target):
                    if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store) and _is_trainer(sub.value):
                        found.setdefault(path, set()).add(sub.attr)
    return found


def split_writes(writes: dict[str, set[str]]) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """``trainer_writes``' answer in two: file -> the attributes it writes that are not Lightning's
    public settables, and file -> the settables it writes (files with none left out of each)."""
    others = {path: attrs - LIGHTNING_SETTABLES for path, attrs in writes.items() if attrs - LIGHTNING_SETTABLES}
    settables = {path: attrs & LIGHTNING_SETTABLES for path, attrs in writes.items() if attrs & LIGHTNING_SETTABLES}
    return others, settables


def init_attributes(texts: dict[str, str]) -> list[str]:
    """The attributes ``Trainer.__init__`` sets on ``self`` (in order, each once)."""
    tree = ast.parse(texts[os.path.join("xtrainer", "trainer.py")])
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer")
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    names: list[str] = []
    for node in ast.walk(init):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            for sub in ast.walk(target):
                if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self" \
                        and isinstance(sub.ctx, ast.Store) and sub.attr not in names:
                    names.append(sub.attr)
    return names


def _module_name(path: str) -> str:
    return path[:-3].replace(os.sep, ".").removesuffix(".__init__")


def import_graph(texts: dict[str, str], type_only: bool = True) -> dict[str, set[str]]:
    """Module -> the xtrainer modules it imports (anywhere in it; ``type_only``: under
    ``if TYPE_CHECKING:`` too). ``from xtrainer.a import b`` names ``xtrainer.a.b`` where that is a
    module, else ``xtrainer.a``; ``from xtrainer import Trainer`` the module it lazily comes from."""
    modules = {_module_name(p) for p in texts}
    package_text = texts[os.path.join("xtrainer", "__init__.py")]
    lazy = next(ast.literal_eval(node.value) for node in ast.parse(package_text).body
                if isinstance(node, ast.AnnAssign | ast.Assign) and "_LAZY" in ast.unparse(node))
    graph = {}
    for path, text in texts.items():
        name = _module_name(path)
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        tree = ast.parse(text)
        skipped = set() if type_only else {
            id(sub) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for stmt in node.body for sub in ast.walk(stmt)}
        found = set()
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
                if base.startswith("xtrainer"):
                    for alias in node.names:
                        full = f"{base}.{alias.name}"
                        found.add(full if full in modules else lazy.get(alias.name, base) if base == "xtrainer"
                                  else base)
        graph[name] = {m for m in found if m in modules} - {name}
    # The package's own imports are its lazy names (PEP 562): importing it imports none of them.
    graph["xtrainer"] = set()
    return graph


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    sys.setrecursionlimit(10000)

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for dep in graph.get(node, ()):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in on_stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = set()
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.add(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def long_modules(texts: dict[str, str], limit: int = 500) -> dict[str, int]:
    return {path: text.count("\n") for path, text in texts.items() if text.count("\n") > limit}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args()
    texts = sources()
    uses = private_uses(texts)
    writes, settables = split_writes(trainer_writes(texts))
    init = init_attributes(texts)
    found = circles(import_graph(texts))
    long = long_modules(texts)
    print(f"private: {len(uses)} uses of the Trainer's private attributes outside trainer.py, "
          f"in {len({u[0] for u in uses})} files")
    others = sorted({a for attrs in writes.values() for a in attrs})
    print(f"writers: {len(writes)} files write Trainer attributes other than Lightning's public settables"
          + (f": {', '.join(others)}" if others else ""))
    print(f"settables: {len(settables)} files write Lightning's public settables: "
          + ", ".join(sorted({a for attrs in settables.values() for a in attrs})))
    print(f"init: {len(init)} attributes set in Trainer.__init__, {sum(a.startswith('_') for a in init)} private")
    print(f"circles: {len(found)} import circles (type-only imports counted), "
          f"largest {max((len(c) for c in found), default=0)} files")
    print(f"long: {len(long)} modules over 500 lines, {sum('/loop/' in p for p in long)} in loop/: "
          + ", ".join(f"{p} ({n})" for p, n in sorted(long.items())))
    if args.verbose:
        for path, line, attr in uses:
            print(f"  private {path}:{line} {attr}")
        for path, attrs in sorted(writes.items()):
            print(f"  writes {path}: {', '.join(sorted(attrs))}")
        for path, attrs in sorted(settables.items()):
            print(f"  settable {path}: {', '.join(sorted(attrs))}")
        print("  init " + ", ".join(init))
        for component in found:
            print("  circle " + ", ".join(sorted(component)))


if __name__ == "__main__":
    main()
