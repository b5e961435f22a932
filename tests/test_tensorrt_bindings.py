"""The TensorRT engine's runtime against the published GPU bindings, where there is no GPU and
no TensorRT: every name cptune reaches on tensorrt (11.4.0.106), nccl4py (0.6.0) and
cuda-bindings (13.5.0) must exist there, so a misspelt, renamed or removed call fails here
instead of at first contact with a GPU.

What is read: every cptune module that imports tensorrt, nccl or cuda (at any level, so new
modules are picked up), with ``ast``:

- attribute chains rooted at those modules, as imported (``trt``, ``cudart``, ``nccl``) or kept
  in an attribute of that name (``self.trt``, ``self.gpu.cudart``); an attribute of that name
  holding a container (``self.nccl = {}``, the communicators) is not the module;
- members used on objects of the bindings: an object's class comes from the call that made
  it (``RESULTS``: ``trt.Builder(...)``, ``builder.create_network()``), followed through
  assignments (to variables, attributes, items of a dict or list) and cptune's own
  functions' returns, or, where it cannot be followed (a parameter, a loop over a dict),
  from its name (``NAMES``). Every member used on such an object is checked, so the tables
  list classes, never methods; a call into the bindings whose result the runtime keeps and
  ``RESULTS`` does not know fails the test (add it);
- methods of a cptune class that subclasses a bindings class (``trt.IProfiler``): they override;
- names imported with ``from ... import``. ``getattr`` with a default is a probe, not checked.

How the bindings are read: the pinned wheels are downloaded once (``pip download --no-deps``)
into pytest's cache and unpacked, never installed; a fresh interpreter imports them and
answers ``hasattr`` along each name, so the test session never sees these modules. nccl4py
and cuda-bindings import without a GPU. tensorrt_bindings/tensorrt.so needs libnvinfer.so.11,
libnvinfer_plugin.so.11 and libnvonnxparser.so.11, which no package index holds
(tensorrt-cu13-libs downloads them from NVIDIA's server), so the unpacked copy is patched: it
names libm.so.6 for them and its undefined symbols become weak (TensorRT's entry points are
then null, and never called). Importing it runs pybind11's registration of every class,
method, property and enum of the real module; ``tensorrt`` is made as the tensorrt-cu13
package makes it (``from tensorrt_bindings import *``). No compiler is needed.
"""

from __future__ import annotations

import ast
import hashlib
import json
import platform
import struct
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

import cptune

#: The published bindings, pinned so the check is reproducible (nccl.core imports cuda-core;
#: cuda-pathfinder finds the libraries for nccl4py and cuda-bindings).
WHEELS = (
    "tensorrt-cu13-bindings==11.4.0.106",
    "nccl4py==0.6.0",
    "cuda-bindings==13.5.0",
    "cuda-core==1.2.2",
    "cuda-pathfinder==1.9.0",
)
#: Top-level packages of the bindings: a cptune module importing one of them is read.
GPU_PACKAGES = {"tensorrt", "nccl", "cuda"}
#: Libraries tensorrt.so links that only NVIDIA's own server has.
TENSORRT_LIBRARIES = (b"libnvinfer.so.11", b"libnvinfer_plugin.so.11", b"libnvonnxparser.so.11")
#: Values that make an attribute a container, not a module, whatever its name (``self.nccl = {}``).
CONTAINERS = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)


class Ref(NamedTuple):
    """Something in the bindings: what ``path`` names inside ``module`` or, with ``instance``,
    an object of the class at ``path``."""

    module: str
    path: str
    instance: bool = False

    def member(self, name: str) -> Ref:
        return Ref(self.module, f"{self.path}.{name}".lstrip("."))

    def __str__(self) -> str:
        return ".".join(filter(None, (self.module, self.path)))


#: The class of what a call into the bindings returns, by the name called (None: a plain value).
RESULTS: dict[str, Ref | None] = {
    "Logger": Ref("tensorrt", "Logger", True),
    "Runtime": Ref("tensorrt", "Runtime", True),
    "Builder": Ref("tensorrt", "Builder", True),
    "OnnxParser": Ref("tensorrt", "OnnxParser", True),
    "create_network": Ref("tensorrt", "INetworkDefinition", True),
    "create_builder_config": Ref("tensorrt", "IBuilderConfig", True),
    "build_serialized_network": Ref("tensorrt", "IHostMemory", True),
    "deserialize_cuda_engine": Ref("tensorrt", "ICudaEngine", True),
    "create_execution_context": Ref("tensorrt", "IExecutionContext", True),
    "create_engine_inspector": Ref("tensorrt", "EngineInspector", True),
    "get_unique_id": Ref("nccl.core", "UniqueId", True),
    "init": Ref("nccl.core", "Communicator", True),
    "split": Ref("nccl.core", "Communicator", True),
    "load_nvidia_dynamic_lib": Ref("cuda.pathfinder", "LoadedDL", True),
}
#: Objects of the bindings whose origin cannot be followed (a parameter, a loop over a dict,
#: a value unwrapped by ``GpuRank.cuda``), by the name of the variable or attribute holding them.
NAMES: dict[str, Ref] = {
    "communicator": Ref("nccl.core", "Communicator", True),
    "properties": Ref("cuda.bindings.runtime", "cudaDeviceProp", True),
}


def _imported(node: ast.AST) -> list[str]:
    """The absolute module names an import statement names."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        return [node.module]
    return []


def _name(node: ast.expr) -> str:
    """The name an expression ends in: ``f`` of ``f`` and ``x.f`` (empty for others)."""
    return getattr(node, "attr", getattr(node, "id", ""))


def _assignments(node: ast.AST) -> Iterator[tuple[ast.expr, ast.expr]]:
    """(target, value) of an assignment, pairwise for ``a, b = x, y``."""
    if isinstance(node, ast.Assign):
        for target in node.targets:
            if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                yield from zip(target.elts, node.value.elts, strict=False)
            else:
                yield target, node.value
    elif isinstance(node, ast.AnnAssign | ast.NamedExpr) and node.value is not None:
        yield node.target, node.value


class Uses:
    """What ``trees`` (file name: module) reach in the bindings: ``names`` maps each name to
    where it is used; ``unknown`` lists the kept results of bindings calls ``RESULTS`` lacks."""

    def __init__(self, trees: dict[str, ast.Module]) -> None:
        self.parent = {
            child: node
            for tree in trees.values()
            for node in ast.walk(tree)
            for child in ast.iter_child_nodes(node)
        }
        self.aliases: dict[str, Ref] = {}
        self.bound: dict[tuple[ast.AST, str], list[ast.expr]] = {}
        self.attributes: dict[str, list[ast.expr]] = {}
        self.containers: set[str] = set()
        self.items: dict[str, list[ast.expr]] = {}
        self.returns: dict[str, list[ast.expr]] = {}
        self.busy: set[object] = set()
        self.names: dict[Ref, set[str]] = {}
        self.unknown: list[str] = []
        for file, tree in trees.items():
            for node in ast.walk(tree):
                self._index(file, node)
        for file, tree in trees.items():
            for node in ast.walk(tree):
                self._read(file, node)

    def _index(self, file: str, node: ast.AST) -> None:
        for alias in node.names if isinstance(node, ast.Import) else []:
            if (top := alias.name.split(".")[0]) in GPU_PACKAGES:
                self.aliases[alias.asname or top] = Ref(alias.name if alias.asname else top, "")
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in GPU_PACKAGES:
            for alias in node.names:
                self.aliases[alias.asname or alias.name] = Ref(node.module, alias.name)
                self.names.setdefault(Ref(node.module, alias.name), set()).add(f"{file}:{node.lineno}")
        if isinstance(node, ast.arg):
            self.bound.setdefault((self._scope(node), node.arg), [])
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            self.bound.setdefault((self._scope(node), node.id), [])
        for target, value in _assignments(node):
            if isinstance(target, ast.Name):
                self.bound.setdefault((self._scope(target), target.id), []).append(value)
            elif isinstance(target, ast.Attribute):
                self.attributes.setdefault(target.attr, []).append(value)
                if isinstance(value, CONTAINERS):
                    self.containers.add(target.attr)
            elif isinstance(target, ast.Subscript) and (holder := _name(target.value)):
                self.items.setdefault(holder, []).append(value)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            returns = [n.value for n in ast.walk(node) if isinstance(n, ast.Return) and n.value is not None]
            self.returns.setdefault(node.name, []).extend(returns)

    def _read(self, file: str, node: ast.AST) -> None:
        at = f"{file}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Attribute) and not self._is_module(node):
            for ref in self.value(node.value):
                self.names.setdefault(ref.member(node.attr), set()).add(at)
        if isinstance(node, ast.ClassDef):
            for base in (ref for expr in node.bases for ref in self.value(expr) if not ref.instance):
                for method in node.body:
                    if isinstance(method, ast.FunctionDef) and not method.name.startswith("__"):
                        self.names.setdefault(base.member(method.name), set()).add(f"{file}:{method.lineno}")
        if isinstance(node, ast.Call) and self._calls_bindings(node.func):
            holder = self.parent[node]
            targets = holder.targets if isinstance(holder, ast.Assign) else []
            kept = isinstance(holder, ast.Attribute | ast.Return | ast.AnnAssign | ast.NamedExpr) or (
                bool(targets) and all(isinstance(t, ast.Name | ast.Attribute) for t in targets)
            )
            if kept and _name(node.func) not in RESULTS:
                self.unknown.append(f"{at} {ast.unparse(node.func)}()")

    def _scope(self, node: ast.AST) -> ast.AST:
        while not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Module):
            node = self.parent[node]
        return node

    def _is_module(self, node: ast.Attribute) -> bool:
        return node.attr in self.aliases and node.attr not in self.containers

    def _calls_bindings(self, func: ast.expr) -> bool:
        if isinstance(func, ast.Attribute):
            return bool(self.value(func.value))
        return isinstance(func, ast.Name) and func.id in self.aliases

    def _typed(self, key: object, values: list[ast.expr], name: str) -> set[Ref]:
        """What ``values`` (assigned to ``name``) are in the bindings, else ``NAMES``'s guess."""
        if key in self.busy:
            return set()
        self.busy.add(key)
        refs = set().union(*(self.value(v) for v in values))
        self.busy.discard(key)
        return refs or ({NAMES[name]} if name in NAMES else set())

    def value(self, node: ast.expr) -> set[Ref]:
        """What ``node`` is in the bindings: empty where it is not theirs, or cannot be told."""
        if isinstance(node, ast.Name):
            if node.id in self.aliases:
                return {self.aliases[node.id]}
            scope = self._scope(node)
            while (scope, node.id) not in self.bound and not isinstance(scope, ast.Module):
                scope = self._scope(self.parent[scope])
            return self._typed((scope, node.id), self.bound.get((scope, node.id), []), node.id)
        if isinstance(node, ast.Attribute):
            if self._is_module(node):
                return {self.aliases[node.attr]}
            members = {ref.member(node.attr) for ref in self.value(node.value) if not ref.instance}
            return members or self._typed(node.attr, self.attributes.get(node.attr, []), node.attr)
        if isinstance(node, ast.Call):
            if self._calls_bindings(node.func):
                return {ref} if (ref := RESULTS.get(_name(node.func))) else set()
            return self._typed(("returns", _name(node.func)), self.returns.get(_name(node.func), []), "")
        if isinstance(node, ast.Subscript) and (holder := _name(node.value)):
            return self._typed(("items", holder), self.items.get(holder, []), "")
        if isinstance(node, ast.BoolOp):
            return set().union(*(self.value(v) for v in node.values))
        if isinstance(node, ast.IfExp):
            return self.value(node.body) | self.value(node.orelse)
        if isinstance(node, ast.NamedExpr):
            return self.value(node.value)
        return set()


def runtime_trees() -> dict[str, ast.Module]:
    """Every cptune module importing tensorrt, nccl or cuda, by its path from the repository root."""
    package = Path(cptune.__file__).parent
    trees = {}
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        if any(m.split(".")[0] in GPU_PACKAGES for node in ast.walk(tree) for m in _imported(node)):
            trees[str(path.relative_to(package.parent))] = tree
    return trees


def make_tensorrt_importable(site: Path) -> None:
    """Patch the unpacked tensorrt_bindings/tensorrt.so (ELF64, little-endian) to load without
    TensorRT's libraries, and add ``tensorrt`` as the tensorrt-cu13 package does."""
    library = site / "tensorrt_bindings" / "tensorrt.so"
    data = bytearray(library.read_bytes())
    assert data[:6] == b"\x7fELF\x02\x01", "tensorrt.so is not a little-endian ELF64 file"
    for name in TENSORRT_LIBRARIES:
        needed = b"\0" + name + b"\0"
        assert data.count(needed) == 1, f"tensorrt.so does not name {name.decode()} once"
        data = data.replace(needed, b"\0libm.so.6".ljust(len(needed), b"\0"))
    (sections,) = struct.unpack_from("<Q", data, 0x28)
    section_size, count = struct.unpack_from("<HH", data, 0x3A)
    for section in range(sections, sections + count * section_size, section_size):
        if struct.unpack_from("<I", data, section + 4)[0] == 11:  # SHT_DYNSYM
            offset, size, _, _, _, symbol_size = struct.unpack_from("<QQIIQQ", data, section + 0x18)
            for symbol in range(offset, offset + size, symbol_size):
                undefined = struct.unpack_from("<H", data, symbol + 6)[0] == 0
                if undefined and data[symbol + 4] >> 4 == 1:  # STB_GLOBAL -> STB_WEAK
                    data[symbol + 4] = 0x20 | data[symbol + 4] & 0xF
    library.write_bytes(data)
    (site / "tensorrt").mkdir()
    (site / "tensorrt" / "__init__.py").write_text(
        "from tensorrt_bindings import *\nfrom tensorrt_bindings import __version__\n"
    )


@pytest.fixture(scope="module")
def bindings(pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding the published bindings unpacked and importable (see the module
    docstring), made once per Python and machine in pytest's cache (in this session's
    temporary directory where the cache is off: ``-p no:cacheprovider``)."""
    if sys.platform != "linux":
        pytest.skip("the published GPU bindings are Linux wheels")
    if (store := getattr(pytestconfig, "cache", None)) is not None:
        cache = store.mkdir("published-gpu-bindings")
    else:
        cache = tmp_path_factory.mktemp("published-gpu-bindings")
    key = repr((WHEELS, sys.implementation.cache_tag, platform.machine()))
    site = cache / hashlib.sha256(key.encode()).hexdigest()[:16]
    if site.is_dir():
        return site
    with tempfile.TemporaryDirectory(dir=cache) as scratch:
        wheels, unpacked = Path(scratch) / "wheels", Path(scratch) / "site"
        download = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--quiet",
            "--disable-pip-version-check",
            "--dest",
            str(wheels),
            *WHEELS,
        ]
        done = subprocess.run(download, capture_output=True, text=True, timeout=240)
        if done.returncode != 0:
            error = (done.stderr.strip().splitlines() or ["no message"])[-1]
            pytest.skip(f"cannot download the published GPU bindings (no package index reachable?): {error}")
        for wheel in sorted(wheels.glob("*.whl")):
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(unpacked)
        make_tensorrt_importable(unpacked)
        unpacked.rename(site)
    return site


#: Run in a fresh, isolated interpreter, the unpacked bindings first on sys.path: reads [[module, path]]
#: on stdin, prints those that do not resolve (importing a submodule on the way, as Python
#: does; a dataclass field counts, as instances have it).
RESOLVE = """\
import importlib, json, sys, types
sys.path.insert(0, sys.argv[1])
missing = []
for module, path in json.load(sys.stdin):
    found = importlib.import_module(module)
    for part in filter(None, path.split(".")):
        if part in getattr(found, "__dataclass_fields__", {}):
            break  # an instance's field: no class attribute to go on with
        if not hasattr(found, part) and isinstance(found, types.ModuleType):
            try:
                importlib.import_module(f"{found.__name__}.{part}")
            except ModuleNotFoundError:
                pass
        if not hasattr(found, part):
            missing.append([module, path])
            break
        found = getattr(found, part)
print(json.dumps(missing))
"""


def missing_names(site: Path, uses: Uses) -> list[str]:
    """The names of ``uses`` the bindings in ``site`` lack, each with where it is used."""
    request = json.dumps([[ref.module, ref.path] for ref in uses.names])
    done = subprocess.run(
        [sys.executable, "-I", "-c", RESOLVE, str(site)],
        input=request,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    missing = [Ref(module, path) for module, path in json.loads(done.stdout)]
    return sorted(f"{ref} ({', '.join(sorted(uses.names[ref]))})" for ref in missing)


# --------------------------------------------------------------------------- tests

#: The runtime's idioms in small, with three made-up names (``_v9``) and one kept result that
#: ``RESULTS`` does not know (``self.engine.serialize()``).
SNIPPET = """\
from cuda.pathfinder import load_nvidia_dynamic_lib


def _stack():
    import tensorrt as trt
    from cuda.bindings import runtime as cudart

    return trt, cudart


class Rank:
    def __init__(self):
        self.trt, self.cudart = _stack()
        self.runtime = self.trt.Runtime(self.trt.Logger(self.trt.Logger.WARNING))
        self.nccl = {}

    def load(self, data, communicator):
        import nccl.core as nccl

        self.engine = self.runtime.deserialize_cuda_engine(data)
        self.plan = self.engine.serialize()
        self.context = self._context()
        self.context.set_communicator_v9(communicator.ptr)
        self.nccl[0] = nccl.Communicator.init(nranks=1, rank=0, unique_id=nccl.get_unique_id())
        self.nccl[0].split(color=0, key=0)
        trt = self.trt

        class Times(trt.IProfiler):
            def report_layer_time(self, name, ms):
                pass

            def report_layer_time_v9(self, name, ms):
                pass

        flag = trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED_V9
        return self.cudart.cudaMemcpyKind.cudaMemcpyHostToDevice, flag, nccl.get_unique_id().as_bytes

    def _context(self):
        context = self.engine.create_execution_context()
        return context
"""
MADE_UP = [
    "tensorrt.IExecutionContext.set_communicator_v9 (snippet.py:23)",
    "tensorrt.IProfiler.report_layer_time_v9 (snippet.py:32)",
    "tensorrt.NetworkDefinitionCreationFlag.STRONGLY_TYPED_V9 (snippet.py:35)",
]


def test_reading_follows_modules_and_objects_through_the_runtime_idioms() -> None:
    """Each rule of the reading (see the module docstring) on a small source: the names it
    reaches, the dict named like a module left alone, the unknown kept result reported."""
    uses = Uses({"snippet.py": ast.parse(SNIPPET)})
    assert sorted(map(str, uses.names)) == [
        "cuda.bindings.runtime",
        "cuda.bindings.runtime.cudaMemcpyKind",
        "cuda.bindings.runtime.cudaMemcpyKind.cudaMemcpyHostToDevice",
        "cuda.pathfinder.load_nvidia_dynamic_lib",
        "nccl.core.Communicator",
        "nccl.core.Communicator.init",
        "nccl.core.Communicator.ptr",
        "nccl.core.Communicator.split",
        "nccl.core.UniqueId.as_bytes",
        "nccl.core.get_unique_id",
        "tensorrt.ICudaEngine.create_execution_context",
        "tensorrt.ICudaEngine.serialize",
        "tensorrt.IExecutionContext.set_communicator_v9",
        "tensorrt.IProfiler",
        "tensorrt.IProfiler.report_layer_time",
        "tensorrt.IProfiler.report_layer_time_v9",
        "tensorrt.Logger",
        "tensorrt.Logger.WARNING",
        "tensorrt.NetworkDefinitionCreationFlag",
        "tensorrt.NetworkDefinitionCreationFlag.STRONGLY_TYPED_V9",
        "tensorrt.Runtime",
        "tensorrt.Runtime.deserialize_cuda_engine",
    ]
    assert uses.unknown == ["snippet.py:21 self.engine.serialize()"]


def test_every_bindings_object_the_runtime_keeps_has_a_known_class() -> None:
    """A call into the bindings whose result the runtime keeps must be in ``RESULTS``, or the
    members used on that result would go unchecked."""
    uses = Uses(runtime_trees())
    assert not uses.unknown, f"add these calls' result classes to RESULTS: {uses.unknown}"


@pytest.mark.slow
def test_made_up_names_are_reported_missing(bindings: Path) -> None:
    """The check can fail: of the snippet's names, exactly the made-up ones are missing."""
    assert missing_names(bindings, Uses({"snippet.py": ast.parse(SNIPPET)})) == MADE_UP


@pytest.mark.slow
def test_runtime_uses_only_names_the_published_bindings_have(bindings: Path) -> None:
    """Every name the TensorRT runtime reaches on tensorrt, nccl4py and cuda-bindings exists
    in the published wheels."""
    uses = Uses(runtime_trees())
    assert {ref.module.split(".")[0] for ref in uses.names} == GPU_PACKAGES, "the reading lost a package"
    missing = missing_names(bindings, uses)
    assert not missing, "names the published bindings lack:\n" + "\n".join(missing)
