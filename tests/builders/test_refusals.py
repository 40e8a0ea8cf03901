"""The builders refuse every config of ``meshsim.refused_configs`` with the framework's type.

torch's refusals come out of torch's own ``device_mesh.py`` (the torch builder runs
``init_device_mesh`` / ``_flatten`` / ``_unflatten`` on the fake backend): the reference's
``upstream`` is checked against the real code here, not against itself.
"""

from __future__ import annotations

import traceback

import pytest

import meshsim
from meshsim.model.sweep import RefusedCase
from tests.builders._ranks import on_rank

pytestmark = pytest.mark.filterwarnings("ignore:Slicing a flattened dim from root mesh")


def _raised(case: RefusedCase, rank: int = 0) -> BaseException:
    with pytest.raises(Exception) as built:
        on_rank(case.framework, case.world_size, case.config, rank=rank)
    return built.value


@pytest.mark.parametrize(
    "case", meshsim.refused_configs(6, "torch") + meshsim.refused_configs(8, "torch"), ids=str
)
def test_torch_itself_refuses_with_the_type_meshsim_names(case: RefusedCase) -> None:
    raised = _raised(case)
    assert type(raised).__name__ == case.error().upstream, (case.id, raised)
    origin = traceback.extract_tb(raised.__traceback__)[-1].filename
    assert origin.endswith("torch/distributed/device_mesh.py"), (case.id, origin)


@pytest.mark.parametrize("case", meshsim.refused_configs(8, ["olmo-core", "torchtitan"]), ids=str)
def test_builders_refuse_with_the_frameworks_type(case: RefusedCase) -> None:
    raised = _raised(case)
    upstream = case.error().upstream
    assert upstream in (type(raised).__name__, getattr(raised, "upstream", None)), (case.id, raised)
