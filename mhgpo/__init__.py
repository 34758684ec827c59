"""mhgpo: end-to-end reinforcement learning of LLM-driven multi-agent search systems.

`mhgpo.train(config, workflow=...)` and `mhgpo.evaluate(config, workflow=...)` (mhgpo/api.py), and the workflow
base classes `Workflow`, `State`, `StepResult`, are imported on first use, so that importing the package (as the
command line does) stays cheap.
"""

__version__ = "0.1.0"

_LAZY = {
    "train": "mhgpo.api",
    "evaluate": "mhgpo.api",
    "Workflow": "mhgpo.team.workflow",
    "State": "mhgpo.team.workflow",
    "StepResult": "mhgpo.team.workflow",
    "TrainConfig": "mhgpo.config",
    "EvalConfig": "mhgpo.config",
}
__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        from importlib import import_module

        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mhgpo' has no attribute {name!r}")
