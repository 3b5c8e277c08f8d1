"""The public surface: what torchps.client exports, and the error hierarchy."""

import importlib
import inspect
import pkgutil

import grpc
import pytest

import torchps.client
import torchps.ps_server
import torchps.serving
import torchps.errors as errors

# Submodules of torchps.client whose public classes and functions users need (all exported from
# torchps.client), and those that are plumbing. A new submodule must be put in one of the two.
USER_FACING = {"allreduce", "client", "dataqueue", "deltas", "embedding", "host", "hybrid", "module", "stats"}
INTERNAL = {"channels", "checkpoints", "datapath", "device", "errors", "failover_watch", "fanout", "held", "lanes",
            "layer_pull", "layout", "membership", "overlap", "recovery", "resize", "streamed_push", "tables", "transfer"}


def test_client_all_is_sorted_and_exists():
    names = torchps.client.__all__
    assert names == sorted(names)
    assert len(names) == len(set(names))
    missing = [n for n in names if not hasattr(torchps.client, n)]
    assert not missing


def test_client_submodules_are_classified():
    found = {m.name for m in pkgutil.iter_modules(torchps.client.__path__)}
    assert found == USER_FACING | INTERNAL, "classify new torchps.client submodules in this test"


@pytest.mark.parametrize("module_name", sorted(USER_FACING))
def test_user_facing_definitions_are_exported(module_name):
    """Every public class or function defined in a user-facing submodule is in torchps.client.__all__."""
    module = importlib.import_module(f"torchps.client.{module_name}")
    public = {name for name, obj in vars(module).items()
              if not name.startswith("_") and (inspect.isclass(obj) or inspect.isfunction(obj))
              and obj.__module__ == module.__name__}
    missing = sorted(public - set(torchps.client.__all__))
    assert not missing, f"torchps.client.{module_name} defines {missing} but torchps.client does not export them"
    for name in public:
        assert getattr(torchps.client, name) is getattr(module, name)


def test_every_error_is_exported_from_client():
    """Users catch torchps errors without importing the server package."""
    classes = {name for name, obj in vars(errors).items()
               if inspect.isclass(obj) and issubclass(obj, errors.PSError)}
    assert classes - set(torchps.client.__all__) == set()
    for name in classes:
        assert getattr(torchps.client, name) is getattr(errors, name)


@pytest.mark.parametrize("name", ["Cluster", "TaskSpec", "Placement"])
def test_shared_types_are_reexported_from_client(name):
    """Types users need that live outside torchps.client are re-exported, as the same objects."""
    obj = getattr(torchps.client, name)
    assert name in torchps.client.__all__
    assert getattr(importlib.import_module(obj.__module__), name) is obj


def test_errors_all_is_complete():
    """torchps.errors.__all__ lists exactly the public classes, functions and constants defined there."""
    defined = {name for name, obj in vars(errors).items()
               if not name.startswith("_") and (inspect.isclass(obj) or inspect.isfunction(obj))
               and obj.__module__ == errors.__name__}
    constants = {name for name in vars(errors) if name.isupper()}
    assert set(errors.__all__) == defined | constants
    assert len(errors.__all__) == len(set(errors.__all__))


def test_every_error_has_a_valid_grpc_code():
    codes = {code.name for code in grpc.StatusCode}
    for name in errors.__all__:
        cls = getattr(errors, name)
        if not inspect.isclass(cls):
            continue
        assert issubclass(cls, errors.PSError), name
        assert cls.grpc_code in codes, f"{name}.grpc_code = {cls.grpc_code!r} is not a grpc.StatusCode name"
        assert cls.grpc_code != "OK", name


def test_error_class_by_name():
    assert errors.error_class_by_name("SpecConflictError") is errors.SpecConflictError
    assert errors.error_class_by_name("ValueError") is None
    assert errors.error_class_by_name("error_class_by_name") is None
    assert errors.error_class_by_name("") is None


@pytest.mark.parametrize("package", [torchps, torchps.client, torchps.ps_server, torchps.serving])
def test_every_module_all_names_exist(package):
    """Each submodule's __all__ names only things that exist."""
    for info in pkgutil.iter_modules(package.__path__):
        if info.name == "__main__" or info.ispkg:
            continue
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for name in getattr(module, "__all__", ()):
            assert hasattr(module, name), f"{module.__name__}.__all__ names missing {name!r}"
