"""Bodies defined in a user's script reach gloo workers even when they mention project modules.

dill would pickle a module outside site-packages by value (thread locals and all); meshsim sends
importable modules by name. Run as a real script, in a subprocess, as a user would.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path


def test_script_body_referencing_project_modules_runs_on_gloo(tmp_path: Path) -> None:
    (tmp_path / "my_project.py").write_text(
        textwrap.dedent(
            """
            import threading
            STATE = threading.local()   # unpicklable by value

            def degree():
                return 2
            """
        )
    )
    script = tmp_path / "train_check.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch.distributed as dist
            import meshsim
            import my_project
            from torch.distributed.device_mesh import init_device_mesh

            def body():
                shape = (2, my_project.degree())
                mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
                return meshsim.observe(mesh)

            observed = meshsim.run(body, world_size=4, backend="gloo", timeout=60)
            meshsim.assert_layout(
                observed, meshsim.expect("torch", 4, mesh_shape=(2, 2), mesh_dim_names=("dp", "tp"))
            )
            print("proven", observed[3].groups["tp"].gathered)
            """
        )
    )
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "proven (2, 3)" in done.stdout
