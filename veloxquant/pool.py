"""Run independent measurements here or as Ray tasks, and get results as they finish.

`run_all(fn, calls, ray=None)`: `ray=None` calls fn(*args) for each in this
process; `ray=""` starts (or joins) a local Ray instance; `ray="ADDRESS"`
joins that cluster. On a GPU machine each task asks Ray for one GPU, else for
one CPU. Results are the same either way: each task is a pure function of its
arguments (the model is loaded by reference in the worker).
"""

from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Tuple

from .errors import VeloxError
from .models import load_model

_MODELS: Dict[str, tuple] = {}  # per process (Ray workers too): model reference -> (model, tokenizer)


def load_cached(model_ref: Optional[str]):
    """(model, tokenizer) for a model reference, loaded once per process: a folder or alias, None for
    the default model, or a picklable callable returning (model, tokenizer) (tests: a tiny model)."""
    key = repr(model_ref) if callable(model_ref) else str(model_ref)
    if key not in _MODELS:
        if callable(model_ref):
            _MODELS[key] = model_ref()
        else:
            _MODELS[key] = load_model(model_ref, progress=False)
    return _MODELS[key]


def _ray():
    try:
        import ray
    except ImportError:
        raise VeloxError("--ray needs the ray package: pip install 'ray>=2.9'") from None
    return ray


def wants_gpu() -> bool:
    import mlx.core as mx

    return mx.default_device().type == mx.gpu


def run_all(fn: Callable, calls: Sequence[Tuple], ray: Optional[str] = None) -> Iterator[Tuple[int, Any]]:
    """(index into calls, fn(*calls[index])) for every call, in the order they finish."""
    if ray is None:
        for i, args in enumerate(calls):
            yield i, fn(*args)
        return
    r = _ray()
    if not r.is_initialized():
        r.init(address=ray or None, include_dashboard=False, log_to_driver=False, configure_logging=False)
    task = r.remote(num_gpus=1 if wants_gpu() else 0, num_cpus=0 if wants_gpu() else 1)(fn)
    pending = {task.remote(*args): i for i, args in enumerate(calls)}
    while pending:
        done, _ = r.wait(list(pending), num_returns=1)
        for ref in done:
            i = pending.pop(ref)
            try:
                result = r.get(ref)
            except r.exceptions.RayTaskError as e:  # the task's own error, without Ray's traceback
                cause = e.cause if getattr(e, "cause", None) is not None else e
                if isinstance(cause, VeloxError):
                    raise cause from None
                raise VeloxError(f"a Ray task failed: {type(cause).__name__}: {cause}") from None
            yield i, result
