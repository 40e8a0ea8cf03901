"""The adapters' framework-independent shims: environment hygiene, refusal naming, device type."""

from __future__ import annotations

import os
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from meshsim.builders._common import FrameworkRejection
from meshsim.builders.real import _shims
from meshsim.builders.real._adapter import framework_refusals
from meshsim.harness import run

_NOISY = """
import os
os.environ["MESHSIM_SHIM_TEST"] = "written at import"
SAW_OLMO_SWITCH = os.environ.get("OLMO_DISABLE_PER_RANK_TRITON_CACHE")
"""


@pytest.fixture
def noisy_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A module that writes an environment variable when imported, as the frameworks do."""
    name = f"meshsim_noisy_{os.getpid()}_{id(tmp_path)}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(_NOISY))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.delenv("OLMO_TRITON_CACHE_BASE", raising=False)
    yield name
    sys.modules.pop(name, None)


def test_load_undoes_import_time_environment_writes(noisy_module: str) -> None:
    before = dict(os.environ)
    (module,) = _shims.load(noisy_module)
    assert module.__name__ == noisy_module
    assert dict(os.environ) == before
    # OLMo's own switch was on during the import (no triton cache dir), and is gone after.
    assert module.SAW_OLMO_SWITCH == "1"


def test_load_respects_a_chosen_triton_cache(
    noisy_module: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRITON_CACHE_DIR", "/somewhere/chosen")
    (module,) = _shims.load(noisy_module)
    assert module.SAW_OLMO_SWITCH is None
    assert os.environ["TRITON_CACHE_DIR"] == "/somewhere/chosen"


def test_unchanged_environ_restores_writes_and_deletions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHSIM_SHIM_KEEP", "1")
    before = dict(os.environ)
    with _shims.unchanged_environ():
        os.environ["MESHSIM_SHIM_NEW"] = "x"
        del os.environ["MESHSIM_SHIM_KEEP"]
    assert dict(os.environ) == before


def test_framework_refusals_keep_the_framework_type_name() -> None:
    class OLMoConfigurationError(Exception):
        pass

    with pytest.raises(FrameworkRejection) as caught, framework_refusals():
        raise OLMoConfigurationError("Data parallel config is required")
    assert caught.value.upstream == "OLMoConfigurationError"
    assert "Data parallel config is required" in str(caught.value)
    assert isinstance(caught.value.__cause__, OLMoConfigurationError)


def test_framework_refusals_pass_rejections_and_success_through() -> None:
    original = FrameworkRejection("mirrored", upstream="AssertionError")
    with pytest.raises(FrameworkRejection) as caught, framework_refusals():
        raise original
    assert caught.value is original
    with framework_refusals():
        value = 1
    assert value == 1


def _device() -> str:
    return _shims.device_type()


def test_device_type_is_cpu_on_gloo() -> None:
    assert run(_device, 2, backend="gloo") == ["cpu", "cpu"]


def test_tested_versions_match_the_extras() -> None:
    """The versions the shims document are the ones pyproject's extras pin."""
    text = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    for dist, version in _shims.TESTED_VERSIONS.items():
        assert f'"{dist}=={version}"' in text, dist


def test_unknown_config_keys_are_refused() -> None:
    from meshsim.builders.real._adapter import check_keys
    from meshsim.errors import UsageError

    check_keys("megatron", {"tensor_model_parallel_size": 2})
    with pytest.raises(UsageError, match=r"takes no config key\(s\) \['tensor_parallel'\]"):
        check_keys("megatron", {"tensor_parallel": 2})


def test_a_release_other_than_the_tested_one_is_named_with_the_fix(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A GPU image's transformers 5.17 failed inside the 5.23 adapter with a bare
    AttributeError; the release that differs is now said before any rank starts."""
    import warnings
    from importlib import metadata

    import meshsim
    from meshsim.builders.real import require, untested_version
    from meshsim.cli.main import _show_warning

    try:
        have = metadata.version("accelerate")
    except metadata.PackageNotFoundError:
        pytest.skip("accelerate is not installed")
    monkeypatch.setitem(_shims.TESTED_VERSIONS, "accelerate", have)
    assert untested_version("accelerate") is None
    monkeypatch.setitem(_shims.TESTED_VERSIONS, "accelerate", "0.0.1")
    note = untested_version("transformers")  # transformers' adapter needs accelerate too
    assert note is not None and note.startswith(f"accelerate {have} is installed and meshsim's")
    assert "tested with 0.0.1" in note and "pip install 'meshsim[transformers]'" in note
    assert untested_version("no-such-framework") is None
    with pytest.warns(meshsim.UntestedFrameworkWarning, match="tested with 0.0.1"):
        require("accelerate")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        require("accelerate")
    _show_warning(seen[0].message, seen[0].category, "x.py", 1)
    assert capsys.readouterr().err == f"meshsim: warning: {untested_version('accelerate')}\n"
