"""l2l from Python: run a job from a script or a notebook, export a checkpoint.

    import l2l

    summary = l2l.run(workers=2, model="bert", layers=4, hidden=64, steps=20, lr=3e-3,
                      save="model.safetensors")
    print(summary["losses"][-1])

Keyword arguments are l2l-launch's flags, dashes made underscores; ``config=`` takes a job
file (``--config``), a map or a :class:`LaunchArgs` under them. A failed job raises
:class:`JobFailed`; Ctrl-C stops every process of the job and raises KeyboardInterrupt.
``l2l.export(checkpoint, out, model="bert", layers=4, ...)`` is l2l-export.
"""

from eps_server.config import ServerConfig
from launch.config import LaunchArgs, LaunchConfig
from worker.config import DataConfig, ModelConfig, WorkerConfig

from .api import Job, JobFailed, config, export, run

__all__ = ["Job", "JobFailed", "config", "export", "run", "LaunchArgs", "LaunchConfig",
           "ModelConfig", "DataConfig", "WorkerConfig", "ServerConfig"]
