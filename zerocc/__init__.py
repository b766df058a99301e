"""zerocc: ZeRO data parallelism as a compiler.

    step = zerocc.compile(model, optimizer, stage=3)
    loss = step(*batch)
    plan = zerocc.plan(model, optimizer, stage=3, world_size=1024, example_inputs=batch)

See ``zerocc/pipeline.py`` for the passes, in order.
"""
from . import ops  # registers zerocc:: custom ops
from .api import CompiledStep, compile
from .precision import DynamicLossScale
from .state_dict import export_full_state_dict, load_checkpoint, save_checkpoint
from .pipeline import register_pass, unregister_pass
from .planning import Plan, plan
from .hardware import measure_hardware
from .analysis.step_time import HardwareProfile, StepTime
from .errors import (CaptureError, CheckpointError, CompileCacheError, CompileCacheWarning, ConfigError, MemoryBudgetError,
                     MemoryBudgetWarning, ObservedValueWarning, PassError, RecompileWarning, ReplicaWarning,
                     UnsupportedOptimizerError, ZeroccError)
from .runtime.failures import RankFailureError, RankMismatchError
from .runtime.host_allocator import keep_freed_host_memory

__all__ = ["compile", "CompiledStep", "DynamicLossScale", "plan", "Plan", "register_pass", "unregister_pass",
           "save_checkpoint", "load_checkpoint", "export_full_state_dict",
           "ZeroccError", "ConfigError", "CaptureError", "CheckpointError", "MemoryBudgetError", "PassError",
           "UnsupportedOptimizerError", "RecompileWarning", "ObservedValueWarning", "CompileCacheWarning", "CompileCacheError",
           "MemoryBudgetWarning", "ReplicaWarning",
           "RankFailureError", "RankMismatchError", "keep_freed_host_memory",
           "measure_hardware", "HardwareProfile", "StepTime"]
__version__ = "0.1.0"
