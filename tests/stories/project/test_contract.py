"""Contracts that tie the parts together: the Trainer's settings and the config schema agree,
hook names come from the base classes, every registered strategy fits, saves, and validates
from its own checkpoint (a new strategy is covered by registering it), and no module imports
another that imports it back (at the top, inside a function, or for type checkers only); the
Trainer is a façade: no module outside it uses its private attributes, and only the loop writes
where a fit is (``LoopState``)."""

import ast
import dataclasses
import importlib.util
import inspect
import os

import conftest
import pytest
from conftest import Regressor, make_loader

import xtrainer
from xtrainer import Trainer
from xtrainer.callbacks import Callback
from xtrainer.callbacks.base import CALLBACK_HOOKS
from xtrainer.config import TrainerConfig
from xtrainer.module import MODULE_HOOKS
from xtrainer.config.settings import TrainerSettings
from xtrainer.strategies import STRATEGIES


def test_the_trainers_arguments_and_the_config_schema_are_one_dataclass():
    params = inspect.signature(Trainer.__init__).parameters
    settings = {f.name: f.default for f in dataclasses.fields(TrainerSettings)}
    objects = ("self", "strategy", "callbacks", "logger", "plugins")  # plugins: a cluster environment, or refused
    refused = ("model_registry", "unexpected")  # taken only to be refused with a message
    own = {name: p.default for name, p in params.items() if name not in objects + refused}
    assert own == settings  # same names, same defaults: a new argument is a new field
    assert issubclass(TrainerConfig, TrainerSettings)
    assert {f.name for f in dataclasses.fields(TrainerConfig)} == set(settings) | {"strategy", "callbacks", "logger"}


def test_every_module_hook_is_a_callback_hook_and_misspelt_hooks_are_warned_of(trainer_kwargs):
    assert MODULE_HOOKS and MODULE_HOOKS <= CALLBACK_HOOKS  # the Trainer calls both by one name
    assert all(callable(getattr(Callback, name)) for name in CALLBACK_HOOKS)

    class Typo(Regressor):
        def on_train_epoch_ned(self):
            pass

    with pytest.warns(UserWarning, match="on_train_epoch_ned looks like a hook.*on_train_epoch_end"):
        Trainer(max_epochs=1, **trainer_kwargs).fit(Typo(), make_loader())


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_registered_strategy_fits_saves_and_validates_from_its_checkpoint(tmp_path, name, monkeypatch):
    if name == "native_ft":  # one replica group under a real lighthouse
        pytest.importorskip("torchft")
        from ft_lighthouse import Lighthouse

        lighthouse = Lighthouse()
        monkeypatch.setenv("TORCHFT_LIGHTHOUSE", lighthouse.address)
        monkeypatch.setenv("REPLICA_GROUP_ID", "0")
        monkeypatch.setenv("NUM_REPLICA_GROUPS", "1")
        try:
            _fit_save_validate(tmp_path, name)
        finally:
            lighthouse.stop()
        return
    _fit_save_validate(tmp_path, name)


def _fit_save_validate(tmp_path, name):
    trainer = Trainer(strategy=name, max_epochs=1, default_root_dir=str(tmp_path), enable_progress_bar=False,
                      logger=False)
    model = Regressor()
    trainer.fit(model, make_loader(), make_loader(n=16, seed=1))
    assert trainer.global_step == 8 and "val_loss" in trainer.callback_metrics
    last = os.path.realpath(os.path.join(trainer.log_dir, "checkpoints", "last.ckpt"))
    assert last.endswith("epoch=0-step=8.ckpt")
    again = Trainer(strategy=name, default_root_dir=str(tmp_path), enable_progress_bar=False, logger=False)
    [metrics] = again.validate(Regressor(), make_loader(n=16, seed=1), ckpt_path="last")
    assert again.ckpt_path == last
    assert metrics["val_loss"] == pytest.approx(float(trainer.callback_metrics["val_loss"]), rel=1e-5)


def _imports(path: str, name: str) -> set[str]:
    """The xtrainer modules ``path`` imports, when it is imported or when one of its functions
    runs: module level and inside functions and classes alike (a function's ``from xtrainer...
    import`` closes a cycle as surely as one at the top, only later), and
    ``importlib.import_module("xtrainer...")`` with a literal name, and under ``if TYPE_CHECKING:``
    too (a circle of type-only imports is a circle for type checkers and readers: a module names
    the Trainer's type through ``xtrainer/trainer_view.py``). ``from xtrainer import Trainer``
    imports the module the package's lazy names (``xtrainer._LAZY``) point to; the package's own
    type-only block declares those names (PEP 562: importing the package imports none of them)."""
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    tree = ast.parse(open(path).read())
    typing_only = {id(sub) for node in ast.walk(tree)
                   if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test) and name == "xtrainer"
                   for stmt in node.body for sub in ast.walk(stmt)}
    found = set()
    for sub in ast.walk(tree):
        if id(sub) in typing_only:
            continue
        if isinstance(sub, ast.Import):
            found |= {alias.name for alias in sub.names if alias.name.startswith("xtrainer")}
        elif isinstance(sub, ast.ImportFrom):
            base = sub.module or ""
            if sub.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - sub.level + 1] + ([base] if base else []))
            if base.startswith("xtrainer"):  # `from xtrainer import x` imports the module x if there is one
                found |= {f"{base}.{a.name}" if _is_module(f"{base}.{a.name}")
                          else xtrainer._LAZY.get(a.name, base) if base == "xtrainer" else base for a in sub.names}
        elif (isinstance(sub, ast.Call) and ast.unparse(sub.func).endswith("import_module") and sub.args
              and isinstance(sub.args[0], ast.Constant) and str(sub.args[0].value).startswith("xtrainer")):
            found.add(sub.args[0].value)
    return found - {name}


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def test_no_import_cycles_type_only_imports_counted():
    root = os.path.dirname(os.path.abspath(xtrainer.__file__))
    graph = {}
    for folder, _, files in os.walk(root):
        for file in files:
            if file.endswith(".py"):
                path = os.path.join(folder, file)
                name = os.path.relpath(path, os.path.dirname(root))[:-3].replace(os.sep, ".").removesuffix(".__init__")
                graph[name] = _imports(path, name)
    assert {"xtrainer.trainer", "xtrainer.module", "xtrainer.callbacks.base"} <= set(graph)
    # imports inside functions are edges too: the CLI builds the doctor's command lazily, and
    # _lazy_xla imports _xla by name at its first use
    assert "xtrainer.launch.doctor" in graph["xtrainer.launch.cli"] and "xtrainer._xla" in graph["xtrainer._lazy_xla"]
    done, cycles = set(), []

    def visit(name, path):
        if name in path:
            cycles.append(" -> ".join(path[path.index(name):] + [name]))
        elif name not in done:
            for dep in graph.get(name, ()):
                visit(dep, path + [name])
            done.add(name)

    for name in graph:
        visit(name, [])
    assert not cycles


def _coupling():
    """``benchmarks/coupling.py``, which counts these from the source."""
    spec = importlib.util.spec_from_file_location(
        "coupling", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(conftest.__file__))), "benchmarks",
                                 "coupling.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_module_but_the_trainer_uses_its_private_attributes():
    coupling = _coupling()
    texts = coupling.sources()
    assert coupling.private_uses(texts) == []
    assert coupling.circles(coupling.import_graph(texts)) == []  # the counter agrees with the test above
    # what is left to write of the Trainer outside it: Lightning's public settables only (the
    # metrics, the data module, the run folder and the run's configuration are their owners')
    others, settables = coupling.split_writes(coupling.trainer_writes(texts))
    assert others == {}, others
    assert {"should_stop"} <= {attr for attrs in settables.values() for attr in attrs}
    assert len(coupling.init_attributes(texts)) <= 30
    assert sum(name.startswith("_") for name in coupling.init_attributes(texts)) <= 3
    assert not [path for path in coupling.long_modules(texts) if path.startswith(os.path.join("xtrainer", "loop"))]


def test_the_counters_find_what_they_count(tmp_path):
    coupling = _coupling()
    texts = {os.path.join("xtrainer", "a.py"): "from xtrainer import b\ndef f(trainer):\n    trainer._x = trainer._y\n"
                                              "    trainer.should_stop = True\n",
             os.path.join("xtrainer", "b.py"): "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                              "    from xtrainer.a import f\n",
             os.path.join("xtrainer", "__init__.py"): "_LAZY = {}\n"}
    assert [use[2] for use in coupling.private_uses(texts)] == ["_x", "_y"]
    assert coupling.trainer_writes(texts) == {os.path.join("xtrainer", "a.py"): {"_x", "should_stop"}}
    assert coupling.split_writes(coupling.trainer_writes(texts)) == (
        {os.path.join("xtrainer", "a.py"): {"_x"}}, {os.path.join("xtrainer", "a.py"): {"should_stop"}})
    assert coupling.circles(coupling.import_graph(texts)) == [{"xtrainer.a", "xtrainer.b"}]


def _loop_state_writes(path: str) -> list[str]:
    """Assignments to a ``LoopState``'s fields in ``path``: ``<x>.loop.<field> = ...``,
    ``trainer.loop = ...``, and through a name bound to ``<x>.loop`` or named ``loop``."""
    from xtrainer.loop.state import LoopState

    fields = {f.name for f in dataclasses.fields(LoopState)}
    tree = ast.parse(open(path).read())
    aliases = {t.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
               and isinstance(node.value, ast.Attribute) and node.value.attr == "loop"
               for t in node.targets if isinstance(t, ast.Name)} | {"loop"}
    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            for sub in ast.walk(target):
                if not isinstance(sub, ast.Attribute) or not isinstance(sub.ctx, ast.Store):
                    continue
                owner = sub.value
                if (sub.attr == "loop" and isinstance(owner, (ast.Name, ast.Attribute))
                        and ast.unparse(owner).endswith("trainer")) or (
                        sub.attr in fields and (isinstance(owner, ast.Attribute) and owner.attr == "loop"
                                                or isinstance(owner, ast.Name) and owner.id in aliases)):
                    found.append(f"{path}:{node.lineno}: {ast.unparse(sub)}")
    return found


def test_only_the_loop_writes_where_a_fit_is():
    root = os.path.dirname(os.path.abspath(xtrainer.__file__))
    writes = [w for folder, _, files in os.walk(root) if not folder.startswith(os.path.join(root, "loop"))
              for name in files if name.endswith(".py") for w in _loop_state_writes(os.path.join(folder, name))]
    assert writes == []


def test_the_loop_state_write_finder_finds_them(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("def f(trainer, loop):\n    trainer.loop.seed = 1\n    trainer.loop = 2\n    state = trainer.loop\n"
                    "    state.global_step += 1\n    loop.progress = None\n    trainer.loopy = 3\n")
    assert [w.split(": ")[1] for w in _loop_state_writes(str(path))] == [
        "trainer.loop.seed", "trainer.loop", "state.global_step", "loop.progress"]


RUNTIME = "xtrainer.strategies.launchers.cpu_threads"  # the CPU runtime's thread replicas


def _modules(root: str, *relative: str) -> dict[str, str]:
    """Every module (dotted name -> path) of the files and folders ``relative`` to the package."""
    found = {}
    for rel in relative:
        path = os.path.join(root, rel)
        paths = [path] if path.endswith(".py") else [os.path.join(folder, f) for folder, _, files in os.walk(path)
                                                     for f in files if f.endswith(".py")]
        for p in paths:
            found[os.path.relpath(p, os.path.dirname(root))[:-3].replace(os.sep, ".").removesuffix(".__init__")] = p
    return found


def _names_the_runtime(path: str, name: str) -> list[str]:
    """Where ``path`` imports the runtime package or one of its modules (at any depth, inside
    functions too), or names it as an attribute (``strategies.cpu_threads``)."""
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    short = RUNTIME.rpartition(".")[2]
    found = []
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Attribute) and node.attr == short or isinstance(node, ast.Name) and node.id == short:
            targets = [RUNTIME]
        else:
            continue
        found += [f"line {node.lineno}: {t}" for t in targets if t == RUNTIME or t.startswith(RUNTIME + ".")]
    return found


def test_only_the_launcher_reaches_the_cpu_thread_runtime():
    """Strategies, callbacks and the compilation cache ask the process (``shared_process``) what
    the thread replicas change; only the launcher, which chooses the runtime, imports it."""
    root = os.path.dirname(os.path.abspath(xtrainer.__file__))
    runtime = _modules(root, "strategies/launchers/cpu_threads")
    assert f"{RUNTIME}.replicas" in runtime and RUNTIME in runtime
    checked = {name: path for name, path in _modules(root, "strategies", "callbacks", "compile_cache.py").items()
               if name not in runtime and name != "xtrainer.strategies.launchers"}
    assert {"xtrainer.strategies.base", "xtrainer.strategies.xla_ddp", "xtrainer.strategies.xla_fsdp",
            "xtrainer.strategies.shared_process", "xtrainer.callbacks.health", "xtrainer.compile_cache"} <= set(checked)
    offenders = {name: hits for name, path in checked.items() if (hits := _names_the_runtime(path, name))}
    assert not offenders, f"import the runtime only in strategies/launchers/__init__.py; ask shared_process instead: {offenders}"
    # The check sees an import where there is one.
    assert _names_the_runtime(os.path.join(root, "strategies", "launchers", "__init__.py"), "xtrainer.strategies.launchers")


def test_the_private_torch_xla_internals_serve_only_the_cpu_thread_runtime():
    """``_xla.py``'s last section (private torch_xla internals for the thread replicas) is called
    from the runtime package and nowhere else."""
    root = os.path.dirname(os.path.abspath(xtrainer.__file__))
    source = open(os.path.join(root, "_xla.py")).read()
    start = next(i for i, line in enumerate(source.splitlines(), 1) if line.startswith("# Private torch_xla internals"))
    private = {node.name for node in ast.parse(source).body if isinstance(node, ast.FunctionDef) and node.lineno > start}
    assert {"replace_sync", "run_thread_per_device", "all_gather_on_channel"} <= private
    runtime = _modules(root, "strategies/launchers/cpu_threads")
    used = {}
    for name, path in _modules(root, ".").items():
        if name == "xtrainer._xla":
            continue
        attrs = {node.attr for node in ast.walk(ast.parse(open(path).read())) if isinstance(node, ast.Attribute)}
        if attrs & private:
            used[name] = sorted(attrs & private)
    assert used and set(used) <= set(runtime), f"private torch_xla internals used outside {RUNTIME}: {used}"


def _url_branches(path: str) -> list[str]:
    """Where ``path`` tells a URL from a local path itself: asks ``is_url``, compares or matches a
    string against one holding ``"://"``, or parses a URL (``urlparse``, ``urlsplit``)."""
    found = []

    def url_text(node: ast.AST) -> bool:
        return any(isinstance(sub, ast.Constant) and isinstance(sub.value, str) and "://" in sub.value
                   for sub in ast.walk(node))

    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, (ast.Name, ast.Attribute)) and (node.id if isinstance(node, ast.Name) else node.attr) in (
                "is_url", "urlparse", "urlsplit"):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Compare) and any(url_text(part) for part in [node.left, *node.comparators]):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in (
                "startswith", "endswith", "match", "search", "fullmatch", "compile", "split", "partition") \
                and any(url_text(arg) for arg in node.args):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_only_the_checkpoint_package_tells_urls_from_local_paths():
    """Checkpoint I/O and the local/URL distinction stay in ``checkpoint/``: its callers use its
    operations (``fs.make_folder``, ``fs.claim_folder``, ``fs.write_text_into``, ``fs.within``,
    ``fs.require_local``, ``storage.append``...) and never branch on a URL themselves."""
    root = os.path.dirname(os.path.abspath(xtrainer.__file__))
    checkpoint = _modules(root, "checkpoint")
    branches = {name: hits for name, path in _modules(root, ".").items()
                if name not in checkpoint and (hits := _url_branches(path))}
    assert branches == {}, f"ask xtrainer/checkpoint/ (fs.py) instead of telling URLs from paths here: {branches}"
    # The check sees a branch where there is one.
    assert len(_url_branches(checkpoint["xtrainer.checkpoint.fs"])) > 10
