"""Stand-in for ``cuda.pathfinder`` (tests only): "loads" NVIDIA libraries by name and
remembers which, so the stand-in TensorRT can tell whether NCCL was loaded before it."""

from types import SimpleNamespace

#: Libraries loaded so far, by short name.
LOADED: dict[str, str] = {}


def load_nvidia_dynamic_lib(libname: str) -> SimpleNamespace:
    LOADED.setdefault(libname, f"/fake/site-packages/nvidia/{libname}/lib/lib{libname}.so.2")
    return SimpleNamespace(abs_path=LOADED[libname], was_already_loaded_from_elsewhere=False)
