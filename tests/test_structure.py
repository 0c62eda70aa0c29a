"""The package's shape, checked from its source: imports flow one way with no cycle, each package imports only the
layers below it, config modules import no torch, and no function grows past what one reading takes in."""

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hlat"

# Shared vocabulary, below every package and importing only itself: hlat/__init__.py, the config field machinery
# (fields.py), where the shipped files are (resources.py), hardware profiles (profiles.py), the run directory's files
# (files.py) and where they are, its checkpoints' names included (paths.py), the console, a DTensor's local and full
# views (dtensor.py), side groups and object gathers (groups.py), and every private torch name hlat reaches
# (torch_private.py).
SHARED = {
    "hlat",
    "hlat.fields",
    "hlat.resources",
    "hlat.profiles",
    "hlat.files",
    "hlat.paths",
    "hlat.console",
    "hlat.dtensor",
    "hlat.groups",
    "hlat.torch_private",
}
# What each package may import of hlat's other packages. Commands -> tools, measurement, job control, planner ->
# train -> the job config (hlat.config.job, made of each package's own config section) -> {models, parallel, data,
# optim} -> shared vocabulary; checkpoints (the train state, its tiers and files) sit between train and the four. A
# package's cli.py is a command and may import what any command may.
ALLOWED = {
    "models": set(),
    "optim": set(),
    "parallel": {"models"},
    "data": set(),
    "config": {"models", "parallel", "data", "optim"},
    "planner": {"models", "parallel", "optim"},
    "checkpoint": {"config", "models", "parallel", "data", "optim"},
    "train": {"checkpoint", "config", "models", "parallel", "data", "optim"},
    "measure": {"checkpoint", "config", "models", "parallel", "data", "optim", "planner", "train"},
    "tools": {"checkpoint", "config", "models", "parallel", "data", "optim", "train"},
    "jobs": {"config"},
}
COMMANDS = set(ALLOWED)
TORCH_FREE = [
    "hlat.fields",
    "hlat.config",
    "hlat.config.job",
    "hlat.config.cli",
    "hlat.paths",
    "hlat.resources",
    "hlat.profiles",
    "hlat.files",
    "hlat.cli",
    "hlat.models.config",
    "hlat.data.config",
    "hlat.optim.config",
    "hlat.optim.modes",
    "hlat.parallel.config",
    "hlat.checkpoint.writer_process",  # the background writer's process, which starts in a fraction of a second
    # the planner, so that `hlat plan` starts at once (docs/architecture.md)
    *(f"hlat.planner.{p.stem}" for p in sorted((PACKAGE / "planner").glob("*.py")) if p.stem != "__init__"),
]
MAX_LINES = 60
LONG_FUNCTIONS: dict[str, str] = {}  # "module:function": why it stays long


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(path: Path, known: set[str]) -> set[str]:
    """The hlat modules `path` imports anywhere in it (at its top or inside a function: both are dependencies)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            # `from hlat.data import packing` imports the submodule; `from hlat.parallel import Topology` the package
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names}
    return {m for m in found if m in known and m != name}


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(path, set(mods)) for name, path in mods.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                on_stack.discard(w)
                component.append(w)
            on_stack.discard(v)
            if component:
                found.append(sorted(component + [v]))

    sys.setrecursionlimit(10_000)
    for v in edges:
        if v not in index:
            visit(v)
    return found


def package_of(module: str) -> str | None:
    """The package of `module` that the layering table names; None for shared vocabulary and the command root."""
    if module in SHARED:
        return None
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()) else None


def test_no_import_cycle():
    assert cycles(graph()) == []


def test_cycle_finder_finds_a_cycle():  # the check above could not fail if this one did
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_imports_flow_one_way():
    wrong = []
    for module, imported in graph().items():
        source = package_of(module)
        if source is None:
            continue
        allowed = ALLOWED[source] | ({*COMMANDS} if module.endswith(".cli") else set()) | {source}
        wrong += [f"{module} imports {m}" for m in imported if package_of(m) and package_of(m) not in allowed]
    assert wrong == []


def test_shared_vocabulary_imports_only_shared_vocabulary():
    edges = graph()
    assert SHARED <= set(edges)
    assert [f"{m} imports {i}" for m in sorted(SHARED) for i in sorted(edges[m]) if i not in SHARED] == []


def test_training_imports_no_measurement_tools_or_job_control():
    """The run itself, all of it: `hlat train`'s command, which supervises it, is job control's."""
    train = {m: i for m, i in graph().items() if package_of(m) == "train"}
    assert train and all(
        package_of(i) not in ("measure", "tools", "jobs") for imported in train.values() for i in imported
    )


def test_config_and_planner_modules_import_no_torch():
    code = (
        f"import sys, importlib; [importlib.import_module(m) for m in {TORCH_FREE!r}]; "
        "assert 'torch' not in sys.modules, [m for m in sys.modules if m.startswith('hlat')]"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": ""},
    )
    assert done.returncode == 0, done.stderr


def room_of(module: str) -> str:
    """The folder a module lies in (`hlat/<folder>/`), or the module itself when it is a file of `hlat/`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and (PACKAGE / parts[1]).is_dir() else module


def test_folders_stand_on_one_floor_each():
    """Drawn folder by folder (a folder stands above what any of its modules imports), no import runs back up a floor
    and none runs in a circle: the folders' import graph has no cycle."""
    rooms: dict[str, set[str]] = {}
    for module, imported in graph().items():
        rooms.setdefault(room_of(module), set()).update(room_of(i) for i in imported if room_of(i) != room_of(module))
    for room in {r for targets in rooms.values() for r in targets}:
        rooms.setdefault(room, set())
    assert cycles(rooms) == []


def dotted(node: ast.AST) -> str:
    """`a.b.c` of an attribute chain that starts at a name ('' for one that starts elsewhere)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else ""


PRIVATE_ATTRIBUTES = {"__tensor_flatten__", "_schema", "storage_data"}  # private in what they reach, not in name


def private_torch_names(path: Path) -> set[str]:
    """The private torch names `path` reaches: a module or an attribute of torch's under a leading underscore
    (dunders such as `torch.__version__` are public), and the private attributes of torch objects hlat reads."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Attribute):
            names = [dotted(node)]
            found |= {node.attr} & PRIVATE_ATTRIBUTES
        for name in names:
            parts = name.split(".")
            if parts[0] == "torch" and any(p.startswith("_") and not p.endswith("__") for p in parts[1:]):
                found.add(name)
    return found


def test_private_torch_names_are_reached_from_one_module():
    reached = {name: private_torch_names(path) for name, path in modules().items()}
    assert reached["hlat.torch_private"], "the finder finds nothing in the module that holds them"
    assert {m: sorted(n) for m, n in reached.items() if n and m != "hlat.torch_private"} == {}


def test_one_module_writes_in_the_background():
    """The one background writer of both tiers starts the writer process (`WriterProcess`); DCP's own asynchronous
    saving (`dcp.async_save`, `StagingOptions`: a thread of the trainer) is used nowhere."""
    pattern = r"\bWriterProcess\b|\basync_save\b|\bStagingOptions\b"
    users = {name for name, path in modules().items() if re.search(pattern, path.read_text())}
    assert users == {"hlat.checkpoint.background"}
    assert not re.search(r"\basync_save\b|\bStagingOptions\b", (PACKAGE / "checkpoint" / "background.py").read_text())


def test_the_step_counter_is_read_through_the_train_state_only():
    """No module outside the checkpoint package reaches the train state's step through a checkpoint object (the
    trainer holds the state it hands to the tiers)."""
    reaching = []
    for name, path in modules().items():
        if package_of(name) == "checkpoint":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            chain = dotted(node) if isinstance(node, ast.Attribute) else ""
            if re.search(r"\b(checkpoints|tiers|durable|memory)\.state\.step$", chain):
                reaching.append(f"{name}: {chain}")
    assert reaching == []


def long_functions() -> list[str]:
    found = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_LINES and f"{name}:{node.name}" not in LONG_FUNCTIONS:
                    found.append(f"{name}:{node.name} ({lines} lines)")
    return found


def test_no_function_over_60_lines():
    assert long_functions() == []
